"""The FPS gate: does the model keep up with the cameras on the target, measured or predicted?

The bars are a latency budget a user would set (`stack.pipeline.Target`): the cameras run at
`camera_hz`, and the network may use `network_share` of each frame period; the rest belongs to
decoding, pre/post-processing, tracking and control on the same computer (`other_stages_ms`). So the
median latency must fit the budget (`min_fps` = 1000 / budget unless set), and the p99 must fit the
frame period minus the other stages (`max_p99_latency_ms` unless set): a longer run makes the frame
miss its period. With the derived values both bars are the network's share, and the p99 bar binds first
for a prediction (p99 = median x `P99_OVER_MEDIAN`). The report prints the budget, the latency and the
headroom (budget / median latency; the median's share of the frame period).

- measured (ONNX Runtime here, TensorRT on a device): median and p99 over `export.timing_runs` runs after warm-up.
  When the target records the reference workload's time on the machine its bar was set for
  (`reference_workload_ms`), the latencies are scaled by (that / the reference timed in this run) before
  comparing, so a loaded or slower CI machine is not mistaken for a slower model. The scale is reported. The
  reference is the network the bar was set with, frozen (`stack.deploy.reference_graph`): it speeds up and slows
  down with the CPU's instruction set and load as the candidate does, which a dense matmul did not
  (docs/log/2026-11-26_reference-workload-fps-bar.md). One reference run follows every model run
  (`time_side_by_side`), no session spinning (`TIMING_SPINS`), and the reference per round is the mean of the runs
  paired with it, so it pays for the same preemptions as the network.
  The median bar is decided on the repeats, not on one median: each timing round's median,
  normalised by the reference runs paired with that round's runs. Their mean's 90% interval within
  the bar: pass; beyond it: fail; the bar inside it: **inconclusive**. An inconclusive verdict buys
  more rounds (TIMING_ROUNDS at a time, up to MAX_TIMING_ROUNDS): on a shared runner one preempted
  round can widen five rounds' interval over the bar (docs/log/2026-11-25_inconclusive-timing-rounds.md),
  and twenty rounds narrow it by about 2.5x. Still inconclusive after them, it fails the gate unless the
  target sets `timing_inconclusive_passes`.
- predicted (TensorRT targets without TensorRT): the latency model's total times the target's
  margin (`latency.margins.target_margin`: from the errors on the target's own published
  references, or the conservative margin when it has none, reported "unvalidated") is the median;
  the p99 is that times `latency.P99_OVER_MEDIAN`, a ratio taken from published Orin runs. The
  report says "predicted" with the model's stated error.
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
    """Factor applied to the raw latency (reference workload normalisation, or the prediction's margin)."""
    raw_median_ms: float = 0.0
    raw_p99_ms: float = 0.0
    reasons: list = field(default_factory=list)
    camera_hz: float = 0.0
    frame_period_ms: float = 0.0
    budget_ms: float = 0.0
    """The network's share of the frame period (target.network_share x period), ms."""
    verdict: str = ""
    """`pass`, `fail` or `inconclusive` (measured repeats straddling the median bar)."""
    repeats_ms: list = field(default_factory=list)
    """Per timing round: the round's median, normalised by the reference block timed after it, ms."""
    reference_workload_ms: float = 0.0
    """The target's reference-workload time (0: raw latency); repeats are normalised to it."""
    inconclusive_passes: bool = False
    """The target's `timing_inconclusive_passes`."""
    validation: str = ""
    """`measured`, or for a prediction `validated` / `unvalidated` (the target has no published reference)."""
    margin_basis: str = ""

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


def median_verdict(median_ms: float, repeats_ms: list, bar_ms: float) -> str:
    """`pass` / `fail` / `inconclusive` of the median bar. With repeats: on the 90% interval of their mean
    (mean +- t x sd / sqrt(n)), pass when it lies within the bar, fail when beyond it, inconclusive
    when the bar is inside it; without (a prediction, a TensorRT timing), on the one median.
    `stack.deploy.verdicts` recomputes it from gate.json."""
    low, high = repeat_interval(repeats_ms) if len(repeats_ms) > 1 else (median_ms, median_ms)
    if high <= bar_ms:
        return "pass"
    return "fail" if low > bar_ms else "inconclusive"


def repeat_interval(repeats_ms: list) -> tuple[float, float]:
    """The 90% t-interval of the repeats' mean, ms (Student's t with n - 1 degrees of freedom)."""
    import statistics

    n = len(repeats_ms)
    mean, half = statistics.fmean(repeats_ms), confidence_t(n) * statistics.stdev(repeats_ms) / n ** 0.5
    return mean - half, mean + half


def confidence_t(n: int) -> float:
    """Two-sided 90% Student's t for the mean of `n` repeats (2.132 for five)."""
    from scipy.stats import t

    return float(t.ppf(0.95, n - 1))


def decide(mode: str, how: str, median_ms: float, p99_ms: float, target, scale: float = 1.0,
           repeats_ms: list | None = None) -> FpsGate:
    """Apply the target's bars to (scaled) latencies; `repeats_ms` (already normalised) decide the median bar."""
    gate = FpsGate(mode, how, median_ms * scale, p99_ms * scale, target.min_fps, target.max_p99_latency_ms,
                   scale, median_ms, p99_ms, camera_hz=target.camera_hz, frame_period_ms=target.frame_period_ms(),
                   budget_ms=target.latency_budget_ms(), repeats_ms=[float(r) for r in repeats_ms or []],
                   inconclusive_passes=target.timing_inconclusive_passes)
    gate.verdict = median_verdict(gate.median_ms, gate.repeats_ms, 1000.0 / target.min_fps)
    spread = ("; repeats' 90%% interval %.2f-%.2f ms" % repeat_interval(gate.repeats_ms)
              if len(gate.repeats_ms) > 1 else "")
    if gate.verdict == "fail":
        gate.reasons.append(f"{mode} {gate.fps:.1f} FPS (median {gate.median_ms:.2f} ms{spread}) is below the "
                            f"required {target.min_fps:g} FPS ({_budget_words(gate, target)})")
    elif gate.verdict == "inconclusive" and not target.timing_inconclusive_passes:
        gate.reasons.append(f"{mode} FPS inconclusive: the bar {1000.0 / target.min_fps:.2f} ms lies inside the spread "
                            f"of the repeats' mean{spread} (median {gate.median_ms:.2f} ms); an inconclusive verdict fails "
                            f"unless the target sets timing_inconclusive_passes")
    if gate.p99_ms > target.max_p99_latency_ms:
        gate.verdict = "fail"
        gate.reasons.append(f"{mode} p99 latency {gate.p99_ms:.2f} ms exceeds {target.max_p99_latency_ms:g} ms "
                            f"(the {gate.frame_period_ms:.1f} ms frame period at {target.camera_hz:g} Hz minus "
                            f"{target.other_stages_ms:g} ms of the pipeline's other stages, unless set)")
    return gate


def _budget_words(gate: FpsGate, target) -> str:
    return (f"budget {gate.budget_ms:.1f} ms = {target.network_share:.0%} of the {gate.frame_period_ms:.1f} ms "
            f"frame period at {target.camera_hz:g} Hz; headroom {gate.headroom:.2f}x")


TIMING_ROUNDS = 5
"""Side-by-side timing alternates the models in this many rounds, so a burst of load hits them all; each
round's normalised median is one repeat of the verdict."""
MAX_TIMING_ROUNDS = 20
"""An inconclusive verdict buys TIMING_ROUNDS more rounds at a time, up to this many: 20 repeats narrow the
interval of 5 by sqrt(20 / 5) x t(4) / t(19) = 2.5x. Looking again only while inconclusive, a clear pass or
fail after five rounds is never revisited."""


TIMING_SPINS = False
"""Whether the sessions timed side by side keep ONNX Runtime's spinning intra-op workers. They do not: sessions
that take turns on the same cores (the models and the reference) each keep a pool that spins after a run, and
the spinning workers take the cores of the session that runs next: the paired timings doubled and a 2x slower
graph showed only 1.6-1.7x. Without spinning a run costs ~10% more alone, as it does on a car computer whose
cores run the other stages too (docs/log/2026-11-26_reference-workload-fps-bar.md)."""


def time_side_by_side(sessions: dict, feeds: dict, runs: int, warmup: int, reference=None,
                      settled=None) -> tuple[dict, float]:
    """({name: LatencyStats}, reference workload ms): the sessions alternate in rounds of ceil(`runs` /
    TIMING_ROUNDS) runs each; with a `reference` ((session, feeds), `stack.deploy.runtime.gate_reference`) every
    model run is followed by one reference run, whose mean time per run is the reference. Pairing each run with
    a reference run samples the same load (a 20-run block after the round tracked it poorly: per-round normalised
    medians of the tiny network spread 14-37 ms at load 2-3.5 on the 2-core EPYC, against 12-24 ms paired).
    Each LatencyStats carries its rounds' medians and the mean reference of the runs paired with them: the
    repeats the median bar is decided on. After TIMING_ROUNDS rounds, and after each further TIMING_ROUNDS up to
    MAX_TIMING_ROUNDS, `settled(stats, reference)` (when given) says whether the verdicts are decided; until it
    does, more rounds are timed. Reference 0.0 when none was timed."""
    from stack.deploy.runtime import time_session

    for session in sessions.values():
        time_session(session, feeds, runs=1, warmup=warmup)
    if reference is not None:
        time_session(*reference, runs=1, warmup=2)
    rounds: dict = {name: [] for name in sessions}
    per_round = -(-runs // TIMING_ROUNDS)
    while True:
        for _ in range(TIMING_ROUNDS):
            for name, session in sessions.items():
                rounds[name].append(_paired_runs(session, feeds, reference, per_round))
        out, reference_ms = _round_stats(rounds)
        if settled is None or len(rounds[next(iter(rounds))]) >= MAX_TIMING_ROUNDS or settled(out, reference_ms):
            return out, reference_ms


def _round_stats(rounds: dict) -> tuple[dict, float]:
    """({name: LatencyStats with its rounds' medians and references}, mean reference ms) of the rounds so far."""
    import numpy as np

    from stack.deploy.runtime import summarize

    out, references = {}, []
    for name, values in rounds.items():
        stats = summarize([t for model, _ in values for t in model])
        stats.round_medians_ms = [float(np.median(model)) * 1e3 for model, _ in values]
        stats.round_reference_ms = [float(np.mean(ref)) * 1e3 for _, ref in values if ref]
        references += stats.round_reference_ms
        out[name] = stats
    return out, float(np.mean(references)) if references else 0.0


def conclusive(target, times: dict, reference_now_ms: float) -> bool:
    """Whether every timed model's median verdict on `target` is decided (pass or fail): `time_side_by_side`'s
    `settled` for an ONNX Runtime target."""
    return all(measured_gate(target, stats, "", reference_now_ms).verdict != "inconclusive"
               for stats in times.values())


def _paired_runs(session, feeds: dict, reference, runs: int) -> tuple[list, list]:
    """(model seconds, reference seconds) of `runs` model runs, each followed by one reference run (none
    without a `reference`)."""
    model, ref = [], []
    for _ in range(runs):
        model += _timed_runs(session, feeds, 1)
        if reference is not None:
            ref += _timed_runs(*reference, 1)
    return model, ref


def _timed_runs(session, feeds: dict, runs: int) -> list:
    """Wall time in seconds of each of `runs` runs."""
    import time

    times = []
    for _ in range(runs):
        start = time.perf_counter()
        session.run(None, feeds)
        times.append(time.perf_counter() - start)
    return times


def normalised_repeats(stats, reference_workload_ms: float) -> list:
    """Each round's median scaled by (reference_workload_ms / the reference block after it); raw medians when
    the target has no reference workload. [] when the timings were not taken in rounds."""
    medians = list(getattr(stats, "round_medians_ms", []) or [])
    blocks = list(getattr(stats, "round_reference_ms", []) or [])
    if reference_workload_ms > 0 and len(blocks) == len(medians):
        return [m * reference_workload_ms / r for m, r in zip(medians, blocks)]
    return medians


def measured_gate(target, stats, runtime: str, reference_now_ms: float | None) -> FpsGate:
    """The gate on timings taken here (`stats`: LatencyStats); the median bar on its normalised repeats."""
    scale, note = 1.0, ""
    if target.reference_workload_ms > 0 and reference_now_ms:
        scale = target.reference_workload_ms / reference_now_ms
        note = (f"; normalised by the reference workload ({reference_now_ms:.2f} ms now vs "
                f"{target.reference_workload_ms:.2f} ms on the reference machine, x{scale:.2f})")
    repeats = normalised_repeats(stats, target.reference_workload_ms if reference_now_ms else 0.0)
    rounds = f", verdict on the {len(repeats)} rounds' medians" if repeats else ""
    how = f"measured: {runtime}, median and p99 over {stats.runs} runs after warm-up{note}{rounds}"
    gate = decide("measured", how, stats.median_ms, stats.p99_ms, target, scale, repeats)
    gate.reference_workload_ms = target.reference_workload_ms if reference_now_ms else 0.0
    gate.validation = "measured"
    return gate


def predicted_gate(target, prediction, error_note: str, margin=1.0, p99_ratio: float | None = None) -> FpsGate:
    """The gate on the latency model's prediction (`prediction`: latency.Prediction) times `margin` (a number,
    or the target's `latency.margins.Margin`, whose status and basis the gate records); the p99 bar is checked
    against that times `p99_ratio` (default `latency.P99_OVER_MEDIAN`): a prediction is a median, and a frame
    that waits is decided by the tail."""
    from stack.deploy.latency.roofline import P99_OVER_MEDIAN

    value = getattr(margin, "value", margin)
    status = getattr(margin, "status", "")
    p99_ratio = P99_OVER_MEDIAN if p99_ratio is None else p99_ratio
    how = (f"predicted: per-layer roofline over the QDQ graph against {target.description or 'the target'} peaks "
           f"(INT8 {target.int8_tops:g} TOPS, FP16 {target.fp16_tflops:g} TFLOPS, {target.memory_bandwidth_gbs:g} GB/s), "
           f"TensorRT-style fusion, {prediction.total_ms:.2f} ms raw x {value:g} {status + ' ' if status else ''}"
           f"safety margin, p99 = median x {p99_ratio:g} (published Orin p99/median); {error_note}")
    gate = decide("predicted", how, prediction.total_ms, prediction.total_ms * p99_ratio, target, scale=value)
    gate.validation, gate.margin_basis = status, getattr(margin, "basis", "")
    return gate
