"""`stack bench ops`: BEV pooling, naive vs reference vs fused op, side by side.

For the tiny and default presets (and the given pipeline when it is neither), on the
rig's real geometry: the naive Lift-Splat version that materialises the frustum
tensor (B, N, D, H, W, C) and scatter-adds it, `bev_pool_ref`, the fused
`torch.ops.stack.bev_pool` (forward, and forward + backward), and the export form
(`FixedBevPool`) under ONNX Runtime. Each variant reports its best time of at least five
runs (other load on the machine only ever adds time) with one thread and with torch's
thread count, and its peak memory above the inputs. Peaks are measured in a child process (one per preset)
as peak RSS, reset through /proc/self/clear_refs, with glibc told to give every
allocation of 64 KiB or more back to the system on free so that RSS follows the live
tensors; timings run in this process with the allocator left as it is (there, fixed
mmap thresholds would add a page fault per fresh 4 KiB to every large allocation).

The floor is the bytes the op cannot avoid moving -- read depth, context and the
geometry tables once, write the grid once -- over the memory bandwidth measured in
the same run by a large tensor copy; forward + backward adds reading the incoming
gradient, depth, context and three rank tables again and writing both gradients. The
goals: forward within 3x and forward + backward within 4x of their floors (docs/results/ops.md).
From a source checkout, the previous CPU kernels (`benchmarks/bev_pool_v1.py`, bench-only: not in
`stack._C`, compiled on first use) are timed beside the current ones.
"""

from __future__ import annotations

import ctypes
import dataclasses
import functools
import gc
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from stack.benchrecord import figures_of
from stack.pipeline import Pipeline

PRESETS = {"tiny": ["pipeline.yaml", "presets/tiny.yaml"], "default": ["pipeline.yaml"]}
"""Presets every run measures, as config files under configs/."""


@dataclasses.dataclass
class Case:
    name: str
    geometry: object
    depth: torch.Tensor
    context: torch.Tensor
    keep: torch.Tensor
    """(B*N*D*H*W,) bool: frustum points inside the grid (what the naive version selects)."""
    cells: torch.Tensor
    """(kept,) int64: cell of each kept point, in frustum order."""

    def describe(self) -> str:
        g = self.geometry
        return (f"{self.name}: B={g.batch} N={g.cameras} D={g.depth_bins} features {g.feat_h}x{g.feat_w} "
                f"C={self.context.shape[2]} grid {g.grid_x}x{g.grid_y}; {self.keep.numel()} frustum points, "
                f"{g.num_points} in the grid, {g.num_cells} non-empty cells")


def geometry_builder(pipeline: Pipeline):
    """A zero-argument callable building the batch's geometry from the pipeline's rig."""
    from stack.ops import bev_geometry
    from stack.rig import rig_matrices

    rig, model = pipeline.data.rig, pipeline.model
    batch = pipeline.data.batch_size
    ks, poses = (torch.tensor(m, dtype=torch.float32) for m in rig_matrices(rig))
    return lambda: bev_geometry(ks.expand(batch, -1, -1, -1), poses.expand(batch, -1, -1, -1),
                                (rig.image_height, rig.image_width), model.feature_stride, model.depth, model.bev)


def build_case(name: str, pipeline: Pipeline) -> Case:
    model = pipeline.model
    geometry = geometry_builder(pipeline)()
    gen = torch.Generator().manual_seed(0)
    g = geometry
    depth = torch.randn(g.batch, g.cameras, g.depth_bins, g.feat_h, g.feat_w, generator=gen).softmax(2)
    context = torch.randn(g.batch, g.cameras, model.neck_channels, g.feat_h, g.feat_w, generator=gen)
    keep = torch.zeros(depth.numel(), dtype=torch.bool)
    keep[g.ranks_depth.long()] = True
    cell_of = torch.full((depth.numel(),), -1, dtype=torch.long)
    cell_of[g.ranks_depth.long()] = g.ranks_bev.long()
    return Case(name, geometry, depth, context, keep, cell_of[keep])


def bev_pool_naive(case: Case) -> torch.Tensor:
    """Lift-Splat as first written: the full (B, N, D, H, W, C) frustum, then select and scatter-add."""
    g, channels = case.geometry, case.context.shape[2]
    frustum = case.depth.unsqueeze(-1) * case.context.permute(0, 1, 3, 4, 2).unsqueeze(2)
    points = frustum.reshape(-1, channels)[case.keep]
    grid = torch.zeros(g.batch * g.grid_x * g.grid_y, channels).index_add_(0, case.cells, points)
    return grid.view(g.batch, g.grid_x, g.grid_y, channels).permute(0, 3, 1, 2).contiguous()


