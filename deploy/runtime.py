"""ONNX Runtime sessions and latency measurement on this machine.

Timing follows the FPS gate's needs: warm-up runs first (allocations, thread pools),
then many timed runs, reported as median and p99. A gate that must not flip on noise
also times a fixed reference workload (a dense fp32 matmul) in the same process, so a
busy or slow machine shows up as a slower reference, not as a model regression.
"""

from __future__ import annotations

import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np


def ort_session(path: str | Path, threads: int = 0, simulate_int8: bool = False):
    """An ONNX Runtime CPU session (`threads` 0: one per core).

    By default with full graph optimisation: QDQ pairs fuse into the host's int8 kernels,
    which is what the `onnxruntime-cpu` targets run. `simulate_int8` stops at the basic
    level, where each QuantizeLinear/DequantizeLinear runs as its own float op: the exact
    rounding and clipping of INT8 with fp32 accumulation, as an engine builder such as
    TensorRT computes it (int32 accumulators), independent of the host. On x86 CPUs without
    VNNI the fused u8·s8 kernels saturate their 16-bit pair sums (ONNX Runtime's
    quantization docs), which measured a relative error of 0.066 where simulation gave 0.0057.
    """
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.graph_optimization_level = (ort.GraphOptimizationLevel.ORT_ENABLE_BASIC if simulate_int8
                                        else ort.GraphOptimizationLevel.ORT_ENABLE_ALL)
    options.intra_op_num_threads = threads or (os.cpu_count() or 1)
    options.log_severity_level = 3
    return ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])


@dataclass
class LatencyStats:
    median_ms: float
    p99_ms: float
    mean_ms: float
    runs: int
    round_medians_ms: list = field(default_factory=list)
    """Median of each timing round when timed side by side (`stack.deploy.gates.fps.time_side_by_side`)."""
    round_reference_ms: list = field(default_factory=list)
    """Mean reference-workload time per run of the block timed after each round, same order."""

    def to_dict(self) -> dict:
        return asdict(self)


def summarize(times_s: list[float]) -> LatencyStats:
    values = np.asarray(times_s) * 1e3
    return LatencyStats(float(np.median(values)), float(np.percentile(values, 99)), float(values.mean()), len(values))


def time_session(session, feeds: dict, runs: int, warmup: int) -> LatencyStats:
    """Median and p99 wall time of `session.run` on `feeds` after `warmup` untimed runs."""
    for _ in range(warmup):
        session.run(None, feeds)
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        session.run(None, feeds)
        times.append(time.perf_counter() - start)
    return summarize(times)


REFERENCE_MATMUL = 512
"""Side of the square fp32 matmul used as the reference workload (268 MFLOP)."""


def reference_workload_ms(runs: int = 30) -> float:
    """Median time of a fixed fp32 matmul through ONNX Runtime: the machine's speed right now."""
    session, feeds = reference_session()
    return time_session(session, feeds, runs=runs, warmup=5).median_ms


def reference_session():
    """(ONNX Runtime session, feeds) of the reference workload: a REFERENCE_MATMUL-square fp32 MatMul."""
    import onnxruntime as ort
    from onnx import TensorProto, helper

    n = REFERENCE_MATMUL
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["a", "b"], ["c"])], "reference",
        [helper.make_tensor_value_info("a", TensorProto.FLOAT, [n, n]), helper.make_tensor_value_info("b", TensorProto.FLOAT, [n, n])],
        [helper.make_tensor_value_info("c", TensorProto.FLOAT, [n, n])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = min(model.ir_version, 10)
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    rng = np.random.default_rng(0)
    feeds = {"a": rng.standard_normal((n, n), dtype=np.float32), "b": rng.standard_normal((n, n), dtype=np.float32)}
    return session, feeds
