"""`stack bench data`: generator images/s, loader samples/s per backend, and their floors, side by side.

1. Generator: `make_dataset` end to end (scene setup, simulation, ray casting,
   JPEG/npy encoding, tar writing) on at least `BENCH_FRAMES` frames (whole
   scenes) of the pipeline's world, with `data.world.workers` processes: camera images (RGB + depth +
   semantics + instances) per second.
2. Loaders over the shards just written (train split, augmentation off, one
   epoch after a warm-up epoch, timed from its first batch so worker start-up and
   the DALI pipeline's one build are excluded): samples/s of the `torch` backend
   (`data.num_workers` processes) and of the `dali` backend (`data.num_workers`
   threads, CPU decode without a GPU), each with and without the per-member hash
   check (`stack.data.checksums`). On a shared machine those rates move more than the
   check costs, so the check is also timed in CPU time per sample against decoding the
   same sample, and the hash's throughput against zlib's CRC-32 on the same bytes.
3. Floors: the same JPEGs decoded in a bare loop by the same decoder — PIL in
   `data.num_workers` processes for torch, a DALI pipeline with only the reader
   and the image decoder for DALI. loader / floor says what the rest costs; the
   DALI loader's graph alone (labels decoded and converted, nothing assembled in
   Python) splits that cost between label bytes and Python.
   Each of these is measured REPEATS times, interleaved, and the best kept, so
   a busy machine disturbs the ratios less.
4. History: both loaders giving each sample its previous key frame (model.temporal_frames = 1, the
   tiny-drive preset's network), against the same loaders without it. Each sample then decodes twice
   the JPEGs, so half the bare-decode rate is the floor set against it.
5. Augmentation on the DALI loader (the pipeline's data.augment): in the graph
   (`stack.data.dali_augment`) against the loader's previous way, `augment_row` on
   every decoded row in Python, and against no augmentation, interleaved with the rest.
6. Consumption: samples/s of one training step (forward + backward) of the
   pipeline's model (`stack.models.build_model`; a timm resnet10t on the same
   images if the model cannot be built), so loader / step says whether data
   loading can keep up with training on this machine.
"""

from __future__ import annotations

import copy
import tempfile
import time
from multiprocessing import get_context
from pathlib import Path

import numpy as np

from stack.benchrecord import figures_of
from stack.pipeline import Pipeline

GOAL_IMAGES_PER_S = 60.0
"""The generator's goal: camera images per second on 2 cores, end to end (docs/results/data.md, "Generator")."""
BENCH_FRAMES = 96
"""Frames rendered for the run: enough that each loader epoch is many batches long, whatever
the preset's scene length (a preset of 6-frame scenes renders 16 scenes, one of 24 renders 4)."""
REPEATS = 3
"""Loader and floor measurements are interleaved and repeated; the best of each is reported."""


def _cpu_seconds() -> float:
    import resource

    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def _generator(pipeline: Pipeline) -> tuple[float, float, int]:
    """(camera images per wall second, per CPU second of this process and its workers, images)."""
    from stack.data.make import make_dataset

    world = pipeline.data.world
    start, cpu = time.perf_counter(), _cpu_seconds()
    make_dataset(pipeline, log=lambda *_: None)
    seconds, cpu = time.perf_counter() - start, _cpu_seconds() - cpu
    images = world.scenes * world.frames_per_scene * len(pipeline.data.rig.cameras)
    return images / seconds, images / cpu, images


def _loader_rate(pipeline: Pipeline, verify: bool = True, augment: bool = False, per_row=None) -> float:
    """Samples/s of one epoch; `per_row(batch, rng)` is extra work per batch (the old per-row augmentation)."""
    from stack.data.loader import build_loader

    loader = build_loader(pipeline, "train", 0, 1, shuffle=True, augment=augment, verify=verify)
    rng = np.random.default_rng(0)
    batches = loader if per_row is None else (per_row(batch, rng) for batch in loader)
    for _ in batches:  # warm-up epoch (page cache, imports)
        pass
    batches = loader if per_row is None else (per_row(batch, rng) for batch in loader)
    start, samples = None, 0
    for batch in batches:  # steady state: from the first batch on (worker start / DALI build excluded)
        if start is None:
            start = time.perf_counter()
            continue
        samples += batch.images.shape[0]
    return samples / (time.perf_counter() - start)


