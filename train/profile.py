"""`stack profile`: a few training steps under `torch.profiler`, with NVTX ranges, written as a Chrome trace.

Every phase of a step is a named range — `data`, `forward/<part>` for each top-level
part of the network (image encoder, each head, ...), `loss`, `backward`, `optimizer` —
opened both as an NVTX range (the `nvtx` package: seen by Nsight Systems on a GPU, a
no-op without one; `torch.cuda.nvtx` fails on CPU-only runs) and as a profiler
`record_function` (seen in the Chrome trace, chrome://tracing or ui.perfetto.dev).
The report prints the top operators and the share of wall time spent waiting for data,
and draws the per-phase times as a PNG.
"""

from __future__ import annotations

import contextlib
import time
from collections import defaultdict
from pathlib import Path
from typing import Callable, Iterable

import nvtx
import torch
from torch import nn

from stack.pipeline import Pipeline
from stack.train.callbacks import PRECISION_DTYPES


@contextlib.contextmanager
def annotate(name: str, totals: dict | None = None):
    """An NVTX range and a profiler range named `name`; adds its wall time to `totals[name]`."""
    start = time.perf_counter()
    with nvtx.annotate(name), torch.profiler.record_function(name):
        yield
    if totals is not None:
        totals[name] += time.perf_counter() - start


def annotate_parts(model: nn.Module, totals: dict) -> list[str]:
    """Wrap each top-level part's forward in a `forward/<name>` range."""
    names = []
    for name, part in model.named_children():
        forward = part.forward

        def ranged(*args, _forward=forward, _name=f"forward/{name}", **kwargs):
            with annotate(_name, totals):
                return _forward(*args, **kwargs)
        part.forward = ranged
        names.append(name)
    return names


def profile_steps(pipeline: Pipeline, out_dir: Path, model: nn.Module | None = None,
                  batches: Iterable | None = None, warmup: int = 2) -> dict:
    """Run warm-up + `train.profile_steps` steps; write trace.json and phases.png; return the figures."""
    from stack.train.module import build_adamw
    from stack.train.parallel import accelerator_name
    from stack.train.precision import for_this_hardware

    pipeline = for_this_hardware(pipeline)
    device = torch.device("cuda" if accelerator_name(pipeline.train) == "gpu" else "cpu")
    torch.manual_seed(pipeline.train.seed)
    if model is None:
        from stack.models import build_model

        model = build_model(pipeline)
    model = model.to(device).train()
    if batches is None:
        from stack.data import build_loader

        batches = build_loader(pipeline, "train", rank=0, world_size=1, pin_memory=device.type == "cuda")
    optimizer = build_adamw(model.parameters(), lr=pipeline.train.lr)
    step = _step_function(pipeline, model, optimizer, device)
    iterator = iter(batches)
    for _ in range(warmup):
        step(iterator, defaultdict(float))
    totals: dict = defaultdict(float)
    annotate_parts(model, totals)
    activities = [torch.profiler.ProfilerActivity.CPU] + (
        [torch.profiler.ProfilerActivity.CUDA] if device.type == "cuda" else [])
    out_dir.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    with torch.profiler.profile(activities=activities) as profiler:
        for _ in range(pipeline.train.profile_steps):
            step(iterator, totals)
    wall = time.perf_counter() - start
    trace = out_dir / "trace.json"
    profiler.export_chrome_trace(str(trace))
    sort = "self_cuda_time_total" if device.type == "cuda" else "self_cpu_time_total"
    return {"trace": trace, "wall_s": wall, "steps": pipeline.train.profile_steps, "phases": dict(totals),
            "data_wait_share": totals["data"] / wall, "top_ops": profiler.key_averages().table(sort_by=sort, row_limit=15),
            "png": _plot_phases(dict(totals), wall, out_dir / "phases.png"),
            **_roofline(pipeline, model, optimizer, next(iterator).to(device), device, out_dir)}


def _roofline(pipeline: Pipeline, model: nn.Module, optimizer, batch, device: torch.device, out_dir: Path) -> dict:
    """One more step, every operator charged to its part against the measured ceilings (`stack.train.operator_costs`):
    roofline.json, roofline.png and the table."""
    import json

    from stack.train.operator_costs import PeakRates, roofline_rows, roofline_table, step_roofline

    precision = pipeline.train.precision
    dtype = PRECISION_DTYPES[precision]
    rates = PeakRates.measure(device, (torch.float32,) if dtype == torch.float32 else (torch.float32, dtype))
    autocast = (lambda: torch.autocast(device.type, dtype=dtype)) if precision != "32-true" else contextlib.nullcontext
    rows = roofline_rows(step_roofline(model, batch, optimizer, rates, autocast, device))
    (out_dir / "roofline.json").write_text(json.dumps(
        {"precision": precision, "bandwidth_gbs": rates.bandwidth_gbs,
         "matmul_tflops": {str(k).removeprefix("torch."): v for k, v in rates.tflops.items()}, "rows": rows}, indent=1))
    return {"roofline": roofline_table(rows, rates), "roofline_png": _plot_roofline(rows, out_dir / "roofline.png")}


def _step_function(pipeline: Pipeline, model: nn.Module, optimizer, device: torch.device) -> Callable:
    precision = pipeline.train.precision
    dtype = PRECISION_DTYPES[precision]
    autocast = (lambda: torch.autocast(device.type, dtype=dtype)) if precision != "32-true" else contextlib.nullcontext
    run = getattr(model, "forward_batch", None) or model

    def step(iterator, totals: dict) -> None:
        with annotate("data", totals):
            batch = next(iterator).to(device, non_blocking=True)
        with autocast():
            outputs = run(batch)
            with annotate("loss", totals):
                loss = model.loss(outputs, batch)["total"]
        with annotate("backward", totals):
            loss.backward()
        with annotate("optimizer", totals):
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    return step


def _plot_phases(phases: dict, wall: float, path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(phases)
    figure, axis = plt.subplots(figsize=(8, 0.4 * len(names) + 1.2))
    axis.barh(names, [100 * phases[n] / wall for n in names], color="tab:blue")
    axis.invert_yaxis()
    axis.set_xlabel("% of profiled wall time (forward parts are nested in the step)")
    axis.set_title("stack profile: time per phase")
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)
    return path


def _plot_roofline(rows: list[dict], path: Path) -> Path:
    """Per part and phase: the operators' measured time beside their floor (log scale)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    parts = [row for row in rows if row["part"] != "step"]
    names = [f"{row['part']} ({row['phase']})" for row in parts]
    figure, axis = plt.subplots(figsize=(9, 0.35 * len(names) + 1.4))
    positions = range(len(names))
    axis.barh([p + 0.2 for p in positions], [max(row["ms"], 1e-3) for row in parts], 0.4, label="measured")
    axis.barh([p - 0.2 for p in positions], [max(row["floor_ms"], 1e-3) for row in parts], 0.4, label="floor")
    axis.set_yticks(list(positions), names)
    axis.invert_yaxis()
    axis.set_xscale("log")
    axis.set_xlabel("ms per step (log): operators' time against max(FLOPs / peak, bytes / bandwidth)")
    axis.legend(loc="lower right")
    axis.set_title("stack profile: where a training step's time goes")
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)
    return path
