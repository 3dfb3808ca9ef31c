"""nuScenes detection metrics: mAP over centre-distance thresholds, the five TP errors and NDS.

Follows the nuScenes detection benchmark (Caesar et al., "nuScenes: A multimodal dataset for
autonomous driving", CVPR 2020; nuscenes-devkit `eval/detection/algo.py`, `evaluate.py`,
`data_classes.py`), which tests check against the devkit's own `accumulate` / `calc_ap` /
`calc_tp` and `DetectionEval.evaluate` / `DetectionMetrics.nd_score`:

- matching per class over the whole split: predictions sorted by score, each taking
  the nearest untaken GT of its class in its sample by BEV centre distance, a match
  when that distance is below the threshold (0.5, 1, 2, 4 m);
- precision interpolated at 101 recall points; AP = mean precision above 10 %
  recall with precision above 10 % (both clipped), rescaled;
- TP errors at the 2 m threshold, averaged over recall above 10 %: ATE (centre
  distance, m), ASE (1 - IoU of the sizes aligned), AOE (smallest yaw difference,
  rad; modulo pi for barriers, whose heading is ambiguous), AVE (velocity L2, m/s),
  AAE (1 - attribute accuracy); 1.0 for a class with no match. A match whose error
  is undefined (a GT box without an attribute, a velocity that is NaN) is skipped
  in the running mean, a class whose every match is undefined scores 1, and matches
  ranked before the first defined one count 0 (the devkit's `cummean`, reproduced);
- per-class exclusions (devkit `evaluate.py`): traffic cones score no AOE, AVE or
  AAE, barriers no AVE or AAE; the mean over classes skips them (`NOT_SCORED`);
- NDS = (5 mAP + sum over the five mean TP errors of (1 - min(1, error))) / 10.

What a detector that predicts no velocity or attribute scores: a NaN velocity (the
convention for "not predicted") or attribute -1 is what the devkit would be given
for such a box; it scores AVE 1 and AAE 1 (just under 1 when the most confident
matches have unlabelled GT, the `cummean` rule above), the worst value after
clipping: NDS is then capped at 0.8 (0.9 with one of the two) rather than flattered
by a zero velocity that happens to fit parked cars. `compute` counts the predictions that carried each, so
a report can say "no velocity head" instead of quoting the 1 as a measurement.
Attributes are indices into `ATTRIBUTES` (nuScenes' names); GT boxes carry -1 when
they have none, as the rendered world's do today, which also scores AAE 1.

- class ranges: like the devkit's `filter_eval_boxes`, GT and predictions farther
  from the ego origin than their class's range are dropped before matching
  (`CLASS_RANGES_M`, nuScenes' detection config: vehicles 50 m, vulnerable road
  users 40 m); `TaskMetrics` also caps each range at the BEV grid's inscribed radius,
  since the network cannot place a box outside its grid.

A class with no ground truth scores AP 0 and errors 1 (the devkit's convention),
and mAP averages over every configured class. The trivial baseline is the empty
detector: mAP 0, every TP error 1, NDS 0. Class names that nuScenes defines get its
rules (ranges, exclusions, the barrier's period); others (the world's `cyclist`) get
the defaults.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import NamedTuple, Sequence

import numpy as np

DISTANCE_THRESHOLDS = (0.5, 1.0, 2.0, 4.0)
TP_THRESHOLD = 2.0
MIN_RECALL = 0.1
MIN_PRECISION = 0.1
RECALL_POINTS = 101
TP_ERRORS = ("ATE", "ASE", "AOE", "AVE", "AAE")
MAP_WEIGHT = 5
"""mAP's weight in NDS against one per TP error (devkit detection_cvpr_2019 `mean_ap_weight`)."""
NOT_SCORED = {"traffic_cone": ("AOE", "AVE", "AAE"), "barrier": ("AVE", "AAE")}
"""TP errors a class does not score (devkit `DetectionEval.evaluate`): a cone has no heading and neither
moves nor has attributes; a barrier does not move and has no attributes."""
YAW_PERIOD = {"barrier": math.pi}
"""Classes whose heading is defined only up to this period (devkit `accumulate`); others 2 pi."""
ATTRIBUTES = ("pedestrian.moving", "pedestrian.sitting_lying_down", "pedestrian.standing", "cycle.with_rider",
              "cycle.without_rider", "vehicle.moving", "vehicle.parked", "vehicle.stopped")
