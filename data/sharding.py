"""Which samples each (rank, worker) reads in an epoch: a global, seeded permutation, equal batch counts per rank.

Data-parallel training hangs when one rank runs out of batches before the others
(the collective waits forever; webdataset issues #188 and #250). The manifest
knows how many samples every shard holds, so the plan is exact instead of
approximate:

1. Every sample of the split has a global id, in stored order (shard by shard).
   A training epoch visits them in `epoch_permutation(total, epoch, seed)`, a
   permutation of all of them drawn from (seed, epoch): consecutive samples come
   from any scene, not from a contiguous run of one scene's frames. On the tiny
   preset's train split (38 scenes of 6 frames, 2 workers) 2.3 % of adjacent samples
   share a scene, what any permutation gives (5 / 227 = 2.2 %); the previous plan,
   contiguous runs of shards through a 16-sample buffer per worker, gave 10.6 %
   (docs/log/2026-11-24_loaders-narrow-labels-global-shuffle.md). Evaluation keeps the stored order.
2. Training drops the tail so every rank gets `total // world_size // batch_size`
   full batches: rank r takes the r-th equal slice of the permutation, so ranks are
   disjoint and together cover all but the dropped tail. Evaluation gives every rank
   `ceil(total / world_size)` samples, wrapping around to the first samples to pad
   (like DistributedSampler), so no sample is lost and the counts still agree.
3. A rank's slice is cut into units (a batch of frames, or one clip) dealt to its
   loader workers round-robin. A DataLoader collects batches from its workers
   round-robin, so a rank's batches arrive in slice order whatever the number of
   workers, and both backends (`torch` with workers, `dali` with threads) yield the
   same batches in the same order for the same seed.

Reading in a random order needs random access: `stack.data.shard_index` reads a
sample by the byte offsets of its members (page-cache reads of a shard's members are
as cheap in any order; `stack bench data` measures permuted against stored order).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Piece:
    """Samples [start, stop) of one shard (a contiguous read, as `stack data inspect` does)."""

    shard: str
    start: int
    stop: int


def _split(total: int, parts: int) -> list:
    return [total // parts + (k < total % parts) for k in range(parts)]


def rank_quota(total: int, world_size: int, batch_size: int, drop_last: bool) -> int:
    """Samples one rank reads per epoch (the same on every rank)."""
    if drop_last:
        return total // world_size // batch_size * batch_size
    return math.ceil(total / world_size)


def worker_quotas(total: int, world_size: int, workers: int, unit: int, drop_last: bool) -> list:
    """Samples each worker of one rank reads: the rank's slice cut into units of `unit`, dealt round-robin."""
    quota, workers = rank_quota(total, world_size, unit, drop_last), max(workers, 1)
    sizes = [min(unit, quota - start) for start in range(0, quota, unit)]
    return [sum(sizes[w::workers]) for w in range(workers)]


def batches_per_rank(total: int, world_size: int, workers: int, batch_size: int, drop_last: bool) -> int:
    """Batches one rank yields per epoch: its quota in batches (every worker batches whole units)."""
    return math.ceil(rank_quota(total, world_size, batch_size, drop_last) / batch_size)


def epoch_permutation(total: int, epoch: int, seed: int, shuffle: bool) -> np.ndarray:
    """Global sample ids in this epoch's order: a permutation drawn from (seed, epoch), or stored order."""
    if not shuffle:
        return np.arange(total)
    return np.random.default_rng([seed, epoch]).permutation(total)


def rank_samples(total: int, rank: int, world_size: int, batch_size: int, drop_last: bool, epoch: int = 0,
                 seed: int = 0, shuffle: bool = False) -> np.ndarray:
    """Global sample ids `rank` reads this epoch, in order (see the module docstring)."""
    order = epoch_permutation(total, epoch, seed, shuffle)
    quota = rank_quota(total, world_size, batch_size, drop_last)
    return order[np.arange(rank * quota, (rank + 1) * quota) % total] if total else order


def worker_samples(rank_ids: np.ndarray, worker: int, workers: int, unit: int) -> np.ndarray:
    """The units (of `unit` consecutive ids) of a rank's slice that `worker` reads: units worker, worker + workers, ..."""
    workers = max(workers, 1)
    starts = np.arange(worker * unit, len(rank_ids), workers * unit)
    return np.concatenate([rank_ids[s:s + unit] for s in starts]) if len(starts) else rank_ids[:0]


def locate(shards: list, ids: np.ndarray) -> list:
    """[(shard path, index within the shard)] of global sample ids; shards = [(path, samples)] in stored order."""
    bounds = np.cumsum([0] + [count for _, count in shards])
    index = np.searchsorted(bounds, ids, side="right") - 1
    return [(shards[i][0], int(g - bounds[i])) for i, g in zip(index, ids)]
