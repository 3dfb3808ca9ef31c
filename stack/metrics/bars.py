"""The bar each head of a trained network must clear against its trivial baseline (`stack eval`, `stack deploy`).

`verdicts` is the one judgement: `stack eval` (`stack.train.evaluate`, `stack.commands.eval`) and the deploy
quality gate (`stack.deploy.gates.quality`) both apply it to `stack.metrics.suite`'s figures.

A bar is derived, not chosen: a network must keep at least `GAIN_SHARE` (80%) of the improvement the tiny
recipe makes over the head's trivial baseline, measured on the same validation frames:

    bar = baseline + GAIN_SHARE x (recipe - baseline)      (per head, in the metric's own direction)

expressed as a ratio to the baseline measured in the same evaluation (so a dataset with harder frames
moves the bar with its baseline), except detection, whose trivial baseline (the empty detector) scores 0
and whose bar is therefore a share of the recipe's mAP. Detection is judged twice: by mAP (are the boxes
found) and by nuScenes' NDS (the same boxes with their placement, size, heading, velocity and attribute errors
weighed in, `stack.metrics.detection.nd_score`), whose empty detector also scores 0. The recipe's figures are the runs of the tiny recipe
recorded in docs/log/2026-11-25_quality-gate-derived-bars.md (today's: docs/results/model.md, "The tiny recipe
against its bars"), on two CPUs and two precisions; `RecipeFigures.margin_in_spreads` checks that each bar
sits at least `MIN_SPREADS` standard deviations of the run-to-run spread below the recipe (so a healthy recipe
run does not fail by chance, about 1 in 1,000 under normal noise at 3.1) while a network that learned a fifth
less than the recipe fails.

The trivial baselines: the ego-status rollout for planning (the planner is a residual on it, so an
untrained planner already scores it), the per-image mean depth, the majority class, the empty detector.

Planning's open-loop row is information, not a verdict (`HeadVerdict.judged`): open-loop L2 does not predict
closed-loop driving (Bench2Drive, Jia et al. 2024: Spearman rho = -0.16 between L2 and driving score over 9 methods;
Dauner et al., CoRL 2023), and on this stack the networks that beat the blind policies in closed loop sit above the
L2 bar while the recipe's, under it, loses to them. A planner is judged where it drives: `stack drive`'s bar and
the quality gate of `stack deploy` (`stack.metrics.driving.closed_loop_bar`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from stack.metrics.planning import DEPARTURE_BAR, DEPARTURE_M

GAIN_SHARE = 0.8
"""Share of the recipe's improvement over the trivial baseline a network must keep."""
MIN_SPREADS = 3.1
"""The bar lies at least this many run-to-run standard deviations below the recipe's mean (one-sided 0.1%)."""


@dataclass(frozen=True)
class RecipeFigures:
    """One head's figure in repeated runs of the tiny recipe, and its trivial baseline on the same frames."""

    metric: str
    higher_is_better: bool
    runs: tuple
    """The head's figure in each recorded recipe run (validation split, 60 frames)."""
    baseline: float
    """The trivial baseline on those frames (identical in every run: it does not depend on the network)."""
    source: str

    @property
    def mean(self) -> float:
        return float(np.mean(self.runs))

    @property
    def spread(self) -> float:
        """Sample standard deviation over the runs."""
        return float(np.std(self.runs, ddof=1))

    @property
    def bar(self) -> float:
        """The absolute bar on the recipe's own frames: baseline + GAIN_SHARE x (recipe - baseline)."""
        return self.baseline + GAIN_SHARE * (self.mean - self.baseline)

    @property
    def ratio(self) -> float:
        """The bar as a multiple of the trivial baseline (detection: of nothing, so the absolute bar)."""
        return self.bar / self.baseline if self.baseline else self.bar

    def margin_in_spreads(self) -> float:
        """How far the bar lies from the recipe's mean, in run-to-run standard deviations."""
        return abs(self.mean - self.bar) / self.spread if self.spread > 0 else math.inf


_RUNS = ("docs/log/2026-11-25_quality-gate-derived-bars.md: tiny recipe runs E, F, the model before F (AVX2 and "
         "AVX-512 EPYC) and make test's (00d9b24)")
_NDS_RUNS = ("docs/log/2026-11-28_nds-bar.md: the recipe with the attribute head and camera-aware depth, make test's "
             "(d262db6, Xeon with AMX, bf16), on an AVX-512 EPYC (bf16) and on it as an AVX2-only CPU (fp32)")
RECIPE = {
    "planning": RecipeFigures("L2@3s (m)", False, (0.676, 0.687, 0.672, 0.6724), 0.8537, _RUNS),
    "depth": RecipeFigures("AbsRel", False, (0.262, 0.262, 0.273, 0.2566), 0.8056, _RUNS),
    "segmentation": RecipeFigures("mIoU", True, (0.658, 0.662, 0.664, 0.663), 0.0351, _RUNS),
    "detection": RecipeFigures("mAP", True, (0.222, 0.226, 0.217, 0.2337), 0.0, _RUNS),
    "nuscenes": RecipeFigures("NDS", True, (0.359, 0.379, 0.371), 0.0, _NDS_RUNS),
}
"""The tiny recipe (684 steps) scored by `stack eval` on its 60 validation frames. NDS from the recipe that predicts
every quantity NDS weighs but velocity (the attribute head since 2026-11-28; before it, a tenth of NDS was 0)."""


