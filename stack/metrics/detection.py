"""nuScenes-style 3D detection metrics: mAP over centre-distance thresholds and TP errors.

Follows the nuScenes detection benchmark (Caesar et al., arXiv:1903.11027;
nuscenes-devkit `eval/detection/algo.py`), which tests check against the devkit's
own `accumulate` / `calc_ap` / `calc_tp`:

- matching per class over the whole split: predictions sorted by score, each taking
  the nearest untaken GT of its class in its sample by BEV centre distance, a match
  when that distance is below the threshold (0.5, 1, 2, 4 m);
- precision interpolated at 101 recall points; AP = mean precision above 10 %
  recall with precision above 10 % (both clipped), rescaled;
- TP errors at the 2 m threshold, averaged over recall above 10 %: ATE (centre
  distance, m), ASE (1 - IoU of the sizes aligned), AOE (smallest yaw difference,
  rad), AVE (velocity L2, m/s); 1.0 for a class with no match.

- class ranges: like the devkit's `filter_eval_boxes`, GT and predictions farther
  from the ego origin than their class's range are dropped before matching
  (`CLASS_RANGES_M`, nuScenes' detection config: vehicles 50 m, vulnerable road
  users 40 m); `TaskMetrics` also caps each range at the BEV grid's inscribed radius,
  since the network cannot place a box outside its grid.

A class with no ground truth scores AP 0 and errors 1 (the devkit's convention),
and mAP averages over every configured class. The trivial baseline is the empty
detector: mAP 0, every TP error 1.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import numpy as np

DISTANCE_THRESHOLDS = (0.5, 1.0, 2.0, 4.0)
TP_THRESHOLD = 2.0
MIN_RECALL = 0.1
MIN_PRECISION = 0.1
RECALL_POINTS = 101
TP_ERRORS = ("ATE", "ASE", "AOE", "AVE")
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


def _match_errors(gt: np.ndarray, pred: np.ndarray) -> tuple[float, float, float, float]:
    """(ATE, ASE, AOE, AVE) of one matched pair of BOX_FIELDS rows."""
    ate = float(np.linalg.norm(pred[:2] - gt[:2]))
    gs, ps = np.maximum(gt[3:6], 1e-9), np.maximum(pred[3:6], 1e-9)
    inter = np.prod(np.minimum(gs, ps))
    ase = 1.0 - float(inter / (np.prod(gs) + np.prod(ps) - inter))
    aoe = abs((pred[6] - gt[6] + np.pi) % (2 * np.pi) - np.pi)
    ave = float(np.linalg.norm(pred[7:9] - gt[7:9]))
    return ate, ase, float(aoe), ave


def _cummean(values: np.ndarray) -> np.ndarray:
    return np.cumsum(values) / np.arange(1, len(values) + 1)


class DetectionMetric:
    """Accumulates decoded boxes and ground truth over a split; `compute` gives nuScenes mAP + TP errors."""

    def __init__(self, classes: Sequence[str], thresholds: Sequence[float] = DISTANCE_THRESHOLDS,
                 ranges: Sequence[float] | None = None):
        """`ranges`: per-class evaluation range in metres (see `class_ranges`); None keeps every box."""
        self.classes, self.thresholds = list(classes), tuple(thresholds)
        self.ranges = None if ranges is None else np.asarray(ranges, dtype=np.float64)
        if self.ranges is not None and len(self.ranges) != len(self.classes):
            raise ValueError(f"ranges has {len(self.ranges)} entries for {len(self.classes)} classes")
        self.samples: list[tuple[np.ndarray, ...]] = []

    def _in_range(self, boxes: np.ndarray, labels: np.ndarray) -> np.ndarray:
        """Mask of the boxes within their class's evaluation range (all True without ranges)."""
        if self.ranges is None or len(labels) == 0:
            return np.ones(len(labels), dtype=bool)
        return np.linalg.norm(boxes[:, :2], axis=1) <= self.ranges[np.clip(labels, 0, len(self.ranges) - 1)]

    def update(self, pred_boxes, pred_scores, pred_labels, gt_boxes, gt_labels) -> None:
        """One batch: per-sample predictions (lists of (n, 9), (n,), (n,)) and GT (B, M, 9), (B, M) with -1 padding."""
        gt_boxes, gt_labels = _numpy(gt_boxes), _numpy(gt_labels)
        for i in range(len(gt_labels)):
            real = gt_labels[i] >= 0
            gt, gt_label = gt_boxes[i][real].astype(np.float64), gt_labels[i][real].astype(np.int64)
            boxes = _numpy(pred_boxes[i]).astype(np.float64).reshape(-1, 9)
            scores = _numpy(pred_scores[i]).astype(np.float64).reshape(-1)
            labels = _numpy(pred_labels[i]).astype(np.int64).reshape(-1)
            kept, kept_gt = self._in_range(boxes, labels), self._in_range(gt, gt_label)
            self.samples.append((boxes[kept], scores[kept], labels[kept], gt[kept_gt], gt_label[kept_gt]))

    def update_detections(self, detections, gt_boxes, gt_labels) -> None:
        """`update` from `stack.models.decoders.Detections`-like objects (fields boxes, scores, labels)."""
        self.update([d.boxes for d in detections], [d.scores for d in detections], [d.labels for d in detections],
                    gt_boxes, gt_labels)

    def _curve(self, label: int, threshold: float) -> _Curve:
        gts = [s[3][s[4] == label] for s in self.samples]
        positives = sum(len(g) for g in gts)
        preds = [(score, sample, row) for sample, s in enumerate(self.samples)
                 for row, score in enumerate(s[1]) if s[2][row] == label]
        if positives == 0:
            return _Curve.empty()
        order = sorted(range(len(preds)), key=lambda i: (preds[i][0], i), reverse=True)
        taken = [np.zeros(len(g), bool) for g in gts]
        hits, confidences, matches = [], [], []
        for i in order:
            score, sample, row = preds[i]
            box = self.samples[sample][0][row]
            distance = np.linalg.norm(gts[sample][:, :2] - box[:2], axis=1) if len(gts[sample]) else np.zeros(0)
            distance = np.where(taken[sample], np.inf, distance)
            best = int(np.argmin(distance)) if len(distance) else -1
            hit = best >= 0 and distance[best] < threshold
            hits.append(hit)
            confidences.append(score)
            if hit:
                taken[sample][best] = True
                matches.append((score, *_match_errors(gts[sample][best], box)))
        if not matches:
            return _Curve.empty()
        return self._interpolate(np.array(hits, float), np.array(confidences), np.array(matches), positives)

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

    def compute(self) -> dict[str, float]:
        """mAP, AP per class (and per threshold), TP errors per class and mean, and the empty-detector baseline."""
        out: dict[str, float] = {}
        for label, name in enumerate(self.classes):
            curves = {threshold: self._curve(label, threshold) for threshold in {*self.thresholds, TP_THRESHOLD}}
            aps = [self.average_precision(curves[threshold]) for threshold in self.thresholds]
            out.update({f"AP_{name}@{threshold:g}m": ap for threshold, ap in zip(self.thresholds, aps)})
            out[f"AP_{name}"] = float(np.mean(aps))
            tp_curve = curves[TP_THRESHOLD]
            for error in TP_ERRORS:
                out[f"{error}_{name}"] = self.tp_error(tp_curve, error)
        out["mAP"] = float(np.mean([out[f"AP_{name}"] for name in self.classes]))
        for error in TP_ERRORS:
            out[f"m{error}"] = float(np.mean([out[f"{error}_{name}"] for name in self.classes]))
        out["samples"] = float(len(self.samples))
        out["gt_boxes"] = float(sum(len(s[4]) for s in self.samples))
        out.update({"baseline_empty/mAP": 0.0, **{f"baseline_empty/m{e}": 1.0 for e in TP_ERRORS}})
        return out

    def reset(self) -> None:
        self.samples = []

    def merge(self, other: "DetectionMetric") -> None:
        """Add another accumulator's samples (e.g. gathered from other ranks with all_gather_object)."""
        self.samples.extend(other.samples)
