"""The plan guard: the planner's best candidate that does not run into what the network itself detects.

Why: the path-speed planner (`stack.models.path_speed_head`) scores each speed candidate with a *learned*
collision logit, trained on few examples of each hazard (12 stopped-vehicle episodes in the tiny-drive data),
while the detection head that sees the same road users is trained on every box of every frame. On the tiny-drive
network the learned logit stays low for a stopped car until braking is too late (BENCHMARKS, closed loop), and
most driven episodes end in a collision the detector had seen. Driving stacks keep an explicit check between
the learned planner and the car for this reason: InterFuser (Shao et al., CoRL 2022) passes its learned
waypoints through a safety controller that reads the network's own object map; PDM-Closed (Dauner et al., CoRL
2023) scores proposals against forecast boxes. Here the guard reads the network's decoded detections
(`decode_detections`, velocity included: a temporal network regresses it), moves them at their velocities, and
drops every candidate whose footprint reaches into one within the horizon, or while braking to a stop at
`model.plan_guard_deceleration` after it (the label rule of `stack.models.losses._stop_after_horizon`). The
highest-scoring candidate left drives; if none is left, the one that travels least (the hardest braking).

What it does not do: see what the detector misses (a false negative drives on), or replace the planner's own
choice where nothing is detected on the path. Boxes that start behind the rear axle are ignored: what
runs into the ego from behind is not avoided by braking.
"""

from __future__ import annotations

import torch

from stack.kinematics import WAYPOINT_STEP_S, resample_by_arc
from stack.metrics.collision import FOOTPRINT_DISCS_M, FOOTPRINT_RADIUS_M, penetration

STOP_STEPS = 8
"""Waypoints (0.5 s apart) of the stop checked after the horizon: 4 s, a stop from 14 m/s at 3.5 m/s^2."""
STOPPED_MPS = 0.5
"""Below this speed the checked stop counts as standing: what runs into a standing ego is not avoided by it."""


def candidate_arcs(trajectories: torch.Tensor) -> torch.Tensor:
    """(K, T) distance each candidate (K, T, 2) has travelled at each waypoint, from the origin."""
    steps = torch.cat([trajectories[:, :1], trajectories.diff(dim=1)], dim=1).norm(dim=-1)
    return steps.cumsum(dim=1)


def braking_to_a_stop(end: torch.Tensor, final: torch.Tensor, deceleration: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(..., E) distance travelled and (..., E) bool "still moving" at STOP_STEPS waypoints after a horizon that
    ends at distance `end` (..., 1) with speed `final` (..., 1), braking at `deceleration` m/s^2 to a stop. The
    label rule (`stack.models.losses._stop_after_horizon`) and the guard (`stop_after`) both use it."""
    after = WAYPOINT_STEP_S * torch.arange(1, STOP_STEPS + 1, dtype=end.dtype, device=end.device)
    braking = torch.minimum(after, final / deceleration)
    return end + final * braking - 0.5 * deceleration * braking ** 2, final - deceleration * after > STOPPED_MPS


def stop_after(arcs: torch.Tensor, deceleration: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(K, E) distance and (K, E) bool "still moving" while each candidate brakes to a stop at `deceleration`
    after its horizon, from its final speed (its last interval's mean speed)."""
    return braking_to_a_stop(arcs[:, -1:], (arcs[:, -1:] - arcs[:, -2:-1]) / WAYPOINT_STEP_S, deceleration)


def colliding_candidates(trajectories: torch.Tensor, boxes: torch.Tensor, deceleration: float) -> torch.Tensor:
    """(K,) bool: candidate k's footprint, driven along the candidates' common path, reaches into a box (M, 9)
    (BOX_FIELDS, moved at its velocity) within the horizon or during its stop after it.

    Every candidate of the path-speed planner lies on one path: the longest candidate is that path's polyline
    (continued straight past its end), and each candidate is a set of arc lengths along it."""
    if len(boxes) == 0:
        return torch.zeros(len(trajectories), dtype=torch.bool)
    trajectories, boxes = trajectories.float(), boxes.float()
    arcs = candidate_arcs(trajectories)
    extension, moving = stop_after(arcs, deceleration)
    checked = torch.cat([arcs, extension], dim=1)  # (K, T + E)
    counted = torch.cat([torch.ones_like(arcs, dtype=torch.bool), moving], dim=1)
    path = trajectories[arcs[:, -1].argmax()][None]  # (1, T, 2)
    valid = torch.ones(path.shape[:2], dtype=torch.bool)
    ahead = (boxes[:, 0] > 0)[None]  # (1, M)
    hits = torch.zeros(len(trajectories), dtype=torch.bool)
    for offset in FOOTPRINT_DISCS_M:  # the car's whole footprint, disc by disc along the path
        points, _ = resample_by_arc(path, valid, (checked + offset).flatten()[None])
        depth = penetration(points.view(1, *checked.shape, 2), boxes[None], ahead, margin=FOOTPRINT_RADIUS_M)
        hits |= ((depth[0].amax(dim=-1) > 0) & counted).any(dim=-1)
    return hits


def guarded_choice(trajectories: torch.Tensor, scores: torch.Tensor, boxes: torch.Tensor,
                   deceleration: float) -> int:
    """Index of the highest-scoring candidate (K, T, 2) / (K,) that runs into no box (M, 9); if every one does,
    the candidate that travels least."""
    hits = colliding_candidates(trajectories, boxes, deceleration)
    if bool(hits.all()):
        return int(candidate_arcs(trajectories.float())[:, -1].argmin())
    return int(torch.where(hits, torch.full_like(scores.float(), -torch.inf), scores.float()).argmax())
