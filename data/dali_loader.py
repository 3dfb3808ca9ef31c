"""The `dali` backend: NVIDIA DALI decodes the same shards into the same `Batch` as the torch backend.

The loader reads each batch's samples itself, in the order `stack.data.sharding` plans
(a seeded global permutation per training epoch, the same order as the torch backend),
by their members' byte offsets (`stack.data.shard_index`); checks every member against
its shard's hash table (`stack.data.checksums`) and the sample's schema; and feeds the
encoded members to the DALI graph through external sources. The graph decodes the
JPEGs — on the CPU without a GPU (`device_id=None`: DALI refuses `device_id=0`
without a GPU even for CPU operators) and with nvJPEG (`mixed`) when a GPU is
present —, stacks the cameras into one (N, 3, H, W) tensor per sample, and decodes
the dense `.npy` labels (semantics mapped through the class map when it is not the
identity). The small labels (boxes, ego status, trajectories) are a few hundred bytes
a sample and are decoded in Python by the same `label_fields` as the torch backend.
With augmentation on, each batch's parameters are drawn in Python as the torch backend
draws them and fed beside its members; the graph resizes, crops and jitters the pixels
and the labels follow the same parameters (`stack.data.dali_augment`).

For a temporal network (model.temporal_frames = k) each sample also carries its k previous
key frames, found and checked by the same `key_frame_history` as the torch backend: their
JPEGs enter the graph as k more sets of cameras, decoded and augmented with the sample's own
parameters (BEVDet4D: one augmentation for every frame of a sample), and their ego poses,
read from each frame's past trajectory, are label fields built in Python.

Clip shards (data.layout=clips: one H.264 video per camera per scene) are decoded with PyAV, as the torch backend
decodes them (DALI cannot decode H.264 on the CPU), a clip's cameras side by side in data.num_workers threads, and
their frames enter the graph decoded (`build_pipeline(..., decoded=True)`): the graph resizes, crops and jitters them as it does decoded JPEGs. Their rows follow the torch
backend's order for one loader process (data.num_workers=0): clips in the planned order, each clip's augmentation
parameters drawn as its frames are decoded, frames mixed with other clips' through the same shuffle buffer, so both
backends give the same batches.

The graph is built once per loader and reused for every epoch: an epoch is just a
new plan fed through the external sources, so nothing is rebuilt and no reader state
carries over between epochs. The dynamic executor hands out its output buffers
without copying (DALI 1.44+, zero-copy outputs), so the dense fields reach the Batch
with no copy in Python and no widening (they stay uint8 / float16, `stack.batch`).
Every rank runs exactly `len(loader)` iterations — the count the torch backend
plans — so data-parallel ranks never wait on each other.
"""

from __future__ import annotations

import math
import re
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch

from stack.batch import IGNORE_INDEX, Batch
from stack.data.dali_augment import GraphAugment
from stack.data.checksums import ShardSums
from stack.data.clips import clip_frames, clip_history
from stack.data.loader import (check_arrays, check_layout, dataset_shards, key_frame_history, read_checked,
                               read_manifest, shuffle_buffer)
from stack.data.samples import LOADER_MEMBERS, BadSample, ClassMaps, decode_arrays, label_fields, stack_fields
from stack.data.shard_index import SampleReader
from stack.data.sharding import batches_per_rank, locate, rank_quota, rank_samples
from stack.errors import StackError
from stack.pipeline import Pipeline

DENSE = ("depth", "semantic")
"""Per-pixel labels, decoded by DALI (semantics mapped through the class map there when it is not the identity)."""
SMALL = tuple(name for name in LOADER_MEMBERS if name not in DENSE)


def dali_device() -> int | None:
    """CUDA device for DALI, or None (CPU-only pipeline) when there is no GPU."""
    return torch.cuda.current_device() if torch.cuda.is_available() else None


def jpeg_inputs(cameras: list, history: int = 0) -> list:
    """Names of the graph's JPEG sources: the key frame's cameras, then those of each of its `history` previous key
    frames, newest first (decoded and augmented as more cameras: one set of parameters for every frame)."""
    return [f"{c}.jpg" for c in cameras] + [f"previous{j}.{c}.jpg" for j in range(1, history + 1) for c in cameras]


