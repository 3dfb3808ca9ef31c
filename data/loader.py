"""`build_loader`: the one entry point the trainer calls, and the `torch` backend (WebDataset + DataLoader).

    loader = build_loader(pipeline, "train", rank=0, world_size=1)
    for epoch in range(epochs):
        loader.set_epoch(epoch)          # optional: each iteration otherwise advances the epoch
        for batch in loader:             # stack.batch.Batch, len(loader) batches on every rank
            ...

Rank and world size come from torch.distributed when it is initialised, else
from the RANK / WORLD_SIZE environment variables, else 0 / 1. Which samples a
(rank, worker) reads is planned exactly from the manifest (`stack.data.sharding`):
a training epoch is a seeded permutation of every sample of the split, each rank
reads an equal, disjoint slice of it, so every rank yields `len(loader)` batches and
no sample is read twice in a training epoch. Samples are read by their members'
byte offsets (`stack.data.shard_index`), decoded and augmented in the DataLoader
workers.

Every member read is checked against its shard's hash table (`stack.data.checksums`),
so bytes corrupted after writing are named rather than decoded into garbage pixels.
A bad sample stops the epoch with a `BadSample` naming the shard and key, unless
`data.skip_bad_samples` is true: then it is replaced by the worker's previous good
sample (so batch counts stay equal across ranks), counted in `loader.skipped`
and logged.
"""

from __future__ import annotations

import logging
import math
import multiprocessing
import os
import tarfile
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

from stack.data.augment import augment_row
from stack.data.checksums import ShardSums
from stack.data.format import MANIFEST, SCHEMA_VERSION, array_problem, label_problem, manifest_problem
from stack.data.samples import (LOADER_MEMBERS, BadSample, ClassMaps, check_jpeg_sizes, check_members, collate,
                                decode_arrays, decode_jpeg, to_fields)
from stack.data.shard_index import SampleReader, ShortShard
from stack.data.sharding import Piece, locate, rank_samples, worker_quotas, worker_samples
from stack.errors import StackError
from stack.pipeline import Pipeline
from stack.user_json import read_json

log = logging.getLogger("stack.data")
SHUFFLE_BUFFER = 16


def read_manifest(root: str | Path) -> dict:
    """The dataset manifest, checked for existence and schema version."""
    path = Path(root) / MANIFEST
    if not path.is_file():
        raise StackError(f"no dataset at {root}: expected {path}; render one with `stack data make` "
                         "(or point data.root at an existing dataset)")
    manifest = read_json(path, "a dataset manifest `stack data make` writes",
                         "Re-create the dataset with `stack data make` (or point data.root at one).")
    if manifest.get("schema") != SCHEMA_VERSION:
        raise StackError(f"{path}: schema version {manifest.get('schema')!r}, this stack reads version {SCHEMA_VERSION}; "
                         "re-create the dataset with this version's `stack data make`")
    problem = manifest_problem(manifest)
    if problem:
        raise StackError(f"{path} is not a dataset manifest: {problem}; re-create the dataset with `stack data make` "
                         "(or point data.root at one)")
    return manifest


def check_arrays(arrays: dict, manifest: dict, shard: str, key: str, values: bool = True) -> None:
    """BadSample unless every `.npy` member has the dtype and shape of the schema (stack.data.format) and, with
    `values`, usable values (`label_problem`: finite, class ids within the manifest's lists)."""
    for name, array in arrays.items():
        problem = array_problem(name, array, len(manifest["cameras"]), manifest["image_size"])
        problem = problem or (values and label_problem(name, array, manifest))
        if problem:
            raise BadSample(f"shard {shard}, sample {key}: member {name}.npy: {problem}; re-create the shard "
                            "with `stack data make`, or set data.skip_bad_samples=true to skip such samples")
    if "boxes" in arrays and "box_ids" in arrays and len(arrays["boxes"]) != len(arrays["box_ids"]):
        raise BadSample(f"shard {shard}, sample {key}: boxes.npy holds {len(arrays['boxes'])} boxes but box_ids.npy "
                        f"{len(arrays['box_ids'])}; re-create the shard with `stack data make`")


