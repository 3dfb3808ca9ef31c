"""`stack bench ops-cuda`: the fused `stack::bev_pool` CUDA kernels against the GPU's DRAM floor.

For the tiny and default presets, on the rig's real geometry, on the first CUDA device:
`bev_pool_ref` (gather + index_add: PyTorch's own CUDA kernels) and the fused op, forward
and forward + backward, in fp32 and in bf16 (the op promotes mixed inputs, so under
bf16-mixed training it sees what autocast hands it). Each run is timed with CUDA events,
two ways:

- cold: before every run a buffer four times the L2 is written, so the inputs come from
  DRAM as they do in a training step, where the image encoder has long evicted them;
  the DRAM floor (`stack.ops.bench.floor_bytes`, bytes over bandwidth) bounds this one;
- warm: back to back, the inputs partly in L2 (for the tiny preset all of them).

The bandwidth is measured in the same run by a device-to-device copy of 1 GiB (read +
write counted), and the datasheet figure is printed beside it. The goal is the CPU's:
forward + backward within 4x of its floor on the default preset.

The events time what a caller waits for, the host included: measured on an H100 the op's
forward + backward through autograd is bound by its launches and layout copies (the tiny
preset costs as much as the default one), so the kernels themselves are judged with Nsight
Compute (docs/results/ops.md, "CUDA on an NVIDIA H100").
"""

from __future__ import annotations

import dataclasses
import statistics
import sys

import torch

from stack.benchrecord import figures_of
from stack.errors import StackError
from stack.ops.bench import (FORWARD_BACKWARD_GOAL, FORWARD_GOAL, PRESETS, Case, backward_floor_bytes, build_case,
                             floor_bytes, forward_backward)
from stack.pipeline import Pipeline

DATASHEET_BANDWIDTH = {"H100 PCIe": 2.0e12, "H100": 3.35e12, "H200": 4.8e12, "A100": 2.0e12, "L4": 0.3e12}
"""Bytes/s of HBM/GDDR per datasheet (H100 SXM5 3.35 TB/s, PCIe 2.0; H200 4.8; A100 80 GB 2.0; L4 0.3),
first match of the device name wins: printed beside the measured copy, never used for the verdict."""
RUNS = 50
"""Timed runs per variant after five warm-ups."""


def require_cuda(bench: str, on_cpu: str) -> torch.device:
    """The first CUDA device, or a clear error (exit 2) saying what `stack bench <bench>` needs and what to run
    instead (`on_cpu`)."""
    if not torch.cuda.is_available():
        raise StackError(f"stack bench {bench} measures on a CUDA GPU; torch sees none (torch.cuda.is_available() "
                         f"is False, torch {torch.__version__}). On a CPU machine run `stack bench {on_cpu}`.")
    return torch.device("cuda", 0)


def to_device(case: Case, device: torch.device, dtype: torch.dtype) -> Case:
    return dataclasses.replace(case, geometry=case.geometry.to(device), depth=case.depth.to(device, dtype),
                               context=case.context.to(device, dtype), keep=case.keep.to(device),
                               cells=case.cells.to(device))


class L2Flush:
    """Writing a buffer 4x the L2's size evicts whatever a previous run left there."""

    def __init__(self, device: torch.device):
        l2_bytes = getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 64 * 2**20)
        self.buffer = torch.empty(max(l2_bytes, 16 * 2**20), dtype=torch.float32, device=device)  # 4 bytes each

    def __call__(self) -> None:
        self.buffer.fill_(1.0)


def event_samples(fn, flush: L2Flush | None, runs: int = RUNS, warmups: int = 5) -> list[float]:
    """Seconds of each of `runs` runs of `fn` between CUDA events, after `warmups`; `flush` runs before each
    one, outside the events."""
    for _ in range(warmups):
        fn()
    torch.cuda.synchronize()
    pairs = []
    for _ in range(runs):
        if flush is not None:
            flush()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        pairs.append((start, end))
    torch.cuda.synchronize()
    return [start.elapsed_time(end) / 1e3 for start, end in pairs]


