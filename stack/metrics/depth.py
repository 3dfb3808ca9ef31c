"""Monocular depth errors with monodepth2's conventions, made explicit.

monodepth2's `compute_errors` (Godard et al., arXiv:1806.01260, `evaluate_depth.py`):
per image, the valid mask is `min_depth < gt < max_depth` (the cap), predictions are
clamped to [min_depth, max_depth], and

    AbsRel = mean(|gt - pred| / gt)          SqRel = mean((gt - pred)^2 / gt)
    RMSE = sqrt(mean((gt - pred)^2))         RMSE_log = sqrt(mean((log gt - log pred)^2))
    delta_k = mean(max(gt / pred, pred / gt) < 1.25^k),  k = 1, 2, 3

then averaged over images. Our depth is metric, so there is no median scaling.
Here an image is one camera of one sample; images without a valid pixel are skipped
and counted. Baseline: the mean-depth predictor, which fills each image with the
mean of its own valid ground truth (a per-image oracle constant, so a hard bar).
"""

from __future__ import annotations

import torch

METRICS = ("AbsRel", "SqRel", "RMSE", "RMSE_log", "delta1", "delta2", "delta3")


def depth_errors(gt: torch.Tensor, pred: torch.Tensor) -> torch.Tensor:
    """The seven monodepth2 errors (METRICS order) of one image's valid pixels (1-D tensors)."""
    ratio = torch.maximum(gt / pred, pred / gt)
    return torch.stack([
        ((gt - pred).abs() / gt).mean(), ((gt - pred) ** 2 / gt).mean(),
        ((gt - pred) ** 2).mean().sqrt(), ((gt.log() - pred.log()) ** 2).mean().sqrt(),
        (ratio < 1.25).double().mean(), (ratio < 1.25**2).double().mean(), (ratio < 1.25**3).double().mean(),
    ])


def summary(metrics: dict) -> str:
    """`stack eval`'s depth line: the error on road users' pixels (`TaskMetrics.depth_road_users`) beside the whole
    image's, since what places a road user in the BEV is the depth of its own few pixels, not the road's."""
    images = int(metrics.get("depth_road_users/images", 0))
    if not images:
        return "no road user's pixel in the split's images"
    return (f"on road users' pixels AbsRel {metrics['depth_road_users/AbsRel']:.3f}, delta1 "
            f"{metrics['depth_road_users/delta1']:.3f} (every pixel: {metrics['depth/AbsRel']:.3f}, "
            f"{metrics['depth/delta1']:.3f}; {images} images show one)")


class DepthMetric:
    """Accumulates per-image depth errors; `compute` averages them over images."""

    def __init__(self, min_depth: float = 1e-3, max_depth: float = 80.0):
        if not 0 < min_depth < max_depth:
            raise ValueError(f"need 0 < min_depth < max_depth, got {min_depth}, {max_depth}")
        self.min_depth, self.max_depth = min_depth, max_depth
        self.reset()

    def update(self, pred: torch.Tensor, gt: torch.Tensor, mask: torch.Tensor | None = None) -> None:
        """Depth maps (..., H, W) in metres; every leading index is one image; gt 0 = no depth. `mask` (same shape,
        bool) keeps only its pixels: an image with none of them counts as without valid depth."""
        if pred.shape != gt.shape or (mask is not None and mask.shape != gt.shape):
            found = "" if mask is None else f" and mask {tuple(mask.shape)}"
            raise ValueError(f"pred {tuple(pred.shape)}{found} and gt {tuple(gt.shape)} must match")
        pred = pred.detach().double().cpu().reshape(-1, *pred.shape[-2:])
        gt = gt.detach().double().cpu().reshape(-1, *gt.shape[-2:])
        masks = [None] * len(gt) if mask is None else mask.detach().cpu().bool().reshape(-1, *mask.shape[-2:])
        for image_pred, image_gt, image_mask in zip(pred, gt, masks):
            valid = (image_gt > self.min_depth) & (image_gt < self.max_depth)
            if image_mask is not None:
                valid &= image_mask
            if not valid.any():
                self.skipped += 1
                continue
            g = image_gt[valid]
            p = image_pred[valid].clamp(self.min_depth, self.max_depth)
            self.sums += depth_errors(g, p)
            self.baseline_sums += depth_errors(g, torch.full_like(g, float(g.mean())))
            self.images += 1

    def compute(self) -> dict[str, float]:
        count = max(self.images, 1)
        nan = float("nan")
        out = {name: float(self.sums[i] / count) if self.images else nan for i, name in enumerate(METRICS)}
        out.update({f"baseline_mean_depth/{name}": float(self.baseline_sums[i] / count) if self.images else nan
                    for i, name in enumerate(METRICS)})
        out.update({"images": float(self.images), "images_without_valid_depth": float(self.skipped),
                    "min_depth": self.min_depth, "max_depth": self.max_depth})
        return out

    def reset(self) -> None:
        self.sums = torch.zeros(len(METRICS), dtype=torch.float64)
        self.baseline_sums = torch.zeros(len(METRICS), dtype=torch.float64)
        self.images, self.skipped = 0, 0

    def merge(self, other: "DepthMetric") -> None:
        """Add another accumulator's per-image sums (e.g. from another rank)."""
        self.sums += other.sums
        self.baseline_sums += other.baseline_sums
        self.images += other.images
        self.skipped += other.skipped