"""nuScenes' box attributes (devkit detection/constants.py `ATTRIBUTE_NAMES`); attributes are indices into it,
-1 for none."""
ATTRIBUTE_GROUPS = {"vehicle": ("car", "truck", "bus", "trailer", "construction_vehicle"), "pedestrian": ("pedestrian",),
                    "cycle": ("bicycle", "motorcycle", "cyclist")}
"""The attributes a class can have, by the prefix of their names (nuScenes: a vehicle is moving, stopped or parked; a
pedestrian moving, standing or sitting; a cycle with or without rider); a class in no group (barrier, traffic
cone) has none (mmdetection3d's `NuScenesDataset.DefaultAttribute` pairs them the same way)."""


def class_attributes(classes: Sequence[str]) -> np.ndarray:
    """(C, len(ATTRIBUTES)) bool: may a box of each class carry each attribute (ATTRIBUTE_GROUPS)."""
    allowed = np.zeros((len(classes), len(ATTRIBUTES)), bool)
    for row, name in enumerate(classes):
        for prefix, members in ATTRIBUTE_GROUPS.items():
            if name in members:
                allowed[row] = [attribute.startswith(prefix + ".") for attribute in ATTRIBUTES]
    return allowed
CLASS_RANGES_M = {"car": 50.0, "truck": 50.0, "bus": 50.0, "trailer": 50.0, "construction_vehicle": 50.0,
                  "pedestrian": 40.0, "motorcycle": 40.0, "bicycle": 40.0, "cyclist": 40.0,
                  "traffic_cone": 30.0, "barrier": 30.0}
"""Evaluation range per class name (nuScenes detection_cvpr_2019 `class_range`), metres from the ego origin."""
DEFAULT_RANGE_M = 50.0
"""Range of a class name nuScenes does not define."""


def class_ranges(classes: Sequence[str], limit: float = float("inf")) -> list[float]:
    """The evaluation range of each class (CLASS_RANGES_M, else DEFAULT_RANGE_M), capped at `limit`."""
    return [min(CLASS_RANGES_M.get(name, DEFAULT_RANGE_M), limit) for name in classes]


def _numpy(x) -> np.ndarray:
    return x.detach().cpu().numpy() if hasattr(x, "detach") else np.asarray(x)


class _Matched(NamedTuple):
    """One sample's predictions of one class, in row order, matched greedily to its GT at one threshold."""

    scores: np.ndarray
    hits: np.ndarray
    errors: np.ndarray
    """(n, 5) TP_ERRORS of each prediction's match; NaN rows for predictions that match nothing."""
    positives: int


@dataclass(eq=False)
class _Sample:
    """One sample's predictions and ground truth after the range filter (attributes: -1 for none).

    A prediction competes only for the GT of its own sample, so the devkit's split-wide greedy matching (by
    score) gives each sample the matches it gets alone: `matched` computes them once per class and threshold,
    and any set of samples (a split, a bootstrap resample of one) is scored by concatenating them."""

    boxes: np.ndarray
    scores: np.ndarray
    labels: np.ndarray
    attributes: np.ndarray
    gt: np.ndarray
    gt_labels: np.ndarray
    gt_attributes: np.ndarray
    _matches: dict = field(default_factory=dict, repr=False)

    def matched(self, label: int, threshold: float, period: float) -> _Matched:
        key = (label, threshold, period)
        if key not in self._matches:
            self._matches[key] = self._match(label, threshold, period)
        return self._matches[key]

    def _match(self, label: int, threshold: float, period: float) -> _Matched:
        """Highest score first (ties: the later row first, as the devkit's sort), each prediction taking the
        nearest untaken GT of its class when it lies within `threshold` metres."""
        rows = np.flatnonzero(self.labels == label)
        is_gt = self.gt_labels == label
        gt, gt_attributes = self.gt[is_gt], self.gt_attributes[is_gt]
        hits, errors = np.zeros(len(rows), bool), np.full((len(rows), len(TP_ERRORS)), np.nan)
        if len(gt) == 0:
            return _Matched(self.scores[rows], hits, errors, 0)
        taken = np.zeros(len(gt), bool)
        for k in np.lexsort((-np.arange(len(rows)), -self.scores[rows])):
            box = self.boxes[rows[k]]
            distance = np.where(taken, np.inf, np.linalg.norm(gt[:, :2] - box[:2], axis=1))
            best = int(np.argmin(distance))
            if distance[best] < threshold:
                taken[best], hits[k] = True, True
                errors[k] = _match_errors(gt[best], box, gt_attributes[best], self.attributes[rows[k]], period)
        return _Matched(self.scores[rows], hits, errors, len(gt))


