"""The accuracy gate: INT8 must not quietly cost accuracy, head by head.

The fp32 and the quantized model run on the same validation samples and are scored with
the same metrics; each head's drop (in the metric's own units, sign-corrected so that a
positive drop is always worse) must stay within the target's budget. When a head fails,
the gate measures per-layer sensitivity, keeps the most sensitive layers in fp32 and tries
again, growing the fp32 set (1, 2, 4, ... layers) until every head passes or the allowed
number of fp32 layers is spent. The report lists every attempt and what was excluded.

Sensitivity is "quantize one layer at a time": each candidate layer alone is quantized
(everything else fp32) and the relative squared error it causes on every output is its
score (cf. Wu et al., "Integer Quantization for Deep Learning Inference", arXiv:2004.09602,
section 5.1 on partial quantization). A real network has hundreds of quantizable nodes,
so a one-pass screen comes first: in the fully quantized model, the signal-to-quantization-
noise ratio of every Q/DQ'd activation (ONNX Runtime's `qdq_loss_debug`) ranks the nodes
that read or write it, and only the `shortlist` worst go through the exact measurement.
Sensitivity is ranked on samples the gate does not score (deploy passes a slice of the
training split), so the layers kept fp32 are not chosen to flatter the frames that judge them.

How sure is a drop measured on a few dozen frames? Each head's drop comes with a paired
bootstrap interval (Efron & Tibshirani, "An Introduction to the Bootstrap", 1993, ch. 13; paired
as in Koehn, "Statistical Significance Tests for Machine Translation Evaluation", EMNLP 2004):
the same resample scores fp32 and INT8, so the interval measures the noise in the *difference*,
which is far smaller than either metric's own. What is resampled is whole validation scenes
(a cluster bootstrap, Davison & Hinkley, "Bootstrap Methods and their Application", 1997,
sec. 3.8): the frames of one scene, half a second apart, see the same cars and err together,
so resampling frames would count six correlated frames as six pieces of evidence and give an
interval too narrow. `BOOTSTRAP_LEVEL` (90%) percentile interval over `BOOTSTRAP_RESAMPLES` (200)
resamples.

The rule: a head passes when its drop is within the budget and its interval lies below the
budget; an interval that straddles the budget is inconclusive, which fails the shipping precision
unless the target says otherwise (`targets.*.accuracy_inconclusive_passes`). The fp32 fallback
keeps layers in fp32 until every head is within budget on its point estimate; the bootstrap then
says whether that is sure (it runs for every attempt within budget, and for a final attempt that is
not, for the report). Beside each interval, a power calculation says how many scenes would tell a drop of the
budget's size from none (one-sided at the interval's level, power `POWER`): the bootstrap's
standard error shrinks as 1/sqrt(scenes), so n = scenes x ((z_level + z_power) x SE / budget)^2.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from statistics import NormalDist
from typing import Callable

import numpy as np

BOOTSTRAP_RESAMPLES = 200
"""Paired bootstrap resamples of the scored frames, for the final attempt (each rescoring of the tiny
preset's 60 frames costs ~0.17 s per model on a loaded 2-core EPYC, nearly all of it nuScenes mAP)."""
BOOTSTRAP_LEVEL = 0.90
"""Coverage of the percentile interval reported for each head's drop."""
POWER = 0.90
"""Probability with which the scene count of the power calculation tells a drop of the budget's size from none."""


@dataclass(frozen=True)
class HeadBudget:
    head: str
    metric: str
    """Name of the metric in the evaluator's result (e.g. `detection_map`)."""
    budget: float
    """Largest allowed drop, in the metric's units."""
    higher_is_better: bool
    prior_metric: str = ""
    """A baseline the head must beat (planning: the ego-status rollout's L2), scored on the same frames."""
    prior_factor: float = 0.0
    """INT8 must not lift the metric above prior_factor x prior when fp32 is below it (lower-is-better heads)."""
    inconclusive_passes: bool = False
    """An interval that straddles the budget passes on the point estimate (the target's choice)."""
    judged: bool = True
    """False: the drop is measured and reported as information, and the head is judged elsewhere (planning, on a
    target that drives closed loop: the closed-loop gate's INT8 driving-score drop, `head_scores.head_budgets`)."""


@dataclass
class HeadResult:
    head: str
    metric: str
    fp32: float
    quantized: float
    drop: float
    budget: float
    low: float = math.nan
    """Lower end of the paired bootstrap interval of the drop (nan: no per-frame scores)."""
    high: float = math.nan
    frames: int = 0
    prior_bar: float = math.nan
    """prior_factor x the prior's value on these frames (nan: the head has no prior)."""
    unit: str = "frames"
    """What the bootstrap resampled: "scenes" (whole validation scenes) or "frames" (no scene ids)."""
    units: int = 0
    """How many of them."""
    units_needed: int = 0
    """The power calculation: units that would tell a drop of the budget's size from none (0: no interval)."""
    inconclusive_passes: bool = False
    judged: bool = True
    """False: information (`HeadBudget.judged`): its verdict does not decide the gate."""

    @property
    def loses_prior(self) -> bool:
        """fp32 beats the bar set by the head's prior and INT8 does not."""
        return bool(self.fp32 <= self.prior_bar < self.quantized)

    @property
    def passed(self) -> bool:
        within = bool(self.drop <= self.budget + 1e-12) and not self.loses_prior
        return within and (self.conclusive or self.inconclusive_passes)

    @property
    def conclusive(self) -> bool:
        """The interval lies wholly on one side of the budget (true when there is no interval)."""
        if math.isnan(self.low) or math.isnan(self.high):
            return True
        return bool(self.high <= self.budget + 1e-12 or self.low > self.budget + 1e-12)

    @property
    def counts(self) -> bool:
        """Whether this head lets the gate pass: it passed, or it is information."""
        return self.passed or not self.judged

    def verdict(self) -> str:
        word = ("pass" if self.passed else "FAIL") if self.judged else \
            f"information ({'within' if self.passed else 'beyond'} the budget)"
        if self.conclusive:
            return word
        return (f"{word} (inconclusive at {self.units} {self.unit}; about {self.units_needed} would resolve a drop "
                f"of {self.budget:g})")


@dataclass
class Attempt:
    excluded: list
    heads: list

    @property
    def passed(self) -> bool:
        return all(head.counts for head in self.heads)


@dataclass
class AccuracyReport:
    fp32_metrics: dict
    attempts: list = field(default_factory=list)
    sensitivity: list = field(default_factory=list)
    """(layer, score) pairs, most sensitive first; empty when the first attempt passed."""
    quantized_path: Path | None = None
    quantized_metrics: dict = field(default_factory=dict)
    """The final attempt's metrics (the report prints the ungated ones beside fp32's)."""

    @property
    def final(self) -> Attempt:
        return self.attempts[-1]

    @property
    def passed(self) -> bool:
        return bool(self.attempts) and self.final.passed

    def to_dict(self) -> dict:
        return {"passed": self.passed, "fp32_metrics": self.fp32_metrics, "quantized_metrics": self.quantized_metrics,
                "excluded": self.final.excluded,
                "heads": [dict(asdict(h), passed=h.passed, conclusive=h.conclusive, loses_prior=h.loses_prior)
                          for h in self.final.heads],
                "bootstrap": {"level": BOOTSTRAP_LEVEL, "resamples": BOOTSTRAP_RESAMPLES, "paired": True,
                              "power": POWER, "unit": self.final.heads[0].unit if self.final.heads else "frames",
                              "rule": "pass when the drop is within the budget and its interval lies below it; an "
                                      "interval that straddles the budget is inconclusive and fails unless the "
                                      "target's accuracy_inconclusive_passes"},
                "attempts": [{"excluded": a.excluded, "passed": a.passed,
                              "drops": {h.head: h.drop for h in a.heads}} for a in self.attempts],
                "sensitivity": [[name, score] for name, score in self.sensitivity[:20]]}


@dataclass
class Scores:
    """An evaluator's answer: metrics over all its frames, and, when it can, the same metrics on any
    resample of those frames (`on(indices)`, for the bootstrap)."""

    metrics: dict
    frames: int = 0
    on: Callable[[np.ndarray], dict] | None = None
    groups: list | None = None
    """The scene of each frame: the bootstrap resamples whole scenes (None: frames)."""


def frame_means(per_frame: list[dict]) -> Scores:
    """Scores for metrics that are means over frames (each frame: metric name -> value)."""
    names = list(per_frame[0])
    table = np.array([[row[name] for name in names] for row in per_frame], dtype=np.float64)

    def on(indices) -> dict:
        return dict(zip(names, table[np.asarray(indices)].mean(axis=0).tolist()))
    return Scores(on(np.arange(len(per_frame))), len(per_frame), on)


def as_scores(value) -> Scores:
    return value if isinstance(value, Scores) else Scores(dict(value))


Runner = Callable[[dict], dict]
"""feeds (input name -> numpy) -> outputs (name -> numpy)."""
Evaluator = Callable[[Runner], "Scores | dict"]
"""Runs the model over the validation samples: Scores (or a plain metric name -> value dict, no interval)."""
Quantizer = Callable[[list], Path]
"""Layers to keep in fp32 -> path of the quantized model built with them excluded."""


def _drop(a: float, b: float, higher_is_better: bool) -> float:
    if math.isnan(a) and math.isnan(b):  # nothing to score on these samples (e.g. no labelled boxes)
        return 0.0
    if math.isnan(a) or math.isnan(b):
        return math.inf
    return a - b if higher_is_better else b - a


def compare(fp32, quantized, budgets: list[HeadBudget], resamples: int = BOOTSTRAP_RESAMPLES,
            level: float = BOOTSTRAP_LEVEL, seed: int = 0) -> list[HeadResult]:
    """Per-head drop (positive = worse) against each budget, with its paired bootstrap interval."""
    fp32, quantized = as_scores(fp32), as_scores(quantized)
    intervals = paired_bootstrap(fp32, quantized, budgets, resamples, level, seed)
    unit, units = _units(fp32)
    rows = []
    for item in budgets:
        a, b = float(fp32.metrics[item.metric]), float(quantized.metrics[item.metric])
        low, high, error = intervals.get(item.metric, (math.nan, math.nan, math.nan))
        prior = float(quantized.metrics.get(item.prior_metric, math.nan)) if item.prior_metric else math.nan
        rows.append(HeadResult(item.head, item.metric, a, b, _drop(a, b, item.higher_is_better), item.budget,
                               low, high, fp32.frames, item.prior_factor * prior, unit, units,
                               units_needed(error, units, item.budget, level), item.inconclusive_passes,
                               item.judged))
    return rows


def _units(scores: Scores) -> tuple[str, int]:
    """("scenes", how many) when the frames name their scenes, else ("frames", how many)."""
    if scores.groups is not None and len(scores.groups) == scores.frames:
        return "scenes", len(set(scores.groups))
    return "frames", scores.frames


def units_needed(standard_error: float, units: int, budget: float, level: float = BOOTSTRAP_LEVEL,
                 power: float = POWER) -> int:
    """Scenes (or frames) that would tell a drop of `budget` from no drop: one-sided at the interval's level
    (the interval's upper end), with probability `power`. The drop's standard error shrinks as 1/sqrt(n), so
    n = units x ((z_level + z_power) x SE / budget)^2. 0 when there is no standard error to scale."""
    if not (standard_error >= 0 and units > 0) or math.isnan(standard_error):
        return 0
    if budget <= 0:
        return units if standard_error == 0 else 0
    z = NormalDist().inv_cdf
    return max(2, math.ceil(units * ((z(1 - (1 - level) / 2) + z(power)) * standard_error / budget) ** 2))


def paired_bootstrap(fp32: Scores, quantized: Scores, budgets: list[HeadBudget], resamples: int,
                     level: float, seed: int = 0) -> dict:
    """metric -> (low, high, standard error) of the drop over resamples with replacement of whole scenes (of
    frames when they name none), the same resample for both models; {} when either side cannot score one."""
    if (resamples <= 0 or fp32.on is None or quantized.on is None or fp32.frames != quantized.frames
            or fp32.frames < 2):
        return {}
    rng = np.random.default_rng(seed)
    clusters = _clusters(fp32)
    drops = {item.metric: [] for item in budgets}
    for _ in range(resamples):
        picked = rng.integers(0, len(clusters), len(clusters))
        indices = np.concatenate([clusters[i] for i in picked])
        a, b = fp32.on(indices), quantized.on(indices)
        for item in budgets:
            drops[item.metric].append(_drop(float(a[item.metric]), float(b[item.metric]), item.higher_is_better))
    tail = 100 * (1 - level) / 2
    return {metric: (float(np.percentile(values, tail)), float(np.percentile(values, 100 - tail)),
                     float(np.std(values, ddof=1))) for metric, values in drops.items()}


def _clusters(scores: Scores) -> list[np.ndarray]:
    """The frame indices of each scene, in first-seen order (each frame alone when frames name no scene)."""
    if scores.groups is None or len(scores.groups) != scores.frames:
        return [np.array([i]) for i in range(scores.frames)]
    order: dict = {}
    for index, group in enumerate(scores.groups):
        order.setdefault(group, []).append(index)
    return [np.array(indices) for indices in order.values()]


def session_runner(path: str | Path, simulate_int8: bool = False) -> Runner:
    """A Runner over an ONNX Runtime CPU session of `path` (`simulate_int8`: see `ort_session`)."""
    from stack.deploy.runtime import ort_session
    from stack.deploy.stateful import memory_shape, resolving

    session = ort_session(path, simulate_int8=simulate_int8)
    names = [output.name for output in session.get_outputs()]
    # a stateful graph fuses the memory it made itself of the frame before: INT8 errors in the memory count
    return resolving(lambda feeds: dict(zip(names, session.run(names, feeds))), memory_shape(session))


def sensitivity(fp32_path: Path, quantize_only: Callable[[str], Path], candidates: list[str],
                samples: list[dict], simulate_int8: bool = False) -> list[tuple[str, float]]:
    """(layer, relative output error when only that layer is quantized), most sensitive first."""
    reference = [session_runner(fp32_path)(feeds) for feeds in samples]
    scores = []
    for layer in candidates:
        run = session_runner(quantize_only(layer), simulate_int8)
        error = 0.0
        for feeds, expected in zip(samples, reference):
            got = run(feeds)
            for name, value in expected.items():
                denominator = float(np.square(value).sum()) or 1.0
                error += float(np.square(got[name].astype(np.float64) - value).sum()) / denominator
        scores.append((layer, error / max(1, len(samples))))
    return sorted(scores, key=lambda item: -item[1])


def channel_sqnr_db(before: list, after: list, shape: tuple | None = None) -> float:
    """Mean over channels (axis 1 of `shape`) of 20 log10(|x| / |x - q(x)|): one loud channel cannot hide the others."""
    x = np.concatenate([np.asarray(a, np.float64).reshape(shape or (1, 1, -1)) for a in before])
    y = np.concatenate([np.asarray(a, np.float64).reshape(shape or (1, 1, -1)) for a in after])
    if x.ndim < 2:
        x, y = x.reshape(1, 1, -1), y.reshape(1, 1, -1)
    x, y = np.moveaxis(x, 1, 0).reshape(x.shape[1], -1), np.moveaxis(y, 1, 0).reshape(y.shape[1], -1)
    signal = np.linalg.norm(x, axis=1)
    noise = np.maximum(np.linalg.norm(x - y, axis=1), 1e-12)
    live = signal > 0
    return float(np.mean(20 * np.log10(signal[live] / noise[live]))) if live.any() else math.inf


def screen(fp32_path: Path, qdq_path: Path, candidates: list[str], samples: list[dict]) -> list[str]:
    """`candidates` ordered by the worst activation SQNR (dB) around them in the quantized model."""
    import tempfile

    import onnx
    from onnxruntime.quantization.qdq_loss_debug import (collect_activations, create_activation_matching,
                                                         modify_model_output_intermediate_tensors)


    inferred = onnx.shape_inference.infer_shapes(onnx.load(str(qdq_path)))
    shapes = {info.name: tuple(d.dim_value for d in info.type.tensor_type.shape.dim)
              for info in list(inferred.graph.value_info) + list(inferred.graph.output)
              if all(d.HasField("dim_value") for d in info.type.tensor_type.shape.dim)}
    with tempfile.TemporaryDirectory() as folder:
        augmented = str(Path(folder) / "augmented.onnx")
        modify_model_output_intermediate_tensors(str(qdq_path), augmented)
        matching = create_activation_matching(collect_activations(augmented, list(samples)))
    sqnr = {name: channel_sqnr_db(pair["pre_qdq"], pair["post_qdq"], shapes.get(name)) for name, pair in matching.items()}
    nodes = {node.name: node for node in onnx.load(str(fp32_path), load_external_data=False).graph.node}

    def worst(name: str) -> float:
        node = nodes.get(name)
        tensors = list(node.input) + list(node.output) if node is not None else []
        return min((sqnr[t] for t in tensors if t in sqnr), default=math.inf)
    return sorted(candidates, key=worst)


def accuracy_gate(fp32_path: Path, quantize_with: Quantizer, evaluate: Evaluator, budgets: list[HeadBudget],
                  candidates: list[str], sensitivity_samples: list[dict], max_fp32_layers: int,
                  log: Callable[[str], None] = print, simulate_int8: bool = False) -> AccuracyReport:
    """Quantize, score per head, and fall back to fp32 for the most sensitive layers until it passes.

    `simulate_int8`: score the quantized graphs with simulated INT8 arithmetic (`ort_session`),
    for QDQ graphs that an engine builder such as TensorRT compiles rather than this host runs.
    """
    fp32_metrics = as_scores(evaluate(session_runner(fp32_path)))
    report = AccuracyReport(fp32_metrics.metrics)
    scored = {}

    def attempt(excluded: list) -> None:
        path = quantize_with(excluded)
        scored["last"] = as_scores(evaluate(session_runner(path, simulate_int8)))
        heads = compare(fp32_metrics, scored["last"], budgets, resamples=0)
        if all(head.counts for head in heads):  # within budget on point estimates: is it sure? (a failure needs no CI)
            heads = compare(fp32_metrics, scored["last"], budgets)
        report.attempts.append(Attempt(excluded, heads))
        report.quantized_path, report.quantized_metrics = path, scored["last"].metrics
        log(_describe(report.final))

    attempt([])
    if _within(report.final) or max_fp32_layers <= 0 or not candidates:
        return _with_intervals(report, fp32_metrics, scored["last"], budgets, log)
    everything_else = set(candidates)
    shortlist = screen(fp32_path, report.quantized_path, candidates, sensitivity_samples)[: max(8, 3 * max_fp32_layers)]
    log(f"accuracy gate: measuring the sensitivity of the {len(shortlist)} of {len(candidates)} layers with the "
        f"noisiest quantized activations (one quantized at a time)")
    report.sensitivity = sensitivity(fp32_path, lambda layer: quantize_with(sorted(everything_else - {layer})),
                                     shortlist, sensitivity_samples, simulate_int8)
    count = 1
    while True:
        count = min(count, max_fp32_layers, len(report.sensitivity))
        attempt([name for name, _ in report.sensitivity[:count]])
        if _within(report.final) or count >= min(max_fp32_layers, len(report.sensitivity)):
            return _with_intervals(report, fp32_metrics, scored["last"], budgets, log)
        count *= 2


def _within(attempt: Attempt) -> bool:
    """Every head within its budget on its point estimate: the fallback has done what layers in fp32 can do. Whether
    the attempt is sure of it is the verdict's business (an inconclusive head fails it); keeping layers the ranking
    names in fp32 did not narrow such an interval on the tiny recipe (detection +0.0155 with none, +0.0157 with one,
    +0.0174 with two on ci-cpu), and each further attempt costs a quantization, a scoring and a bootstrap."""
    return all(head.drop <= head.budget + 1e-12 and not head.loses_prior for head in attempt.heads if head.judged)


def _with_intervals(report: AccuracyReport, fp32: Scores, quantized: Scores, budgets: list, log) -> AccuracyReport:
    """The final attempt's heads with their bootstrap intervals (computed here for a final attempt that failed on
    its point estimates, whose verdict they do not change), and the verdict in one line."""
    if fp32.on is None or quantized.on is None:
        return report
    if any(math.isnan(head.low) for head in report.final.heads):
        report.final.heads = compare(fp32, quantized, budgets)
    unit, units = _units(fp32)
    log(f"accuracy gate: {'PASS' if report.passed else 'FAIL'}; paired bootstrap of {units} {unit} "
        f"({BOOTSTRAP_RESAMPLES} resamples of {fp32.frames} frames): " + ", ".join(
            f"{h.head} {h.drop:+.4f}{_interval(h)} {h.verdict()}" for h in report.final.heads))
    return report


def _interval(head: HeadResult) -> str:
    return "" if math.isnan(head.low) else f", {BOOTSTRAP_LEVEL:.0%} CI [{head.low:+.4f}, {head.high:+.4f}]"


def _describe(attempt: Attempt) -> str:
    heads = ", ".join(f"{h.head} {h.metric} {h.fp32:.4f}->{h.quantized:.4f} (drop {h.drop:+.4f}{_interval(h)} / "
                      f"{h.budget:g}{'' if h.conclusive else ', inconclusive'})" for h in attempt.heads)
    kept = f" with {len(attempt.excluded)} layer(s) in fp32" if attempt.excluded else ""
    return f"accuracy gate{kept}: {'PASS' if attempt.passed else 'FAIL'}: {heads}"
