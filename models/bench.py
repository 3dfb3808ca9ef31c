"""`stack bench model`: parameters, FLOPs per frame per component, and forward/backward time.

FLOPs come from `torch.utils.flop_counter.FlopCounterMode` (convolutions, matmuls,
attention) on one frame (batch 1, all cameras); bev_pool's gather-multiply-add is
not a matmul, so its work is counted analytically (2 FLOPs per kept frustum point
and channel). The floor is the same FLOPs at the machine's measured dense fp32
matmul rate, measured in the same run; the ratio time / floor says how far each
component is from compute-bound. Times are medians after one warm-up run, of at least
MIN_RUNS and at most MAX_RUNS runs, stopping once BUDGET_S seconds are spent (so the
large preset stays within minutes on a CPU).
"""

from __future__ import annotations

import os
import statistics
import time

import torch

from stack.benchrecord import figures_of
from stack.pipeline import Pipeline

REPEATS = 3
"""Runs of the matmul peak measurement."""
MIN_RUNS, MAX_RUNS, BUDGET_S = 2, 7, 20.0


def timed_runs(run_once) -> list[float]:
    """Seconds of each call of `run_once()` after a warm-up, within the MIN/MAX_RUNS and BUDGET_S bounds."""
    run_once()
    times: list[float] = []
    while len(times) < MAX_RUNS and (len(times) < MIN_RUNS or sum(times) < BUDGET_S):
        start = time.perf_counter()
        run_once()
        times.append(time.perf_counter() - start)
    return times


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def matmul_peak_flops(device: torch.device, size: int = 2048) -> float:
    """Measured dense fp32 matmul rate, FLOP/s: the best of 2 x REPEATS runs, like the component times."""
    a, b = torch.randn(size, size, device=device), torch.randn(size, size, device=device)
    a @ b
    times = []
    for _ in range(2 * REPEATS):
        _sync(device)
        start = time.perf_counter()
        a @ b
        _sync(device)
        times.append(time.perf_counter() - start)
    return 2 * size**3 / min(times)


def component_flops(model, batch, geometry) -> dict[str, float]:
    """FLOPs of one forward per top-level component (bev_pool counted analytically)."""
    from torch.utils.flop_counter import FlopCounterMode

    from stack.models.network import COMPONENTS

    with torch.no_grad(), FlopCounterMode(display=False) as counter:
        model(batch.images, batch.ego_status, batch.command, geometry)
    counts = counter.get_flop_counts()
    flops = {name: float(sum(counts.get(f"{type(model).__name__}.{name}", {}).values())) for name in COMPONENTS}
    flops["view_transform"] = 2.0 * geometry.num_points * model.pipeline.model.neck_channels
    return flops


def median_and_best(samples: list[float]) -> tuple[float, float]:
    return statistics.median(samples), min(samples)


def component_samples(model, batch, geometry) -> dict[str, list[float]]:
    """Forward seconds of every timed run per top-level component and for the whole forward
    (`total`), from module hooks in the same runs, so the parts and the whole compare.
    The table shows each one's median and best.
    On a shared machine a multi-threaded op waits at its barrier whenever one thread loses
    its core, which only ever adds time: the best run approximates an idle machine."""
    from stack.models.network import COMPONENTS

    device = batch.images.device
    names = COMPONENTS + ("total",)
    samples: dict[str, list[float]] = {name: [] for name in names}
    starts: dict[str, float] = {}
    hooks = []
    for name in names:
        module = model if name == "total" else getattr(model, name)

        def before(_module, _inputs, name=name):
            _sync(device)
            starts[name] = time.perf_counter()

        def after(_module, _inputs, _output, name=name):
            _sync(device)
            samples[name].append(time.perf_counter() - starts[name])

        hooks += [module.register_forward_pre_hook(before), module.register_forward_hook(after)]
    try:
        with torch.no_grad():
            timed_runs(lambda: model(batch.images, batch.ego_status, batch.command, geometry))
    finally:
        for hook in hooks:
            hook.remove()
    return {name: values[1:] for name, values in samples.items()}  # the first call is timed_runs' warm-up


def train_step_samples(model, batch, geometry) -> list[float]:
    """Seconds of each timed forward + loss + backward in train mode."""
    device = batch.images.device

    def step():
        model.zero_grad(set_to_none=True)
        model.loss(model(batch.images, batch.ego_status, batch.command, geometry), batch)["total"].backward()
        _sync(device)

    model.train()
    times = timed_runs(step)
    model.eval()
    return times


