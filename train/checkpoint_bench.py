"""`stack bench checkpoint`: how long a checkpoint stalls the training loop, asynchronous vs synchronous save.

The state is what `stack train` checkpoints for the pipeline's network: weights plus AdamW's two
moments (one optimizer step on zero gradients fills them), and a small meta part. Both ways write
the same folder format through `stack.checkpoint.sharded.AsyncCheckpointWriter`:

- synchronous: the loop waits for staging, the write of every shard, the fsyncs and the commit
  (what `RollingCheckpoints.save(blocking=True)` does);
- asynchronous: the loop waits only for staging (a copy into CPU memory) and the launch of the
  background write (`dcp.async_save`); the write is then awaited outside the timer, as a
  checkpoint interval longer than the write allows.

Rounds alternate the two (A B, B A, …) so they share whatever else the machine is doing; medians
are reported. The floors: the disk's sequential write bandwidth (the same bytes, one file, fsync)
bounds the synchronous stall from below, and a copy of the tensors into existing buffers the
asynchronous one. Beside each wall-clock stall, the process's CPU time in that window (all threads).

The stall above times the writer alone. What a user waits for is the training loop's pause: Lightning's
state dump, the finite-weights scan, the staging and hand-off, and, while the asynchronous write runs
beside the next steps, whatever it takes from them (on a 2-core machine it competes for the cores).
So the bench also runs the real loop (`stack train`'s Trainer and callbacks, synthetic batches from
`stack.synthetic_batch.random_batch`) three ways, interleaved over rounds: no checkpoint, asynchronous
checkpoints, synchronous ones, every `LOOP_EVERY` steps; the cost of a checkpoint is the loop's extra
wall time over the run without, divided by the checkpoints written. Goal: the asynchronous
checkpoint costs the loop ≤ 0.1× what the synchronous one does (judged on the loop, not the writer;
docs/results/training.md, "Checkpoints: what the training loop pays").
"""

from __future__ import annotations

import os
import shutil
import statistics
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import lightning.pytorch as pl
import torch

from stack.benchrecord import figures_of
from stack.pipeline import Pipeline
from stack.checkpoint.sharded import AsyncCheckpointWriter

GOAL = 0.1
ROUNDS = 6
LOOP_MODES = ("none", "async", "sync")
LOOP_EVERY = 6
LOOP_CHECKPOINTS = 4
LOOP_ROUNDS = 5


def training_state(pipeline: Pipeline) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """The network and an AdamW whose moments exist (as after the first training step)."""
    from stack.models import build_model

    model = build_model(pipeline).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    for parameter in model.parameters():
        parameter.grad = torch.zeros_like(parameter)
    optimizer.step()
    return model, optimizer


def lightning_checkpoint(model, optimizer, step: int) -> dict:
    """The shape of what Lightning's `dump_checkpoint` hands the writer (tensors by reference, as it does)."""
    return {"state_dict": {f"model.{k}": v for k, v in model.state_dict().items()},
            "optimizer_states": [optimizer.state_dict()], "global_step": step, "epoch": 0,
            "loops": {"fit_loop": {"epoch_progress": {"current": {"completed": 0}}}}}


def state_bytes(checkpoint: dict) -> int:
    tensors = list(checkpoint["state_dict"].values())
    tensors += [v for s in checkpoint["optimizer_states"][0]["state"].values() for v in s.values()
                if isinstance(v, torch.Tensor)]
    return sum(t.numel() * t.element_size() for t in tensors)


def timed_save(writer: AsyncCheckpointWriter, checkpoint: dict, step: int,
               blocking: bool) -> tuple[float, float, float, float]:
    """(seconds the loop was stalled, CPU seconds of the whole process meanwhile (all threads), seconds until the
    checkpoint was latest, CPU seconds of the process after the stall until then). The CPU time tells the work
    apart from waiting for other jobs on a shared machine; after an asynchronous stall the main thread only
    waits, so the last figure is the background write's own CPU time: what it takes from a training that keeps
    every core busy."""
    start, cpu = time.perf_counter(), time.process_time()
    writer.start(checkpoint, step, rank_zero=True)
    if blocking:
        writer.wait()
    stalled, stalled_cpu = time.perf_counter() - start, time.process_time() - cpu
    writer.wait()
    return stalled, stalled_cpu, time.perf_counter() - start, time.process_time() - cpu - stalled_cpu


