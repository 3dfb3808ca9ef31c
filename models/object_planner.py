"""Object-level attention for the path-speed planner: the network's own detections as tokens, read per candidate.

Why: the plan guard (`stack.models.plan_guard`) drives the tiny-drive network past the blind policies by checking
each speed candidate against the decoded detections with hand-set rules (a score threshold, room to stop). What
those rules guess, how far to trust a detection given its score, class, range and motion, is what a planner over
object tokens learns from data: PlanT (Renz et al., CoRL 2022) plans with a transformer over object tokens and,
given true objects, matches the privileged expert. Here the detections are decoded inside the graph (the
heatmap's top peaks after its 3x3 max-pool suppression and the box regression at their cells: a fixed token count
with a validity mask), so the exported ONNX computes the plan end to end and the bundle ships the whole planner.

Each candidate reads the objects through its own geometry: for every waypoint, where each object (moved at its
detected velocity) stands relative to the candidate's waypoint, along and across the path there. A per-pair MLP
scores "this candidate runs into this object", and the candidate's collision term takes their soft maximum
beside a zero for "nothing there" (logsumexp: the most dangerous object decides, as the guard's any-detection rule does, but learned and graded by
score); the candidate also attends the pairs (`scaled_dot_product_attention`, a learned null token so that an empty
road is attended too) for a correction of its imitation term. Both start at zero (a zero gain, a zero last layer),
so a network with this branch starts as the planner without it. The detections enter without a gradient: the
detection loss keeps their meaning. Evidence and figures: docs/model.md ("Object tokens").
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from stack.kinematics import WAYPOINT_STEP_S
from stack.models.decoders import divmod_index, regression_boxes, top_peaks

POSITION_SCALE_M = 32.0
"""Positions and ranges enter divided by this (the tiny BEV's half extent)."""
VELOCITY_SCALE_MPS = 10.0
"""Velocities enter divided by this (the world's speeds are 0-15 m/s)."""
OBJECT_HEADS = 4


class ObjectPlanner(nn.Module):
    """The top `tokens` detections → per speed candidate (B, K, 2) corrections of the imitation and collision
    logits. `steps`: waypoints per candidate; `own` features per candidate (acceleration, ego speed and
    acceleration, as the scorer reads them)."""

    def __init__(self, classes: int, tokens: int, steps: int, bev_ranges: tuple, cell_size: float,
                 min_score: float, width: int = 64, own_features: int = 3):
        super().__init__()
        self.tokens, self.steps, self.classes = tokens, steps, classes
        self.register_buffer("class_ids", torch.arange(classes), persistent=False)  # the one-hot's columns
        (self.x_min, _), (self.y_min, _) = bev_ranges
        self.cell_size = cell_size
        self.min_score = min_score  # peaks below it are masked out: the host decoder's model.score_threshold
        self.token = nn.Sequential(nn.Linear(classes + 12, width), nn.ReLU(inplace=True), nn.Linear(width, width))
        self.pair = nn.Sequential(nn.Linear(2 * steps + 2, width), nn.ReLU(inplace=True), nn.Linear(width, width))
        self.pair_collision = nn.Sequential(nn.ReLU(), nn.Linear(width, 1))
        self.query = nn.Linear(own_features, width)
        # The pairs' soft maximum is scaled by a gain that starts at 0 (ReZero, Bachlechner et al. 2020): the branch
        # starts as the planner without it, and the pair scorer learns once the first step moves the gain.
        self.collision_gain = nn.Parameter(torch.zeros(()))
        self.null = nn.Parameter(torch.zeros(1, 1, width))
        self.out = nn.Sequential(nn.ReLU(), nn.Linear(width, 1))
        nn.init.zeros_(self.out[-1].weight)  # starts as the planner without objects
        nn.init.zeros_(self.out[-1].bias)

    def forward(self, heatmap: torch.Tensor, box_regression: torch.Tensor, points: torch.Tensor,
                directions: torch.Tensor, own: torch.Tensor) -> torch.Tensor:
        """`points` (B, K, T, 2) the candidates' waypoints and `directions` (B, K, T, 2) the path's unit tangent
        there (BEV frame, metres); returns (B, K, 2): imitation and collision logit corrections."""
        boxes, scores, labels = self.detections(heatmap.detach(), box_regression.detach())
        return self.score(boxes, scores, labels, points, directions, own)

    def score(self, boxes: torch.Tensor, scores: torch.Tensor, labels: torch.Tensor, points: torch.Tensor,
              directions: torch.Tensor, own: torch.Tensor) -> torch.Tensor:
        """`forward` from detections (B, N, 9) boxes, (B, N) scores, (B, N) labels: decoded in the graph, or
        object-level states that need no rendering (true objects with a detector's errors)."""
        valid = scores >= self.min_score  # (B, N)
        tokens = self.token(self._token_features(boxes, scores, labels))  # (B, N, W)
        pairs = self.pair(self._pair_features(boxes, points, directions))  # (B, K, N, W)
        keys = tokens[:, None] + pairs
        collision = self.pair_collision(keys)[..., 0].masked_fill(~valid[:, None], float("-inf"))  # (B, K, N)
        nothing = torch.zeros_like(collision[..., :1])  # an empty road corrects nothing, whatever N
        soft_any = self.collision_gain * torch.logsumexp(torch.cat([nothing, collision], dim=-1), dim=-1)
        imitation = self._attend(self.query(own), keys, valid)
        return torch.stack([imitation, soft_any], dim=-1)

    def detections(self, heatmap: torch.Tensor, box_regression: torch.Tensor):
        """(B, N, 9) boxes, (B, N) scores, (B, N) labels of the top `tokens` peaks."""
        scores, labels, cells = top_peaks(heatmap, self.tokens)
        channels, grid_y = box_regression.shape[1], heatmap.shape[-1]
        regression = box_regression.float().flatten(2).gather(2, cells[:, None].expand(-1, channels, -1))
        boxes = regression_boxes(regression.transpose(1, 2), *divmod_index(cells, grid_y), self.x_min, self.y_min,
                                 self.cell_size)
        return boxes, scores, labels

    def _token_features(self, boxes: torch.Tensor, scores: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """(B, N, C + 12): class, score, position, range and bearing (where it sits relative to the cameras),
        log size, heading and velocity."""
        position = boxes[..., :2] / POSITION_SCALE_M
        distance = boxes[..., :2].norm(dim=-1, keepdim=True)
        bearing = boxes[..., :2] / distance.clamp(min=1e-3)
        one_hot = (labels[..., None] == self.class_ids).float()  # ONNX OneHot is not a native TensorRT operator
        return torch.cat([one_hot, scores[..., None], position,
                          distance / POSITION_SCALE_M, bearing, boxes[..., 3:5].clamp(min=1e-2).log(),
                          torch.sin(boxes[..., 6:7]), torch.cos(boxes[..., 6:7]),
                          boxes[..., 7:9] / VELOCITY_SCALE_MPS], dim=-1)

    def _pair_features(self, boxes: torch.Tensor, points: torch.Tensor, directions: torch.Tensor) -> torch.Tensor:
        """(B, K, N, 2T + 2): per waypoint, the object (moved at its velocity to that waypoint's time) relative to
        the candidate's waypoint, along and across the path there; and the object's half length and width."""
        times = WAYPOINT_STEP_S * torch.arange(1, self.steps + 1, dtype=points.dtype, device=points.device)
        moved = boxes[:, None, :, None, :2] + boxes[:, None, :, None, 7:9] * times[:, None]  # (B, 1, N, T, 2)
        offset = moved - points[:, :, None]  # (B, K, N, T, 2)
        tangent = directions[:, :, None]
        along = (offset * tangent).sum(-1)
        across = offset[..., 1] * tangent[..., 0] - offset[..., 0] * tangent[..., 1]
        half = (boxes[..., 3:5] / 2).clamp(max=10.0) / 5.0  # (B, N, 2)
        k = points.shape[1]
        return torch.cat([along / 10.0, across / 10.0, half[:, None].expand(-1, k, -1, -1)], dim=-1)

    def _attend(self, query: torch.Tensor, keys: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
        """(B, K) imitation correction: each candidate's query attends its (object, pair) keys and a null key."""
        b, k, n, width = keys.shape
        null = self.null.expand(b * k, 1, width)
        keys = torch.cat([null, keys.reshape(b * k, n, width)], dim=1)  # (B K, 1 + N, W)
        mask = torch.cat([valid.new_ones(b, 1), valid], dim=1)[:, None].expand(b, k, n + 1).reshape(b * k, 1, n + 1)
        heads = OBJECT_HEADS
        split = width // heads
        q = query.reshape(b * k, 1, heads, split).transpose(1, 2)
        kv = keys.view(b * k, n + 1, heads, split).transpose(1, 2)
        attended = F.scaled_dot_product_attention(q, kv, kv, attn_mask=mask[:, None])  # (B K, H, 1, split)
        attended = attended.transpose(1, 2).reshape(b, k, width)
        return self.out(attended)[..., 0]