def split_shards(manifest: dict, root: str | Path, split: str) -> list:
    """[(absolute shard path, samples)] of a split; an empty list is an error."""
    shards = [(str(Path(root) / s["path"]), int(s["samples"])) for s in manifest.get("splits", {}).get(split, [])]
    if not shards or not sum(count for _, count in shards):
        known = ", ".join(f"{k} ({len(v)} shards)" for k, v in manifest.get("splits", {}).items()) or "none"
        raise StackError(f"split {split!r} of {Path(root) / MANIFEST} lists no shards (found: {known}); render more "
                         "scenes (data.world.scenes) or lower data.world.val_fraction")
    return shards


def dataset_shards(pipeline: Pipeline, manifest: dict, split: str) -> list:
    """[(absolute shard path, samples)] of `split` in data.root, and for "train" also every data.aggregate
    dataset's train split (after checking it holds frames of the same rig)."""
    shards = split_shards(manifest, pipeline.data.root, split)
    if split != "train":
        return shards
    for root in pipeline.data.aggregate:
        other = read_manifest(root)
        for key in ("cameras", "image_size", "layout", "semantic_classes", "detection_classes", "attribute_names"):
            if other.get(key) != manifest.get(key):
                raise StackError(f"data.aggregate dataset {root} has {key} {other.get(key)!r} but data.root "
                                 f"{pipeline.data.root} has {manifest.get(key)!r}: aggregate only datasets recorded "
                                 f"with the same rig and layout (remove {root} from data.aggregate)")
        shards += split_shards(other, root, "train")
    return shards


def resolve_rank(rank: int | None, world_size: int | None) -> tuple[int, int]:
    if rank is not None and world_size is not None:
        return rank, world_size
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank(), torch.distributed.get_world_size()
    return int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))


def read_piece(piece: Piece):
    """The raw samples [start, stop) of a shard, via webdataset's tar iterators; errors name the shard."""
    from webdataset.tariterators import group_by_keys, tar_file_iterator

    index, key = -1, None
    try:
        with open(piece.shard, "rb") as stream:
            files = ({**f, "__url__": piece.shard} for f in tar_file_iterator(stream))
            for index, sample in enumerate(group_by_keys(files)):
                key = sample["__key__"]
                if index >= piece.stop:
                    return
                if index >= piece.start:
                    yield sample
    except (tarfile.TarError, OSError, ValueError) as exc:
        where = f"after sample {key}" if key else "at its start"
        raise BadSample(f"shard {piece.shard}: not a readable tar ({exc}) {where}; "
                        "re-create it with `stack data make`") from exc
    if index + 1 < piece.stop:
        message = (f"shard {piece.shard}: holds {index + 1} samples, the manifest promises at least {piece.stop}; "
                   "the shard is truncated or was replaced; re-create the dataset with `stack data make`")
        raise ShortShard(index + 1, message)


def _plan_batch(pipeline: Pipeline, manifest: dict) -> int:
    """Samples per planning unit: a batch of frames, or one clip (its frames fill batches in the worker)."""
    return 1 if manifest.get("layout") == "clips" else pipeline.data.batch_size


def check_layout(pipeline: Pipeline, manifest: dict, root) -> None:
    """The shards under `root` must have the layout the pipeline asks for."""
    found = manifest.get("layout", "frames")
    if found != pipeline.data.layout:
        raise StackError(f"data.layout={pipeline.data.layout} but {Path(root) / MANIFEST} holds {found} shards; set "
                         f"data.layout={found} or re-create the dataset with "
                         f"`stack data make data.layout={pipeline.data.layout}`")


def read_checked(reader: SampleReader, sums: ShardSums | None, manifest: dict, shard: str, index: int) -> dict:
    """One stored frame sample's members, hashed against its shard's table (`sums`; None reads unhashed, as only
    `stack bench data` does) and checked against the manifest's cameras and image size: what both backends read."""
    sample = reader.read(shard, index)
    if sums is not None:
        sums.check_sample(sample, shard)
    check_members(sample, manifest["cameras"], shard)
    check_jpeg_sizes(sample, manifest["cameras"], manifest["image_size"], shard)
    return sample