def disk_floor_seconds(folder: Path, size: int) -> float:
    """Seconds to write `size` bytes sequentially into one file and fsync it (the disk's bandwidth floor)."""
    block = os.urandom(1 << 20)
    path = folder / "floor.bin"
    start = time.perf_counter()
    with open(path, "wb") as handle:
        for _ in range(max(1, size >> 20)):
            handle.write(block)
        handle.flush()
        os.fsync(handle.fileno())
    seconds = time.perf_counter() - start
    path.unlink()
    return seconds


def copy_floor_seconds(tensors: list[torch.Tensor], buffers: list[torch.Tensor]) -> float:
    """Seconds to copy every tensor into buffers that already exist (what staging into reused buffers must do)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the stager copies
    start = time.perf_counter()
    for source, target in zip(tensors, buffers):
        target.copy_(source)
    seconds = time.perf_counter() - start
    torch.set_num_threads(threads)
    return seconds


def measure(pipeline: Pipeline, folder: Path, rounds: int | None = None) -> dict:
    rounds = rounds or ROUNDS
    model, optimizer = training_state(pipeline)
    checkpoint = lightning_checkpoint(model, optimizer, 0)
    size = state_bytes(checkpoint)
    tensors = list(checkpoint["state_dict"].values()) + [
        v for s in checkpoint["optimizer_states"][0]["state"].values() for v in s.values() if isinstance(v, torch.Tensor)]
    buffers = [torch.empty_like(t) for t in tensors]
    times = {"sync": [], "async": [], "sync_cpu": [], "async_cpu": [], "async_written": [], "async_write_cpu": [],
             "disk": [], "copy": []}
    writer = AsyncCheckpointWriter(folder, keep=2)
    for index in range(rounds):
        order = (True, False) if index % 2 == 0 else (False, True)
        for blocking in order:
            step = 2 * index + (0 if blocking == order[0] else 1) + 1
            stalled, cpu, written, write_cpu = timed_save(writer, lightning_checkpoint(model, optimizer, step), step,
                                                          blocking)
            times["sync" if blocking else "async"].append(stalled)
            times["sync_cpu" if blocking else "async_cpu"].append(cpu)
            if not blocking:
                times["async_written"].append(written)
                times["async_write_cpu"].append(write_cpu)
        times["disk"].append(disk_floor_seconds(folder, size))
        times["copy"].append(copy_floor_seconds(tensors, buffers))
        print(f"round {index + 1}/{rounds}: sync stall {times['sync'][-1] * 1e3:.0f} ms, "
              f"async stall {times['async'][-1] * 1e3:.0f} ms", flush=True)
    medians = {name: statistics.median(values) for name, values in times.items()}
    return {"state_mb": size / 2**20, **{f"{name}_ms": value * 1e3 for name, value in medians.items()},
            "disk_mb_s": size / 2**20 / medians["disk"], "seconds": times}


class StepClock(pl.Callback):
    """Wall seconds from one training step's start to the next one's: the step and every callback after it (a
    checkpoint's dump, scan, staging and hand-off; the whole write when synchronous; the steps a background write
    slows down)."""

    def __init__(self):
        self.starts: list[float] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self.starts.append(time.perf_counter())

    def step_seconds(self) -> list[float]:
        return [after - before for before, after in zip(self.starts, self.starts[1:])]


def loop_seconds(pipeline: Pipeline, folder: Path, mode: str) -> float:
    """Wall seconds of `LOOP_EVERY * LOOP_CHECKPOINTS` training steps after a first (untimed) one, checkpointing every
    `LOOP_EVERY` steps as `mode` says ("none", "async", "sync"); the last checkpoint's write is inside the window."""
    from stack.train.checkpoints import RollingCheckpoints
    from stack.synthetic_batch import random_batch
    from stack.train.datamodule import PipelineData, ResumableLoader
    from stack.train.fit import _quiet_known_warnings, build_trainer
    from stack.train.module import TrainModule

    steps = LOOP_EVERY * LOOP_CHECKPOINTS
    every = LOOP_EVERY if mode != "none" else 10 * steps
    pipeline = replace(pipeline, train=replace(pipeline.train, out_dir=str(folder), max_steps=steps + 2,
                                               checkpoint_every_n_steps=every, log_every_n_steps=10 * steps,
                                               accelerator="cpu", devices=1, tracking_uri="off"))
    batches = [random_batch(pipeline, pipeline.data.batch_size, seed=i) for i in range(4)]

    def loaders(split: str, rank: int, world: int):
        return ResumableLoader(lambda epoch: iter(batches), len(batches))

    _quiet_known_warnings()
    pl.seed_everything(pipeline.train.seed, verbose=False)
    module = TrainModule(pipeline)
    trainer, _ = build_trainer(pipeline, progress=False, validate=False)
    rolling = next(c for c in trainer.callbacks if isinstance(c, RollingCheckpoints))
    rolling.blocking = mode == "sync"
    clock = StepClock()
    trainer.callbacks.append(clock)
    trainer.fit(module, datamodule=PipelineData(pipeline, loaders))
    # steps 2 .. steps+1: the checkpoint after step `steps` and its write (awaited by the next save or the end) count
    return sum(clock.step_seconds()[1:steps + 1])