def forward_backward(pool, case: Case, grad: torch.Tensor):
    """A callable running `pool` forward and backward on fresh leaf copies of the case's inputs."""
    def step():
        depth = case.depth.detach().requires_grad_()
        context = case.context.detach().requires_grad_()
        pool(depth, context, case.geometry).backward(grad)
        return depth.grad
    return step


# ----------------------------------------------------------------------- measuring


def _rss() -> dict:
    found = {}
    with open("/proc/self/status") as status:
        for line in status:
            key, value = line.split(":", 1)
            if key in ("VmRSS", "VmHWM"):
                found[key] = int(value.split()[0]) * 1024
    return found


def peak_bytes(fn) -> int:
    """Peak resident memory above the current level while `fn` runs (its result is dropped).

    Meaningful only after `track_allocations_in_rss()`.
    """
    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    before = _rss()["VmRSS"]
    with open("/proc/self/clear_refs", "w") as clear:
        clear.write("5")  # resets VmHWM to the current RSS
    fn()
    return max(0, _rss()["VmHWM"] - before)


def track_allocations_in_rss() -> None:
    """Make glibc mmap (and unmap on free) every allocation of 64 KiB or more, for this process."""
    ctypes.CDLL("libc.so.6").mallopt(-3, 64 * 1024)  # M_MMAP_THRESHOLD; also stops its dynamic growth


def timed_samples(fn, min_total: float = 0.5, min_reps: int = 5) -> list[float]:
    """Seconds of every run of `fn` after a warm-up: at least `min_reps` runs and `min_total` seconds."""
    fn()  # warm-up
    times, start = [], time.perf_counter()
    while len(times) < min_reps or time.perf_counter() - start < min_total:
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return times


def best_seconds(fn, min_total: float = 0.5, min_reps: int = 5) -> float:
    """Fastest of at least `min_reps` runs (and `min_total` seconds): other load on the machine only adds time."""
    return min(timed_samples(fn, min_total, min_reps))