def key_frame_history(shards: list, reader: SampleReader, sums: ShardSums | None, manifest: dict, sample: dict,
                      shard: str, index: int, frames: int) -> list:
    """The `frames` key frames before `sample` (stored at (shard, index) of the split's `shards`), newest first, as
    ((stored sample, its shard), ego pose then): each pose in the ego frame of the key frame after it, from that
    frame's own past trajectory (`stack.kinematics.previous_pose`). Where the sequence starts, the oldest frame it
    has (the sample itself at a first frame) stands in with zero motion, as BEVDet4D does. Both backends read their
    history here (`stack.data.sequences`)."""
    from stack.data.sequences import previous_location
    from stack.kinematics import previous_pose

    history, newest, where = [], (sample, shard), (shard, index)
    for _ in range(frames):
        where = previous_location(shards, reader, *where, newest[0]["__key__"]) if where is not None else None
        if where is None:
            history.append((newest, np.zeros(3, np.float32)))
            continue
        pose = previous_pose(decode_arrays(newest[0], newest[1], ("past",))["past"])
        newest = (read_checked(reader, sums, manifest, *where), where[0])
        history.append((newest, pose))
    return history


def add_clip_history(rows: list, pasts: list, frames: int) -> None:
    """Give each row of one clip (a whole scene's key frames, in order) its `frames` previous key frames, as
    `key_frame_history` gives a frame sample its (`stack.data.clips.clip_history`). The rows share the decoded
    pixels, read only (augmentation and collation write new tensors)."""
    from stack.data.clips import clip_history

    for t, row in enumerate(rows):
        history = clip_history(pasts, t, frames)
        images = [rows[index]["images"] for index, _ in history]
        poses = [torch.from_numpy(pose) for _, pose in history]
        row["previous_images"], row["previous_pose"] = images[0], poses[0]
        if frames > 1:
            row["earlier_images"] = torch.cat(images[1:])
            row["earlier_poses"] = torch.stack(poses[1:])


class _Failure:
    """A worker's error, carried to the main process as data (so its message arrives without a worker traceback)."""

    def __init__(self, message: str):
        self.message = message


def _collate(rows: list):
    failures = [row for row in rows if isinstance(row, _Failure)]
    return failures[0] if failures else collate(rows)