def _with_history(pipeline: Pipeline) -> Pipeline:
    """`pipeline` for a network that fuses the previous key frame: its loaders read that frame too."""
    temporal = copy.deepcopy(pipeline)
    temporal.model.temporal_frames = 1
    return temporal


def _augment_rows_in_python(pipeline: Pipeline):
    """What the DALI loader did before the graph augmented: `augment_row` on every decoded row, then collate."""
    from stack.data.augment import augment_row
    from stack.data.samples import collate

    def per_row(batch, rng):
        rows = [{name: tensor[i] for name, tensor in batch.tensors().items()} for i in range(batch.images.shape[0])]
        return collate([augment_row(row, pipeline.data.augment, rng) for row in rows])
    return per_row


def _jpeg_lists(pipeline: Pipeline) -> list:
    from stack.data.loader import read_manifest, read_piece, split_shards
    from stack.data.sharding import Piece

    manifest = read_manifest(pipeline.data.root)
    cameras = manifest["cameras"]
    out = []
    for path, count in split_shards(manifest, pipeline.data.root, "train"):
        for sample in read_piece(Piece(path, 0, count)):
            out.append([sample[f"{c}.jpg"] for c in cameras])
    return out


def _verify_cost(pipeline: Pipeline) -> tuple[float, float]:
    """(CPU ms per sample to check every member's CRC-32, CPU ms per sample to decode it without the check),
    one thread, the same raw samples, best of 3: the verification's share, insensitive to other load."""
    import multiprocessing

    from stack.data.checksums import ShardSums
    from stack.data.loader import FrameSamples, read_manifest, read_piece, split_shards
    from stack.data.sharding import Piece

    manifest = read_manifest(pipeline.data.root)
    shards = split_shards(manifest, pipeline.data.root, "train")
    samples = [(path, sample) for path, count in shards for sample in read_piece(Piece(path, 0, count))]
    decoder = FrameSamples(pipeline, manifest, shards, 0, 1, True, False, False, 0,
                           multiprocessing.get_context("fork").Value("q", 0), verify=False)
    sums = ShardSums()

    def cpu_ms(work) -> float:
        best = float("inf")
        for _ in range(3):
            start = time.process_time()
            for path, sample in samples:
                work(sample, path)
            best = min(best, (time.process_time() - start) * 1000 / len(samples))
        return best
    return cpu_ms(lambda sample, path: sums.check_sample(sample, path)), cpu_ms(decoder.decode)


def _hash_rates(samples: list) -> tuple[float, float]:
    """Bytes/s of (xxh3_64, zlib CRC-32) over every JPEG member on one core (best of 3 passes each)."""
    import zlib

    from stack.data.format import member_hash

    jpegs = [jpeg for sample in samples for jpeg in sample]
    total, rates = sum(map(len, jpegs)), []
    for function in (member_hash, zlib.crc32):
        best = 0.0
        for _ in range(3):
            start = time.perf_counter()
            for jpeg in jpegs:
                function(jpeg)
            best = max(best, total / (time.perf_counter() - start))
        rates.append(best)
    return rates[0], rates[1]


def _decode_all(jpegs: list) -> int:
    import io

    from PIL import Image

    for data in jpegs:
        with Image.open(io.BytesIO(data)) as image:
            np.asarray(image.convert("RGB"))
    return len(jpegs)


def _pil_floor(pipeline: Pipeline, samples: list) -> float:
    workers = max(pipeline.data.num_workers, 1)
    chunks = [sum(samples[i::workers], []) for i in range(workers)]
    with get_context("fork").Pool(workers) as pool:
        pool.map(_decode_all, [c[:1] for c in chunks])
        start = time.perf_counter()
        pool.map(_decode_all, chunks)
        return len(samples) / (time.perf_counter() - start)


