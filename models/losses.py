"""The multi-task loss: detection, depth, segmentation and planning terms, weighted from config.

- detection: CenterNet's Gaussian focal loss on the heatmap (arXiv:1904.07850) +
  L1 on the box regression at GT centre cells (CenterPoint weights: velocity 0.2,
  regression 0.25 of the heatmap term);
- depth: cross entropy over depth bins (BEVDepth), unknown depth ignored;
- segmentation: cross entropy, IGNORE_INDEX pixels ignored;
- planning: winner-takes-all L2 over the K modes (best mode by mean L2 over valid
  waypoints), cross entropy pushing the mode scores to that winner, and a soft
  collision penalty — the squared penetration of the winner's waypoints into the GT
  boxes (`stack.metrics.collision`), so gradients push the plan out of boxes.

Every term is averaged so its scale does not depend on batch size or box count.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from stack.batch import IGNORE_INDEX, Batch
from stack.kinematics import arc_lengths, resample_by_arc, speed_profile_arcs
from stack.metrics.collision import FOOTPRINT_DISCS_M, FOOTPRINT_RADIUS_M, penetration
from stack.models.bev_heads import REGRESSION_FIELDS
from stack.models.targets import downsample_labels, encode_depth, encode_detections, encode_drivable
from stack.ops.bev_pool import grid_cells
from stack.pipeline import Pipeline

BOX_LOSS_WEIGHT = 0.25
COLLISION_LOSS_WEIGHT = 1.0
SPEED_TEMPERATURE_M = 1.0
"""Soft imitation target of the speed candidates: a candidate 1 m further from the expert's progress (mean over
the horizon) gets e^-1 of the weight."""


def focal_heatmap_loss(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """CenterNet focal loss (alpha 2, beta 4), normalised by the number of centre cells."""
    logits = logits.float()
    positive = target.eq(1).float()
    log_p, log_not_p = F.logsigmoid(logits), F.logsigmoid(-logits)
    p = torch.sigmoid(logits)
    pos = log_p * (1 - p) ** 2 * positive
    neg = log_not_p * p**2 * (1 - target) ** 4 * (1 - positive)
    return -(pos.sum() + neg.sum()) / positive.sum().clamp(min=1)


def masked_cross_entropy(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Mean cross entropy over labelled pixels; 0 (not NaN) when every pixel is IGNORE_INDEX.

    `target` may be the Batch's narrow uint8 labels: it is widened here, on the device."""
    target = target.long()
    summed = F.cross_entropy(logits, target, ignore_index=IGNORE_INDEX, reduction="sum")
    return summed / (target != IGNORE_INDEX).sum().clamp(min=1)


def regression_weights(velocity: float) -> tuple[float, ...]:
    """L1 weight of each box-regression field (REGRESSION_FIELDS): CenterPoint's code_weights, 1 for every field
    but vx and vy, which get `model.loss_weights.velocity`."""
    return tuple(velocity if field in ("vx", "vy") else 1.0 for field in REGRESSION_FIELDS)


def detection_loss(outputs, batch: Batch, pipeline: Pipeline) -> dict[str, torch.Tensor]:
    model = pipeline.model
    targets = encode_detections(batch.boxes, batch.box_labels, len(model.detection_classes), model.bev,
                                grid_cells(model.bev))
    heatmap = focal_heatmap_loss(outputs["heatmap"], targets.heatmap)
    regression = outputs["box_regression"].float().flatten(2)  # (B, 10, X*Y)
    index = targets.cell_index[:, None, :].expand(-1, regression.shape[1], -1)
    predicted = regression.gather(2, index).transpose(1, 2)  # (B, M, 10)
    weights = predicted.new_tensor(regression_weights(model.loss_weights.velocity))
    error = (predicted - targets.regression).abs() * weights * targets.valid[..., None]
    box = error.sum() / targets.valid.sum().clamp(min=1)
    losses = {"det_heatmap": heatmap, "det_box": box, "detection": heatmap + BOX_LOSS_WEIGHT * box}
    if "attribute_logits" in outputs:
        losses["det_attribute"] = attribute_loss(outputs["attribute_logits"], batch, targets)
        losses["detection"] = losses["detection"] + model.loss_weights.attributes * losses["det_attribute"]
    return losses


def attribute_loss(logits: torch.Tensor, batch: Batch, targets) -> torch.Tensor:
    """Cross entropy of the attribute logits (B, A, X, Y) at each box's centre cell, over the boxes on the grid
    that carry an attribute (`Batch.box_attributes`; none: a zero that keeps the graph)."""
    labels = batch.box_attributes if batch.box_attributes is not None else torch.full_like(batch.box_labels, -1)
    flat = logits.float().flatten(2)  # (B, A, X*Y)
    at_centres = flat.gather(2, targets.cell_index[:, None, :].expand(-1, flat.shape[1], -1)).transpose(1, 2)
    labelled = targets.valid & (labels >= 0)
    if not labelled.any():
        return at_centres.sum() * 0.0
    return F.cross_entropy(at_centres[labelled], labels[labelled])


