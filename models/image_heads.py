"""Per-camera heads on image features: depth distribution + lifted context, and semantics.

The depth head follows BEVDepth (Li et al., arXiv:2206.10092): it predicts, per
feature pixel, a categorical distribution over `model.depth.bins` uniform depth bins
(supervised with cross entropy against the rendered metric depth) and the context
features that lift-splat spreads along each ray. The distribution's expectation over
bin centres is the metric depth map of the monocular-depth task.
"""

from __future__ import annotations

import torch
from torch import nn

from stack.models.layers import ConvNormAct


class DepthContextHead(nn.Module):
    """Lift features (B*N, C, h, w) → depth logits (B*N, D, h, w) and context (B*N, C, h, w)."""

    def __init__(self, channels: int, depth_bins: int):
        super().__init__()
        self.depth_bins = depth_bins
        self.body = nn.Sequential(ConvNormAct(channels, channels), ConvNormAct(channels, channels))
        self.out = nn.Conv2d(channels, depth_bins + channels, 1)

    def forward(self, features: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        out = self.out(self.body(features))
        return out[:, : self.depth_bins], out[:, self.depth_bins:]


class SegmentationHead(nn.Module):
    """Fine features (B*N, C, h, w) → per-class logits (B*N, S, h, w) at the segmentation stride."""

    def __init__(self, channels: int, classes: int):
        super().__init__()
        self.body = ConvNormAct(channels, channels)
        self.out = nn.Conv2d(channels, classes, 1)

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        return self.out(self.body(features))


def expected_depth(depth_logits: torch.Tensor, centres: torch.Tensor, dim: int = -3) -> torch.Tensor:
    """Metric depth as the expectation of the bin distribution: sum_d softmax(logits)_d * centre_d."""
    probs = depth_logits.float().softmax(dim)
    shape = [1] * probs.dim()
    shape[dim] = -1
    return (probs * centres.view(shape)).sum(dim)
