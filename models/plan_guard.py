"""The plan guard: the planner's best candidate that does not run into what the network itself detects.

Why: the path-speed planner (`stack.models.path_speed_head`) scores each candidate with a learned collision logit,
trained on few examples of each hazard, while the detection head that sees the same road users is trained on every
box of every frame; alone, the tiny-drive network misses stopped cars its detector sees. As InterFuser's safety
controller (Shao et al., CoRL 2022) and PDM-Closed (Dauner et al., CoRL 2023) check a learned plan against the
scene, the guard reads the network's decoded detections (`decode_detections`), moves them at their detected
velocities and drops every candidate whose footprint reaches one within the horizon or while braking to a stop at
`guard.deceleration` after it; the best-scoring candidate left drives, else the one that travels least. It cannot
see what the detector misses, and ignores boxes that start behind the rear axle (braking does not avoid them).

Its other rules (`stack.pipeline.GuardConfig`, each 0 = off): `guard.reaction_s` keeps room to stop (RSS:
Shalev-Shwartz, Shammah, Shashua 2017; `braking_after_reaction`), also short of where a detection stands now, since
the detected velocity of a car standing ahead errs towards "driving away"; `guard.restart_s` moves on after standing
if the way is clear (TransFuser's creeping, against the inertia problem of Codevilla et al., ICCV 2019);
`guard.segmentation` and `guard.depth` count a detection only where the network's segmentation head sees a road
user there, or its depth head a surface (`segmentation_support`, `depth_support`): off in the presets, as they trade
collisions for progress. The guard's false positives score low: of the detections it overruled the planner for, 58
of 84 at 0.20-0.25 had no road user within 2.5 m, 2 of 27 at 0.40 or more. Evidence: docs/results/closed-loop.md
("The plan guard's settings"), docs/log/2026-11-27_plan-guard.md, 2026-11-27_guard-restart-confirmation.md,
2026-11-29_room-to-stop.md, 2026-11-29_guard-segmentation-check.md, 2026-11-29_guard-false-positives-on-rays.md.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from stack.kinematics import WAYPOINT_STEP_S, resample_by_arc
from stack.metrics.collision import FOOTPRINT_DISCS_M, FOOTPRINT_RADIUS_M, penetration
from stack.pipeline.guard_config import GUARD_EMERGENCY_DECELERATION, GUARD_STANDOFF_M

STOP_STEPS = 8
"""Waypoints (0.5 s apart) of the stop checked after the horizon: 4 s, a stop from 14 m/s at 3.5 m/s^2."""
STOPPED_MPS = 0.5
"""Below this speed the checked stop counts as standing: what runs into a standing ego is not avoided by it."""
REACTION_STEP_S = 0.1
"""Seconds between the instants `braking_after_reaction` checks: the simulation step, so that the last metres
before a stop are not stepped over."""
RESTART_TRAVEL_M = 1.0
"""A candidate that travels less than this over its horizon does not move the ego on (as the blocked infraction and
`benchmarks/standstill_labels.py` count moving on)."""


def candidate_arcs(trajectories: torch.Tensor) -> torch.Tensor:
    """(K, T) distance each candidate (K, T, 2) has travelled at each waypoint, from the origin."""
    steps = torch.cat([trajectories[:, :1], trajectories.diff(dim=1)], dim=1).norm(dim=-1)
    return steps.cumsum(dim=1)


def braking_to_a_stop(end: torch.Tensor, final: torch.Tensor, deceleration: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(..., E) distance travelled and (..., E) bool "still moving" at STOP_STEPS waypoints after a horizon that
    ends at distance `end` (..., 1) with speed `final` (..., 1), braking at `deceleration` m/s^2 to a stop."""
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
    arcs = candidate_arcs(trajectories.float())
    extension, moving = stop_after(arcs, deceleration)
    checked = torch.cat([arcs, extension], dim=1)  # (K, T + E)
    counted = torch.cat([torch.ones_like(arcs, dtype=torch.bool), moving], dim=1)
    return _path_hits(_common_path(trajectories, arcs), checked, counted, boxes, WAYPOINT_STEP_S)


