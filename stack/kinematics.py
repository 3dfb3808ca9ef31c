"""The ego's own motion model: where its current status (speed, acceleration, yaw rate) carries it.

Shared by the planning head (its waypoints are residuals on this rollout) and the
planning metric (which reports the rollout as a second, stronger baseline beside
constant velocity), so that both use one definition.
"""

from __future__ import annotations

import math

import numpy as np
import torch

WAYPOINT_STEP_S = 0.5
"""Seconds between trajectory waypoints: the generator's past/future labels, the planner's output, the metrics."""
ROLLOUT_SUBSTEPS = 5
"""Integration substeps per waypoint interval of the kinematic prior."""


def kinematic_rollout(ego_status: torch.Tensor, steps: int, step_s: float = WAYPOINT_STEP_S) -> torch.Tensor:
    """(B, T, 2) ego-frame positions at step_s, 2 step_s, ... under constant acceleration and yaw rate.

    Speed is clamped at zero (a braking car stops; it does not reverse). Midpoint
    integration over ROLLOUT_SUBSTEPS per interval: exportable ops only (cumsum, cos, sin).
    """
    speed, acceleration, yaw_rate = ego_status.float().unbind(-1)
    dt = step_s / ROLLOUT_SUBSTEPS
    t = (torch.arange(steps * ROLLOUT_SUBSTEPS, device=ego_status.device, dtype=torch.float32) + 0.5) * dt
    velocity = torch.clamp(speed[:, None] + acceleration[:, None] * t, min=0.0)
    heading = yaw_rate[:, None] * t
    path = torch.stack([velocity * torch.cos(heading), velocity * torch.sin(heading)], dim=-1).cumsum(dim=1) * dt
    return path[:, ROLLOUT_SUBSTEPS - 1::ROLLOUT_SUBSTEPS]


def speed_profile_arcs(speed: torch.Tensor, accelerations: torch.Tensor, steps: int,
                       step_s: float = WAYPOINT_STEP_S) -> torch.Tensor:
    """(B, K, T) distance travelled at step_s, 2 step_s, ... from `speed` (B,) m/s at each constant
    acceleration (K,) m/s^2; a braking profile stops and stays stopped (it does not reverse).

    Exportable ops only (min, where, div): the speed vocabulary of the path-speed planner."""
    t = step_s * torch.arange(1, steps + 1, device=speed.device, dtype=torch.float32)
    v = speed.float().clamp(min=0.0)[:, None, None]
    a = accelerations.float()[None, :, None]
    braking = a < 0
    stop_time = torch.where(braking, v / torch.where(braking, -a, torch.ones_like(a)), torch.full_like(v * a, math.inf))
    moving = torch.minimum(t.view(1, 1, -1), stop_time)
    return v * moving + 0.5 * a * moving ** 2


def along_path(path: torch.Tensor, spacing: float, arcs: torch.Tensor) -> torch.Tensor:
    """Points (B, ..., 2) at arc lengths `arcs` (B, ...) along a path that starts at the origin and passes
    through `path` (B, P, 2), one point every `spacing` metres; beyond its end, along its last segment.

    Linear interpolation written as a sum of clamped segment weights (no gather, no searchsorted), so it
    exports to ONNX as elementwise ops and one matmul."""
    batch, points = path.shape[:2]
    knots = torch.cat([path.new_zeros(batch, 1, 2), path], dim=1)
    segments = knots[:, 1:] - knots[:, :-1]  # (B, P, 2)
    position = arcs.reshape(batch, -1, 1) / spacing - torch.arange(points, device=path.device, dtype=path.dtype)
    # Each segment's share of the arc, in [0, 1]; the last segment's is unbounded: it extends past the end.
    weights = torch.cat([position[..., :-1].clamp(0.0, 1.0), position[..., -1:].clamp(min=0.0)], dim=-1)
    return (weights @ segments).reshape(*arcs.shape, 2)


