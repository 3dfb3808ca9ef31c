"""The `dali` backend: NVIDIA DALI reads the same shards and yields the same `Batch` as the torch backend.

`fn.readers.webdataset` reads the tar shards through their index files (written by
`stack data make`), `fn.decoders.image` decodes the JPEGs — on the CPU without a
GPU (`device_id=None`: DALI refuses `device_id=0` without a GPU even for CPU
operators) and with nvJPEG (`mixed`) when a GPU is present — and
`fn.decoders.numpy` decodes the `.npy` labels. The rows then go through the same
`to_fields` and `augment_row` as the torch backend, so both backends agree.
The raw bytes of every member DALI read also come out of the graph, and each is
checked against its shard's hash table (`stack.data.checksums`) before the batch is
used; DALI's `source_info` names the shard, key and member.

Sharding: DALI splits the samples into `num_shards` contiguous runs, one per rank
(`shard_id = rank`). The pipeline is rebuilt each epoch (a fresh reader starts at
the beginning of its run, reshuffled with an epoch-dependent seed), and every rank
runs exactly `len(loader)` iterations — the same count the torch backend plans —
so data-parallel ranks never wait on each other. A rank whose run is one sample
short wraps around (evaluation) like DistributedSampler.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import torch

from stack.data.augment import augment_row
from stack.batch import IGNORE_INDEX, Batch
from stack.data.checksums import ShardSums
from stack.data.format import SCHEMA_VERSION
from stack.data.loader import check_layout, read_manifest, split_shards
from stack.data.samples import LOADER_MEMBERS, BadSample, ClassMaps, collate, label_fields, stack_fields
from stack.data.sharding import batches_per_rank
from stack.errors import StackError
from stack.pipeline import Pipeline

DENSE = ("depth", "semantic")
"""Per-pixel labels, decoded by DALI (semantics mapped through the class map there when it is not the identity)."""
SMALL = tuple(name for name in LOADER_MEMBERS if name not in DENSE)


def dali_device() -> int | None:
    """CUDA device for DALI, or None (CPU-only pipeline) when there is no GPU."""
    return torch.cuda.current_device() if torch.cuda.is_available() else None


def build_pipeline(shards: list, cameras: list, maps: ClassMaps, batch_size: int, threads: int, rank: int,
                   world_size: int, shuffle: bool, seed: int, raw: bool = False):
    """DALI pipeline: CHW images per camera, depth, semantics, the small `.npy` labels, meta.json (see DENSE),
    and with `raw` every member's undecoded bytes after those (for the checksums)."""
    from nvidia.dali import fn, pipeline_def, types

    device_id = dali_device()

    @pipeline_def(batch_size=batch_size, num_threads=threads, device_id=device_id, seed=seed, exec_dynamic=True)
    def frames():
        extensions = [f"{c}.jpg" for c in cameras] + [f"{n}.npy" for n in DENSE + SMALL] + ["meta.json"]
        members = fn.readers.webdataset(
            paths=[path for path, _ in shards], index_paths=[str(Path(path).with_suffix(".idx")) for path, _ in shards],
            ext=extensions, shard_id=rank, num_shards=world_size, random_shuffle=shuffle, initial_fill=64,
            pad_last_batch=False, missing_component_behavior="error", name="reader")
        images = [fn.transpose(fn.decoders.image(members[i], device="mixed" if device_id is not None else "cpu",
                                                 output_type=types.RGB), perm=[2, 0, 1]) for i in range(len(cameras))]
        # depth (float16) and identity-mapped semantics (uint8) are widened while being copied out of
        # DALI's buffers, one pass instead of a cast here plus a copy there
        depth = fn.decoders.numpy(members[len(cameras)])
        semantic = fn.decoders.numpy(members[len(cameras) + 1])
        if not maps.semantic_is_identity:
            keys = [int(k) for k in range(255)]
            semantic = fn.lookup_table(semantic, keys=keys, values=[float(maps.semantic[k]) for k in keys],
                                       default_value=float(IGNORE_INDEX), dtype=types.INT64)
        small = [fn.decoders.numpy(members[len(cameras) + len(DENSE) + i]) for i in range(len(SMALL))]
        return (*images, depth, semantic, *small, members[-1], *(members if raw else ()))

    pipe = frames()
    pipe.build()
    return pipe


def _batch_view(tensor_list) -> np.ndarray:
    """A dense DALI batch as a numpy view of DALI's buffer: copy it before the next `run` reuses the buffer."""
    if hasattr(tensor_list, "as_cpu"):
        tensor_list = tensor_list.as_cpu()
    return np.asarray(tensor_list.as_tensor())


def _host(tensor_list, index: int) -> np.ndarray:
    if hasattr(tensor_list, "as_cpu"):
        tensor_list = tensor_list.as_cpu()
    return np.array(tensor_list[index])