def copy_bandwidth(megabytes: int = 512) -> float:
    """Bytes/s of a large tensor copy (read + write counted), with torch's threads."""
    src = torch.ones(megabytes * 2**20 // 4)
    dst = torch.empty_like(src)
    seconds = best_seconds(lambda: dst.copy_(src), min_total=1.0)
    return 2 * src.nbytes / seconds


GEOMETRY = "geometry (bev_geometry, per batch)"
"""The row timing `bev_geometry` itself, beside the variants."""
FORWARD_GOAL, FORWARD_BACKWARD_GOAL = 3.0, 4.0
"""Most time over the floor the op may take: forward, and forward + backward."""


def floor_bytes(case: Case) -> int:
    """Read depth, context and the geometry tables once; write the (B, C, X, Y) grid once."""
    g = case.geometry
    tables = sum(t.nbytes for t in (g.ranks_depth, g.ranks_feat, g.ranks_bev, g.interval_starts, g.interval_lengths))
    grid = g.batch * case.context.shape[2] * g.grid_x * g.grid_y * case.context.element_size()
    return case.depth.nbytes + case.context.nbytes + tables + grid


def backward_floor_bytes(case: Case) -> int:
    """Read the incoming gradient, depth, context and the three rank tables; write both gradients."""
    g = case.geometry
    ranks = sum(t.nbytes for t in (g.ranks_depth, g.ranks_feat, g.ranks_bev))
    grad = g.batch * case.context.shape[2] * g.grid_x * g.grid_y * case.context.element_size()
    return grad + ranks + 2 * (case.depth.nbytes + case.context.nbytes)


def onnx_runtime_runner(case: Case, folder: Path):
    """A callable running `FixedBevPool` exported for this geometry under ONNX Runtime, or None."""
    try:
        import onnxruntime
    except ImportError:
        return None
    from stack.ops import FixedBevPool

    path = folder / f"bev_pool_{case.name}.onnx"
    torch.onnx.export(FixedBevPool(case.geometry).eval(), (case.depth, case.context), str(path),
                      input_names=["depth", "context"], output_names=["bev"], opset_version=17, dynamo=False)
    feeds = {"depth": case.depth.numpy(), "context": case.context.numpy()}
    sessions = {}

    def run_session():  # one session per torch thread count, so both columns use the same number of threads
        threads = torch.get_num_threads()
        if threads not in sessions:
            options = onnxruntime.SessionOptions()
            options.intra_op_num_threads = threads
            options.enable_cpu_mem_arena = False  # its arena would hide the peak after the first run
            sessions[threads] = onnxruntime.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
        return sessions[threads].run(None, feeds)

    return run_session


# ------------------------------------------------------------------------ reporting


def variants(case: Case, folder: Path) -> dict:
    """Name -> zero-argument callable, all computing the same grid (forward) or its gradient."""
    from stack.ops import bev_pool, bev_pool_ref, extension_loaded

    found = {"naive (frustum tensor + index_add)": lambda: bev_pool_naive(case),
             "reference (gather + index_add)": lambda: bev_pool_ref(case.depth, case.context, case.geometry)}
    if extension_loaded():
        found["op stack::bev_pool"] = lambda: bev_pool(case.depth, case.context, case.geometry)
    if _has_previous_kernels():
        found["previous kernel bev_pool_v1"] = lambda: _previous().bev_pool_v1(case.depth, case.context,
                                                                              *_op_tables(case))
    runner = onnx_runtime_runner(case, folder)
    if runner is not None:
        found["export form, ONNX Runtime"] = runner
    g = case.geometry
    grad = torch.randn(g.batch, case.context.shape[2], g.grid_x, g.grid_y)
    found["naive fwd+bwd"] = forward_backward(lambda d, c, _: _naive_autograd(case, d, c), case, grad)
    found["reference fwd+bwd"] = forward_backward(bev_pool_ref, case, grad)
    if extension_loaded():
        found["op fwd+bwd"] = forward_backward(bev_pool, case, grad)
    if _has_previous_kernels():
        found["previous kernel fwd+bwd"] = lambda: _previous_forward_backward(case, grad)
    return found


def _previous():
    """`torch.ops.stack_bench` with the previous kernels (compiled on first use), from the source checkout."""
    from stack import bench_only

    return bench_only.load("bev_pool_v1").ops()


@functools.lru_cache(maxsize=1)
def _has_previous_kernels() -> bool:
    """Whether the bench-only previous kernels can be timed here; says why not, once, when they cannot."""
    from stack import bench_only

    module = bench_only.load("bev_pool_v1")
    why = bench_only.MISSING if module is None else module.buildable()
    if why:
        print(f"previous-kernel rows skipped: {why}", file=sys.stderr)
        return False
    _previous()
    return True


def _op_tables(case: Case) -> tuple:
    g = case.geometry
    return (g.ranks_depth, g.ranks_feat, g.ranks_bev, g.interval_starts, g.interval_lengths, g.batch, g.grid_x,
            g.grid_y)


def _previous_forward_backward(case: Case, grad: torch.Tensor) -> torch.Tensor:
    """The previous kernels' forward then backward, called directly (they have no autograd formula)."""
    g = case.geometry
    _previous().bev_pool_v1(case.depth, case.context, *_op_tables(case))
    grad_depth, _ = _previous().bev_pool_backward_v1(grad, case.depth, case.context, g.ranks_depth,
                                                     g.ranks_feat, g.ranks_bev)
    return grad_depth


def _naive_autograd(case: Case, depth: torch.Tensor, context: torch.Tensor) -> torch.Tensor:
    return bev_pool_naive(dataclasses.replace(case, depth=depth, context=context))


def measure_times(case: Case, folder: Path, thread_counts: tuple, log, runs: dict | None = None) -> dict:
    """Variant -> ({threads: best seconds}, max abs error vs the reference, NaN for gradients); `runs`, when
    given, receives variant -> every run's seconds (`time_per_thread_count`)."""
    from stack.ops import bev_pool_ref

    expected = bev_pool_ref(case.depth, case.context, case.geometry)
    found, threads_before = {}, torch.get_num_threads()
    for name, fn in variants(case, folder).items():
        error = float("nan")
        if "bwd" not in name:
            out = fn()
            error = float((torch.as_tensor(out[0] if isinstance(out, list) else out) - expected).abs().max())
        found[name] = (time_per_thread_count(fn, thread_counts, None if runs is None else runs.setdefault(name, {})),
                       error)
        log(f"  {name}: " + ", ".join(f"{s * 1e3:.2f} ms ({t} threads)" for t, s in found[name][0].items()))
    torch.set_num_threads(threads_before)
    return found


def time_per_thread_count(fn, thread_counts: tuple, runs: dict | None = None) -> dict:
    """{threads: best wall seconds} plus "cpu": the process CPU seconds per run with one thread (the mean),
    which other jobs on a busy machine barely change. `runs`, when given, receives every run's seconds under
    the same keys."""
    seconds, samples = {}, {}
    for threads in thread_counts:
        torch.set_num_threads(threads)
        samples[threads] = timed_samples(fn)
        seconds[threads] = min(samples[threads])
        if threads == 1:
            samples["cpu"] = cpu_seconds_per_run(fn)
            seconds["cpu"] = sum(samples["cpu"]) / len(samples["cpu"])
    if runs is not None:
        runs.update(samples)
    return seconds


def cpu_seconds_per_run(fn, reps: int = 5) -> list[float]:
    times = []
    for _ in range(reps):
        start = time.process_time()
        fn()
        times.append(time.process_time() - start)
    return times


def measure_peaks(case: Case, pipeline: Pipeline, folder: Path) -> dict:
    """Variant -> peak bytes above the inputs; call in a process of its own."""
    track_allocations_in_rss()
    found = {}
    for name, fn in variants(case, folder).items():
        fn()
        found[name] = peak_bytes(fn)
    found[GEOMETRY] = peak_bytes(geometry_builder(pipeline))
    return found


def peaks_in_child(name: str, pipeline: Pipeline, folder: Path) -> dict:
    from stack.config import pipeline_to_yaml

    path = folder / f"{name}.yaml"
    path.write_text(pipeline_to_yaml(pipeline))
    result = subprocess.run([sys.executable, "-m", "stack.ops.bench", name, str(path)], capture_output=True, text=True)
    if result.returncode != 0:  # e.g. no /proc/self/clear_refs: report times without peaks
        print(f"  peak memory not measured: {result.stderr.strip().splitlines()[-1:]}", flush=True)
        return {}
    return json.loads(result.stdout.strip().splitlines()[-1])


def format_case(case: Case, times: dict, peaks: dict, bandwidth: float,
                bandwidth_one_thread: float | None = None) -> str:
    """The preset's table and floor lines. `bandwidth`: the copy bandwidth with the most threads, which the wall
    times are judged against; `bandwidth_one_thread`: the one-thread copy, for the 1-thread CPU times."""
    op = "op stack::bev_pool"
    counts = list(next(iter(times.values()))[0])  # thread counts, and "cpu"
    most = max(t for t in counts if t != "cpu")
    header = " | ".join("CPU time, 1 thread (ms)" if t == "cpu" else f"time, {t} thread{'s' if t > 1 else ''} (ms)"
                        for t in counts)
    lines = [f"{case.describe()}", "",
             f"| variant | {header} | time / op ({most} threads) | peak above inputs (MiB) | peak / op | "
             "max abs error vs reference |", "|---|" + "---:|" * (len(counts) + 4)]
    for name, (seconds, error) in times.items():
        base = None if name.startswith("geometry") else "op fwd+bwd" if "bwd" in name else op
        base_time = times[base][0][most] if base in times else float("nan")
        base_peak = peaks.get(base, 0) if base else 0
        cells = " | ".join(f"{seconds[t] * 1e3:.2f}" for t in counts)
        time_ratio = "-" if base_time != base_time else f"{seconds[most] / base_time:.1f}x"
        peak = f"{peaks[name] / 2**20:.1f}" if name in peaks else "-"
        peak_ratio = f"{peaks[name] / base_peak:.1f}x" if base_peak and name in peaks else "-"
        err = "-" if error != error else f"{error:.1e}"
        lines.append(f"| {name} | {cells} | {time_ratio} | {peak} | {peak_ratio} | {err} |")
    forward_bytes = floor_bytes(case)
    both_bytes = forward_bytes + backward_floor_bytes(case)
    lines += ["", f"floor: {forward_bytes / 2**20:.1f} MiB to move (depth + context + tables read, grid written) "
              f"at {bandwidth / 1e9:.1f} GB/s = {forward_bytes / bandwidth * 1e3:.2f} ms; forward + backward "
              f"{both_bytes / 2**20:.1f} MiB = {both_bytes / bandwidth * 1e3:.2f} ms",
              floor_line("op forward", times.get(op), forward_bytes / bandwidth, most, FORWARD_GOAL,
                         forward_bytes / (bandwidth_one_thread or bandwidth)),
              floor_line("op forward + backward", times.get("op fwd+bwd"), both_bytes / bandwidth, most,
                         FORWARD_BACKWARD_GOAL, both_bytes / (bandwidth_one_thread or bandwidth))]
    return "\n".join(lines)


def floor_line(what: str, timed: tuple | None, floor_s: float, most: int, goal: float,
               floor_one_thread_s: float | None = None) -> str:
    """`what` = Nx the floor (wall, `most` threads) and Mx (1-thread CPU time), against the goal: met or missed.

    The wall ratio decides; the CPU-time ratio (against the floor at the one-thread copy bandwidth when given) is
    printed beside it because other jobs on the machine barely change it.
    """
    if timed is None:
        return f"{what}: not measured (the extension stack._C is not built)"
    wall, cpu = timed[0][most], timed[0].get("cpu", float("nan"))
    verdict = "met" if wall / floor_s <= goal else "MISSED"
    cpu_ratio = cpu / (floor_one_thread_s or floor_s)
    return (f"{what} = {wall / floor_s:.1f}x the floor ({most} threads, wall), {cpu_ratio:.1f}x (1 thread, "
            f"CPU time); goal <= {goal:g}x: {verdict}")


def record_figures(figures, case: Case, runs: dict, bandwidths: dict) -> None:
    """Every run of every variant per thread count, and the 1-thread CPU times, for --record. The op's rows carry
    their floor: its bytes over the copy bandwidth `bandwidths[threads]` measured with as many threads."""
    floors = {"op stack::bev_pool": floor_bytes(case), "op fwd+bwd": floor_bytes(case) + backward_floor_bytes(case)}
    for name, by_threads in runs.items():
        for threads, samples in by_threads.items():
            label = "CPU time, 1 thread" if threads == "cpu" else f"{threads} thread{'s' if threads > 1 else ''}"
            floor = floors[name] / bandwidths[threads] if name in floors else None
            figures.add(f"{case.name}: {name}, {label}", samples, "s", floor=floor)


def run(pipeline: Pipeline, args) -> int:
    from stack.config import CONFIG_DIR, load_pipeline

    cases = {name: load_pipeline([CONFIG_DIR / f for f in files]) for name, files in PRESETS.items()}
    if pipeline.name not in cases:
        cases[pipeline.name] = pipeline
    load = ", ".join(f"{x:.2f}" for x in os.getloadavg())
    print(f"stack bench ops: torch {torch.__version__}, {torch.get_num_threads()} threads, {os.cpu_count()} CPUs, "
          f"load average {load} (figures are only meaningful on a quiet machine)", flush=True)
    thread_counts = tuple(sorted({1, torch.get_num_threads()}))
    bandwidth = copy_bandwidth()
    torch.set_num_threads(1)
    bandwidth_one_thread = copy_bandwidth()
    torch.set_num_threads(thread_counts[-1])
    bandwidths = {1: bandwidth_one_thread, "cpu": bandwidth_one_thread, thread_counts[-1]: bandwidth}
    print(f"measured copy bandwidth: {bandwidth / 1e9:.1f} GB/s with {thread_counts[-1]} threads, "
          f"{bandwidth_one_thread / 1e9:.1f} GB/s with 1 (512 MiB tensor copy, read + write)", flush=True)
    reports = []
    with tempfile.TemporaryDirectory() as folder:
        for name, preset in cases.items():
            case = build_case(name, preset)
            print(f"measuring {case.describe()}", flush=True)
            runs: dict = {}
            times = measure_times(case, Path(folder), thread_counts, lambda line: print(line, flush=True), runs)
            geometry = time_per_thread_count(geometry_builder(preset), thread_counts, runs.setdefault(GEOMETRY, {}))
            torch.set_num_threads(thread_counts[-1])
            times[GEOMETRY] = (geometry, float("nan"))
            record_figures(figures_of(args), case, runs, bandwidths)
            print("  peak memory (child process) ...", flush=True)
            peaks = peaks_in_child(name, preset, Path(folder))
            reports.append(format_case(case, times, peaks, bandwidth, bandwidth_one_thread))
    print("\n" + "\n\n".join(reports))
    return 0


def _peaks_main(name: str, yaml_path: str) -> None:
    from stack.config import pipeline_from_yaml

    pipeline = pipeline_from_yaml(Path(yaml_path).read_text(), source=yaml_path)
    with tempfile.TemporaryDirectory() as folder:
        print(json.dumps(measure_peaks(build_case(name, pipeline), pipeline, Path(folder))))


if __name__ == "__main__":
    _peaks_main(*sys.argv[1:3])
