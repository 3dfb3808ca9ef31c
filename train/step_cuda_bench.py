"""`stack bench train-step-cuda`: one training step of the pipeline's network on a CUDA GPU.

The network, AdamW and a synthetic batch (`stack.synthetic_batch.random_batch`, already in
GPU memory: data loading is measured by `stack bench data`) at fp32 and at bf16-mixed.
Each step is split by CUDA events recorded between its phases -- forward with the loss,
backward, optimizer step -- so the parts add up to the step and no extra synchronisation
enters it. Reported per precision: median step time, samples/s, the split, MFU (the
step's FLOPs from `torch.utils.flop_counter`, convolution backward counted as
`stack.train.callbacks.step_flop_counter` counts it, over the datasheet dense peak at that
precision, `stack.train.callbacks.datasheet_peak`), peak GPU memory, and for bf16 the
kernels that take the time (torch.profiler, by CUDA time) -- what a faster step has to
shrink.
"""

from __future__ import annotations

import statistics

import torch

from stack.benchrecord import figures_of
from stack.pipeline import Pipeline

PRECISIONS = ("32-true", "bf16-mixed")
STEPS, WARMUPS = 20, 3
PHASES = ("forward + loss", "backward", "optimizer")


def _step_parts(model, optimizer, batch, precision: str):
    """A closure running one step; it records a CUDA event before each phase and after the last."""
    enabled = precision == "bf16-mixed"

    def step() -> list:
        events = [torch.cuda.Event(enable_timing=True) for _ in range(len(PHASES) + 1)]
        events[0].record()
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=enabled):
            loss = model.loss(model.forward_batch(batch), batch)["total"]
        events[1].record()
        loss.backward()
        events[2].record()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        events[3].record()
        return events
    return step


def measure_precision(pipeline: Pipeline, precision: str, batch, device: torch.device) -> dict:
    from stack.models import build_model
    from stack.train.callbacks import datasheet_peak, precision_key, step_flop_counter

    torch.manual_seed(0)
    model = build_model(pipeline).to(device).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    step = _step_parts(model, optimizer, batch, precision)
    for _ in range(WARMUPS):
        step()
    with step_flop_counter() as counter:
        step()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats(device)
    recorded = [step() for _ in range(STEPS)]
    torch.cuda.synchronize()
    phases = {name: [events[i].elapsed_time(events[i + 1]) / 1e3 for events in recorded]
              for i, name in enumerate(PHASES)}
    steps = [events[0].elapsed_time(events[-1]) / 1e3 for events in recorded]
    props = torch.cuda.get_device_properties(device)
    peak = datasheet_peak(torch.cuda.get_device_name(device), precision_key(precision, device),
                          props.multi_processor_count)
    row = {"precision": precision, "steps": steps, "phases": phases, "gflop": counter.get_total_flops() / 1e9,
           "peak_memory_gib": torch.cuda.max_memory_allocated(device) / 2**30, "peak": peak}
    row["step_s"] = statistics.median(steps)
    row["mfu"] = None if peak is None else row["gflop"] / 1e3 / row["step_s"] / peak[0]
    if precision == "bf16-mixed":
        row["kernels"] = kernel_table(step)
    return row


def kernel_table(step, steps: int = 3, rows: int = 15) -> str:
    """torch.profiler's table of the kernels and ops taking the most CUDA time over `steps` steps."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    return prof.key_averages().table(sort_by="cuda_time_total", row_limit=rows)


def format_row(row: dict, batch_size: int) -> str:
    split = " / ".join(f"{statistics.median(row['phases'][name]) * 1e3:.1f}" for name in PHASES)
    mfu = "-" if row["mfu"] is None else f"{100 * row['mfu']:.1f}% of {row['peak'][0]:g} TFLOP/s"
    return (f"| {row['precision']} | {row['step_s'] * 1e3:.1f} | {batch_size / row['step_s']:.1f} | {split} | "
            f"{row['gflop']:.0f} | {mfu} | {row['peak_memory_gib']:.1f} |")


def run_step_cuda(pipeline: Pipeline, args) -> int:
    from stack.synthetic_batch import random_batch
    from stack.ops.bev_pool_cuda_bench import require_cuda

    device = require_cuda("train-step-cuda", "train-step")
    batch_size = pipeline.data.batch_size
    batch = random_batch(pipeline, batch_size, seed=0).to(device)
    print(f"stack bench train-step-cuda: {torch.cuda.get_device_name(device)}, torch {torch.__version__}, "
          f"pipeline {pipeline.name}, batch {batch_size}; median of {STEPS} steps after {WARMUPS} warm-ups",
          flush=True)
    figures, rows = figures_of(args), []
    for precision in PRECISIONS:
        row = measure_precision(pipeline, precision, batch, device)
        figures.add(f"step: {precision}", row["steps"], "s")
        for name in PHASES:
            figures.add(f"step: {precision}, {name}", row["phases"][name], "s")
        rows.append(row)
        print(format_row(row, batch_size), flush=True)
    print("\n| precision | step ms | samples/s | forward + loss / backward / optimizer ms | GFLOP | MFU "
          "(datasheet dense peak) | peak GPU memory GiB |\n|---|---:|---:|---|---:|---|---:|")
    print("\n".join(format_row(row, batch_size) for row in rows))
    for row in rows:
        if row["peak"]:
            print(f"{row['precision']} peak: {row['peak'][1]}")
        if "kernels" in row:
            print(f"\nCUDA time by kernel/op, {row['precision']}, 3 steps:\n{row['kernels']}")
    return 0