@dataclass
class _Curve:
    """Interpolated precision, confidence and TP errors over RECALL_POINTS recall values."""

    precision: np.ndarray
    confidence: np.ndarray
    errors: dict = field(default_factory=dict)

    @classmethod
    def empty(cls) -> "_Curve":
        zeros = np.zeros(RECALL_POINTS)
        return cls(zeros, zeros.copy(), {name: np.ones(RECALL_POINTS) for name in TP_ERRORS})


def _match_errors(gt: np.ndarray, pred: np.ndarray, gt_attribute: int, attribute: int,
                  period: float = 2 * math.pi) -> tuple[float, ...]:
    """(ATE, ASE, AOE, AVE, AAE) of one matched pair of BOX_FIELDS rows, as the devkit's `center_distance`,
    `scale_iou`, `yaw_diff`, `velocity_l2` and `attr_acc` (NaN: undefined, skipped by `_cummean`)."""
    ate = float(np.linalg.norm(pred[:2] - gt[:2]))
    gs, ps = np.maximum(gt[3:6], 1e-9), np.maximum(pred[3:6], 1e-9)
    inter = np.prod(np.minimum(gs, ps))
    ase = 1.0 - float(inter / (np.prod(gs) + np.prod(ps) - inter))
    aoe = abs((gt[6] - pred[6] + period / 2) % period - period / 2)
    ave = float(np.linalg.norm(pred[7:9] - gt[7:9]))
    aae = math.nan if gt_attribute < 0 else float(attribute != gt_attribute)
    return ate, ase, float(aoe), ave, aae


def _cummean(values: np.ndarray) -> np.ndarray:
    """Running mean that skips NaN; all NaN gives ones (devkit `common/utils.py` `cummean`)."""
    if np.isnan(values).all():
        return np.ones(len(values))
    sums, counts = np.nancumsum(values), np.cumsum(~np.isnan(values))
    return np.divide(sums, counts, out=np.zeros_like(sums), where=counts != 0)


def _class_mean(values: list[float]) -> float:
    """Mean over the classes that score an error (NaN when none does), as the devkit's `np.nanmean`."""
    scored = [value for value in values if not math.isnan(value)]
    return float(np.mean(scored)) if scored else math.nan


def nd_score(mean_ap: float, errors: Sequence[float]) -> float:
    """NDS (devkit `DetectionMetrics.nd_score`): each mean TP error becomes the score 1 - min(1, error) (an error
    no class scores counts as 1), weighted 1 beside mAP's MAP_WEIGHT."""
    scores = [0.0 if math.isnan(error) else 1.0 - min(1.0, error) for error in errors]
    return (MAP_WEIGHT * mean_ap + sum(scores)) / (MAP_WEIGHT + len(scores))


