"""The FPS gate: does the model keep up with the cameras on the target, measured or predicted?

The bars are a latency budget a user would set (`stack.pipeline.Target`): the cameras run at
`camera_hz`, and the network may use `network_share` of each frame period; the rest belongs to
decoding, pre/post-processing, tracking and control on the same computer. So the median
latency must fit the budget (`min_fps` = 1000 / budget unless set), and the p99 must fit the
whole frame period (`max_p99_latency_ms` unless set): a longer run delays or drops the next
frame. The report prints the budget, the latency and the headroom (budget / median latency;
the median's share of the frame period).

- measured (ONNX Runtime here, TensorRT on a device): median and p99 over
  `export.timing_runs` runs after warm-up. When the target records the reference
  workload's time on the machine its bar was set for (`reference_workload_ms`), the
  latencies are scaled by (that / the reference timed in this run) before comparing, so a
  loaded or slower CI machine is not mistaken for a slower model. The scale is reported.
  The reference is timed *between* the model's rounds (`time_side_by_side`) and taken as
  the mean per run over those blocks: a 1.4 ms matmul usually fits inside one scheduler
  slice, so its median ignores other processes (1.41-1.64 ms at load 7 on a 2-core EPYC
  while the tiny network went from ~50 to 117-147 ms), whereas its mean over a block pays
  for the preemptions as the network does (6-10 ms at that load: network / reference
  13-16x, as on a quiet machine).
- predicted (TensorRT targets without TensorRT): the latency model's total times
  `latency.GATE_MARGIN` (the worst optimistic leave-one-out error over its published
  references) is the median; the p99 is that times `latency.P99_OVER_MEDIAN`, a ratio taken
  from published Orin runs. The report says "predicted" with the model's stated error.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field


@dataclass
class FpsGate:
    mode: str
    """`measured` or `predicted`."""
    how: str
    """One line on how the latency was obtained."""
    median_ms: float
    p99_ms: float
    min_fps: float
    max_p99_ms: float
    scale: float = 1.0
    """Factor applied to the raw latency (reference workload normalisation); 1 when none."""
    raw_median_ms: float = 0.0
    raw_p99_ms: float = 0.0
    reasons: list = field(default_factory=list)
    camera_hz: float = 0.0
    frame_period_ms: float = 0.0
    budget_ms: float = 0.0
    """The network's share of the frame period (target.network_share x period), ms."""

    @property
    def headroom(self) -> float:
        """Budget / median latency: above 1 the network fits its share of the frame period."""
        return self.budget_ms / self.median_ms if self.median_ms > 0 else float("inf")

    @property
    def period_used(self) -> float:
        """Median latency as a fraction of the frame period."""
        return self.median_ms / self.frame_period_ms if self.frame_period_ms > 0 else 0.0

    @property
    def fps(self) -> float:
        return 1000.0 / self.median_ms if self.median_ms > 0 else float("inf")

    @property
    def passed(self) -> bool:
        return not self.reasons

    def to_dict(self) -> dict:
        return dict(asdict(self), fps=self.fps, passed=self.passed, headroom=self.headroom,
                    period_used=self.period_used)


def decide(mode: str, how: str, median_ms: float, p99_ms: float, target, scale: float = 1.0) -> FpsGate:
    """Apply the target's bars to (scaled) latencies."""
    gate = FpsGate(mode, how, median_ms * scale, p99_ms * scale, target.min_fps, target.max_p99_latency_ms,
                   scale, median_ms, p99_ms, camera_hz=target.camera_hz, frame_period_ms=target.frame_period_ms(),
                   budget_ms=target.latency_budget_ms())
    if gate.fps < target.min_fps:
        gate.reasons.append(f"{mode} {gate.fps:.1f} FPS (median {gate.median_ms:.2f} ms) is below the "
                            f"required {target.min_fps:g} FPS ({_budget_words(gate, target)})")
    if gate.p99_ms > target.max_p99_latency_ms:
        gate.reasons.append(f"{mode} p99 latency {gate.p99_ms:.2f} ms exceeds {target.max_p99_latency_ms:g} ms "
                            f"(the {gate.frame_period_ms:.1f} ms frame period at {target.camera_hz:g} Hz unless set)")
    return gate