def device_copy_bandwidth(device: torch.device, megabytes: int = 1024) -> float:
    """Bytes/s of a device-to-device tensor copy, read + write counted: the best of the runs."""
    src = torch.ones(megabytes * 2**20 // 4, device=device)
    dst = torch.empty_like(src)
    return 2 * src.nbytes / min(event_samples(lambda: dst.copy_(src), None, runs=20))


def datasheet_bandwidth(name: str) -> tuple[str, float] | None:
    for key, value in DATASHEET_BANDWIDTH.items():
        if all(word in name for word in key.split()):
            return key, value
    return None


def output_gradient(case: Case) -> torch.Tensor:
    """A random gradient of the pooled BEV (B, C, X, Y), on the case's device and dtype."""
    g = case.geometry
    return torch.randn(g.batch, case.context.shape[2], g.grid_x, g.grid_y, device=case.depth.device,
                       dtype=case.depth.dtype)


def variants(case: Case) -> dict:
    from stack.ops import bev_pool, bev_pool_ref

    g, grad = case.geometry, output_gradient(case)

    return {"reference (gather + index_add)": lambda: bev_pool_ref(case.depth, case.context, g),
            "op stack::bev_pool": lambda: bev_pool(case.depth, case.context, g),
            "reference fwd+bwd": forward_backward(bev_pool_ref, case, grad),
            "op fwd+bwd": forward_backward(bev_pool, case, grad)}


def measure_case(case: Case, flush: L2Flush, bandwidth: float, figures, log) -> list[str]:
    """Table rows for one preset and dtype; every run goes to `figures` with its floor."""
    from stack.ops import bev_pool, bev_pool_ref

    reference = bev_pool_ref(case.depth.float(), case.context.float(), case.geometry)
    error = float((bev_pool(case.depth, case.context, case.geometry).float() - reference).abs().max())
    dtype = str(case.depth.dtype).removeprefix("torch.")
    forward, both = floor_bytes(case), floor_bytes(case) + backward_floor_bytes(case)
    rows = []
    for name, fn in variants(case).items():
        floor_s = (both if "bwd" in name else forward) / bandwidth
        medians = {}
        for how, flusher in (("cold", flush), ("warm", None)):
            samples = event_samples(fn, flusher)
            medians[how] = statistics.median(samples)
            figures.add(f"{case.name} {dtype}: {name}, {how} L2", samples, "s", floor=floor_s)
        goal = FORWARD_BACKWARD_GOAL if "bwd" in name else FORWARD_GOAL
        verdict = "" if not name.startswith("op") else (" met" if medians["cold"] / floor_s <= goal else " MISSED")
        rows.append(f"| {case.name} | {dtype} | {name} | {medians['cold'] * 1e3:.3f} | {medians['warm'] * 1e3:.3f} | "
                    f"{floor_s * 1e3:.3f} | {medians['cold'] / floor_s:.1f}x (goal <= {goal:g}x){verdict} |")
        log(rows[-1])
    log(f"  {case.name} {dtype}: op forward max abs error vs the fp32 reference {error:.2e}")
    return rows


def run(pipeline: Pipeline, args) -> int:
    from stack.config import CONFIG_DIR, load_pipeline

    device = require_cuda("ops-cuda", "ops")
    name = torch.cuda.get_device_name(device)
    cases = {preset: load_pipeline([CONFIG_DIR / f for f in files]) for preset, files in PRESETS.items()}
    if pipeline.name not in cases:
        cases[pipeline.name] = pipeline
    bandwidth = device_copy_bandwidth(device)
    sheet = datasheet_bandwidth(name)
    sheet_text = f"; datasheet {sheet[0]} {sheet[1] / 1e12:.2f} TB/s" if sheet else ""
    print(f"stack bench ops-cuda: {name}, torch {torch.__version__}; measured device copy "
          f"{bandwidth / 1e12:.2f} TB/s (1 GiB, read + write){sheet_text}; median of {RUNS} runs", flush=True)
    flush, figures = L2Flush(device), figures_of(args)
    rows = ["| preset | dtype | variant | cold L2 ms | warm L2 ms | DRAM floor ms | cold / floor |",
            "|---|---|---|---:|---:|---:|---:|"]
    for preset, config in cases.items():
        base = build_case(preset, config)
        print(f"measuring {base.describe()}; floor bytes fp32: forward {floor_bytes(base) / 2**20:.1f} MiB, "
              f"backward {backward_floor_bytes(base) / 2**20:.1f} MiB", flush=True)
        for dtype in (torch.float32, torch.bfloat16):
            rows += measure_case(to_device(base, device, dtype), flush, bandwidth, figures,
                                 lambda line: print(line, flush=True))
    print("\n" + "\n".join(rows))
    return 0


def profiled_pass(preset: str = "default") -> None:
    """One forward + backward of `preset` per dtype (fp32, bf16) inside the CUDA profiler's range, after one
    outside it, for `ncu --profile-from-start off` or `nsys --capture-range=cudaProfilerApi`."""
    from stack.config import CONFIG_DIR, load_pipeline
    from stack.ops import bev_pool

    if preset not in PRESETS:
        raise StackError(f"no preset {preset!r} to profile; the presets are {', '.join(sorted(PRESETS))}")
    device = require_cuda("ops-cuda", "ops")
    base = build_case(preset, load_pipeline([CONFIG_DIR / f for f in PRESETS[preset]]))
    for dtype in (torch.float32, torch.bfloat16):
        case = to_device(base, device, dtype)
        step = forward_backward(bev_pool, case, output_gradient(case))
        step()  # warm-up, outside the range
        torch.cuda.synchronize()
        torch.cuda.profiler.start()
        step()
        torch.cuda.synchronize()
        torch.cuda.profiler.stop()
        print(f"profiled one forward + backward: {case.describe()}, {dtype}", flush=True)


def main(argv: list[str]) -> int:
    try:
        profiled_pass(*argv[:1])
    except StackError as error:
        print(f"python -m stack.ops.bev_pool_cuda_bench: error: {error}", file=sys.stderr)
        return error.exit_code
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
