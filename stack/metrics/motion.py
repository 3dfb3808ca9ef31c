"""Does a temporal network read motion from the previous key frame? Its velocity at moving road users' centres,
with the previous frame fused and with the frame fused with itself.

Why: mAVE alone cannot say where a network's velocity comes from. One frame already tells much of it: a car in
a driving lane, nose forward, is likely moving; a car at the kerb likely is not. The second input a temporal
network (BEVDet4D, `stack.models.temporal`) gets is the frame itself with zero ego motion, the input of a
sequence's first frame: a network that reads motion from the previous frame is worse there, one that guesses
from appearance is not. BEVDet4D's own ablation is this comparison across trained networks (mAVE 0.909 without
the previous frame, 0.337 with it, BEVDet-Tiny); here it is one network, the same weights, both inputs.

Figures (`stack eval`, `motion/` keys), over ground-truth boxes moving faster than MOVING_MPS whose centre lies
on the BEV grid, the velocity regressed at the centre's cell (the cell a CenterPoint head is trained to answer
at): the mean velocity error with and without the previous frame, the share of it the previous frame removes,
and the speed ratio (least-squares slope of the predicted on the true velocity: 1 reads speed right, 0 says
everything stands). The error is also split along the ray from the ego to the road user and across it: a lift-splat
BEV smears a thing along its camera ray by the depth error (tens of percent of the range from one camera), while
its bearing is sharp, so motion along the ray is the harder one to read from two frames.
"""

from __future__ import annotations

import math

import torch

MOVING_MPS = 1.0
"""A road user moving faster than this over ground is counted (a parked car's velocity is 0 from one frame)."""
VELOCITY_FIELDS = slice(8, 10)
"""vx, vy in the detection head's box regression (`stack.models.bev_heads.REGRESSION_FIELDS`; the metrics do not
import the models)."""


class MotionMetric:
    """Velocity at moving road users' centres, accumulated over batches, from two forward passes of one network."""

    def __init__(self, bev):
        self.bev = bev
        self.reset()

    def reset(self) -> None:
        self.true, self.fused, self.alone, self.rays = [], [], [], []

    def update(self, fused: torch.Tensor, alone: torch.Tensor, boxes: torch.Tensor, labels: torch.Tensor) -> None:
        """`fused` and `alone`: box regressions (B, 10, X, Y) with the previous frame and with the frame fused with
        itself; `boxes` (B, M, 9) ground truth in the ego frame (BOX_FIELDS), `labels` (B, M), -1 for padding."""
        cells = self.centre_cells(boxes)
        counted = (labels >= 0) & (boxes[..., 7:9].norm(dim=-1) > MOVING_MPS) & (cells[..., 0] >= 0)
        batch = torch.arange(len(boxes))[:, None].expand_as(labels)[counted]
        x, y = cells[counted].unbind(-1)
        self.true.append(boxes[counted][:, 7:9].float())
        centres = boxes[counted][:, :2].float()
        self.rays.append(centres / centres.norm(dim=-1, keepdim=True).clamp_min(1e-6))
        for kept, regression in ((self.fused, fused), (self.alone, alone)):
            kept.append(regression[:, VELOCITY_FIELDS].float().permute(0, 2, 3, 1)[batch, x, y])

    def centre_cells(self, boxes: torch.Tensor) -> torch.Tensor:
        """(B, M, 2) long grid cell of each box centre; -1 for centres off the grid."""
        (x0, x1), (y0, y1), size = self.bev.x_range, self.bev.y_range, self.bev.cell_size
        xy = boxes[..., :2].float()
        on_grid = (xy[..., 0] >= x0) & (xy[..., 0] < x1) & (xy[..., 1] >= y0) & (xy[..., 1] < y1)
        cells = torch.stack([(xy[..., 0] - x0) / size, (xy[..., 1] - y0) / size], dim=-1).floor().long()
        return torch.where(on_grid[..., None], cells, torch.full_like(cells, -1))

    def merge(self, other: MotionMetric) -> None:
        self.true += other.true
        self.fused += other.fused
        self.alone += other.alone
        self.rays += other.rays

    def compute(self) -> dict[str, float]:
        true = torch.cat(self.true) if self.true else torch.zeros(0, 2)
        out = {"moving_boxes": float(len(true))}
        if not len(true):
            figures = [f"{figure}{name}" for figure in ("velocity_error", "speed_ratio", "along_ray_error",
                                                        "across_ray_error") for name in ("", "_alone")]
            return {**out, **dict.fromkeys(figures + ["previous_frame_share"], math.nan)}
        along = torch.cat(self.rays)
        across = torch.stack([-along[:, 1], along[:, 0]], dim=-1)
        for name, kept in (("", self.fused), ("_alone", self.alone)):
            predicted = torch.cat(kept)
            error = predicted - true
            out[f"velocity_error{name}"] = float(error.norm(dim=-1).mean())
            out[f"speed_ratio{name}"] = float((predicted * true).sum() / (true * true).sum())
            out[f"along_ray_error{name}"] = float((error * along).sum(dim=-1).abs().mean())
            out[f"across_ray_error{name}"] = float((error * across).sum(dim=-1).abs().mean())
        out["previous_frame_share"] = 1.0 - out["velocity_error"] / out["velocity_error_alone"]
        return out


def summary(metrics: dict, prefix: str = "motion/") -> str:
    """One line for a report: what the previous frame adds to the velocity of moving road users."""
    def get(key: str) -> float:
        return float(metrics.get(prefix + key, math.nan))

    return (f"velocity of {get('moving_boxes'):.0f} moving road users (> {MOVING_MPS:g} m/s) at their centres: error "
            f"{get('velocity_error'):.3f} m/s with the previous key frame(s), {get('velocity_error_alone'):.3f} with the "
            f"frame fused with itself (the previous frames remove {get('previous_frame_share'):.0%} of it); "
            f"speed ratio {get('speed_ratio'):.2f} vs {get('speed_ratio_alone'):.2f} (1 reads speed right, 0 says "
            f"everything stands); along the ray from the ego {get('along_ray_error'):.3f} vs "
            f"{get('along_ray_error_alone'):.3f}, across it {get('across_ray_error'):.3f} vs "
            f"{get('across_ray_error_alone'):.3f} m/s")