class DaliLoader:
    """Iterable of Batch for one rank with `len()` equal on every rank; each iteration is one epoch."""

    def __init__(self, pipeline: Pipeline, split: str, rank: int, world_size: int, shuffle: bool, augment: bool,
                 verify: bool = True):
        if pipeline.data.skip_bad_samples:
            raise StackError("data.skip_bad_samples=true is supported by data.backend=torch only (a DALI pipeline "
                             "stops at the first undecodable sample); use data.backend=torch to skip bad samples")
        self.pipeline, self.split, self.rank, self.world_size = pipeline, split, rank, world_size
        self.shuffle, self.augment, self.drop_last = shuffle, augment, split == "train"
        self.manifest = read_manifest(pipeline.data.root)
        check_layout(pipeline, self.manifest, pipeline.data.root)
        if self.manifest.get("layout") == "clips":
            raise StackError("data.backend=dali reads frame shards; clip shards (H.264) decode with data.backend=torch "
                             "(PyAV, CPU), or on a GPU with stack.data.clips.decode_h264_gpu (DALI cannot decode H.264 "
                             "on the CPU)")
        self.shards = split_shards(self.manifest, pipeline.data.root, split)
        self.maps = ClassMaps.build(self.manifest, pipeline)
        self.sums = ShardSums() if verify else None
        self.epoch, self._epoch_set = 0, False
        self.skipped = 0
        if len(self) == 0:
            raise StackError(f"split {split!r} has fewer than one batch of data.batch_size={pipeline.data.batch_size} "
                             f"per rank for {world_size} rank(s); render more scenes or lower data.batch_size")

    def __len__(self) -> int:
        total = sum(count for _, count in self.shards)
        return batches_per_rank(total, self.world_size, 1, self.pipeline.data.batch_size, self.drop_last)

    def set_epoch(self, epoch: int) -> None:
        self.epoch, self._epoch_set = epoch, True

    def __iter__(self):
        cameras = self.manifest["cameras"]
        seed = (self.pipeline.train.seed * 1000003 + self.epoch) % (2 ** 31)
        try:
            pipe = build_pipeline(self.shards, cameras, self.maps, self.pipeline.data.batch_size,
                                  max(self.pipeline.data.num_workers, 1), self.rank, self.world_size, self.shuffle, seed,
                                  raw=self.sums is not None)
        except RuntimeError as exc:
            raise self._error("could not open", exc) from exc
        rng = np.random.default_rng([self.pipeline.train.seed, self.epoch, self.rank])
        if not self._epoch_set:
            self.epoch += 1
        self._epoch_set = False
        total = sum(count for _, count in self.shards)
        per_rank = total // self.world_size // self.pipeline.data.batch_size * self.pipeline.data.batch_size \
            if self.drop_last else -(-total // self.world_size)
        remaining = per_rank
        for _ in range(len(self)):
            outputs = self._run(pipe)
            take = min(self.pipeline.data.batch_size, remaining)
            remaining -= take
            yield self._batch(outputs, take, len(cameras), rng)
        del pipe

    def _run(self, pipe):
        try:
            return pipe.run()
        except RuntimeError as exc:
            raise self._error("could not read a sample of", exc) from exc

    def _error(self, what: str, exc: RuntimeError) -> BadSample:
        """DALI's error, shortened, with the shards it was reading and what to do."""
        shards = ", ".join(path for path, _ in self.shards)
        lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
        # DALI puts the cause after "encountered:", below the Python traceback of the operator
        after = lines[lines.index("encountered:") + 1:] if "encountered:" in lines else lines
        detail = re.sub(r'^Assert on ".*?" failed: ', "", (after or [type(exc).__name__])[0])
        return BadSample(f"DALI {what} shard(s) {shards}: {detail}; run with data.backend=torch to name the "
                         "sample, or re-create the shards (and their .idx files) with `stack data make`")

    def _verify(self, raw: list, take: int) -> None:
        """Each raw member of the first `take` samples against its shard's hash ("shard:offset:key.member")."""
        for members in raw:
            members = members.as_cpu() if hasattr(members, "as_cpu") else members
            for index in range(take):
                shard, _, name = members[index].source_info().rsplit(":", 2)
                key, member = name.split(".", 1)
                self.sums.check_member(member, np.asarray(members[index]), shard, key)

    def _batch(self, outputs, take: int, cameras: int, rng: np.random.Generator) -> Batch:
        """The first `take` samples of a DALI batch as a Batch (augmented per row when asked)."""
        if self.sums is not None:
            members = 1 + cameras + len(DENSE) + len(SMALL)  # images, dense, small, meta.json
            self._verify(outputs[-members:], take)
            outputs = outputs[:-members]
        for index in range(take):
            meta = json.loads(_host(outputs[-1], index).tobytes())
            if meta.get("schema") != SCHEMA_VERSION:
                raise BadSample(f"a sample of split {self.split} has schema version {meta.get('schema')!r}, this stack "
                                f"reads version {SCHEMA_VERSION} (scene {meta.get('scene')}, frame {meta.get('frame')}); "
                                "re-create the shards with `stack data make`")
        dense = {  # one copy each out of DALI's buffers
            "images": torch.from_numpy(np.stack([_batch_view(outputs[c])[:take] for c in range(cameras)], axis=1)),
            "depth": torch.from_numpy(np.array(_batch_view(outputs[cameras])[:take], dtype=np.float32)),
            "semantic": torch.from_numpy(np.array(_batch_view(outputs[cameras + 1])[:take], dtype=np.int64)),
        }
        first = cameras + len(DENSE)
        labels = [label_fields({name: _host(outputs[first + i], index) for i, name in enumerate(SMALL)}, self.maps,
                               self.pipeline) for index in range(take)]
        if not self.augment:
            return Batch(**dense, **stack_fields(labels, labels[0]))
        rows = [{**{name: value[index] for name, value in dense.items()}, **labels[index]} for index in range(take)]
        return collate([augment_row(row, self.pipeline.data.augment, rng) for row in rows])