def _budget_words(gate: FpsGate, target) -> str:
    return (f"budget {gate.budget_ms:.1f} ms = {target.network_share:.0%} of the {gate.frame_period_ms:.1f} ms "
            f"frame period at {target.camera_hz:g} Hz; headroom {gate.headroom:.2f}x")


TIMING_ROUNDS = 5
"""Side-by-side timing alternates the models in this many rounds, so a burst of load hits them all."""
REFERENCE_RUNS_PER_ROUND = 20
"""Reference-workload runs timed as one block after each round."""


def time_side_by_side(sessions: dict, feeds: dict, runs: int, warmup: int) -> tuple[dict, float]:
    """({name: LatencyStats} over `runs` runs each, reference workload ms): the sessions alternate in TIMING_ROUNDS
    rounds, each round followed by a block of reference runs whose mean time per run is the reference."""
    import time

    from stack.deploy.runtime import reference_session, summarize, time_session

    reference, reference_feeds = reference_session()
    for session in sessions.values():
        time_session(session, feeds, runs=1, warmup=warmup)
    time_session(reference, reference_feeds, runs=1, warmup=5)
    times, reference_s = {name: [] for name in sessions}, 0.0
    per_round = -(-runs // TIMING_ROUNDS)
    for _ in range(TIMING_ROUNDS):
        for name, session in sessions.items():
            for _ in range(per_round):
                start = time.perf_counter()
                session.run(None, feeds)
                times[name].append(time.perf_counter() - start)
        start = time.perf_counter()
        for _ in range(REFERENCE_RUNS_PER_ROUND):
            reference.run(None, reference_feeds)
        reference_s += time.perf_counter() - start
    reference_ms = 1e3 * reference_s / (TIMING_ROUNDS * REFERENCE_RUNS_PER_ROUND)
    return {name: summarize(values) for name, values in times.items()}, reference_ms


def measured_gate(target, stats, runtime: str, reference_now_ms: float | None) -> FpsGate:
    """The gate on timings taken here (`stats`: LatencyStats)."""
    scale, note = 1.0, ""
    if target.reference_workload_ms > 0 and reference_now_ms:
        scale = target.reference_workload_ms / reference_now_ms
        note = (f"; normalised by the reference workload ({reference_now_ms:.2f} ms now vs "
                f"{target.reference_workload_ms:.2f} ms on the reference machine, x{scale:.2f})")
    how = f"measured: {runtime}, median and p99 over {stats.runs} runs after warm-up{note}"
    return decide("measured", how, stats.median_ms, stats.p99_ms, target, scale)


def predicted_gate(target, prediction, error_note: str, margin: float = 1.0, p99_ratio: float | None = None) -> FpsGate:
    """The gate on the latency model's prediction (`prediction`: latency.Prediction) times `margin`; the p99
    bar is checked against that times `p99_ratio` (default `latency.P99_OVER_MEDIAN`): a prediction is a
    median, and a frame that waits is decided by the tail."""
    from stack.deploy.latency.roofline import P99_OVER_MEDIAN

    p99_ratio = P99_OVER_MEDIAN if p99_ratio is None else p99_ratio
    how = (f"predicted: per-layer roofline over the QDQ graph against {target.description or 'the target'} peaks "
           f"(INT8 {target.int8_tops:g} TOPS, FP16 {target.fp16_tflops:g} TFLOPS, {target.memory_bandwidth_gbs:g} GB/s), "
           f"TensorRT-style fusion, {prediction.total_ms:.2f} ms raw x {margin:g} safety margin, p99 = median x "
           f"{p99_ratio:g} (published Orin p99/median); {error_note}")
    return decide("predicted", how, prediction.total_ms, prediction.total_ms * p99_ratio, target, scale=margin)