class DetectionMetric:
    """Accumulates decoded boxes and ground truth over a split; `compute` gives nuScenes mAP, TP errors and NDS."""

    def __init__(self, classes: Sequence[str], thresholds: Sequence[float] = DISTANCE_THRESHOLDS,
                 ranges: Sequence[float] | None = None):
        """`ranges`: per-class evaluation range in metres (see `class_ranges`); None keeps every box."""
        self.classes, self.thresholds = list(classes), tuple(thresholds)
        self.ranges = None if ranges is None else np.asarray(ranges, dtype=np.float64)
        if self.ranges is not None and len(self.ranges) != len(self.classes):
            raise ValueError(f"ranges has {len(self.ranges)} entries for {len(self.classes)} classes")
        self.samples: list[_Sample] = []

    def _in_range(self, boxes: np.ndarray, labels: np.ndarray) -> np.ndarray:
        """Mask of the boxes within their class's evaluation range (all True without ranges)."""
        if self.ranges is None or len(labels) == 0:
            return np.ones(len(labels), dtype=bool)
        return np.linalg.norm(boxes[:, :2], axis=1) <= self.ranges[np.clip(labels, 0, len(self.ranges) - 1)]

    def update(self, pred_boxes, pred_scores, pred_labels, gt_boxes, gt_labels, pred_attributes=None,
               gt_attributes=None) -> None:
        """One batch: per-sample predictions (lists of (n, 9), (n,), (n,)) and GT (B, M, 9), (B, M) with -1 padding.
        A prediction without velocity has NaN vx, vy; attributes (per-sample (n,) predicted, (B, M) GT) are
        indices into ATTRIBUTES, -1 (or None for all) where there is none."""
        gt_boxes, gt_labels = _numpy(gt_boxes), _numpy(gt_labels)
        gt_attributes = np.full(gt_labels.shape, -1) if gt_attributes is None else _numpy(gt_attributes)
        for i in range(len(gt_labels)):
            real = gt_labels[i] >= 0
            gt, gt_label = gt_boxes[i][real].astype(np.float64), gt_labels[i][real].astype(np.int64)
            boxes = _numpy(pred_boxes[i]).astype(np.float64).reshape(-1, 9)
            scores = _numpy(pred_scores[i]).astype(np.float64).reshape(-1)
            labels = _numpy(pred_labels[i]).astype(np.int64).reshape(-1)
            attributes = np.full(len(labels), -1, np.int64) if pred_attributes is None or pred_attributes[i] is None \
                else _numpy(pred_attributes[i]).astype(np.int64).reshape(-1)
            kept, kept_gt = self._in_range(boxes, labels), self._in_range(gt, gt_label)
            self.samples.append(_Sample(boxes[kept], scores[kept], labels[kept], attributes[kept], gt[kept_gt],
                                        gt_label[kept_gt], gt_attributes[i][real].astype(np.int64)[kept_gt]))

    def update_detections(self, detections, gt_boxes, gt_labels, gt_attributes=None) -> None:
        """`update` from `stack.models.decoders.Detections`-like objects (fields boxes, scores, labels and, when the
        network predicts them, attributes)."""
        self.update([d.boxes for d in detections], [d.scores for d in detections], [d.labels for d in detections],
                    gt_boxes, gt_labels, [getattr(d, "attributes", None) for d in detections], gt_attributes)

    def _curve(self, label: int, threshold: float) -> _Curve:
        period = YAW_PERIOD.get(self.classes[label], 2 * math.pi)
        per_sample = [sample.matched(label, threshold, period) for sample in self.samples]
        positives = sum(matched.positives for matched in per_sample)
        if positives == 0:
            return _Curve.empty()
        scores = np.concatenate([m.scores for m in per_sample])
        order = np.lexsort((-np.arange(len(scores)), -scores))  # the devkit's sort: score, then later first
        hits = np.concatenate([m.hits for m in per_sample])[order]
        if not hits.any():
            return _Curve.empty()
        confidences = scores[order]
        errors = np.concatenate([m.errors for m in per_sample])[order]
        matches = np.column_stack([confidences[hits], errors[hits]])
        return self._interpolate(hits.astype(float), confidences, matches, positives)

    @staticmethod
    def _interpolate(hits, confidences, matches, positives) -> _Curve:
        tp, fp = np.cumsum(hits), np.cumsum(1 - hits)
        recall_points = np.linspace(0, 1, RECALL_POINTS)
        recall = tp / positives
        precision = np.interp(recall_points, recall, tp / (tp + fp), right=0)
        confidence = np.interp(recall_points, recall, confidences, right=0)
        errors = {name: np.interp(confidence[::-1], matches[::-1, 0], _cummean(matches[:, k + 1])[::-1])[::-1]
                  for k, name in enumerate(TP_ERRORS)}
        return _Curve(precision, confidence, errors)

    @staticmethod
    def average_precision(curve: _Curve) -> float:
        precision = curve.precision[round(100 * MIN_RECALL) + 1:] - MIN_PRECISION
        return float(np.mean(np.clip(precision, 0, None))) / (1.0 - MIN_PRECISION)

    @staticmethod
    def tp_error(curve: _Curve, name: str) -> float:
        first = round(100 * MIN_RECALL) + 1
        nonzero = np.nonzero(curve.confidence)[0]
        last = int(nonzero[-1]) if len(nonzero) else 0
        return 1.0 if last < first else float(np.mean(curve.errors[name][first:last + 1]))

    def _class_metrics(self, label: int, name: str) -> dict[str, float]:
        """AP per threshold and mean, and each TP error (NaN where NOT_SCORED excludes it) of one class."""
        curves = {threshold: self._curve(label, threshold) for threshold in {*self.thresholds, TP_THRESHOLD}}
        aps = [self.average_precision(curves[threshold]) for threshold in self.thresholds]
        out = {f"AP_{name}@{threshold:g}m": ap for threshold, ap in zip(self.thresholds, aps)}
        out[f"AP_{name}"] = float(np.mean(aps))
        for error in TP_ERRORS:
            excluded = error in NOT_SCORED.get(name, ())
            out[f"{error}_{name}"] = math.nan if excluded else self.tp_error(curves[TP_THRESHOLD], error)
        return out

    def compute(self) -> dict[str, float]:
        """mAP, AP per class (and per threshold), TP errors per class and mean, NDS, how many predictions carried a
        velocity and an attribute, and the empty-detector baseline."""
        out: dict[str, float] = {}
        for label, name in enumerate(self.classes):
            out.update(self._class_metrics(label, name))
        out["mAP"] = float(np.mean([out[f"AP_{name}"] for name in self.classes]))
        for error in TP_ERRORS:
            out[f"m{error}"] = _class_mean([out[f"{error}_{name}"] for name in self.classes])
        out["NDS"] = nd_score(out["mAP"], [out[f"m{error}"] for error in TP_ERRORS])
        out.update(self._counts())
        out.update({"baseline_empty/mAP": 0.0, "baseline_empty/NDS": 0.0,
                    **{f"baseline_empty/m{e}": 1.0 for e in TP_ERRORS}})
        return out

    def _counts(self) -> dict[str, float]:
        """Samples, GT boxes (and those with an attribute), predictions (and those with a velocity, an attribute)."""
        boxes = [s.boxes for s in self.samples if len(s.boxes)]
        velocity = np.isfinite(np.concatenate(boxes)[:, 7:9]).all(axis=1).sum() if boxes else 0
        return {"samples": float(len(self.samples)), "gt_boxes": float(sum(len(s.gt_labels) for s in self.samples)),
                "gt_with_attribute": float(sum((s.gt_attributes >= 0).sum() for s in self.samples)),
                "predictions": float(sum(len(s.scores) for s in self.samples)),
                "predictions_with_velocity": float(velocity),
                "predictions_with_attribute": float(sum((s.attributes >= 0).sum() for s in self.samples))}

    def reset(self) -> None:
        self.samples = []

    def merge(self, other: "DetectionMetric") -> None:
        """Add another accumulator's samples (e.g. gathered from other ranks with all_gather_object)."""
        self.samples.extend(other.samples)


