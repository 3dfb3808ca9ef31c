"""The ego's own motion model: where its current status (speed, acceleration, yaw rate) carries it.

Shared by the planning head (its waypoints are residuals on this rollout) and the
planning metric (which reports the rollout as a second, stronger baseline beside
constant velocity), so that both use one definition.
"""

from __future__ import annotations

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
