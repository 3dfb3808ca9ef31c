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
asynchronous one. Beside each wall-clock stall, the process's CPU time in that window (all threads). Goal (issue 17): asynchronous stall ≤ 0.1× the synchronous stall.
"""

from __future__ import annotations

import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch

from stack.benchrecord import figures_of
from stack.pipeline import Pipeline
from stack.checkpoint.sharded import AsyncCheckpointWriter

GOAL = 0.1
ROUNDS = 6


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


def timed_save(writer: AsyncCheckpointWriter, checkpoint: dict, step: int, blocking: bool) -> tuple[float, float, float]:
    """(seconds the loop was stalled, CPU seconds of the whole process meanwhile (all threads), seconds until the
    checkpoint was latest). The CPU time tells the work apart from waiting for other jobs on a shared machine."""
    start, cpu = time.perf_counter(), time.process_time()
    writer.start(checkpoint, step, rank_zero=True)
    if blocking:
        writer.wait()
    stalled, stalled_cpu = time.perf_counter() - start, time.process_time() - cpu
    writer.wait()
    return stalled, stalled_cpu, time.perf_counter() - start


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
    times = {"sync": [], "async": [], "sync_cpu": [], "async_cpu": [], "async_written": [], "disk": [], "copy": []}
    writer = AsyncCheckpointWriter(folder, keep=2)
    for index in range(rounds):
        order = (True, False) if index % 2 == 0 else (False, True)
        for blocking in order:
            step = 2 * index + (0 if blocking == order[0] else 1) + 1
            stalled, cpu, written = timed_save(writer, lightning_checkpoint(model, optimizer, step), step, blocking)
            times["sync" if blocking else "async"].append(stalled)
            times["sync_cpu" if blocking else "async_cpu"].append(cpu)
            if not blocking:
                times["async_written"].append(written)
        times["disk"].append(disk_floor_seconds(folder, size))
        times["copy"].append(copy_floor_seconds(tensors, buffers))
        print(f"round {index + 1}/{rounds}: sync stall {times['sync'][-1] * 1e3:.0f} ms, "
              f"async stall {times['async'][-1] * 1e3:.0f} ms", flush=True)
    medians = {name: statistics.median(values) for name, values in times.items()}
    return {"state_mb": size / 2**20, **{f"{name}_ms": value * 1e3 for name, value in medians.items()},
            "disk_mb_s": size / 2**20 / medians["disk"], "seconds": times}


def record_figures(figures, row: dict) -> None:
    """The stalls of every round, each against its floor (the median disk write, the median copy), for --record."""
    seconds = row["seconds"]
    figures.add("synchronous stall", seconds["sync"], "s", floor=row["disk_ms"] / 1e3)
    figures.add("asynchronous stall", seconds["async"], "s", floor=row["copy_ms"] / 1e3)
    figures.add("asynchronous write (background)", seconds["async_written"], "s", floor=row["disk_ms"] / 1e3)
    figures.add("synchronous stall, CPU time", seconds["sync_cpu"], "s")
    figures.add("asynchronous stall, CPU time", seconds["async_cpu"], "s")


def run(pipeline: Pipeline, args) -> int:
    """`stack bench checkpoint`: one markdown row for this pipeline's state size; exit 1 if the goal is missed."""
    parent = Path(pipeline.train.out_dir).parent
    parent.mkdir(parents=True, exist_ok=True)
    folder = Path(tempfile.mkdtemp(prefix="checkpoint-bench-", dir=parent))
    try:
        row = measure(pipeline, folder)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    ratio = row["async_ms"] / row["sync_ms"]
    record_figures(figures_of(args), row)
    print(f"\nstate {row['state_mb']:.1f} MiB (weights + AdamW moments), written to {parent} "
          f"(disk floor {row['disk_mb_s']:.0f} MiB/s, fsync'd), {ROUNDS} interleaved rounds, medians; "
          f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs\n")
    print("| state MiB | sync stall ms (CPU ms) | floor ms (disk) | async stall ms (CPU ms) | floor ms (copy) | "
          "async write ms (background) | async / sync |\n|---|---|---|---|---|---|---|")
    print(f"| {row['state_mb']:.1f} | {row['sync_ms']:.0f} ({row['sync_cpu_ms']:.0f}) | {row['disk_ms']:.0f} | "
          f"{row['async_ms']:.1f} ({row['async_cpu_ms']:.1f}) | {row['copy_ms']:.1f} | {row['async_written_ms']:.0f} | "
          f"{ratio:.3f} |")
    print(f"\nasync stall = {ratio:.3f}x the synchronous stall (goal <= {GOAL}x): {'met' if ratio <= GOAL else 'MISSED'}")
    return 0 if ratio <= GOAL else 1
