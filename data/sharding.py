"""Which samples each (rank, worker) reads in an epoch: contiguous runs, equal batch counts on every rank.

Data-parallel training hangs when one rank runs out of batches before the others
(the collective waits forever; webdataset issues #188 and #250). The manifest
knows how many samples every shard holds, so the plan is exact instead of
approximate:

1. The epoch's sample order is the shards' order (permuted per epoch with the
   seed when shuffling), samples within a shard in stored order.
2. Training drops the tail so every rank gets `total // world_size // batch_size`
   full batches; evaluation gives every rank `ceil(total / world_size)` samples,
   wrapping around to the first samples to pad (like DistributedSampler), so no
   sample is lost and the counts still agree.
3. Each rank's run is split among its loader workers, in whole batches when
   training, so the number of batches a rank yields is known in advance (`len`).

Every (rank, worker) reads contiguous pieces of at most a few shards, so I/O stays
sequential; within a worker a small shuffle buffer mixes the order when training.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Piece:
    """Samples [start, stop) of one shard."""

    shard: str
    start: int
    stop: int


def _split(total: int, parts: int) -> list:
    return [total // parts + (k < total % parts) for k in range(parts)]


def worker_quotas(total: int, world_size: int, workers: int, batch_size: int, drop_last: bool) -> list:
    """Samples each worker of one rank yields (the same on every rank)."""
    workers = max(workers, 1)
    if drop_last:
        batches = total // world_size // batch_size
        return [b * batch_size for b in _split(batches, workers)]
    return _split(math.ceil(total / world_size), workers)


def batches_per_rank(total: int, world_size: int, workers: int, batch_size: int, drop_last: bool) -> int:
    """Batches one rank yields per epoch (each worker batches its own samples)."""
    return sum(math.ceil(q / batch_size) for q in worker_quotas(total, world_size, workers, batch_size, drop_last))


def epoch_order(shards: list, epoch: int, seed: int, shuffle: bool) -> list:
    """[(path, samples)] in this epoch's order."""
    if not shuffle:
        return list(shards)
    order = np.random.default_rng([seed, epoch]).permutation(len(shards))
    return [shards[i] for i in order]


def plan(shards: list, rank: int, world_size: int, worker: int, workers: int, batch_size: int,
         drop_last: bool, epoch: int = 0, seed: int = 0, shuffle: bool = False) -> list:
    """The pieces (in reading order) that `worker` of `rank` reads this epoch; shards = [(path, samples)]."""
    ordered = epoch_order(shards, epoch, seed, shuffle)
    total = sum(count for _, count in ordered)
    quotas = worker_quotas(total, world_size, workers, batch_size, drop_last)
    per_rank = sum(quotas)
    start = rank * per_rank + sum(quotas[:worker])
    return _pieces(ordered, start, start + quotas[worker], total)


def _pieces(ordered: list, start: int, stop: int, total: int) -> list:
    """Pieces covering global positions [start, stop), wrapping around past `total`."""
    pieces, position = [], start
    bounds = np.cumsum([0] + [count for _, count in ordered])
    while position < stop and total:
        wrapped = position % total
        index = int(np.searchsorted(bounds, wrapped, side="right") - 1)
        offset = wrapped - int(bounds[index])
        take = min(ordered[index][1] - offset, stop - position)
        pieces.append(Piece(ordered[index][0], offset, offset + take))
        position += take
    return pieces