def _common_path(trajectories: torch.Tensor, arcs: torch.Tensor) -> torch.Tensor:
    """(1, T, 2): the longest candidate (K, T, 2), given their arcs (K, T): the path every candidate lies on."""
    return trajectories[arcs[:, -1].argmax()][None].float()


def _path_hits(path: torch.Tensor, checked: torch.Tensor, counted: torch.Tensor, boxes: torch.Tensor,
               step_s: float) -> torch.Tensor:
    """(K,) bool: the ego's footprint at arc lengths `checked` (K, S) along the candidates' common `path` (1, T, 2),
    at t = (i + 1) * step_s, reaches into a box (M, 9) moved at its velocity, at some instant `counted` (K, S)."""
    boxes = boxes.float()
    valid = torch.ones(path.shape[:2], dtype=torch.bool)
    ahead = (boxes[:, 0] > 0)[None]  # (1, M)
    hits = torch.zeros(len(checked), dtype=torch.bool)
    for offset in FOOTPRINT_DISCS_M:  # the car's whole footprint, disc by disc along the path
        points, _ = resample_by_arc(path, valid, (checked + offset).flatten()[None])
        depth = penetration(points.view(1, *checked.shape, 2), boxes[None], ahead, margin=FOOTPRINT_RADIUS_M,
                            step_s=step_s)
        hits |= ((depth[0].amax(dim=-1) > 0) & counted).any(dim=-1)
    return hits