def record_figures(figures, samples: dict, train_samples: list, flops: dict, peak: float) -> None:
    """Every forward time per component (floor: its FLOPs at the matmul peak) and the train step's, for --record."""
    for name, values in samples.items():
        work = sum(flops.values()) if name == "total" else flops[name]
        figures.add(f"forward: {name}", values, "s", floor=work / peak if work > 0 else None)
    figures.add("forward + loss + backward", train_samples, "s")


def run(pipeline: Pipeline, args) -> int:
    """Measure the pipeline's network on one frame and print a markdown section (for a dated docs/log entry, then
    the docs/results page: docs/results/model.md, "Size and compute per preset")."""
    import warnings

    from stack.models import build_model
    from stack.synthetic_batch import random_batch

    warnings.filterwarnings("ignore", message="bev_pool: the extension")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch.manual_seed(0)
    print(f"building {pipeline.name!r} ({pipeline.model.backbone}) on {device} ...", flush=True)
    model = build_model(pipeline).to(device)
    batch = random_batch(pipeline, batch_size=1, seed=0).to(device)
    start = time.perf_counter()
    geometry = model.geometry(batch.intrinsics, batch.cam_to_ego)
    geometry_s = time.perf_counter() - start
    print("counting FLOPs, measuring the matmul peak ...", flush=True)
    flops, peak = component_flops(model.eval(), batch, geometry), matmul_peak_flops(device)
    print("timing components, forward and backward ...", flush=True)
    load_before = os.getloadavg()[0]
    samples = component_samples(model, batch, geometry)
    train_samples = train_step_samples(model, batch, geometry)
    times = {name: median_and_best(values) for name, values in samples.items()}
    forward_s, train_s = times["total"], median_and_best(train_samples)
    load = (load_before, os.getloadavg()[0])
    record_figures(figures_of(args), samples, train_samples, flops, peak)
    print(_markdown(pipeline, model, flops, times, peak, forward_s, train_s, geometry_s, device, load))
    return 0


def _markdown(pipeline, model, flops, times, peak, forward_s, train_s, geometry_s, device, load) -> str:
    from stack.models.network import COMPONENTS

    rig = pipeline.data.rig
    lines = [f"### `{pipeline.name}`: {pipeline.model.backbone}, {len(rig.cameras)} x {rig.image_width}x{rig.image_height}, "
             f"BEV {model.grid[0]}x{model.grid[1]}, {pipeline.model.depth.bins} depth bins ({device}, "
             f"{torch.get_num_threads()} threads)", "",
             f"Measured fp32 matmul peak: {peak / 1e9:.1f} GFLOP/s (best 2048^2 matmul). "
             f"Floor = FLOPs / that peak. 1-min load average {load[0]:.1f} -> {load[1]:.1f} "
             f"on {os.cpu_count()} cores (above the core count, wall times include waiting for a core).", "",
             "| component | params (M) | GFLOP / frame | forward ms, median | best | floor ms | best / floor |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    for name in COMPONENTS:
        params = sum(p.numel() for p in getattr(model, name).parameters()) / 1e6
        floor_ms = flops[name] / peak * 1e3
        median, best = times[name]
        ratio = best * 1e3 / floor_ms if floor_ms > 0 else float("nan")
        lines.append(f"| {name} | {params:.3f} | {flops[name] / 1e9:.3f} | {median * 1e3:.1f} | {best * 1e3:.1f} | "
                     f"{floor_ms:.1f} | {ratio:.1f} |")
    total = sum(flops.values())
    params = sum(p.numel() for p in model.parameters()) / 1e6
    (forward_median, forward_best), (train_median, train_best) = forward_s, train_s
    lines += [f"| **total** | {params:.3f} | {total / 1e9:.3f} | {forward_median * 1e3:.1f} | "
              f"{forward_best * 1e3:.1f} | {total / peak * 1e3:.1f} | {forward_best / (total / peak):.1f} |", "",
              f"- forward + loss + backward (train mode, batch 1): median {train_median * 1e3:.0f} ms, best "
              f"{train_best * 1e3:.0f} ms ({train_best / forward_best:.2f}x the best forward; FLOPs alone predict ~3x)",
              f"- pooling geometry for one frame (`bev_geometry`, once per batch in training, baked for export): "
              f"{geometry_s * 1e3:.0f} ms",
              f"- reproduce: `OMP_NUM_THREADS={torch.get_num_threads()} stack bench model -c configs/pipeline.yaml"
              f"{'' if pipeline.name == 'default' else f' -c configs/presets/{pipeline.name}.yaml'}`"]
    return "\n".join(lines)
