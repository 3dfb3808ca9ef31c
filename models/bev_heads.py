"""BEV encoder, CenterPoint-style detection head, and the attention planning head.

Detection follows CenterPoint (Yin et al., arXiv:2006.11275): one heatmap channel
per class marks object centres; at each centre cell a regression map gives the
sub-cell offset, height, log size, yaw as (sin, cos) and velocity
(REGRESSION_FIELDS). `stack.models.detection` encodes targets and decodes boxes.

Planning: K mode queries, each the ego embedding (ego status + high-level command)
plus a learned mode embedding, cross-attend to pooled BEV tokens with
`scaled_dot_product_attention` and regress T waypoint displacements (cumulated
into positions, metres, ego frame) and a score per mode (as in VAD/UniAD's
ego query, arXiv:2303.12077). The waypoints are residuals on a kinematic prior:
the ego's own status (speed, acceleration, yaw rate) rolled out at constant
acceleration and turn rate (`kinematic_rollout`). Ego status alone explains most of
an open-loop plan (AD-MLP, arXiv:2305.10430); starting from its rollout leaves the
network the part that needs the scene (leaders, stop lines, turns), instead of
first having to learn to integrate speed through attention and LayerNorm.

BEV-rotation augmentation (`stack.data.augment`) turns the scene, the boxes and the
target trajectories by an angle θ about the ego. The head still plans in the body
frame (prior along +x plus residual) and then rotates its trajectories by θ
(`rotate_trajectories`), so plan, targets and boxes share the rotated frame and the
collision loss compares like with like; cos θ and sin θ enter the ego query through
a zero-initialised embedding, so the planner can relate the rotated BEV tokens to
its body frame. θ = None (evaluation, export) is θ = 0: the same outputs, and no
rotation op in the graph.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from stack.kinematics import kinematic_rollout
from stack.models.layers import ConvNormAct, ResidualBlock

REGRESSION_FIELDS = ("dx", "dy", "z", "log_length", "log_width", "log_height", "sin_yaw", "cos_yaw", "vx", "vy")
"""Channels of the `box_regression` output, in order (offsets in cells, the rest metres, m/s)."""
HEATMAP_PRIOR = 0.1
"""Initial foreground probability of the heatmap (CenterNet's -2.19 logit bias)."""
PLAN_TOKEN_SIDE = 16
"""BEV is average-pooled to about this many tokens per side before planning attention."""
PLAN_HEADS = 4
"""Attention heads in the planning head (bev_channels must divide by it)."""


class BevEncoder(nn.Module):
    """Two-scale residual encoder on the BEV grid (BEVDet-style): full res → 1/2 → back, concatenated."""

    def __init__(self, in_channels: int, channels: int):
        super().__init__()
        self.stem = ResidualBlock(in_channels, channels)
        self.down = nn.Sequential(ResidualBlock(channels, 2 * channels, stride=2), ResidualBlock(2 * channels, 2 * channels))
        self.fuse = ConvNormAct(3 * channels, channels)

    def forward(self, bev: torch.Tensor) -> torch.Tensor:
        full = self.stem(bev)
        half = self.down(full)
        up = F.interpolate(half, size=full.shape[-2:], mode="bilinear", align_corners=False)
        return self.fuse(torch.cat([full, up], dim=1))


class DetectionHead(nn.Module):
    """BEV features → class heatmap logits (B, C, X, Y), box regression (B, 10, X, Y) and, with `attributes`
    > 0, attribute logits (B, attributes, X, Y): one more CenterPoint branch, read at each box's centre cell as the
    regression is (nuScenes' moving / stopped / parked ..., `stack.metrics.detection.ATTRIBUTES`)."""

    def __init__(self, channels: int, classes: int, attributes: int = 0):
        super().__init__()
        self.shared = ConvNormAct(channels, channels)
        self.heatmap = nn.Sequential(ConvNormAct(channels, channels), nn.Conv2d(channels, classes, 1))
        self.regression = nn.Sequential(ConvNormAct(channels, channels), nn.Conv2d(channels, len(REGRESSION_FIELDS), 1))
        self.attributes = nn.Sequential(ConvNormAct(channels, channels), nn.Conv2d(channels, attributes, 1)) \
            if attributes else None
        nn.init.constant_(self.heatmap[-1].bias, -math.log((1 - HEATMAP_PRIOR) / HEATMAP_PRIOR))

    def forward(self, bev: torch.Tensor) -> dict[str, torch.Tensor]:
        shared = self.shared(bev)
        outputs = {"heatmap": self.heatmap(shared), "box_regression": self.regression(shared)}
        if self.attributes is not None:
            outputs["attribute_logits"] = self.attributes(shared)
        return outputs


class CrossAttentionLayer(nn.Module):
    """Pre-norm cross attention (queries → BEV tokens) + MLP, with residuals."""

    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.heads = heads
        self.norm_q, self.norm_kv, self.norm_mlp = nn.LayerNorm(dim), nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.q, self.kv, self.proj = nn.Linear(dim, dim), nn.Linear(dim, 2 * dim), nn.Linear(dim, dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def _split(self, x: torch.Tensor) -> torch.Tensor:
        b, n, d = x.shape
        return x.view(b, n, self.heads, d // self.heads).transpose(1, 2)

    def forward(self, queries: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        b, k, d = queries.shape
        key, value = self.kv(self.norm_kv(tokens)).chunk(2, dim=-1)
        attended = F.scaled_dot_product_attention(self._split(self.q(self.norm_q(queries))), self._split(key), self._split(value))
        queries = queries + self.proj(attended.transpose(1, 2).reshape(b, k, d))
        return queries + self.mlp(self.norm_mlp(queries))


class PlanningTrunk(nn.Module):
    """The planner's query trunk: mode queries (ego status + command + BEV-rotation embedding + a learned mode
    embedding) cross-attend the pooled BEV tokens. Shared by `PlanningHead` (waypoint regression) and
    `stack.models.path_speed_head.PathSpeedPlanningHead` (a path and a scored speed vocabulary)."""

    def __init__(self, bev_channels: int, grid: tuple[int, int], modes: int, commands: int, layers: int = 2,
                 width: int = 0):
        super().__init__()
        self.modes = modes
        channels = width or bev_channels
        self.project = nn.Linear(bev_channels, channels) if channels != bev_channels else None
        self.pool = max(1, math.ceil(max(grid) / PLAN_TOKEN_SIDE))
        tokens = math.ceil(grid[0] / self.pool) * math.ceil(grid[1] / self.pool)
        self.token_pos = nn.Parameter(torch.randn(1, tokens, channels) * 0.02)
        self.ego = nn.Sequential(nn.Linear(3, channels), nn.ReLU(inplace=True), nn.Linear(channels, channels))
        self.command = nn.Embedding(commands, channels)
        self.rotation = nn.Linear(2, channels)
        nn.init.zeros_(self.rotation.weight)  # starts as the unaugmented planner; learns what θ says about the BEV
        nn.init.zeros_(self.rotation.bias)
        self.mode = nn.Parameter(torch.randn(1, modes, channels) * 0.02)
        self.layers = nn.ModuleList(CrossAttentionLayer(channels, PLAN_HEADS) for _ in range(layers))
        self.norm = nn.LayerNorm(channels)

    def queries(self, bev: torch.Tensor, ego_status: torch.Tensor, command: torch.Tensor,
                bev_rotation: torch.Tensor | None = None) -> torch.Tensor:
        """(B, modes, channels): the mode queries after attending the BEV, normalised."""
        pooled = F.avg_pool2d(bev, self.pool, self.pool, ceil_mode=True) if self.pool > 1 else bev
        tokens = pooled.flatten(2).transpose(1, 2)
        tokens = (self.project(tokens) if self.project is not None else tokens) + self.token_pos
        ego = self.ego(ego_status.float()) + self.command(command) + self._rotation_embedding(ego_status, bev_rotation)
        queries = ego[:, None, :] + self.mode
        for layer in self.layers:
            queries = layer(queries, tokens)
        return self.norm(queries)

    def _rotation_embedding(self, ego_status: torch.Tensor, bev_rotation: torch.Tensor | None) -> torch.Tensor:
        """The (B, channels) embedding of (cos θ, sin θ); with θ None, that of θ = 0 (a constant)."""
        if bev_rotation is None:
            angle = ego_status.new_tensor([1.0, 0.0], dtype=self.rotation.weight.dtype)
            return self.rotation(angle)[None]
        angle = bev_rotation.to(self.rotation.weight.dtype)
        return self.rotation(torch.stack([torch.cos(angle), torch.sin(angle)], dim=-1))


class PlanningHead(PlanningTrunk):
    """BEV features + ego status (B, 3) + command (B,) → trajectories (B, K, T, 2) and mode logits (B, K)."""

    keep_fp32 = ("waypoints", "score")
    """Children that run in fp32 under mixed precision (autocast off in `forward`): FSDP2
    gathers their weights in fp32 too (`stack.train.parallel.fp32_modules`)."""

    def __init__(self, bev_channels: int, grid: tuple[int, int], modes: int, steps: int, commands: int, layers: int = 2,
                 width: int = 0):
        super().__init__(bev_channels, grid, modes, commands, layers, width)
        self.steps = steps
        channels = width or bev_channels
        self.waypoints = nn.Linear(channels, steps * 2)
        nn.init.zeros_(self.waypoints.weight)  # every mode starts on the kinematic prior
        nn.init.zeros_(self.waypoints.bias)
        self.score = nn.Linear(channels, 1)

    def forward(self, bev: torch.Tensor, ego_status: torch.Tensor, command: torch.Tensor,
                bev_rotation: torch.Tensor | None = None):
        """`bev_rotation` (B,) radians: the BEV augmentation's yaw; None means 0 (see the module docstring)."""
        queries = self.queries(bev, ego_status, command, bev_rotation)
        # Waypoints reach tens of metres, where bf16 resolves only ~0.1 m: keep the last layer
        # and the cumulative sum in fp32 even under mixed precision.
        device_type = "cpu" if queries.device.type == "meta" else queries.device.type
        with torch.autocast(device_type=device_type, enabled=False):
            queries = queries.float()
            steps = self.waypoints(queries).view(-1, self.modes, self.steps, 2)
            prior = kinematic_rollout(ego_status, self.steps)
            body_frame = prior[:, None] + steps.cumsum(dim=2)
            trajectories = body_frame if bev_rotation is None else rotate_trajectories(body_frame, bev_rotation)
            return trajectories, self.score(queries).squeeze(-1)


def rotate_trajectories(points: torch.Tensor, angle: torch.Tensor) -> torch.Tensor:
    """(B, ..., 2) xy turned by `angle` (B,) radians about the origin (counter-clockwise, about +z).

    Exact at angle 0 (cos 0 = 1, sin 0 = 0), so θ = 0 and θ = None plan the same waypoints."""
    shape = (-1, *([1] * (points.dim() - 2)))  # broadcast over every axis of x and y but the batch
    c, s = torch.cos(angle.float()).view(shape), torch.sin(angle.float()).view(shape)
    x, y = points.unbind(-1)
    return torch.stack([c * x - s * y, s * x + c * y], dim=-1)