def depth_loss(outputs, batch: Batch, pipeline: Pipeline) -> torch.Tensor:
    """Depth-bin cross entropy over labelled pixels; road users' pixels weigh 1 + `loss_weights.depth_road_users`
    (the weighted mean: the loss keeps its scale whatever the weight)."""
    model = pipeline.model
    target = encode_depth(batch.depth.float(), model.feature_stride, model.depth).flatten(0, 1)
    logits = outputs["depth_logits"].float().flatten(0, 1)  # (B*N, D, h, w)
    extra = model.loss_weights.depth_road_users
    if not extra:
        return masked_cross_entropy(logits, target)
    target = target.long()
    entropy = F.cross_entropy(logits, target, ignore_index=IGNORE_INDEX, reduction="none")
    classes = downsample_labels(batch.semantic, model.feature_stride).flatten(0, 1).long()
    weight = 1.0 + extra * torch.isin(classes, torch.tensor(model.road_user_classes(), device=classes.device)).float()
    weight = weight * (target != IGNORE_INDEX).float()
    return (entropy * weight).sum() / weight.sum().clamp(min=1)


def segmentation_loss(outputs, batch: Batch, pipeline: Pipeline) -> torch.Tensor:
    target = downsample_labels(batch.semantic, pipeline.model.segmentation_stride)
    logits = outputs["seg_logits"].float().flatten(0, 1)
    return masked_cross_entropy(logits, target.flatten(0, 1))


def planning_loss(outputs, batch: Batch, model=None) -> dict[str, torch.Tensor]:
    """`model` (ModelConfig) is needed for the path-speed planner's outputs only."""
    if "plan_path" in outputs:
        return path_speed_loss(outputs, batch, model)
    trajectories = outputs["plan_trajectories"].float()  # (B, K, T, 2)
    valid = batch.future_valid.float()  # (B, T)
    error = (trajectories - batch.future_trajectory[:, None]).norm(dim=-1)  # (B, K, T)
    per_mode = (error * valid[:, None]).sum(-1) / valid.sum(-1, keepdim=True).clamp(min=1)
    best = per_mode.argmin(dim=1)
    l2 = per_mode.gather(1, best[:, None]).mean()
    classification = F.cross_entropy(outputs["plan_scores"].float(), best)
    winner = trajectories[torch.arange(len(best), device=best.device), best]  # (B, T, 2)
    depth = penetration(winner, batch.boxes, batch.box_labels >= 0)  # (B, T, M)
    collision = (depth.square().sum(-1) * valid).sum() / valid.sum().clamp(min=1)
    total = l2 + classification + COLLISION_LOSS_WEIGHT * collision
    return {"plan_l2": l2, "plan_cls": classification, "plan_collision": collision, "planning": total}


def path_speed_loss(outputs, batch: Batch, model) -> dict[str, torch.Tensor]:
    """The path-speed planner's terms (`stack.models.path_speed_head`).

    - plan_path: L1 between the path and the expert's future read at the same arc lengths, over the
      stretch the expert actually drives (a stopping expert says nothing about the path beyond);
    - plan_speed: cross entropy against the soft imitation target of `speed_candidate_targets`;
    - plan_refine: `refinement_loss`, the target candidate's waypoints against the expert's progress;
    - plan_collision: binary cross entropy against its collision labels;
    - plan_drivable: binary cross entropy of the drivable-area map on the cells the cameras see the ground of
      (`encode_drivable`).
    """
    path = outputs["plan_path"].float()
    arcs = model.path_spacing_m * torch.arange(1, path.shape[1] + 1, device=path.device, dtype=torch.float32)
    expert_path, driven = resample_by_arc(batch.future_trajectory.float(), batch.future_valid, arcs, _forward(batch))
    path_l1 = ((path - expert_path).abs().sum(-1) * driven).sum() / driven.sum().clamp(min=1)
    anchors, expert = _progress(batch, model.planning_accelerations)
    target, hits = _speed_labels(batch, anchors, expert)
    speed = -(target * outputs["plan_speed_logits"].float().log_softmax(dim=1)).sum(1).mean()
    refine = refinement_loss(outputs["plan_arc_refinement"].float(), target.argmax(dim=1), anchors, expert,
                             batch.future_valid)
    collision = F.binary_cross_entropy_with_logits(outputs["plan_collision_logits"].float(), hits.float())
    drivable_logits = outputs["plan_drivable_logits"].float()
    drivable, known = encode_drivable(batch.depth, batch.semantic, batch.intrinsics, batch.cam_to_ego,
                                      model.segmentation_classes, model.bev, tuple(drivable_logits.shape[1:]))
    drivable_bce = (F.binary_cross_entropy_with_logits(drivable_logits, drivable, reduction="none") * known).sum() \
        / known.sum().clamp(min=1)
    total = path_l1 + speed + refine + collision + drivable_bce
    return {"plan_path": path_l1, "plan_speed": speed, "plan_refine": refine, "plan_collision": collision,
            "plan_drivable": drivable_bce, "planning": total}