class FrameSamples(IterableDataset):
    """Batch rows of one rank for one epoch; each DataLoader worker reads its planned pieces."""

    def __init__(self, pipeline: Pipeline, manifest: dict, shards: list, rank: int, world_size: int,
                 drop_last: bool, shuffle: bool, augment: bool, epoch: int, skipped, verify: bool = True,
                 reader: SampleReader | None = None):
        super().__init__()
        self.pipeline, self.manifest, self.shards = pipeline, manifest, shards
        self.rank, self.world_size, self.drop_last = rank, world_size, drop_last
        self.shuffle, self.augment, self._epoch, self.skipped = shuffle, augment, epoch, skipped
        self.maps = ClassMaps.build(manifest, pipeline)
        self.sums = ShardSums() if verify else None
        self.reader = reader or SampleReader()

    @property
    def epoch(self) -> int:
        """The epoch to read: an int, or a shared `multiprocessing.Value` the loader sets before each epoch
        (persistent workers read it when the next epoch starts)."""
        return int(getattr(self._epoch, "value", self._epoch))

    def __iter__(self):
        info = get_worker_info()
        worker, workers = (info.id, info.num_workers) if info else (0, 1)
        seed, unit, epoch = self.pipeline.train.seed, _plan_batch(self.pipeline, self.manifest), self.epoch
        total = sum(count for _, count in self.shards)
        ids = rank_samples(total, self.rank, self.world_size, unit, self.drop_last, epoch, seed, self.shuffle)
        samples = locate(self.shards, worker_samples(ids, worker, workers, unit))
        rng = np.random.default_rng([seed, epoch, self.rank, worker])
        rows = self._rows(samples, rng)
        clips = self.manifest.get("layout") == "clips"
        try:  # a clip's frames are one scene: a buffer mixes them with other clips' frames
            yield from (shuffle_buffer(rows, rng) if self.shuffle and clips else rows)
        except BadSample as exc:
            yield _Failure(str(exc))

    def decode(self, shard: str, index: int) -> tuple[dict, list]:
        """(the stored sample, its Batch rows): one row for a frame sample (read by `read_checked`, as the DALI
        backend reads it), one per frame for a clip (`stack.data.clips.clip_frames`, as DALI reads it)."""
        if self.manifest.get("layout") == "clips":
            from stack.data.clips import clip_frames

            sample, frames, videos = clip_frames(self.reader, self.sums, self.manifest, shard, index)
            rows = [to_fields(videos[:, t], arrays, self.maps, self.pipeline) for t, arrays in enumerate(frames)]
            if self.pipeline.model.temporal_frames:
                add_clip_history(rows, [arrays["past"] for arrays in frames], self.pipeline.model.temporal_frames)
            return sample, rows
        sample = read_checked(self.reader, self.sums, self.manifest, shard, index)
        arrays = decode_arrays(sample, shard, LOADER_MEMBERS)
        check_arrays(arrays, self.manifest, shard, sample["__key__"])
        images = np.stack([decode_jpeg(sample[f"{c}.jpg"], shard, sample["__key__"], f"{c}.jpg")
                           for c in self.manifest["cameras"]])
        return sample, [to_fields(images, arrays, self.maps, self.pipeline)]

    def add_previous(self, row: dict, sample: dict, shard: str, index: int) -> None:
        """The k = model.temporal_frames key frames before the row's (`key_frame_history`): the previous one's
        images and the ego pose then in the row's ego frame, and for k >= 2 the ones before it (`earlier_images`,
        `earlier_poses`: each pose in the frame of the key frame after it). Augmentation later treats every frame
        alike."""
        history = key_frame_history(self.shards, self.reader, self.sums, self.manifest, sample, shard, index,
                                    self.pipeline.model.temporal_frames)
        decoded = {id(sample): row["images"]}  # a sequence start repeats a frame: decode each stored frame once
        images = []
        for (before, before_shard), _ in history:
            if id(before) not in decoded:
                decoded[id(before)] = torch.from_numpy(np.stack([
                    decode_jpeg(before[f"{c}.jpg"], before_shard, before["__key__"], f"{c}.jpg")
                    for c in self.manifest["cameras"]])).permute(0, 3, 1, 2)
            images.append(decoded[id(before)])
        poses = [torch.from_numpy(pose) for _, pose in history]
        row["previous_images"], row["previous_pose"] = images[0], poses[0]
        if len(images) > 1:
            row["earlier_images"] = torch.cat(images[1:])
            row["earlier_poses"] = torch.stack(poses[1:])

    def _rows(self, samples: list, rng: np.random.Generator):
        """Decoded (and augmented) rows of [(shard, index)]; with skip_bad_samples a bad sample is replaced by the
        last good one (the first good one when the worker starts with bad ones)."""
        skip, last_good, owed = self.pipeline.data.skip_bad_samples, None, 0
        for shard, index in samples:
            try:
                sample, rows = self.decode(shard, index)
                if self.pipeline.model.temporal_frames and self.manifest.get("layout") != "clips":
                    self.add_previous(rows[0], sample, shard, index)  # a clip's rows have theirs (`decode`)
            except BadSample as exc:
                if not skip:
                    raise
                owed += self._skip(exc)
                continue
            if self.augment:
                rows = [augment_row(row, self.pipeline.data.augment, rng) for row in rows]
            for _ in range(owed + 1):
                yield from rows
            last_good, owed = rows, 0
        if owed and last_good is not None:
            for _ in range(owed):
                yield from last_good
        elif owed:
            raise BadSample(f"every sample this loader worker was given is bad ({owed} skipped); see the log above")

    def _skip(self, exc: BadSample, count: int = 1) -> int:
        log.warning("skipping %d bad sample(s): %s", count, exc)
        with self.skipped.get_lock():
            self.skipped.value += count
        return count


def shuffle_buffer(rows, rng: np.random.Generator, size: int = SHUFFLE_BUFFER):
    """`rows` in a locally shuffled order: each row enters a buffer of `size`, and a full buffer gives up one drawn at
    random (a clip's frames are one scene; the buffer mixes them with other clips' frames)."""
    buffer = []
    for row in rows:
        buffer.append(row)
        if len(buffer) >= size:
            yield buffer.pop(int(rng.integers(len(buffer))))
    while buffer:
        yield buffer.pop(int(rng.integers(len(buffer))))


