"""ONNX Runtime sessions and latency measurement on this machine.

Timing follows the FPS gate's needs: warm-up runs first (allocations, thread pools),
then many timed runs, reported as median and p99. A gate that must not flip on noise
also times a fixed reference workload (the frozen graph of the network the bar was set for,
`stack.deploy.reference_graph`) in the same process, so a busy or slow machine shows up as a slower reference,
not as a model regression.
"""

from __future__ import annotations

import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np


def ort_session(path: str | Path | bytes, threads: int = 0, simulate_int8: bool = False, spinning: bool = True):
    """An ONNX Runtime CPU session of a model file (or its serialized bytes); `threads` 0: one per core.

    By default with full graph optimisation: QDQ pairs fuse into the host's int8 kernels,
    which is what the `onnxruntime-cpu` targets run. `simulate_int8` stops at the basic
    level, where each QuantizeLinear/DequantizeLinear runs as its own float op: the exact
    rounding and clipping of INT8 with fp32 accumulation, as an engine builder such as
    TensorRT computes it (int32 accumulators), independent of the host. On x86 CPUs without
    VNNI the fused u8·s8 kernels saturate their 16-bit pair sums (ONNX Runtime's
    quantization docs), which measured a relative error of 0.066 where simulation gave 0.0057.

    `spinning` False: the intra-op workers sleep as soon as a run ends instead of spinning for the next one.
    Timed side by side, sessions take turns on the same cores and a spinning pool takes them from the session
    that runs next (`stack.deploy.gates.fps.TIMING_SPINS`).
    """
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.graph_optimization_level = (ort.GraphOptimizationLevel.ORT_ENABLE_BASIC if simulate_int8
                                        else ort.GraphOptimizationLevel.ORT_ENABLE_ALL)
    options.intra_op_num_threads = threads or (os.cpu_count() or 1)
    options.log_severity_level = 3
    options.add_session_config_entry("session.intra_op.allow_spinning", "1" if spinning else "0")
    source = path if isinstance(path, bytes) else str(path)
    return ort.InferenceSession(source, options, providers=["CPUExecutionProvider"])


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


class RepeatedSession:
    """An ONNX Runtime session whose every run is `factor` runs of the real one: exactly `factor` x the work
    (the network a measured FPS bar must refuse, `stack bench fps-bar`)."""

    def __init__(self, session, factor: int):
        self.session, self.factor = session, factor

    def run(self, names, feeds):
        for _ in range(self.factor - 1):
            self.session.run(names, feeds)
        return self.session.run(names, feeds)


REFERENCE_MATMUL = 512
"""Side of the square fp32 matmul whose rate is `stack bench infer`'s floor (268 MFLOP)."""


def matmul_ms(runs: int = 30) -> float:
    """Median time of a fixed fp32 matmul through ONNX Runtime: the machine's fp32 speed right now."""
    session, feeds = matmul_session()
    return time_session(session, feeds, runs=runs, warmup=5).median_ms


def matmul_session():
    """(ONNX Runtime session, feeds) of a REFERENCE_MATMUL-square fp32 MatMul, a thread per core: the machine's
    fp32 rate (`stack bench infer`'s floor). Not a measured gate's reference: a matmul does not
    scale like a network across instruction sets (`stack.deploy.reference_graph`)."""
    from onnx import TensorProto, helper

    n = REFERENCE_MATMUL
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["a", "b"], ["c"])], "reference",
        [helper.make_tensor_value_info("a", TensorProto.FLOAT, [n, n]), helper.make_tensor_value_info("b", TensorProto.FLOAT, [n, n])],
        [helper.make_tensor_value_info("c", TensorProto.FLOAT, [n, n])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = min(model.ir_version, 10)
    session = ort_session(model.SerializeToString())
    rng = np.random.default_rng(0)
    feeds = {"a": rng.standard_normal((n, n), dtype=np.float32), "b": rng.standard_normal((n, n), dtype=np.float32)}
    return session, feeds


def gate_reference(target):
    """(session, feeds) of `target`'s reference workload, the frozen network its measured bar was set with,
    without spinning like the sessions it is timed beside; None when the target compares raw latency."""
    from stack.deploy.gates.fps import TIMING_SPINS
    from stack.deploy.reference_graph import example_feeds, thaw

    if target.reference_workload_ms <= 0:
        return None
    model = thaw(target.reference_graph_path())
    return ort_session(model, spinning=TIMING_SPINS), example_feeds(model)