def measure_loop(pipeline: Pipeline, folder: Path, rounds: int = LOOP_ROUNDS) -> dict:
    """Per mode, the loop's seconds in each round (modes in a rotated order each round, so they share the load),
    after one untimed run of each mode (the process's first fits pay one-time costs: 27 s against 11-13 s)."""
    seconds: dict[str, list[float]] = {mode: [] for mode in LOOP_MODES}
    for mode in LOOP_MODES:
        loop_seconds(pipeline, folder / f"warm-{mode}", mode)
        shutil.rmtree(folder / f"warm-{mode}", ignore_errors=True)
    for index in range(rounds):
        order = LOOP_MODES[index % 3:] + LOOP_MODES[:index % 3]
        for mode in order:
            run_folder = folder / f"loop-{index}-{mode}"
            seconds[mode].append(loop_seconds(pipeline, run_folder, mode))
            shutil.rmtree(run_folder, ignore_errors=True)
        print(f"loop round {index + 1}/{rounds}: " + ", ".join(
            f"{mode} {seconds[mode][-1]:.2f} s" for mode in LOOP_MODES), flush=True)
    per_checkpoint = {mode: [(seconds[mode][i] - seconds["none"][i]) / LOOP_CHECKPOINTS for i in range(rounds)]
                      for mode in ("async", "sync")}
    return {"seconds": seconds, "per_checkpoint": per_checkpoint,
            "step_ms": statistics.median(seconds["none"]) / (LOOP_EVERY * LOOP_CHECKPOINTS) * 1e3}


def record_figures(figures, row: dict) -> None:
    """The stalls of every round, each against its floor (the median disk write, the median copy), for --record."""
    seconds = row["seconds"]
    figures.add("synchronous stall", seconds["sync"], "s", floor=row["disk_ms"] / 1e3)
    figures.add("asynchronous stall", seconds["async"], "s", floor=row["copy_ms"] / 1e3)
    figures.add("asynchronous write (background)", seconds["async_written"], "s", floor=row["disk_ms"] / 1e3)
    figures.add("synchronous stall, CPU time", seconds["sync_cpu"], "s")
    figures.add("asynchronous stall, CPU time", seconds["async_cpu"], "s")
    figures.add("asynchronous write (background), CPU time", seconds["async_write_cpu"], "s")
    loop = row.get("loop")
    if loop:
        figures.add("loop without checkpoints", loop["seconds"]["none"], "s")
        for mode, name in (("async", "asynchronous"), ("sync", "synchronous")):
            figures.add(f"loop cost per {name} checkpoint", loop["per_checkpoint"][mode], "s",
                        floor=row["copy_ms"] / 1e3 if mode == "async" else row["disk_ms"] / 1e3)