def refinement_loss(refinement: torch.Tensor, best: torch.Tensor, anchors: torch.Tensor, expert: torch.Tensor,
                    valid: torch.Tensor) -> torch.Tensor:
    """L1 (m) between the expert's distance travelled at each valid waypoint (`expert` (B, T)) and the imitation
    target's candidate (`best`, (B,)) after its refinement (B, K, T) of its anchor (B, K, T): winner-takes-all,
    as multi-modal regression heads train only the mode that matches (the others keep their anchors' meaning)."""
    rows = torch.arange(len(best), device=best.device)
    refined = (anchors[rows, best] + refinement[rows, best]).clamp(min=0.0)
    error = (refined - expert).abs() * valid
    return error.sum() / valid.sum().clamp(min=1)


def speed_candidate_targets(batch: Batch, accelerations) -> tuple[torch.Tensor, torch.Tensor]:
    """Per speed candidate: (B, K) soft imitation target and (B, K) bool collision label.

    Imitation: softmax(-d / SPEED_TEMPERATURE_M), d the mean gap (m) between the candidate's progress and the
    expert's over the valid waypoints (Hydra-MDP's target). Collision: the car's footprint (FOOTPRINT_DISCS_M),
    driven by the candidate along the *expert's* path (continued straight past where the expert stopped),
    reaches into a ground-truth box moved at its velocity at some valid waypoint: the label is the world's,
    whatever path the network drew."""
    return _speed_labels(batch, *_progress(batch, accelerations))


def _progress(batch: Batch, accelerations) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, K, T) distance each acceleration anchor travels, (B, T) distance the expert travels, per waypoint."""
    future, valid = batch.future_trajectory.float(), batch.future_valid
    return speed_profile_arcs(batch.ego_status[:, 0], _as_tensor(accelerations, future), valid.shape[1]), \
        arc_lengths(future, valid)


def _as_tensor(accelerations, like: torch.Tensor) -> torch.Tensor:
    return torch.as_tensor(list(accelerations), dtype=torch.float32, device=like.device)


def _speed_labels(batch: Batch, anchors: torch.Tensor, expert: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`speed_candidate_targets` from the anchors' and the expert's progress."""
    future, valid = batch.future_trajectory.float(), batch.future_valid
    mask = valid.float()[:, None]
    gap = ((anchors - expert[:, None]).abs() * mask).sum(-1) / mask.sum(-1).clamp(min=1)
    checked, counted = anchors, mask.expand_as(anchors)
    hits = torch.zeros_like(gap, dtype=torch.bool)
    for offset in FOOTPRINT_DISCS_M:  # the car's whole footprint, disc by disc along the expert's path
        along_expert, _ = resample_by_arc(future, valid, (checked + offset).flatten(1), _forward(batch))
        depth = penetration(along_expert.view(*checked.shape, 2), batch.boxes, batch.box_labels >= 0,
                            margin=FOOTPRINT_RADIUS_M)
        hits |= (depth.amax(dim=-1) * counted > 0).any(dim=-1)
    return (-gap / SPEED_TEMPERATURE_M).softmax(dim=1), hits


def _forward(batch: Batch) -> torch.Tensor:
    """(B, 2): the body's +x in the batch's (BEV-augmented) frame."""
    angle = batch.bev_rotation.float()
    return torch.stack([torch.cos(angle), torch.sin(angle)], dim=-1)


def multitask_loss(outputs: dict[str, torch.Tensor], batch: Batch, pipeline: Pipeline) -> dict[str, torch.Tensor]:
    """All terms, the four task losses, and `total` = sum of task loss x model.loss_weights.<task>."""
    terms = {**detection_loss(outputs, batch, pipeline), **planning_loss(outputs, batch, pipeline.model)}
    terms["depth"] = depth_loss(outputs, batch, pipeline)
    terms["segmentation"] = segmentation_loss(outputs, batch, pipeline)
    weights = pipeline.model.loss_weights
    terms["total"] = sum(getattr(weights, task) * terms[task]
                         for task in ("detection", "depth", "segmentation", "planning"))
    return terms
