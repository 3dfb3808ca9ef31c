"""Semantic segmentation: IoU per class and mIoU from an accumulated confusion matrix.

IoU_c = TP / (TP + FP + FN) from the confusion matrix summed over the split (not
averaged per image), pixels labelled IGNORE_INDEX excluded; mIoU averages over the
classes that occur in the ground truth or the predictions — the convention of
torchmetrics' `JaccardIndex(average="macro", ignore_index=...)`, the test oracle.
With no labelled pixel at all, mIoU is NaN and `pixels` is 0.

Baseline: the majority-class segmenter, which labels every pixel with the class most
frequent in this split's ground truth; its IoU for that class is the class's share
of the labelled pixels and 0 elsewhere, so it comes from the same matrix.
"""

from __future__ import annotations

from typing import Sequence

import torch

from stack.batch import IGNORE_INDEX


class SegmentationMetric:
    """Accumulates a (classes x classes) confusion matrix (rows GT, columns prediction)."""

    def __init__(self, classes: Sequence[str], ignore_index: int = IGNORE_INDEX):
        self.classes, self.ignore_index = list(classes), ignore_index
        self.confusion = torch.zeros(len(self.classes), len(self.classes), dtype=torch.int64)

    def update(self, prediction: torch.Tensor, target: torch.Tensor) -> None:
        """Class maps of any equal shape (int); target pixels equal to ignore_index are skipped."""
        if prediction.shape != target.shape:
            raise ValueError(f"prediction {tuple(prediction.shape)} and target {tuple(target.shape)} must match")
        n = len(self.classes)
        target, prediction = target.reshape(-1).long().cpu(), prediction.reshape(-1).long().cpu()
        keep = target != self.ignore_index
        if (target[keep] >= n).any() or (target[keep] < 0).any() or (prediction[keep] >= n).any():
            raise ValueError(f"class indices must lie in [0, {n}) or equal ignore_index {self.ignore_index}")
        self.confusion += torch.bincount(target[keep] * n + prediction[keep], minlength=n * n).view(n, n)

    @staticmethod
    def iou_from_confusion(confusion: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(IoU per class, whether the class occurs in GT or prediction)."""
        confusion = confusion.double()
        tp = confusion.diag()
        union = confusion.sum(0) + confusion.sum(1) - tp
        return tp / union.clamp(min=1), union > 0

    def compute(self) -> dict[str, float]:
        iou, present = self.iou_from_confusion(self.confusion)
        pixels = int(self.confusion.sum())
        out = {f"IoU_{name}": float(iou[i]) if present[i] else float("nan") for i, name in enumerate(self.classes)}
        out["mIoU"] = float(iou[present].mean()) if pixels else float("nan")
        out["pixel_accuracy"] = float(self.confusion.diag().sum() / pixels) if pixels else float("nan")
        out["pixels"] = float(pixels)
        out["baseline_majority/mIoU"] = self._majority_miou()
        return out

    def _majority_miou(self) -> float:
        """mIoU of predicting the most frequent GT class everywhere (NaN without labelled pixels)."""
        per_class = self.confusion.sum(1)
        pixels = int(per_class.sum())
        if not pixels:
            return float("nan")
        majority = int(per_class.argmax())
        baseline = torch.zeros_like(self.confusion)
        baseline[:, majority] = per_class
        iou, present = self.iou_from_confusion(baseline)
        return float(iou[present].mean())

    def reset(self) -> None:
        self.confusion.zero_()

    def merge(self, other: "SegmentationMetric") -> None:
        """Add another accumulator's confusion matrix (e.g. from another rank)."""
        self.confusion += other.confusion