def run(pipeline: Pipeline, args) -> int:
    """`stack bench checkpoint`: the writer's stalls and the loop's cost per checkpoint for this pipeline's state;
    exit 1 if the goal is missed by the writer or in the loop."""
    parent = Path(pipeline.train.out_dir).parent
    parent.mkdir(parents=True, exist_ok=True)
    folder = Path(tempfile.mkdtemp(prefix="checkpoint-bench-", dir=parent))
    try:
        row = measure(pipeline, folder)
        row["loop"] = measure_loop(pipeline, folder)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    record_figures(figures_of(args), row)
    writer_met = print_stalls(row, parent)
    loop_met = print_loop(row) == 0
    return 0 if writer_met and loop_met else 1


def print_stalls(row: dict, parent: Path) -> bool:
    """The writer's table and its verdict (True: the asynchronous stall is within the goal)."""
    print(f"\nstate {row['state_mb']:.1f} MiB (weights + AdamW moments), written to {parent} "
          f"(disk floor {row['disk_mb_s']:.0f} MiB/s, fsync'd), {ROUNDS} interleaved rounds, medians; "
          f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs\n")
    print("| state MiB | sync stall ms (CPU ms) | floor ms (disk) | async stall ms (CPU ms) | floor ms (copy) | "
          "async write ms (background) | async / sync |\n|---|---|---|---|---|---|---|")
    print(f"| {row['state_mb']:.1f} | {row['sync_ms']:.0f} ({row['sync_cpu_ms']:.0f}) | {row['disk_ms']:.0f} | "
          f"{row['async_ms']:.1f} ({row['async_cpu_ms']:.1f}) | {row['copy_ms']:.1f} | {row['async_written_ms']:.0f} | "
          f"{row['async_ms'] / row['sync_ms']:.3f} |")
    ratio = row["async_ms"] / row["sync_ms"]
    print(f"\nthe writer: an asynchronous save stalls {ratio:.3f}x a synchronous one (goal <= {GOAL}x): "
          f"{'met' if ratio <= GOAL else 'MISSED'}")
    return ratio <= GOAL


def print_loop(row: dict) -> int:
    """The loop's table and the goal's verdict (0 met, 1 missed)."""
    loop = row["loop"]
    cost = {mode: statistics.median(values) for mode, values in loop["per_checkpoint"].items()}
    spread = {mode: (min(values), max(values)) for mode, values in loop["per_checkpoint"].items()}
    steps = LOOP_EVERY * LOOP_CHECKPOINTS
    print(f"\nthe training loop (Lightning, synthetic batches, {steps} steps, a checkpoint every {LOOP_EVERY}: "
          f"{LOOP_CHECKPOINTS} per run; {LOOP_ROUNDS} rounds, modes interleaved; median step "
          f"{loop['step_ms']:.0f} ms without checkpoints)\n")
    print("| checkpoints | loop s per run (rounds) | cost per checkpoint ms (median; min..max) |\n|---|---|---|")
    for mode in LOOP_MODES:
        runs = " / ".join(f"{value:.2f}" for value in loop["seconds"][mode])
        paid = "-" if mode == "none" else (f"{cost[mode] * 1e3:.0f} ({spread[mode][0] * 1e3:.0f}.."
                                           f"{spread[mode][1] * 1e3:.0f})")
        print(f"| {mode} | {runs} | {paid} |")
    if cost["sync"] <= 0:
        print("\nthe synchronous checkpoints cost the loop nothing measurable in this run (the rounds' spread covers "
              "them): no ratio; run again on a quieter machine")
        return 1
    ratio = cost["async"] / cost["sync"]
    met = ratio <= GOAL
    print(f"\nthe loop pays {ratio:.3f}x for an asynchronous checkpoint what it pays for a synchronous one "
          f"(goal <= {GOAL}x; the writer's own stall: {row['async_ms'] / row['sync_ms']:.3f}x): "
          f"{'met' if met else 'MISSED'}")
    floor = (row["async_cpu_ms"] + row["async_write_cpu_ms"]) / 1e3
    print(f"floor: the asynchronous checkpoint's own CPU time, {floor * 1e3:.0f} ms (stall {row['async_cpu_ms']:.0f} + "
          f"background write {row['async_write_cpu_ms']:.0f}), is {floor / cost['sync']:.2f}x the synchronous cost: "
          f"a training that keeps all {os.cpu_count()} cores busy gives that time to the writer whichever thread or "
          f"process runs it")
    return 0 if met else 1