class TorchLoader:
    """Iterable of Batch for one rank, with `len()` equal on every rank; each iteration is one epoch."""

    def __init__(self, pipeline: Pipeline, split: str, rank: int, world_size: int, shuffle: bool, augment: bool,
                 verify: bool = True, pin_memory: bool = False):
        self.pipeline, self.split, self.rank, self.world_size = pipeline, split, rank, world_size
        self.pin_memory = pin_memory
        self.shuffle, self.augment, self.drop_last, self.verify = shuffle, augment, split == "train", verify
        root = pipeline.data.root
        self.manifest = read_manifest(root)
        check_layout(pipeline, self.manifest, root)
        self.shards = dataset_shards(pipeline, self.manifest, split)
        self.epoch, self._epoch_set, self._loader = 0, False, None
        self.skipped = multiprocessing.get_context("fork").Value("q", 0)
        self._shared_epoch = multiprocessing.get_context("fork").Value("q", 0)
        if len(self) == 0:
            total = sum(count for _, count in self.shards)
            raise StackError(f"split {split!r} has {total} samples: fewer than one batch of data.batch_size="
                             f"{pipeline.data.batch_size} per rank for {world_size} rank(s); render more scenes or "
                             "lower data.batch_size")

    def __len__(self) -> int:
        total = sum(count for _, count in self.shards)
        unit = _plan_batch(self.pipeline, self.manifest)
        frames = self.manifest.get("frames_per_clip", 1) if unit == 1 and self.manifest.get("layout") == "clips" else 1
        quotas = worker_quotas(total, self.world_size, self.pipeline.data.num_workers, unit, self.drop_last)
        return sum(math.ceil(q * frames / self.pipeline.data.batch_size) for q in quotas)

    def set_epoch(self, epoch: int) -> None:
        self.epoch, self._epoch_set = epoch, True

    def data_loader(self) -> DataLoader:
        """The DataLoader, made once: its workers fork once per loader and stay (`persistent_workers`), each epoch
        reading the epoch from a shared value. Forking a process that holds torch and re-importing in it cost
        ~0.35 s of CPU per worker per epoch: 3 ms a sample on the tiny preset's 228-frame epoch, more than
        decoding it. The shards are indexed before the fork, so the workers inherit the index."""
        if self._loader is None:
            reader = SampleReader()
            reader.prepare(self.shards)
            dataset = FrameSamples(self.pipeline, self.manifest, self.shards, self.rank, self.world_size,
                                   self.drop_last, self.shuffle, self.augment, self._shared_epoch, self.skipped,
                                   self.verify, reader)
            workers = self.pipeline.data.num_workers
            self._loader = DataLoader(dataset, batch_size=self.pipeline.data.batch_size, num_workers=workers,
                                      collate_fn=_collate, multiprocessing_context="fork" if workers else None,
                                      persistent_workers=workers > 0, pin_memory=self.pin_memory)
        return self._loader

    def __iter__(self):
        loader = self.data_loader()
        self._shared_epoch.value = self.epoch
        if not self._epoch_set:
            self.epoch += 1
        self._epoch_set = False
        for batch in loader:
            if isinstance(batch, _Failure):
                raise BadSample(batch.message)
            yield batch


def build_loader(pipeline: Pipeline, split: str, rank: int | None = None, world_size: int | None = None,
                 shuffle: bool | None = None, augment: bool | None = None, verify: bool = True,
                 pin_memory: bool = False):
    """An iterable of `stack.batch.Batch` with `len()` for `split` ("train" or "val") on this rank.

    shuffle defaults to True for train; augment to `data.augment.enabled` for train
    (never for val). `data.backend` picks the torch or the DALI implementation;
    both yield the same fields, shapes and dtypes. `verify=False` skips the member
    checksums (only `stack bench data` does, to measure what they cost). `pin_memory=True` (a CUDA consumer: the
    trainer on a GPU) hands the torch loader's batches over in page-locked memory; DALI's are on the GPU already.
    """
    rank, world_size = resolve_rank(rank, world_size)
    shuffle = split == "train" if shuffle is None else shuffle
    augment = (split == "train" and pipeline.data.augment.enabled) if augment is None else augment
    if pipeline.data.backend == "dali":
        from stack.data.dali_loader import DaliLoader

        return DaliLoader(pipeline, split, rank, world_size, shuffle, augment, verify)
    return TorchLoader(pipeline, split, rank, world_size, shuffle, augment, verify, pin_memory)