def resample_by_arc(points: torch.Tensor, valid: torch.Tensor, arcs: torch.Tensor,
                    forward: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """A trajectory (B, T, 2) from the origin, its valid prefix (B, T), read at arc lengths `arcs` (S,) or (B, S).

    Returns (B, S, 2) points and (B, S) validity (the arc lies within the trajectory's driven extent).
    Beyond that extent the points continue straight along the trajectory's last 2 m (along `forward` (B, 2),
    default +x, where it moved less than 0.5 m): where a stopping expert would have gone had it not stopped.
    Training-side only (targets); zero-length segments (a standing ego) are skipped."""
    segments, lengths = _segments(points, valid)
    cumulative = torch.cat([lengths.new_zeros(lengths.shape[0], 1), lengths.cumsum(dim=1)], dim=1)  # (B, T+1)
    arcs = arcs.to(points.dtype).expand(points.shape[0], -1) if arcs.dim() == 1 else arcs.to(points.dtype)

    def read(at: torch.Tensor) -> torch.Tensor:
        fraction = (at[:, :, None] - cumulative[:, None, :-1]) / lengths[:, None, :].clamp(min=1e-6)
        return (fraction.clamp(0.0, 1.0) * (lengths[:, None, :] > 1e-6)) @ segments

    extent = cumulative[:, -1:]  # (B, 1)
    end = read(extent)
    heading = end - read((extent - 2.0).clamp(min=0.0))
    if forward is None:
        forward = torch.zeros_like(heading[:, 0]) + points.new_tensor([1.0, 0.0])
    heading = torch.where(extent[:, :, None] > 0.5, heading / heading.norm(dim=-1, keepdim=True).clamp(min=1e-6),
                          forward[:, None])
    beyond = (arcs - extent).clamp(min=0.0)[..., None]
    return read(arcs) + beyond * heading, arcs <= extent


def arc_lengths(points: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """(B, T) distance travelled along a trajectory (B, T, 2) from the origin to each waypoint (valid prefix)."""
    return _segments(points, valid)[1].cumsum(dim=1)


def _segments(points: torch.Tensor, valid: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, T, 2) steps from the origin through each waypoint of (B, T, 2), and (B, T) their lengths (0 where
    the waypoint is not valid)."""
    segments = points - torch.cat([points.new_zeros(points.shape[0], 1, 2), points[:, :-1]], dim=1)
    return segments, segments.norm(dim=-1) * valid.float()


def previous_pose(past: np.ndarray) -> np.ndarray:
    """float32 (3,) x, y, yaw of the ego one waypoint step (0.5 s) ago in the current ego frame, from the past
    trajectory (P, 2) whose last row is that position: the previous key frame's pose that a temporal network
    (stack.models.temporal) warps its BEV memory by, in training (the loader) and in the closed loop alike.

    The heading comes from the chord: along an arc of constant curvature (the bicycle model between two
    key frames), the chord from the earlier point to the current one points along the mean of the two
    headings, and the current heading is 0 in the ego frame, so the earlier heading is twice the chord's
    angle. A car that has not moved (under 5 cm) has not turned."""
    x, y = float(past[-1, 0]), float(past[-1, 1])
    if math.hypot(x, y) < 0.05:
        return np.array([x, y, 0.0], np.float32)
    chord = math.atan2(-y, -x)
    return np.array([x, y, 2.0 * chord], np.float32)


def best_plan(trajectories: np.ndarray, scores: np.ndarray) -> np.ndarray:
    """The highest-scoring mode, as `stack.models.decoders.decode_plan` picks it.

    A network whose output is not finite (diverged weights, a broken INT8 model) has no plan: the
    car falls back to stopping where it is (every waypoint at the ego's position), the minimal-risk
    manoeuvre of ISO 21448 / SAE J3016's fallback, and the episode scores what that costs (no
    progress) instead of the evaluation, or the deploy gate, dying on the controller's check."""
    if not (np.isfinite(trajectories).all() and np.isfinite(scores).all()):
        return np.zeros(trajectories.shape[2:], np.float64)
    return np.asarray(trajectories[0, int(np.argmax(scores[0]))], np.float64)