SUMMARY_KEYS = ("NDS", "mAP", *(f"m{error}" for error in TP_ERRORS), "predictions", "predictions_with_velocity",
                "predictions_with_attribute", "gt_boxes", "gt_with_attribute")
"""The figures `summary` reads (what a report must keep to print it)."""


def summary(metrics: dict, prefix: str = "detection/") -> str:
    """NDS and the five mean TP errors in one line for a report, naming the predictions the network does not make
    (their error is the devkit's 1 for such a box, not a measurement)."""
    def get(key: str) -> float:
        return float(metrics.get(prefix + key, math.nan))

    errors = ", ".join(f"m{error} {get('m' + error):.3f}" for error in TP_ERRORS)
    notes = []
    if get("predictions") > 0 and get("predictions_with_velocity") == 0:
        notes.append("no velocity head (mAVE 1 by the devkit's rule)")
    if get("predictions") > 0 and get("predictions_with_attribute") == 0:
        notes.append("no attribute head (mAAE: the devkit's score of boxes without attribute)")
    if get("gt_boxes") > 0 and get("gt_with_attribute") == 0:
        notes.append("no attribute labels in the data (mAAE 1 by the devkit's rule)")
    return f"NDS {get('NDS'):.3f} (mAP {get('mAP'):.3f}; {errors})" + "".join(f"; {note}" for note in notes)
