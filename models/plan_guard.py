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
`guard.deceleration` after it (the label rule of `stack.models.losses._stop_after_horizon`). The
highest-scoring candidate left drives; if none is left, the one that travels least (the hardest braking).

What it does not do: see what the detector misses (a false negative drives on), or replace the planner's own
choice where nothing is detected on the path. Boxes that start behind the rear axle are ignored: what
runs into the ego from behind is not avoided by braking.

**Segmentation support** (`guard.segmentation` > 0, `segmentation_support`): a detection counts only
where the network's own segmentation head also sees a road user, in the central half of the box's image rectangle,
in some camera that sees the box. The two heads are trained on the same frames with separate outputs, so a false
positive of one need not be one of the other (cross-task consistency: Zamir et al., CVPR 2020). On the tiny-drive
DAgger network's tuning drives, the detections that alone overruled the planner with a road-user probability under
0.2 there were 66 of 236 false positives (no road user within 2.5 m) and 2 of 87 true ones, mostly pedestrians
and cyclists either way; the false positives left are mostly real road users placed metres off along the camera
ray, which no image tells apart. Driven (112 tuning episodes), it trades: route completion +0.018, at-fault
collisions +0.018 an episode, PDMS -0.036, driving score +0.011 within noise (BENCHMARKS.md, "Two heads must
agree"); so it is off in the presets, kept for a network whose segmentation sees small road users better.

**Depth support** (`guard.depth` > 0, `depth_support`): a detection counts only where the network's own
depth head puts a surface between the box's near face and its centre, at the cell its centre projects to. Two
fifths of the tiny-drive network's false positives are road users placed short along their own camera rays, where
the depth head may still see the road user behind; driven at 0.1 on 112 tuning episodes it trades as the
segmentation check does (route completion +0.021, collisions +0.027 an episode, PDMS -0.027; BENCHMARKS.md, "Where
the guard's false positives lie"), so it is off in the presets too.

`PlanGuard` carries the guard from one replanning instant of a drive to the next, for two optional rules:

- **Confirmation** (`guard.confirm_below` > 0): a detection scoring below this is braked for only
  once the previous replan saw one where its detected velocity and the ego's odometry put it now; one scoring
  at least this counts at once. ByteTrack (Zhang et al., ECCV 2022) uses low-score detections the same way, to
  continue tracks and never to start one; M-of-N confirmation is the radar trackers' form of it (Blackman,
  "Multiple-Target Tracking with Radar Applications", 1986). On the tiny-drive network, 58 of the 84 boxes the
  guard braked for at scores 0.2-0.25 in 56 tuning episodes had no road user within 2.5 m; 2 of 28 at 0.4 or
  more (BENCHMARKS.md).
- **Restart** (`guard.restart_s` > 0): a behaviour-cloned planner that has stopped tends to stay
  stopped (the inertia problem, Codevilla et al., ICCV 2019), and its data says so (`benchmarks/
  standstill_labels.py`). After the ego has stood this long, if the guard's own choice would still not move,
  the best-scoring candidate that moves and runs into no detection, confirmed or not, drives: TransFuser's
  "creeping" (Chitta et al., TPAMI 2022), which moves a car stuck for long if its safety check finds the way
  clear.

**Room to stop** (`guard.reaction_s` > 0, `braking_after_reaction`): every candidate must also leave the
car able to stop GUARD_STANDOFF_M short of each detection, after following the candidate for the reaction time (one
replanning period plus the latency) and then braking at GUARD_EMERGENCY_DECELERATION: RSS's safe distance (a
response time, then the minimum braking; Shalev-Shwartz, Shammah, Shashua 2017). It is checked both where the
detection's velocity takes it and where it stands now, because the tiny-drive network's velocity of a car standing
in the lane ahead errs towards "driving away" (+0.4 to +3 m/s on the tuning drives' stopped_vehicle episodes), which
the rule above trusts.

**Deferred braking** (`guard.defer_below` > 0, with room to stop on): the rule above brakes for a
detection as soon as it is seen, as if it were sure (the horizon's candidate and a comfortable stop after it must
both stay clear, so one false positive 40 m ahead already slows the car). A detection scoring below this setting is
held to the room-to-stop rule only: it is braked for as late as the car can still stop for it, and since every
replan looks again, a false positive that does not persist never slows the car.
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
CONFIRM_GATE_M = 2.5
"""A detection confirms one of the previous replan's that was predicted to lie within this distance: about three
times the tiny-drive network's mean translation error (mATE 0.71 m)."""
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
    velocity of a standing car ahead errs towards "driving away": BENCHMARKS.md, "Room to stop")."""
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
    """The plan guard over one drive, replan after replan (`guarded_choice` plus the confirmation and restart
    rules of this module's docstring). `choose` starts a new drive by itself when time does not advance."""

    def __init__(self, score: float, deceleration: float, confirm_below: float = 0.0, restart_s: float = 0.0,
                 defer_below: float = 0.0, reaction_s: float = 0.0):
        self.score, self.deceleration = score, deceleration
        self.confirm_below, self.restart_s = confirm_below, restart_s
        self.defer_below, self.reaction_s = defer_below, reaction_s
        self.reset()

    @classmethod
    def from_config(cls, guard) -> PlanGuard:
        """The guard a pipeline's `guard` section (`stack.pipeline.GuardConfig`) asks for."""
        return cls(guard.score, guard.deceleration, guard.confirm_below, guard.restart_s, guard.defer_below,
                   guard.reaction_s)

    def reset(self) -> None:
        self._previous: tuple[torch.Tensor, Odometry] | None = None
        self._standing_since: float | None = None

    def choose(self, trajectories: torch.Tensor, scores: torch.Tensor, boxes: torch.Tensor, box_scores: torch.Tensor,
               odometry: Odometry) -> int:
        """Index of the candidate (K, T, 2) / (K,) to drive, given this replan's detections (M, 9) with their scores
        (M,) and where the ego is."""
        if self._previous is not None and odometry.time_s <= self._previous[1].time_s:
            self.reset()
        keep = box_scores >= self.score
        boxes, box_scores = boxes[keep], box_scores[keep]
        counted = (box_scores >= self.confirm_below) | self._confirmed(boxes, odometry)
        self._previous = (boxes, odometry)
        choice = best_clear(trajectories, scores, self.conflicts(trajectories, boxes[counted], box_scores[counted]))
        return self._restart(choice, trajectories, scores, boxes, box_scores, odometry)

    def conflicts(self, trajectories: torch.Tensor, boxes: torch.Tensor, box_scores: torch.Tensor) -> torch.Tensor:
        """(K,) bool: the candidates that run into a detection (M, 9) scoring at least `defer_below` (every one, with
        `defer_below` 0) or, with `reaction_s` > 0, could not stop short of any one after that reaction time."""
        firm = box_scores >= self.defer_below
        floor = boxes if self.reaction_s else None
        return conflicting_candidates(trajectories, boxes[firm], self.deceleration, floor, self.reaction_s)

    def _confirmed(self, boxes: torch.Tensor, now: Odometry) -> torch.Tensor:
        """(M,) bool: the previous replan saw a box where it predicted this one to be now (every box, on a drive's
        first replan: there is nothing to confirm with)."""
        if self._previous is None:
            return torch.ones(len(boxes), dtype=torch.bool)
        before, then = self._previous
        if len(before) == 0 or len(boxes) == 0:
            return torch.zeros(len(boxes), dtype=torch.bool)
        distance = torch.cdist(boxes[:, :2].float(), _predicted_into(before.float(), then, now))
        return distance.amin(dim=1) <= CONFIRM_GATE_M

    def _restart(self, choice: int, trajectories: torch.Tensor, scores: torch.Tensor, boxes: torch.Tensor,
                 box_scores: torch.Tensor, odometry: Odometry) -> int:
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
        usable = (travel >= RESTART_TRAVEL_M) & ~self.conflicts(trajectories, boxes, box_scores)
        if not bool(usable.any()):
            return choice
        return int(torch.where(usable, scores.float(), torch.full_like(scores.float(), -torch.inf)).argmax())


def _predicted_into(boxes: torch.Tensor, then: Odometry, now: Odometry) -> torch.Tensor:
    """(M, 2) centres of boxes (M, 9) detected in the ego frame at `then`, moved at their velocities to `now` and
    expressed in the ego frame at `now`."""
    def rotation(yaw: float) -> torch.Tensor:
        c, s = math.cos(yaw), math.sin(yaw)
        return torch.tensor([[c, -s], [s, c]])

    dt = now.time_s - then.time_s
    fixed = boxes[:, :2] @ rotation(then.yaw).T + torch.tensor([then.x, then.y])
    fixed = fixed + dt * boxes[:, 7:9] @ rotation(then.yaw).T
    return (fixed - torch.tensor([now.x, now.y])) @ rotation(now.yaw)


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