def inputs(cameras: list, history: int = 0) -> list:
    """Names of the graph's external sources, one per encoded member fed to it: the JPEGs, then DENSE."""
    return jpeg_inputs(cameras, history) + [f"{name}.npy" for name in DENSE]


def decoded_inputs(cameras: list, history: int = 0) -> list:
    """Names of the graph's external sources for decoded frames (a clip's): one HWC uint8 image per camera of the
    key frame and of each previous one, newest first, then DENSE as arrays."""
    return [f"{name[:-len('.jpg')]}.rgb" for name in jpeg_inputs(cameras, history)] + list(DENSE)


def build_pipeline(cameras: list, maps: ClassMaps, batch_size: int, threads: int, seed: int = 0, augment=None,
                   history: int = 0, decoded: bool = False):
    """DALI graph from encoded members (fed per batch, `feed`; with `decoded`, decoded frames and label arrays,
    `feed_decoded`) to (one HWC uint8 image per camera of the key frame and of each of its `history` previous key
    frames, depth float16, semantic uint8) per sample; with `augment` (a `dali_augment.GraphAugment`, its parameters
    fed per batch too) the cameras of every frame, depth and semantics are resized, cropped and colour-jittered in
    the graph."""
    from nvidia.dali import fn, pipeline_def, types

    device_id = dali_device()

    @pipeline_def(batch_size=batch_size, num_threads=threads, device_id=device_id, seed=seed, exec_dynamic=True,
                  prefetch_queue_depth=1)
    def frames():
        if decoded:
            pixels, dense = _decoded_sources(fn, types, cameras, history, device_id)
        else:
            pixels, dense = _encoded_sources(fn, types, cameras, history, device_id)
        depth, semantic = dense
        if not maps.semantic_is_identity:
            keys = list(range(256))
            semantic = fn.lookup_table(semantic, keys=keys, values=[int(maps.semantic[k]) for k in keys],
                                       default_value=IGNORE_INDEX, dtype=types.UINT8)
        if augment is not None:
            pixels, depth, semantic = augment.apply(fn, types, pixels, depth, semantic)
        # cameras leave the graph as decoded (HWC): stacking and transposing them here took two passes
        # (0.49 ms CPU a sample at 6 x 256x128), one strided copy into the Batch takes 0.14 ms (`_images`)
        return (*pixels, depth, semantic)

    pipe = frames()
    pipe.build()
    return pipe


def _encoded_sources(fn, types, cameras: list, history: int, device_id: int | None) -> tuple:
    """The graph's JPEG and `.npy` sources, decoded: JPEGs with nvJPEG on a GPU (`mixed`), on the CPU without one."""
    members = [fn.external_source(name=name, dtype=types.UINT8, ndim=1) for name in inputs(cameras, history)]
    images = len(jpeg_inputs(cameras, history))
    pixels = [fn.decoders.image(members[i], device="mixed" if device_id is not None else "cpu", output_type=types.RGB)
              for i in range(images)]
    return pixels, (fn.decoders.numpy(members[images]), fn.decoders.numpy(members[images + 1]))


def _decoded_sources(fn, types, cameras: list, history: int, device_id: int | None) -> tuple:
    """The graph's sources of decoded frames (HWC uint8, moved to the GPU when there is one, as nvJPEG's output is)
    and dense label arrays ((camera, H, W) float16 depth and uint8 semantics, as `fn.decoders.numpy` gives them)."""
    names = decoded_inputs(cameras, history)
    pixels = [fn.external_source(name=name, dtype=types.UINT8, ndim=3, layout="HWC") for name in names[:-2]]
    if device_id is not None:
        pixels = [image.gpu() for image in pixels]
    return pixels, (fn.external_source(name=names[-2], dtype=types.FLOAT16, ndim=3),
                    fn.external_source(name=names[-1], dtype=types.UINT8, ndim=3))


def feed(pipe, cameras: list, samples: list, history: int = 0) -> None:
    """Give the graph the encoded members of one batch of samples (WebDataset-style dicts; with `history`, each
    carries its previous key frames' stored samples under "history", newest first: `key_frame_history`)."""
    for name in inputs(cameras):
        pipe.feed_input(name, [np.frombuffer(sample[name], np.uint8) for sample in samples])
    for j in range(1, history + 1):
        for c in cameras:
            pipe.feed_input(f"previous{j}.{c}.jpg",
                            [np.frombuffer(sample["history"][j - 1][0][0][f"{c}.jpg"], np.uint8) for sample in samples])