def _dali_floor(pipeline: Pipeline) -> float:
    from nvidia.dali import fn, pipeline_def, types

    from stack.data.dali_loader import dali_device
    from stack.data.loader import read_manifest, split_shards

    manifest = read_manifest(pipeline.data.root)
    shards = split_shards(manifest, pipeline.data.root, "train")
    device_id = dali_device()

    @pipeline_def(batch_size=pipeline.data.batch_size, num_threads=max(pipeline.data.num_workers, 1),
                  device_id=device_id, exec_dynamic=True)
    def decode_only():
        members = fn.readers.webdataset(paths=[p for p, _ in shards],
                                        index_paths=[str(Path(p).with_suffix(".idx")) for p, _ in shards],
                                        ext=[f"{c}.jpg" for c in manifest["cameras"]], name="reader")
        return tuple(fn.decoders.image(m, device="mixed" if device_id is not None else "cpu", output_type=types.RGB)
                     for m in members)

    pipe = decode_only()
    pipe.build()
    return _pipeline_rate(pipe, sum(c for _, c in shards), pipeline.data.batch_size)


def _pipeline_rate(pipe, samples: int, batch_size: int) -> float:
    """Samples/s of a built DALI pipeline over one epoch, after a warm-up epoch."""
    iterations = max(samples // batch_size, 1)
    for _ in range(iterations):
        pipe.run()
    start = time.perf_counter()
    for _ in range(iterations):
        pipe.run()
    return iterations * batch_size / (time.perf_counter() - start)


def _dali_graph_rate(pipeline: Pipeline) -> float:
    """Samples/s of the DALI loader's own graph (the members it is fed decoded and converted), without reading,
    checking or Batch assembly: the samples are read into memory first and fed batch by batch."""
    from stack.data.dali_loader import build_pipeline, feed
    from stack.data.loader import read_manifest, split_shards
    from stack.data.samples import ClassMaps
    from stack.data.shard_index import SampleReader

    manifest = read_manifest(pipeline.data.root)
    reader, size = SampleReader(), pipeline.data.batch_size
    samples = [reader.read(path, i) for path, count in split_shards(manifest, pipeline.data.root, "train")
               for i in range(count)]
    batches = [samples[i:i + size] for i in range(0, len(samples) - size + 1, size)]
    pipe = build_pipeline(manifest["cameras"], ClassMaps.build(manifest, pipeline), size,
                          max(pipeline.data.num_workers, 1))

    def epoch() -> None:
        for batch in batches:
            feed(pipe, manifest["cameras"], batch)
            pipe.run()
    epoch()  # warm-up
    start = time.perf_counter()
    epoch()
    return len(batches) * size / (time.perf_counter() - start)


def _tree_cpu() -> float:
    """CPU seconds of this process and of its live children (DataLoader workers), from /proc."""
    import os

    tick, total = os.sysconf("SC_CLK_TCK"), time.process_time()
    with open(f"/proc/{os.getpid()}/task/{os.getpid()}/children") as listing:
        for pid in listing.read().split():
            try:
                with open(f"/proc/{pid}/stat") as stat:
                    fields = stat.read().rsplit(")", 1)[1].split()
                total += (int(fields[11]) + int(fields[12])) / tick
            except OSError:  # the child ended meanwhile
                pass
    return total


def _loader_cpu_ms(pipeline: Pipeline, epochs: int = 3) -> float:
    """Steady-state CPU ms per sample of one loader (this process, its DALI threads and its live workers) over
    `epochs` epochs after a first one: what loading costs the machine, which other jobs do not skew as they
    skew rates (they can still slow it through shared caches)."""
    from stack.data.loader import build_loader

    loader = build_loader(pipeline, "train", 0, 1, shuffle=True, augment=False)
    for _ in loader:  # workers started, page cache warm
        pass
    start, samples = _tree_cpu(), 0
    for _ in range(epochs):
        samples += sum(batch.images.shape[0] for batch in loader)
    return 1000 * (_tree_cpu() - start) / samples


def _floor_cpu_ms(pipeline: Pipeline, samples: list) -> tuple[float, float]:
    """CPU ms per sample of the two floors: PIL decoding the JPEGs in this process, and the bare DALI pipeline
    (reader + decoder, its threads) over two epochs, best of 3 each."""
    pil, dali = float("inf"), float("inf")
    for _ in range(3):
        start = time.process_time()
        for jpegs in samples:
            _decode_all(jpegs)
        pil = min(pil, 1000 * (time.process_time() - start) / len(samples))
        start = time.process_time()
        _dali_floor(pipeline)
        dali = min(dali, 1000 * (time.process_time() - start) / (2 * (len(samples) // pipeline.data.batch_size)
                                                              * pipeline.data.batch_size))
    return pil, dali


def _read_order_rates(pipeline: Pipeline) -> tuple[float, float]:
    """Samples/s of reading every train sample's members by offset (`stack.data.shard_index`) in stored order and
    in an epoch's permuted order, best of 3 each, page cache warm: what random access costs the global shuffle."""
    from stack.data.loader import read_manifest, split_shards
    from stack.data.shard_index import SampleReader
    from stack.data.sharding import epoch_permutation, locate

    shards = split_shards(read_manifest(pipeline.data.root), pipeline.data.root, "train")
    total = sum(count for _, count in shards)
    rates = []
    for shuffle in (False, True):
        where, best = locate(shards, epoch_permutation(total, 1, 0, shuffle)), 0.0
        for _ in range(3):
            reader = SampleReader()
            start = time.perf_counter()
            for shard, index in where:
                reader.read(shard, index)
            best = max(best, total / (time.perf_counter() - start))
            reader.close()
        rates.append(best)
    return rates[0], rates[1]


def _training_step_rate(pipeline: Pipeline) -> tuple[float, str]:
    """Samples/s of forward + backward on one batch from the loader (median of 3 after a warm-up)."""
    from stack.data import build_loader

    batch = next(iter(build_loader(pipeline, "train", 0, 1, augment=False)))
    try:
        from stack.models import build_model
        from stack.models.losses import multitask_loss

        model, what = build_model(pipeline), f"stack BevNet ({pipeline.model.backbone})"

        def step():
            multitask_loss(model.forward_batch(batch), batch, pipeline)["total"].backward()
    except Exception as exc:  # the model package is optional for this benchmark
        import timm

        model, what = timm.create_model("resnet10t", num_classes=10), f"timm resnet10t estimate ({type(exc).__name__})"
        images = batch.images.flatten(0, 1).float() / 255

        def step():
            model(images).sum().backward()
    step()
    times = []
    for _ in range(3):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    return batch.images.shape[0] / float(np.median(times)), what


def bench_scenes(frames_per_scene: int) -> int:
    """Whole scenes that hold at least BENCH_FRAMES frames."""
    return -(-BENCH_FRAMES // frames_per_scene)


FLOORS = {"torch": "pil", "torch_unverified": "pil", "dali": "dali_floor", "dali_unverified": "dali_floor",
          "dali_graph": "dali_floor"}
"""Loader measure -> the bare-decode measure that bounds its rate."""
HALF_FLOORS = {"torch_previous_frame": "pil", "dali_previous_frame": "dali_floor"}
"""Loader measure -> the bare decode whose half rate bounds it: each sample decodes twice the JPEGs (the torch
backend decodes a scene's first frame once, its own previous frame: with 6-frame scenes its floor is ~8% higher)."""


def record_figures(figures, generator_rate: float, rates: dict) -> None:
    """The generator's rate (one run) and every interleaved loader and floor rate (REPEATS each), for --record;
    a loader's floor is the best rate of the bare decode it is set against."""
    figures.add("generator (make, end to end)", [generator_rate], "camera images/s", lower_is_better=False)
    for name, values in rates.items():
        floor = max(rates[FLOORS[name]]) if name in FLOORS else None
        floor = max(rates[HALF_FLOORS[name]]) / 2 if name in HALF_FLOORS else floor
        figures.add(f"rate: {name}", values, "samples/s", lower_is_better=False, floor=floor)


def run(pipeline: Pipeline, args) -> int:
    """Print the side-by-side table (markdown), for a dated docs/log entry, then docs/results/data.md."""
    import os

    from stack import bench_only

    render_bench = bench_only.load("render_side_by_side")

    with tempfile.TemporaryDirectory() as folder:
        bench = copy.deepcopy(pipeline)
        bench.data.root = folder
        bench.data.world.scenes = bench_scenes(bench.data.world.frames_per_scene)
        bench.data.world.val_fraction = 0.0
        rate, cpu_rate, images = _generator(bench)
        print(f"generator: {images} camera images in {images / rate:.1f} s", flush=True)
        renderers = (render_bench.side_by_side(bench, log=lambda line: print(line, flush=True))
                     if render_bench else None)
        dali = copy.deepcopy(bench)
        dali.data.backend = "dali"
        torch_k1, dali_k1 = _with_history(bench), _with_history(dali)
        jpegs = _jpeg_lists(bench)
        measures = {"torch": lambda: _loader_rate(bench), "dali": lambda: _loader_rate(dali),
                    "pil": lambda: _pil_floor(bench, jpegs), "dali_floor": lambda: _dali_floor(bench),
                    "dali_graph": lambda: _dali_graph_rate(bench),
                    "torch_unverified": lambda: _loader_rate(bench, verify=False),
                    "dali_unverified": lambda: _loader_rate(dali, verify=False),
                    "torch_previous_frame": lambda: _loader_rate(torch_k1),
                    "dali_previous_frame": lambda: _loader_rate(dali_k1),
                    "dali_augment_graph": lambda: _loader_rate(dali, augment=True),
                    "dali_augment_python": lambda: _loader_rate(dali, per_row=_augment_rows_in_python(dali))}
        rates = {name: [] for name in measures}
        for _ in range(REPEATS):  # interleaved, best of REPEATS: other processes only ever slow a run down
            for name, measure in measures.items():
                rates[name].append(measure())
        best = {name: max(values) for name, values in rates.items()}
        record_figures(figures_of(args), rate, rates)
        torch_rate, dali_rate, pil_floor, dali_floor, dali_graph, torch_unverified, dali_unverified = \
            (best[name] for name in list(measures)[:7])
        xxh_rate, crc_rate = _hash_rates(jpegs)
        check_ms, decode_ms = _verify_cost(bench)
        stored_reads, permuted_reads = _read_order_rates(bench)
        torch_cpu, dali_cpu = _loader_cpu_ms(bench), _loader_cpu_ms(dali)
        pil_cpu, dali_floor_cpu = _floor_cpu_ms(bench, jpegs)
        step_rate, step_what = _training_step_rate(bench)
    rig, data = pipeline.data.rig, pipeline.data
    print(f"\nmachine: {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.2f}; "
          f"images {rig.image_width}x{rig.image_height}, "
          f"{len(rig.cameras)} cameras, batch {data.batch_size}, {data.num_workers} loader workers, "
          f"{data.world.workers} render processes")
    print("\n| what | rate | floor / reference | ratio |\n|---|---|---|---|")
    cores = min(data.world.workers, os.cpu_count() or 1)
    goal = GOAL_IMAGES_PER_S
    print(f"| generator (make, end to end) | {rate:.1f} camera images/s | goal {goal:.0f} images/s | {rate / goal:.2f}x goal |")
    print(f"| generator per CPU second (load-independent) | {cpu_rate:.1f} images/CPU-s | x {cores} idle cores = "
          f"{cpu_rate * cores:.1f} images/s | {cpu_rate * cores / goal:.2f}x goal |")
    print("\n".join(render_bench.rows(renderers, cores)) if renderers else f"| renderer rows skipped: {bench_only.MISSING} | | | |")
    print(f"| torch loader | {torch_rate:.1f} samples/s | PIL bare decode {pil_floor:.1f} samples/s | "
          f"{pil_floor / torch_rate:.2f}x slower than floor |")
    print(f"| dali loader (cpu) | {dali_rate:.1f} samples/s | DALI bare decode {dali_floor:.1f} samples/s | "
          f"{dali_floor / dali_rate:.2f}x slower than floor |")
    print(f"| dali graph only (members fed from memory, no Batch assembly) | {dali_graph:.1f} samples/s | DALI bare "
          f"decode {dali_floor:.1f} samples/s | {dali_floor / dali_graph:.2f}x slower than floor |")
    print(f"| torch loader, CPU time per sample (main + workers, steady state) | {torch_cpu:.2f} ms | PIL decode of "
          f"the same JPEGs {pil_cpu:.2f} ms | {torch_cpu / pil_cpu:.2f}x the floor |")
    print(f"| dali loader, CPU time per sample (all threads, steady state) | {dali_cpu:.2f} ms | DALI bare decode "
          f"{dali_floor_cpu:.2f} ms | {dali_cpu / dali_floor_cpu:.2f}x the floor |")
    print(f"| reading samples by member offsets, an epoch's permuted order | {permuted_reads:.0f} samples/s | stored "
          f"order {stored_reads:.0f} samples/s | permuted/stored {permuted_reads / stored_reads:.2f} |")
    print(f"| torch loader, member checksums verified | {torch_rate:.1f} samples/s | same loader unverified "
          f"{torch_unverified:.1f} samples/s | verified/unverified {torch_rate / torch_unverified:.3f} |")
    print(f"| dali loader, member checksums verified | {dali_rate:.1f} samples/s | same loader unverified "
          f"{dali_unverified:.1f} samples/s | verified/unverified {dali_rate / dali_unverified:.3f} |")
    print(f"| member hashes checked (xxh3_64), CPU time per sample, 1 thread | {check_ms:.3f} ms | decoding the same sample "
          f"(JPEGs, npy, Batch row) {decode_ms:.2f} ms | check = {100 * check_ms / decode_ms:.2f}% of decode |")
    print(f"| xxh3_64 of the JPEG members, one core | {xxh_rate / 2**20:.0f} MiB/s | zlib CRC-32 of the same bytes "
          f"{crc_rate / 2**20:.0f} MiB/s | {xxh_rate / crc_rate:.1f}x |")
    for backend, one_frame, floor in (("torch", torch_rate, pil_floor), ("dali", dali_rate, dali_floor)):
        with_previous = best[f"{backend}_previous_frame"]
        print(f"| {backend} loader with the previous key frame (model.temporal_frames=1) | {with_previous:.1f} samples/s "
              f"| one frame {one_frame:.1f} samples/s; bare decode of twice the JPEGs {floor / 2:.1f} samples/s | "
              f"{with_previous / one_frame:.2f}x the one-frame rate, {floor / 2 / with_previous:.2f}x slower than "
              "floor |")
    augment = pipeline.data.augment
    print(f"| dali loader, augmented in the graph (resize {augment.resize_scale}, rotation {augment.bev_rotate_deg} deg, "
          f"jitter {augment.color_jitter}) | {best['dali_augment_graph']:.1f} samples/s | same loader, augment_row per "
          f"row in Python {best['dali_augment_python']:.1f} samples/s; not augmented {dali_rate:.1f} samples/s | "
          f"graph/python {best['dali_augment_graph'] / best['dali_augment_python']:.2f}x, "
          f"graph/off {best['dali_augment_graph'] / dali_rate:.2f} |")
    print(f"| training step: {step_what} | {step_rate:.1f} samples/s | torch / step, dali / step | "
          f"{torch_rate / step_rate:.1f}x, {dali_rate / step_rate:.1f}x |")
    return 0