def braking_after_reaction(arcs: torch.Tensor, reaction_s: float, deceleration: float = GUARD_EMERGENCY_DECELERATION
                           ) -> tuple[torch.Tensor, torch.Tensor]:
    """(K, S) distance and (K, S) bool "counted" at t = (i + 1) * REACTION_STEP_S of each candidate (K, T arcs)
    followed for `reaction_s`, then braking at `deceleration` to a stop: RSS's response time and minimum braking
    (Shalev-Shwartz, Shammah, Shashua, "On a Formal Model of Safe and Scalable Self-driving Cars", 2017). While
    it follows the candidate every instant counts; once it brakes, only those it still moves at."""
    knots = torch.cat([arcs.new_zeros(len(arcs), 1), arcs], dim=1)  # (K, T + 1) at 0, 0.5, ... s
    speeds = knots.diff(dim=1) / WAYPOINT_STEP_S  # (K, T): each interval's mean speed
    span = reaction_s + float(speeds.amax().clamp(min=0.0)) / deceleration
    times = REACTION_STEP_S * torch.arange(1, math.ceil(span / REACTION_STEP_S) + 2, dtype=arcs.dtype)

    def follow(at: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        interval = (at / WAYPOINT_STEP_S).floor().long().clamp(max=speeds.shape[1] - 1)  # past the horizon: last
        speed = speeds[:, interval]
        return knots[:, interval] + speed * (at - WAYPOINT_STEP_S * interval), speed

    reached, speed = follow(torch.tensor([reaction_s], dtype=arcs.dtype))
    followed, _ = follow(times)
    braking_s = torch.minimum((times - reaction_s).clamp(min=0.0), speed / deceleration)
    braked = reached + speed * braking_s - 0.5 * deceleration * braking_s ** 2
    braking = times > reaction_s
    moving = speed - deceleration * (times - reaction_s) > STOPPED_MPS
    return torch.where(braking, braked, followed), ~braking | moving


def conflicting_candidates(trajectories: torch.Tensor, boxes: torch.Tensor, deceleration: float,
                           stop_short_of: torch.Tensor | None = None, reaction_s: float = 0.0) -> torch.Tensor:
    """(K,) bool: `colliding_candidates` for `boxes`; and for the boxes (M', 9) `stop_short_of`, a candidate that,
    followed for `reaction_s` and then braked at GUARD_EMERGENCY_DECELERATION (`braking_after_reaction`), would not
    stop GUARD_STANDOFF_M short of where one goes at its detected velocity or of where it stands now (the detected
    velocity of a standing car ahead errs towards "driving away": docs/log/2026-11-29_room-to-stop.md)."""
    hits = colliding_candidates(trajectories, boxes, deceleration)
    if stop_short_of is not None and len(stop_short_of):
        arcs = candidate_arcs(trajectories.float())
        checked, counted = braking_after_reaction(arcs, reaction_s)
        standing = stop_short_of.clone()
        standing[:, 7:9] = 0.0
        moved_and_standing = torch.cat([stop_short_of, standing])
        hits |= _path_hits(_common_path(trajectories, arcs), checked + GUARD_STANDOFF_M, counted, moved_and_standing,
                           REACTION_STEP_S)
    return hits


def guarded_choice(trajectories: torch.Tensor, scores: torch.Tensor, boxes: torch.Tensor,
                   deceleration: float) -> int:
    """Index of the highest-scoring candidate (K, T, 2) / (K,) that runs into no box (M, 9); if every one does, the
    candidate that travels least."""
    return best_clear(trajectories, scores, colliding_candidates(trajectories, boxes, deceleration))


def best_clear(trajectories: torch.Tensor, scores: torch.Tensor, hits: torch.Tensor) -> int:
    """Index of the highest-scoring candidate (K, T, 2) / (K,) not in `hits` (K,); if all are, the one that travels
    least (the hardest braking)."""
    if bool(hits.all()):
        return int(_travel(trajectories).argmin())
    return int(torch.where(hits, torch.full_like(scores.float(), -torch.inf), scores.float()).argmax())


def _travel(trajectories: torch.Tensor) -> torch.Tensor:
    """(K,) distance each candidate (K, T, 2) travels over its horizon."""
    return candidate_arcs(trajectories.float())[:, -1]


@dataclass(frozen=True)
class Odometry:
    """The ego at a replanning instant: its rear-axle pose in a frame fixed for the drive (a car's odometry
    frame; the simulated world's), and its speed."""

    time_s: float
    x: float
    y: float
    yaw: float
    speed: float


class PlanGuard:
    """The plan guard over one drive, replan after replan (`guarded_choice` plus room to stop and the restart rule of
    this module's docstring). `choose` starts a new drive by itself when time does not advance."""

    def __init__(self, score: float, deceleration: float, restart_s: float = 0.0, reaction_s: float = 0.0):
        self.score, self.deceleration = score, deceleration
        self.restart_s, self.reaction_s = restart_s, reaction_s
        self.reset()

    @classmethod
    def from_config(cls, guard) -> PlanGuard:
        """The guard a pipeline's `guard` section (`stack.pipeline.GuardConfig`) asks for."""
        return cls(guard.score, guard.deceleration, guard.restart_s, guard.reaction_s)

    def reset(self) -> None:
        self._last_time_s: float | None = None
        self._standing_since: float | None = None

    def choose(self, trajectories: torch.Tensor, scores: torch.Tensor, boxes: torch.Tensor, box_scores: torch.Tensor,
               odometry: Odometry) -> int:
        """Index of the candidate (K, T, 2) / (K,) to drive, given this replan's detections (M, 9) with their scores
        (M,) and where the ego is."""
        if self._last_time_s is not None and odometry.time_s <= self._last_time_s:
            self.reset()
        self._last_time_s = odometry.time_s
        boxes = boxes[box_scores >= self.score]
        choice = best_clear(trajectories, scores, self.conflicts(trajectories, boxes))
        return self._restart(choice, trajectories, scores, boxes, odometry)

    def conflicts(self, trajectories: torch.Tensor, boxes: torch.Tensor) -> torch.Tensor:
        """(K,) bool: the candidates that run into a detection (M, 9) or, with `reaction_s` > 0, could not stop short
        of one after that reaction time."""
        return conflicting_candidates(trajectories, boxes, self.deceleration, boxes if self.reaction_s else None,
                                      self.reaction_s)

    def _restart(self, choice: int, trajectories: torch.Tensor, scores: torch.Tensor, boxes: torch.Tensor,
                 odometry: Odometry) -> int:
        """`choice`, or after `restart_s` standing the best-scoring candidate that moves on and hits nothing."""
        if odometry.speed >= STOPPED_MPS:
            self._standing_since = None
            return choice
        if self._standing_since is None:
            self._standing_since = odometry.time_s
        travel = _travel(trajectories)
        if (not self.restart_s or odometry.time_s - self._standing_since < self.restart_s
                or travel[choice] >= RESTART_TRAVEL_M):
            return choice
        usable = (travel >= RESTART_TRAVEL_M) & ~self.conflicts(trajectories, boxes)
        if not bool(usable.any()):
            return choice
        return int(torch.where(usable, scores.float(), torch.full_like(scores.float(), -torch.inf)).argmax())


SUPPORT_IN_FRONT_M = 0.5
"""A box corner nearer the camera plane than this does not count as seen by that camera."""
SUPPORT_EXTENT = 0.5
"""The share of a box's image rectangle, around its centre's projection, `segmentation_support` reads: the centre
cell alone (0) dropped the most false positives on the tuning drives and also the most real pedestrians (under one
8-pixel cell at 15 m), the whole rectangle (1) reaches past the box to the road users beside it
(`benchmarks/guard_overrides.py`)."""


def box_corners(boxes: torch.Tensor) -> torch.Tensor:
    """(M, 8, 3) corners of boxes (M, 9) in BOX_FIELDS order (centre x, y, z; length, width, height; yaw)."""
    signs = torch.tensor([[sx, sy, sz] for sx in (-0.5, 0.5) for sy in (-0.5, 0.5) for sz in (-0.5, 0.5)],
                         dtype=boxes.dtype)
    local = signs[None] * boxes[:, None, 3:6]  # (M, 8, 3)
    cos, sin = torch.cos(boxes[:, 6:7]), torch.sin(boxes[:, 6:7])
    x = boxes[:, None, 0] + local[..., 0] * cos - local[..., 1] * sin
    y = boxes[:, None, 1] + local[..., 0] * sin + local[..., 1] * cos
    return torch.stack([x, y, boxes[:, None, 2] + local[..., 2]], dim=-1)


def _image_regions(boxes: torch.Tensor, intrinsics: torch.Tensor, cam_to_ego: torch.Tensor,
                   image_size: tuple[int, int], cells: tuple[int, int], extent: float):
    """Where each box (M, 9) lies in each camera's map of `cells` (h, w) cells: yields (camera, box index, rows,
    columns, near_m, centre_m) for every camera that sees all the box's corners in front of it and every box whose
    central `extent` of its image rectangle (0: the cell its centre projects to) overlaps that camera's map, with
    the camera-frame depth of the box's nearest corner and of its centre."""
    height, width = image_size
    cells_y, cells_x = cells
    scale = torch.tensor([cells_x / width, cells_y / height])
    points = torch.cat([box_corners(boxes.float()), boxes[:, None, :3].float()], dim=1)  # (M, 9, 3): centre last
    homogeneous = torch.cat([points, torch.ones_like(points[..., :1])], dim=-1)
    for camera in range(len(intrinsics)):
        in_camera = (homogeneous @ torch.linalg.inv(cam_to_ego[camera].float()).T)[..., :3]  # (M, 9, 3)
        seen = (in_camera[..., 2] > SUPPORT_IN_FRONT_M).all(dim=1)
        projected = (in_camera @ intrinsics[camera].float().T)
        projected = projected[..., :2] / projected[..., 2:].clamp(min=1e-3) * scale  # (M, 9, 2) in cells
        centre, low, high = projected[:, 8], projected[:, :8].amin(dim=1), projected[:, :8].amax(dim=1)
        low, high = centre + extent * (low - centre), centre + extent * (high - centre)
        first, last = low.floor().long(), high.floor().long() + 1  # the cells the region touches, end exclusive
        first = torch.maximum(first, torch.zeros_like(first))
        last = torch.minimum(last, torch.tensor([cells_x, cells_y]))
        for m in torch.nonzero(seen & (last > first).all(dim=1)).flatten().tolist():  # the region is in this image
            (left, top), (right, bottom) = first[m].tolist(), last[m].tolist()
            yield (camera, m, slice(top, bottom), slice(left, right), float(in_camera[m, :8, 2].min()),
                   float(in_camera[m, 8, 2]))


def segmentation_support(boxes: torch.Tensor, thing_probs: torch.Tensor, intrinsics: torch.Tensor,
                         cam_to_ego: torch.Tensor, image_size: tuple[int, int],
                         extent: float = SUPPORT_EXTENT) -> torch.Tensor:
    """(M,) how strongly the network's own segmentation sees a road user where each detected box (M, 9) lies: the
    highest probability of a road-user class (car, truck, pedestrian, cyclist: `thing_probs` (N, h, w), one map a
    camera at the segmentation stride) in the central `extent` of the box's image rectangle (0: the cell its centre
    projects to), over the cameras that see all its corners in front of them; 1.0 for a box no camera sees (nothing
    to check it against)."""
    if len(boxes) == 0:
        return torch.zeros(0)
    support = torch.full((len(boxes),), -1.0)
    for camera, m, rows, columns, _, _ in _image_regions(boxes, intrinsics, cam_to_ego, image_size,
                                                         tuple(thing_probs.shape[-2:]), extent):
        support[m] = max(float(support[m]), float(thing_probs[camera, rows, columns].max()))
    return torch.where(support < 0, torch.ones_like(support), support)


DEPTH_MARGIN_BINS = 1.0
"""`depth_support`'s window reaches this many depth bins beyond the box's nearest corner and its centre: a
pixel of the box shows its surface, between the two, and the target bins round down (`encode_depth`)."""


DEPTH_SUPPORT_EXTENT = 0.0
"""`depth_support` reads the cell a box's centre projects to: over the central half of its image rectangle the cells
below the box see the road in front of it, at the depths between its near face and its centre, and support every
box standing on a road (3 of 229 false positives dropped at 0.05 on the tiny-drive DAgger network's tuning drives,
against 46 at the centre cell; `benchmarks/guard_overrides.py`)."""


def depth_support(boxes: torch.Tensor, depth_probs: torch.Tensor, depth_edges: tuple[float, float],
                  intrinsics: torch.Tensor, cam_to_ego: torch.Tensor, image_size: tuple[int, int],
                  extent: float = DEPTH_SUPPORT_EXTENT) -> torch.Tensor:
    """(M,) how strongly the network's own depth head puts a surface where each detected box (M, 9) lies along the
    camera ray: the highest probability mass, over the cells of the central `extent` of the box's image rectangle
    (0: the cell its centre projects to) in the cameras that see it, of the depth bins between its nearest corner
    and its centre (widened by DEPTH_MARGIN_BINS each way). `depth_probs` (N, D, h, w) are each camera's depth-bin
    probabilities at the lift stride over `depth_edges` (min_m, max_m); 1.0 for a box no camera sees. A detection
    placed nearer along a road user's ray than the road user (the depth head seeing the road user behind it) gets
    little."""
    if len(boxes) == 0:
        return torch.zeros(0)
    bins = depth_probs.shape[1]
    low_m, high_m = depth_edges
    width_m = (high_m - low_m) / bins
    support = torch.full((len(boxes),), -1.0)
    for camera, m, rows, columns, near_m, centre_m in _image_regions(
            boxes, intrinsics, cam_to_ego, image_size, tuple(depth_probs.shape[-2:]), extent):
        first = max(int(math.floor((near_m - low_m) / width_m - DEPTH_MARGIN_BINS)), 0)
        last = min(int(math.floor((centre_m - low_m) / width_m + DEPTH_MARGIN_BINS)) + 1, bins)
        mass = depth_probs[camera, first:last, rows, columns].sum(dim=0) if last > first else torch.zeros(1)
        support[m] = max(float(support[m]), float(mass.max()))
    return torch.where(support < 0, torch.ones_like(support), support)
