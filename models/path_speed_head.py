"""The path-speed planning head: a path from the scene, then a scored vocabulary of speeds along it.

Why not one regressed trajectory: on our recipe the regression head learned the ego-status
shortcut (its 3-s waypoint reproduced 22-24% of the expert's departures from the rollout on its
own training frames: docs/log/2026-11-25_learning-to-recover.md), and an L2 regression onto one
trajectory averages "stop for the car" and "drive on" into a car that hits the car slowly. Our expert
(`stack.sim.world.interactive`) always follows its route's centre line and chooses only its speed, so its
plan factors exactly into *where* (a path) and *how fast* (a speed profile along it): the path-velocity
decomposition of motion planning (Kant & Zucker, IJRR 1986), used by Apollo's EM planner and by most
production stacks. Each factor gets the form that learns it:

- **Path**: the ego query (ego status + command + learned mode, as `PlanningHead`) attends the BEV
  tokens and regresses heading increments at fixed arc lengths (`model.path_spacing_m`,
  `model.path_points`): a path that does not depend on speed, so a stopped expert's frame does
  not teach a zero-length path and a fast one a long one.
- **Speed**: a vocabulary of constant-acceleration profiles (`model.planning_accelerations`)
  along that path, scored as Hydra-MDP does (Li et al., arXiv:2406.06978): an imitation logit
  per candidate (soft target from the expert's progress) and a collision logit per candidate
  distilled from the ground truth (the candidate's waypoints against the boxes moved at their
  velocities, `stack.metrics.collision`). The score is log p(expert) + w log p(no collision) (w: `model.planning_collision_weight`).
  Each candidate is scored from the BEV features and detection heatmap sampled where it will
  be, as cost-volume planners score trajectories (NMP, Zeng et al., CVPR 2019): whether braking
  is needed is a question about the cells ahead, not about the mean of all tokens.
- **Motion of others** (`model.planning_velocity`): one frame cannot tell a stopped car from a lead
  car (at 15-35 m the expert brakes 2-2.5x as often for the stopped one:
  docs/log/2026-11-26_stopped-vs-lead-car-labels.md). A temporal network's detection head regresses each
  road user's velocity; the scorer then also reads, at every sampled point, that velocity resolved
  along and across the path there, gated by the occupancy: "something ahead on my path that moves
  at 1 m/s" is one feature, not a pattern the scorer must find in 32 BEV channels. The velocity is
  read without a gradient, so it keeps the meaning the detection loss gives it.

Outputs keep the network's contract (`stack.models.outputs`): `plan_trajectories` (B, K, T, 2)
are the K speed candidates along the path, `plan_scores` (B, K) their combined log-scores, so
`decode_plan`, the metrics, export and every policy read it unchanged. The loss reads the
training outputs listed in `TRAINING_OUTPUTS`, which export leaves out.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from stack.kinematics import WAYPOINT_STEP_S, along_path, speed_profile_arcs
from stack.models.bev_heads import PlanningTrunk, rotate_trajectories
from stack.models.object_planner import ObjectPlanner

SAMPLES_PER_STEP = 2
"""Points per waypoint interval at which each candidate reads the BEV (every 0.25 s: at 11 m/s, 2.75 m apart,
closer than a car is long)."""
SAMPLE_FEATURES = 16
"""Channels each sampled BEV point is projected to before the candidate scorer."""
VELOCITY_SCALE_MPS = 10.0
"""Velocities enter the scorer divided by this (the world's speeds are 0-15 m/s)."""
PATH_TANGENT_M = 0.5
"""Arc step of the finite difference that gives the path's direction at each sampled point."""
SCORER_HIDDEN = 128
MAX_REFINEMENT_M = 2.0
"""Largest shift of a candidate's waypoint along the path: anchor + refinement (as anchor-based planners refine
their vocabulary, e.g. DiffusionDrive's truncated anchors, arXiv:2411.15139) lets the plan follow the expert's
speed between the constant-acceleration anchors, while the anchor's collision verdict still describes it."""


class PathSpeedPlanningHead(PlanningTrunk):
    """BEV features + detection heatmap + ego status + command → K speed candidates along one path.

    Each candidate is scored by one shared MLP from what lies where *it* will be: the BEV features, the
    detection heatmap (max-pooled over 3x3 cells, so a road user's centre peak covers its body) and the
    drivable-area map (a 1x1 convolution of the BEV, supervised with the cameras' lifted labels,
    `stack.models.targets.encode_drivable`) sampled along its own waypoints, with its acceleration, the ego
    speed and acceleration, and the ego query. Shared weights see K examples per frame, and "does this
    candidate run into something" becomes a question about K short rows of cells."""

    keep_fp32 = ("path", "drivable", "sample_projection", "scorer", "objects")
    """Children that run in fp32 under mixed precision (as `PlanningHead.keep_fp32`)."""

    def __init__(self, bev_channels: int, heatmap_channels: int, grid: tuple[int, int], bev_ranges: tuple,
                 accelerations: list[float], steps: int, commands: int, path_points: int, path_spacing_m: float,
                 layers: int = 2, width: int = 0, collision_weight: float = 1.0, sample_velocity: bool = False,
                 objects: int = 0, cell_size: float = 1.0, object_min_score: float = 0.1):
        super().__init__(bev_channels, grid, modes=1, commands=commands, layers=layers, width=width)
        self.steps, self.spacing = steps, path_spacing_m
        self.collision_weight = collision_weight
        self.sample_velocity = sample_velocity
        self.x_range, self.y_range = bev_ranges
        self.register_buffer("accelerations", torch.tensor(accelerations, dtype=torch.float32), persistent=False)
        channels = width or bev_channels
        self.path = nn.Linear(channels, path_points)
        nn.init.zeros_(self.path.weight)  # starts straight ahead
        nn.init.zeros_(self.path.bias)
        self.drivable = nn.Conv2d(bev_channels, 1, 1)
        self.sample_projection = nn.Linear(bev_channels + heatmap_channels + 1 + 2 * sample_velocity, SAMPLE_FEATURES)
        samples = steps * SAMPLES_PER_STEP
        self.scorer = nn.Sequential(nn.Linear(samples * SAMPLE_FEATURES + 3 + channels, SCORER_HIDDEN),
                                    nn.ReLU(inplace=True), nn.Linear(SCORER_HIDDEN, SCORER_HIDDEN),
                                    nn.ReLU(inplace=True), nn.Linear(SCORER_HIDDEN, 2 + steps))
        nn.init.zeros_(self.scorer[-1].weight[2:])  # the refinement starts at zero: each candidate is its anchor
        nn.init.zeros_(self.scorer[-1].bias[2:])
        self.objects = ObjectPlanner(heatmap_channels, objects, steps, bev_ranges, cell_size, object_min_score) \
            if objects else None

    def forward(self, bev: torch.Tensor, heatmap: torch.Tensor, ego_status: torch.Tensor, command: torch.Tensor,
                bev_rotation: torch.Tensor | None = None,
                box_regression: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
        """`box_regression` (B, 10, X, Y): the detection head's, read for its velocity when `sample_velocity` and for
        the object tokens' boxes when `objects`."""
        if (self.sample_velocity or self.objects is not None) and box_regression is None:
            raise ValueError("this planner reads the detection head's box regression (model.planning_velocity or "
                             "model.planning_objects): pass box_regression")
        query = self.queries(bev, ego_status, command, bev_rotation)[:, 0]  # (B, C)
        device_type = "cpu" if query.device.type == "meta" else query.device.type
        with torch.autocast(device_type=device_type, enabled=False):  # metres: fp32 (see PlanningHead)
            query, speed = query.float(), ego_status[:, 0].float()
            path = self._path(query, bev_rotation)  # (B, P, 2), in the (possibly rotated) BEV frame
            fine_arcs = speed_profile_arcs(speed, self.accelerations, self.steps * SAMPLES_PER_STEP,
                                           WAYPOINT_STEP_S / SAMPLES_PER_STEP)  # (B, K, T * SAMPLES_PER_STEP)
            anchors = fine_arcs[..., SAMPLES_PER_STEP - 1::SAMPLES_PER_STEP]  # (B, K, T): at the waypoints
            occupancy = F.max_pool2d(heatmap.float(), 3, stride=1, padding=1).sigmoid()
            drivable = self.drivable(bev.float())
            features = torch.cat([bev.float(), occupancy, drivable.sigmoid()], dim=1)
            points = along_path(path.detach(), self.spacing, fine_arcs)  # (B, K, S, 2)
            sampled = self._read(features, points)  # (B, K, S, F)
            if self.sample_velocity:
                tangent = along_path(path.detach(), self.spacing, fine_arcs + PATH_TANGENT_M) - points
                sampled = torch.cat([sampled, self._path_velocity(box_regression, heatmap, points, tangent)], -1)
            sampled = F.relu(self.sample_projection(sampled)).flatten(2)
            k = self.accelerations.shape[0]
            own = torch.stack([self.accelerations.view(1, k).expand(len(speed), k) / 5.0,
                               (speed / 10.0)[:, None].expand(-1, k),
                               (ego_status[:, 1].float() / 5.0)[:, None].expand(-1, k)], dim=-1)
            logits = self.scorer(torch.cat([sampled, own, query[:, None].expand(-1, k, -1)], dim=-1))
            imitation, collision = logits[..., 0], logits[..., 1]
            if self.objects is not None:
                corrections = self.objects(heatmap, box_regression, *self._waypoints(path.detach(), anchors), own)
                imitation, collision = imitation + corrections[..., 0], collision + corrections[..., 1]
            refinement = MAX_REFINEMENT_M * torch.tanh(logits[..., 2:])  # (B, K, T) metres along the path
            candidates = along_path(path, self.spacing, (anchors + refinement).clamp(min=0.0))  # (B, K, T, 2)
            scores = imitation.log_softmax(dim=1) + self.collision_weight * F.logsigmoid(-collision)
        return {"plan_trajectories": candidates, "plan_scores": scores, "plan_path": path,
                "plan_speed_logits": imitation, "plan_collision_logits": collision,
                "plan_arc_refinement": refinement, "plan_drivable_logits": drivable[:, 0]}

    def _waypoints(self, path: torch.Tensor, anchors: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(B, K, T, 2) each anchor's waypoints on the path and (B, K, T, 2) the path's unit direction there."""
        points = along_path(path, self.spacing, anchors)
        tangent = along_path(path, self.spacing, anchors + PATH_TANGENT_M) - points
        return points, tangent / tangent.norm(dim=-1, keepdim=True).clamp(min=1e-6)

    def _path(self, query: torch.Tensor, bev_rotation: torch.Tensor | None) -> torch.Tensor:
        """(B, P, 2): points every `spacing` metres, from heading increments (body frame, then turned by θ)."""
        heading = self.path(query).cumsum(dim=1)
        body = torch.stack([torch.cos(heading), torch.sin(heading)], dim=-1).cumsum(dim=1) * self.spacing
        return body if bev_rotation is None else rotate_trajectories(body, bev_rotation)

    def _path_velocity(self, box_regression: torch.Tensor, heatmap: torch.Tensor, points: torch.Tensor,
                       tangent: torch.Tensor) -> torch.Tensor:
        """(B, K, S, 2): the detected velocity at each point, along and across the path's direction there, times
        the occupancy there.

        The velocity regression is trained at each box's centre cell only (CenterPoint), so it is spread over the
        3x3 cells the max-pooled occupancy covers as a heatmap-weighted mean: the centre's peak dominates, and
        the cells of empty road (occupancy ~0) carry ~0 whatever their regression says."""
        peak = heatmap.detach().float().sigmoid().amax(dim=1, keepdim=True)  # (B, 1, X, Y)
        weighted = F.avg_pool2d(box_regression[:, 8:10].detach().float() * peak, 3, stride=1, padding=1)
        velocity = weighted / F.avg_pool2d(peak, 3, stride=1, padding=1).clamp(min=1e-6)
        gate = F.max_pool2d(peak, 3, stride=1, padding=1)
        sampled = self._read(velocity * gate, points) / VELOCITY_SCALE_MPS  # (B, K, S, 2)
        direction = tangent / tangent.norm(dim=-1, keepdim=True).clamp(min=1e-6)
        along = (sampled * direction).sum(-1)
        across = sampled[..., 1] * direction[..., 0] - sampled[..., 0] * direction[..., 1]
        return torch.stack([along, across], dim=-1)

    def _read(self, features: torch.Tensor, points: torch.Tensor) -> torch.Tensor:
        """(B, K, S, F): `features` (B, F, X, Y) bilinearly sampled at `points` (B, K, S, 2) metres."""
        # grid_sample's grid is (x → last axis, y → first spatial axis); our BEV is (X, Y): Y is the width.
        gx = (points[..., 1] - self.y_range[0]) / (self.y_range[1] - self.y_range[0]) * 2 - 1
        gy = (points[..., 0] - self.x_range[0]) / (self.x_range[1] - self.x_range[0]) * 2 - 1
        sampled = F.grid_sample(features, torch.stack([gx, gy], dim=-1), mode="bilinear", padding_mode="zeros",
                                align_corners=False)  # (B, F, K, S)
        return sampled.permute(0, 2, 3, 1)