def feed_decoded(pipe, cameras: list, rows: list, history: int = 0) -> None:
    """Give the graph one batch of clip rows (`DaliLoader._clip_rows`): each row's cameras of its key frame and of its
    `history` previous ones (frames of its clip's decoded videos), and its depth and semantic arrays."""
    names = decoded_inputs(cameras, history)
    for j in range(history + 1):
        for c in range(len(cameras)):
            pipe.feed_input(names[j * len(cameras) + c], [row["videos"][c, row["frames"][j]] for row in rows])
    for name in DENSE:
        pipe.feed_input(name, [row[name] for row in rows])


def _images(outputs: list) -> torch.Tensor:
    """(B, N, 3, H, W) uint8 from one (B, H, W, 3) DALI output per camera: one strided copy, the transpose in it."""
    cameras = [_zero_copy(output) for output in outputs]
    b, h, w, _ = cameras[0].shape
    images = torch.empty((b, len(cameras), 3, h, w), dtype=torch.uint8)
    for index, camera in enumerate(cameras):
        images[:, index].numpy()[:] = camera.numpy().transpose(0, 3, 1, 2)
    return images


def _zero_copy(tensor_list) -> torch.Tensor:
    """A dense DALI output batch as a tensor over DALI's own buffer (kept alive by the tensor: dynamic executor)."""
    if hasattr(tensor_list, "as_cpu"):
        tensor_list = tensor_list.as_cpu()
    return torch.from_numpy(np.asarray(tensor_list.as_tensor()))


