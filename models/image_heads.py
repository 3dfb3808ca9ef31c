"""Per-camera heads on image features: depth distribution + lifted context, and semantics.

The depth head follows BEVDepth (Li et al., arXiv:2206.10092): it predicts, per
feature pixel, a categorical distribution over `model.depth.bins` uniform depth bins
(supervised with cross entropy against the rendered metric depth) and the context
features that lift-splat spreads along each ray. The distribution's expectation over
bin centres is the metric depth map of the monocular-depth task.

With `model.depth.camera_aware` the head also conditions on its camera, as BEVDepth's DepthNet does: the depth
along a pixel's ray depends on the focal length and on how high and how tilted the camera sits, which per-vehicle
calibration changes, so an MLP of the camera's parameters gates the depth and the context features
(squeeze-and-excitation style, Hu et al. 2018). Only what changes a pixel's depth on a flat world enters
(`camera_vector`): the intrinsics, the height, and the camera axes' tilt against the vertical; not the yaw or
the position in the ground plane, which the BEV rotation augmentation changes without changing any depth.
"""

from __future__ import annotations

import torch
from torch import nn

import torch.nn.functional as F

from stack.models.layers import ConvNormAct

CAMERA_FEATURES = 8
"""fx / W, fy / H, cx / W, cy / H, the camera's height (m), and the vertical component of its x, y, z axes."""


def camera_vector(intrinsics: torch.Tensor, cam_to_ego: torch.Tensor, image_size: tuple[int, int]) -> torch.Tensor:
    """(B * N, CAMERA_FEATURES) of intrinsics (B, N, 3, 3) in pixels of an image (H, W) and cam_to_ego (B, N, 4, 4):
    what of a camera changes the depth of its pixels on a flat world, invariant to a turn about the vertical."""
    height, width = image_size
    k, pose = intrinsics.float().flatten(0, 1), cam_to_ego.float().flatten(0, 1)
    scaled = torch.stack([k[:, 0, 0] / width, k[:, 1, 1] / height, k[:, 0, 2] / width, k[:, 1, 2] / height], dim=-1)
    return torch.cat([scaled, pose[:, 2:3, 3], pose[:, 2, :3]], dim=-1)


class CameraGates(nn.Module):
    """Camera vector (B * N, CAMERA_FEATURES) -> two gates (B * N, C, 1, 1) in (0, 2), one for the depth branch and
    one for the context; the last layer starts at zero, so a new network starts as the plain one (gates of 1)."""

    def __init__(self, channels: int):
        super().__init__()
        self.mlp = nn.Sequential(nn.Linear(CAMERA_FEATURES, channels), nn.ReLU(inplace=True),
                                 nn.Linear(channels, channels), nn.ReLU(inplace=True))
        self.gates = nn.Linear(channels, 2 * channels)
        nn.init.zeros_(self.gates.weight)
        nn.init.zeros_(self.gates.bias)

    def forward(self, cameras: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        gates = 2.0 * torch.sigmoid(self.gates(self.mlp(cameras)))
        depth, context = gates[..., None, None].chunk(2, dim=1)
        return depth, context


class DepthContextHead(nn.Module):
    """Lift features (B*N, C, h, w) → depth logits (B*N, D, h, w) and context (B*N, C, h, w)."""

    def __init__(self, channels: int, depth_bins: int, camera_aware: bool = False):
        super().__init__()
        self.depth_bins = depth_bins
        self.body = nn.Sequential(ConvNormAct(channels, channels), ConvNormAct(channels, channels))
        self.out = nn.Conv2d(channels, depth_bins + channels, 1)
        self.camera_gates = CameraGates(channels) if camera_aware else None

    def forward(self, features: torch.Tensor, cameras: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """`cameras` (B * N, CAMERA_FEATURES), `camera_vector` of each image's camera: needed when camera-aware."""
        body = self.body(features)
        if self.camera_gates is None:
            out = self.out(body)
            return out[:, : self.depth_bins], out[:, self.depth_bins:]
        depth_gate, context_gate = self.camera_gates(cameras.to(body.dtype))
        bins = self.depth_bins  # the plain head's one 1x1 conv, its two halves fed the two gated features
        depth = F.conv2d(body * depth_gate, self.out.weight[:bins], self.out.bias[:bins])
        return depth, F.conv2d(body * context_gate, self.out.weight[bins:], self.out.bias[bins:])


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