def bar_ratio(head: str) -> float:
    """The head's bar as a multiple of its trivial baseline (detection: the absolute mAP bar), rounded to three
    decimals towards the lenient side so the printed rule is the applied one."""
    recipe = RECIPE[head]
    scaled = recipe.ratio * 1000
    return (math.floor(scaled) if recipe.higher_is_better else math.ceil(scaled)) / 1000


@dataclass
class HeadVerdict:
    head: str
    metric: str
    value: float
    baseline: float
    bar: str
    passed: bool
    note: str = ""
    """Another reference worth printing beside the verdict (planning: constant velocity)."""
    threshold: float = math.nan
    """The bar as a number on this evaluation's frames (the value must be at most / at least it)."""
    judged: bool = True
    """False: the row is information (`passed` says whether it is within the open-loop bar) and the head is judged
    elsewhere (planning: in closed loop)."""

    def to_dict(self) -> dict:
        return {"head": self.head, "metric": self.metric, "value": self.value, "baseline": self.baseline,
                "bar": self.bar, "threshold": self.threshold, "passed": self.passed, "judged": self.judged}

    @property
    def verdict(self) -> str:
        return verdict_word(self.passed, self.judged)


def verdict_word(passed: bool, judged: bool = True) -> str:
    """A head row's word in tables: pass / FAIL when judged; for information, whether it is within the bar."""
    if judged:
        return "pass" if passed else "FAIL"
    return "information (within)" if passed else "information (beyond)"


PLANNING_JUDGED_IN = "closed loop (stack drive, stack deploy's quality gate)"
"""Where planning is judged; its open-loop row is information."""


def all_judged_pass(rows) -> bool:
    """Whether every judged row passes (information rows do not count); `rows` are HeadVerdicts or their dicts."""
    def field(row, name):
        return row[name] if isinstance(row, dict) else getattr(row, name)

    return all(field(row, "passed") for row in rows if (row.get("judged", True) if isinstance(row, dict)
                                                         else row.judged))


HEAD_KEYS = ("planning/L2_at_3s", "planning/baseline_cv/L2_at_3s", "planning/baseline_ego_rollout/L2_at_3s",
             "depth/AbsRel", "depth/baseline_mean_depth/AbsRel", "segmentation/mIoU",
             "segmentation/baseline_majority/mIoU", "detection/mAP", "detection/baseline_empty/mAP",
             "planning/departure_reproduced", "planning/departure_share", "detection/NDS",
             "detection/baseline_empty/NDS")
"""Every figure `verdicts` reads (what a deploy bundle records so its verdicts can be recomputed)."""


def verdicts(metrics: dict) -> list[HeadVerdict]:
    """Each head's headline metric, its trivial baseline, the bar it must clear, and whether it does.
    A missing or NaN figure never passes."""
    def get(key):
        return float(metrics.get(key, math.nan))

    l2, l2_cv, l2_prior = get("planning/L2_at_3s"), get("planning/baseline_cv/L2_at_3s"), \
        get("planning/baseline_ego_rollout/L2_at_3s")
    rel, rel_mean = get("depth/AbsRel"), get("depth/baseline_mean_depth/AbsRel")
    miou, miou_major = get("segmentation/mIoU"), get("segmentation/baseline_majority/mIoU")
    mean_ap, nds = get("detection/mAP"), get("detection/NDS")
    departure, share = get("planning/departure_reproduced"), get("planning/departure_share")
    planning, depth, segmentation, detection, nuscenes = (bar_ratio(h) for h in ("planning", "depth", "segmentation",
                                                                                  "detection", "nuscenes"))
    return [
        HeadVerdict("planning", "L2@3s (m)", l2, l2_prior, f"<= {planning:g} x ego-status rollout",
                    l2 <= planning * l2_prior, f"constant velocity {l2_cv:.3f} m ({_ratio(l2, l2_cv)}); "
                    f"reproduces {departure:.0%} of the expert's departures from the rollout (> "
                    f"{DEPARTURE_M:g} m at 3 s: {share:.0%} of frames; the closed-loop mechanism, target "
                    f">= {DEPARTURE_BAR:.0%}); information: planning is judged in {PLANNING_JUDGED_IN}",
                    planning * l2_prior, judged=False),
        HeadVerdict("depth", "AbsRel", rel, rel_mean, f"<= {depth:g} x mean depth", rel <= depth * rel_mean,
                    threshold=depth * rel_mean),
        HeadVerdict("segmentation", "mIoU", miou, miou_major, f">= {segmentation:g} x majority class",
                    miou >= segmentation * miou_major, threshold=segmentation * miou_major),
        HeadVerdict("detection", "mAP", mean_ap, get("detection/baseline_empty/mAP"), f">= {detection:g}",
                    mean_ap >= detection, threshold=detection),
        HeadVerdict("nuscenes", "NDS", nds, get("detection/baseline_empty/NDS"), f">= {nuscenes:g}",
                    nds >= nuscenes, threshold=nuscenes),
    ]


def _ratio(value: float, reference: float) -> str:
    return f"{value / reference:.2f}x" if reference else "n/a"