class DaliLoader:
    """Iterable of Batch for one rank with `len()` equal on every rank; each iteration is one epoch."""

    def __init__(self, pipeline: Pipeline, split: str, rank: int, world_size: int, shuffle: bool, augment: bool,
                 verify: bool = True):
        if pipeline.data.skip_bad_samples:
            raise StackError("data.skip_bad_samples=true is supported by data.backend=torch only (a DALI pipeline "
                             "stops at the first undecodable sample); use data.backend=torch to skip bad samples")
        self.pipeline, self.split, self.rank, self.world_size = pipeline, split, rank, world_size
        self.shuffle, self.augment, self.drop_last = shuffle, augment, split == "train"
        rig = pipeline.data.rig
        self.graph_augment = GraphAugment(pipeline.data.augment, rig.image_height, rig.image_width) if augment else None
        self.manifest = read_manifest(pipeline.data.root)
        check_layout(pipeline, self.manifest, pipeline.data.root)
        self.clips = self.manifest.get("layout") == "clips"
        self.shards = dataset_shards(pipeline, self.manifest, split)
        self.frames_back = pipeline.model.temporal_frames  # previous key frames each sample carries (k)
        self.maps = ClassMaps.build(self.manifest, pipeline)
        self.sums = ShardSums() if verify else None
        self.reader = SampleReader()
        self.epoch, self._epoch_set = 0, False
        self.skipped = 0
        self._pipe, self._in_flight, self._pool = None, 0, None
        if len(self) == 0:
            raise StackError(f"split {split!r} has fewer than one batch of data.batch_size={pipeline.data.batch_size} "
                             f"per rank for {world_size} rank(s); render more scenes or lower data.batch_size")

    def __len__(self) -> int:
        total, batch_size = sum(count for _, count in self.shards), self.pipeline.data.batch_size
        if self.clips:  # the rank's clips, each of frames_per_clip rows, batched as they come
            frames = rank_quota(total, self.world_size, 1, self.drop_last) * self.manifest["frames_per_clip"]
            return math.ceil(frames / batch_size)
        return batches_per_rank(total, self.world_size, 1, batch_size, self.drop_last)

    def set_epoch(self, epoch: int) -> None:
        self.epoch, self._epoch_set = epoch, True

    def graph(self):
        """The DALI graph, built on first use and kept for every later epoch."""
        if self._pipe is None:
            try:
                self._pipe = build_pipeline(self.manifest["cameras"], self.maps, self.pipeline.data.batch_size,
                                            max(self.pipeline.data.num_workers, 1), self.pipeline.train.seed,
                                            self.graph_augment, self.frames_back, self.clips)
            except RuntimeError as exc:
                raise BadSample(f"DALI could not build its pipeline: {_dali_message(exc)}") from exc
        return self._pipe

    def __iter__(self):
        epoch, batch_size = self.epoch, self.pipeline.data.batch_size
        if not self._epoch_set:
            self.epoch += 1
        self._epoch_set = False
        seed, total = self.pipeline.train.seed, sum(count for _, count in self.shards)
        ids = rank_samples(total, self.rank, self.world_size, 1 if self.clips else batch_size, self.drop_last, epoch,
                           seed, self.shuffle)
        pipe = self.graph()
        self._drain(pipe)
        if self.clips:  # the torch backend's generator for its one loader process (data.num_workers=0: worker 0)
            batches = self._clip_batches(ids, np.random.default_rng([seed, epoch, self.rank, 0]))
        else:
            batches = self._frame_batches(ids, np.random.default_rng([seed, epoch, self.rank]))
        pending = None
        for where, samples, params in batches:
            submitted = self._submit(pipe, where, samples, params)
            if pending is not None:  # batch k is collected once batch k + 1 is read, fed and scheduled
                yield self._collect(pipe, *pending)
            pending = submitted
        if pending is not None:
            yield self._collect(pipe, *pending)

    def _frame_batches(self, ids: np.ndarray, rng: np.random.Generator):
        """(where, samples, augmentation parameters or None) of each batch of frame samples, read and checked."""
        batch_size = self.pipeline.data.batch_size
        for start in range(0, len(ids), batch_size):
            where = locate(self.shards, ids[start:start + batch_size])
            samples = [self._read(shard, index) for shard, index in where]
            # drawn as the torch backend draws them for these rows
            yield where, samples, self.graph_augment.draw(rng, len(samples)) if self.augment else None

    def _clip_batches(self, ids: np.ndarray, rng: np.random.Generator):
        """(where, rows, augmentation parameters or None) of each batch of clip frames: the planned clips decoded, each
        clip's parameters drawn as its frames are decoded, frames mixed through the shuffle buffer when shuffling,
        all with one generator, as `stack.data.loader.FrameSamples` does in one process."""
        rows = self._clip_rows(locate(self.shards, ids), rng)
        batch, batch_size = [], self.pipeline.data.batch_size
        for row in shuffle_buffer(rows, rng) if self.shuffle else rows:
            batch.append(row)
            if len(batch) == batch_size:
                yield self._rows_batch(batch)
                batch = []
        if batch:
            yield self._rows_batch(batch)

    def _rows_batch(self, rows: list) -> tuple:
        params = [row.pop("params") for row in rows]
        return [row["where"] for row in rows], rows, params if self.augment else None

    def _clip_rows(self, where: list, rng: np.random.Generator):
        """Each planned clip's frames as rows: its decoded videos (shared), the frame's index and its previous key
        frames' (`clip_history`), its dense and small label arrays, and its augmentation parameters."""
        for shard, index in where:
            sample, frames, videos = clip_frames(self.reader, self.sums, self.manifest, shard, index, self._decoder())
            pasts = [arrays["past"] for arrays in frames]
            params = self.graph_augment.draw(rng, len(frames)) if self.augment else [None] * len(frames)
            for t, arrays in enumerate(frames):
                history = clip_history(pasts, t, self.frames_back)
                row = {"__key__": f"{sample['__key__']} frame {t}", "where": (shard, index), "videos": videos,
                       "frames": [t] + [before for before, _ in history], "params": params[t],
                       "arrays": {name: arrays[name] for name in SMALL}, **{name: arrays[name] for name in DENSE}}
                if self.frames_back:
                    row["history"] = history
                yield row

    def _decoder(self) -> ThreadPoolExecutor:
        """Threads that decode a clip's cameras side by side (as many as the graph's: data.num_workers, at least 1),
        made on first use and kept."""
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max(self.pipeline.data.num_workers, 1), thread_name_prefix="clip-decode")
        return self._pool

    def _submit(self, pipe, where: list, samples: list, params: list | None) -> tuple:
        """Feed one batch's samples (frame samples, or clip rows) and augmentation parameters to the graph and
        schedule its run. The dynamic executor runs it in DALI's threads while Python reads the next batch, so
        reading, hashing and label decoding overlap decoding instead of adding to it."""
        if self.clips:
            feed_decoded(pipe, self.manifest["cameras"], samples, self.frames_back)
        else:
            feed(pipe, self.manifest["cameras"], samples, self.frames_back)
        if params is not None:
            self.graph_augment.feed(pipe, params)
        self._schedule(pipe, where, samples)
        return where, samples, params

    def _collect(self, pipe, where: list, samples: list, params) -> Batch:
        return self._batch(self._outputs(pipe, where, samples), samples, params)

    def _drain(self, pipe) -> None:
        """Collect runs an abandoned epoch left scheduled, so the next epoch's first output is its own."""
        while self._in_flight:
            self._in_flight -= 1
            try:
                pipe.outputs()
            except RuntimeError:
                pass

    def _read(self, shard: str, index: int) -> dict:
        """One sample's members, checked (hashes, schema, label arrays) before DALI sees them; for a temporal network
        also its previous key frames (`key_frame_history`: read and checked alike, their JPEGs fed as more
        cameras)."""
        sample = read_checked(self.reader, self.sums, self.manifest, shard, index)
        arrays = decode_arrays(sample, shard, LOADER_MEMBERS)  # views over the bytes: the dense ones are checked here,
        check_arrays(arrays, self.manifest, shard, sample["__key__"])  # decoded in the graph, which cannot name them
        sample["arrays"] = {name: arrays[name] for name in SMALL}
        if self.frames_back:
            sample["history"] = key_frame_history(self.shards, self.reader, self.sums, self.manifest, sample, shard,
                                                  index, self.frames_back)
        return sample

    def _schedule(self, pipe, where: list, samples: list) -> None:
        try:
            pipe.schedule_run()
        except RuntimeError as exc:
            raise self._error(exc, where, samples) from exc
        self._in_flight += 1

    def _outputs(self, pipe, where: list, samples: list):
        self._in_flight -= 1
        try:
            return pipe.outputs()
        except RuntimeError as exc:
            raise self._error(exc, where, samples) from exc

    def _error(self, exc: RuntimeError, where: list, samples: list) -> BadSample:
        keys = ", ".join(f"shard {shard} sample {sample['__key__']}" for (shard, _), sample in zip(where, samples))
        return BadSample(f"DALI could not decode a sample of the batch [{keys}]: {_dali_message(exc)}; run with "
                         "data.backend=torch to name the sample and member, or re-create the shards with "
                         "`stack data make`")

    def _batch(self, outputs, samples: list, params: list | None) -> Batch:
        """A Batch from DALI's dense outputs and the samples' small labels (their geometry augmented by `params`,
        the parameters the graph augmented the pixels with)."""
        cameras, frames = len(self.manifest["cameras"]), self.frames_back + 1
        images = [_images(outputs[j * cameras:(j + 1) * cameras]) for j in range(frames)]
        dense = {"images": images[0], "depth": _zero_copy(outputs[frames * cameras]),
                 "semantic": _zero_copy(outputs[frames * cameras + 1])}
        if self.frames_back:
            dense["previous_images"] = images[1]
        if self.frames_back > 1:
            dense["earlier_images"] = torch.cat(images[2:], dim=1)
        labels = [self._labels(sample) for sample in samples]
        if params is not None:
            self.graph_augment.geometry(labels, params)
        return Batch(**dense, **stack_fields(labels, labels[0]))

    def _labels(self, sample: dict) -> dict:
        """The sample's small label fields, and for a temporal network the ego poses of its previous key frames."""
        row = label_fields(sample["arrays"], self.maps, self.pipeline)
        if self.frames_back:  # popped: at a scene start the history holds the sample itself (a reference cycle)
            poses = [torch.from_numpy(pose) for _, pose in sample.pop("history")]
            row["previous_pose"] = poses[0]
            if len(poses) > 1:
                row["earlier_poses"] = torch.stack(poses[1:])
        return row


def _dali_message(exc: RuntimeError) -> str:
    """DALI's error, shortened to its cause (DALI puts it after "encountered:", below the operator's traceback)."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    after = lines[lines.index("encountered:") + 1:] if "encountered:" in lines else lines
    return re.sub(r'^Assert on ".*?" failed: ', "", (after or [type(exc).__name__])[0])
