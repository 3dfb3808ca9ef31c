"""Small building blocks shared by the neck, heads and BEV encoder.

Necks and heads normalise with GroupNorm, not BatchNorm: GroupNorm has no running
statistics, so it behaves the same at batch size 1 (export, one frame at a time), under
FSDP mixed precision (BatchNorm's fp32 buffers against bf16 activations are a known
trap, pytorch/pytorch#75478), and across ranks without SyncBatchNorm. The timm
backbone keeps its own BatchNorm so that ImageNet checkpoints load unchanged.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class GroupNorm(nn.GroupNorm):
    """`nn.GroupNorm` that normalises channels-last CPU tensors in the contiguous layout.

    ATen's CPU GroupNorm kernel for channels-last input is many times slower than its
    contiguous one (bf16 [24, 32, 16, 32]: 5.3 against 0.3 ms forward), and the convolutions
    around it run channels-last; copying in and out costs less than the slow kernel. Same
    parameters, same state dict, same ONNX graph. Measured: docs/results/training.md
    ("Where a training step's time goes").
    """

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.device.type != "cpu" or x.is_contiguous() or not x.is_contiguous(memory_format=torch.channels_last):
            return super().forward(x)
        y = F.group_norm(x.contiguous(), self.num_groups, self.weight, self.bias, self.eps)
        return y.contiguous(memory_format=torch.channels_last)


def group_norm(channels: int) -> GroupNorm:
    """GroupNorm with up to 32 groups that divide `channels` (Wu & He, arXiv:1803.08494)."""
    groups = next(g for g in (32, 16, 8, 4, 2, 1) if channels % g == 0)
    return GroupNorm(groups, channels)


class ConvNormAct(nn.Sequential):
    """Conv2d (no bias) → GroupNorm → ReLU."""

    def __init__(self, in_channels: int, out_channels: int, kernel_size: int = 3, stride: int = 1):
        super().__init__(
            nn.Conv2d(in_channels, out_channels, kernel_size, stride, padding=kernel_size // 2, bias=False),
            group_norm(out_channels),
            nn.ReLU(inplace=True),
        )


class ResidualBlock(nn.Module):
    """A ResNet basic block with GroupNorm; a 1x1 projection when shape changes."""

    def __init__(self, in_channels: int, out_channels: int, stride: int = 1):
        super().__init__()
        self.body = nn.Sequential(
            ConvNormAct(in_channels, out_channels, 3, stride),
            nn.Conv2d(out_channels, out_channels, 3, padding=1, bias=False),
            group_norm(out_channels),
        )
        self.shortcut = nn.Identity()
        if stride != 1 or in_channels != out_channels:
            self.shortcut = nn.Sequential(
                nn.Conv2d(in_channels, out_channels, 1, stride, bias=False), group_norm(out_channels)
            )
        self.act = nn.ReLU(inplace=True)

    def forward(self, x):
        return self.act(self.body(x) + self.shortcut(x))
