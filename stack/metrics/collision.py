"""Ego waypoints against ground-truth boxes: the shared geometry of the collision loss and metric.

Boxes are the current frame's ground truth moved at their own constant velocity to
each waypoint's time (the data carry no future boxes); the ego is a disc of radius
EGO_RADIUS_M, so a waypoint collides when it lies inside a box inflated by that
radius. The penetration depth is differentiable in the waypoints, which makes it
usable as a soft training penalty as well as a 0/1 metric.
"""

from __future__ import annotations

import torch

from stack.kinematics import WAYPOINT_STEP_S

EGO_RADIUS_M = 0.925
"""Half the width of the ego car (nuScenes' Renault Zoe: 1.85 m)."""
FOOTPRINT_DISCS_M = (-0.05, 1.3, 2.65)
"""Centres (m ahead of the rear axle, along the path) of three discs of radius FOOTPRINT_RADIUS_M that cover
the simulated ego's box (4.6 x 1.9 m, centre 1.3 m ahead of the rear axle: bumpers at -1.0 and +3.6 m).
A waypoint is a rear-axle position: a single disc there lets the front 2.7 m of the car into an obstacle."""
FOOTPRINT_RADIUS_M = 0.95


def penetration(points: torch.Tensor, boxes: torch.Tensor, box_valid: torch.Tensor,
                margin: float = EGO_RADIUS_M, step_s: float = WAYPOINT_STEP_S) -> torch.Tensor:
    """How deep (m, >= 0) each waypoint reaches into each box.

    points (B, ..., T, 2) ego xy at t = (i + 1) * step_s; boxes (B, M, 9) in BOX_FIELDS order;
    box_valid (B, M). Returns (B, ..., T, M); zero outside boxes and for invalid boxes.
    """
    batch, steps = points.shape[0], points.shape[-2]
    flat = points.reshape(batch, -1, steps, 1, 2)
    times = step_s * torch.arange(1, steps + 1, device=points.device, dtype=points.dtype).view(1, 1, steps, 1)
    boxes = boxes.to(points.dtype)
    centre_x = boxes[:, None, None, :, 0] + boxes[:, None, None, :, 7] * times
    centre_y = boxes[:, None, None, :, 1] + boxes[:, None, None, :, 8] * times
    dx, dy = flat[..., 0] - centre_x, flat[..., 1] - centre_y
    cos, sin = torch.cos(boxes[:, None, None, :, 6]), torch.sin(boxes[:, None, None, :, 6])
    along, across = dx * cos + dy * sin, -dx * sin + dy * cos
    depth_along = boxes[:, None, None, :, 3] / 2 + margin - along.abs()
    depth_across = boxes[:, None, None, :, 4] / 2 + margin - across.abs()
    inside = torch.relu(torch.minimum(depth_along, depth_across)) * box_valid[:, None, None, :]
    return inside.reshape(*points.shape[:-1], boxes.shape[1])


def collides(points: torch.Tensor, boxes: torch.Tensor, box_valid: torch.Tensor) -> torch.Tensor:
    """(B, ..., T) bool: the waypoint lies inside any (inflated, moved) box."""
    return (penetration(points, boxes, box_valid) > 0).any(dim=-1)
