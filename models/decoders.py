"""Decoders: the network's raw outputs → boxes, metric depth, class maps and one plan.

These run after the network (outside the exported graph), so they may use
data-dependent control flow. Detection decoding is CenterPoint's: sigmoid heatmap,
3x3 max-pool peak extraction, top-k over classes x cells, box fields from the
regression map at each peak, score threshold, then per-class BEV NMS: torchvision's
`batched_nms` on each box's axis-aligned BEV footprint, or, with
`model.circle_nms_radius_m`, CenterPoint's circle NMS (Yin et al., "Center-based 3D
Object Detection and Tracking", CVPR 2021), which suppresses by centre distance and
so does not depend on box sizes that a camera network estimates poorly.

Why the NMS is here and not in the exported graph: the graph ends at the dense head
maps (`models/outputs.py`, the layout its metadata promises), and every runtime
(PyTorch for `stack eval`, ONNX Runtime in deploy's gates and `stack drive`) decodes
them with this module on the host; there is no box post-processing in the graph for
an NMS to join. `circle_nms` is written in fixed shapes and TensorRT's native ONNX
operators (tests export it and check both), so it moves into the graph unchanged if
decoding ever does.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from stack.ops.bev_pool import depth_bin_centres
from stack.pipeline import Pipeline
from stack.models.image_heads import expected_depth


@dataclass
class Detections:
    """Decoded boxes of one sample; all fields share the first dimension n."""

    boxes: torch.Tensor
    """(n, 9) float32 in BOX_FIELDS order (ego frame, metres, radians, m/s)."""
    scores: torch.Tensor
    """(n,) float32 in [0, 1], descending."""
    labels: torch.Tensor
    """(n,) int64 index into model.detection_classes."""
    attributes: torch.Tensor | None = None
    """(n,) int64 index into `stack.metrics.detection.ATTRIBUTES` (-1: the class has none); None: the network
    predicts no attributes (no model.attribute_head), which the metrics score as the devkit does such a box."""


def boxes_from_regression(regression: torch.Tensor, cell_x: torch.Tensor, cell_y: torch.Tensor,
                          pipeline: Pipeline) -> torch.Tensor:
    """Box fields (n, 9) from regression vectors (n, 10) found at cells (cell_x, cell_y)."""
    bev = pipeline.model.bev
    return regression_boxes(regression, cell_x, cell_y, bev.x_range[0], bev.y_range[0], bev.cell_size)


def regression_boxes(regression: torch.Tensor, cell_x: torch.Tensor, cell_y: torch.Tensor, x_min: float,
                     y_min: float, cell_size: float) -> torch.Tensor:
    """Box fields (..., 9) from regression vectors (..., 10) at cells (...) of a BEV grid starting at (x_min,
    y_min): CenterPoint's offsets, height, log size, (sin, cos) yaw and velocity. Plain tensor ops, so the
    exported planner decodes its object tokens in the graph (`stack.models.object_planner`)."""
    x = x_min + (cell_x + regression[..., 0]) * cell_size
    y = y_min + (cell_y + regression[..., 1]) * cell_size
    size = regression[..., 3:6].clamp(max=10.0).exp()
    yaw = torch.atan2(regression[..., 6], regression[..., 7])
    return torch.stack([x, y, regression[..., 2], size[..., 0], size[..., 1], size[..., 2], yaw,
                        regression[..., 8], regression[..., 9]], dim=-1)


def bev_footprint_xyxy(boxes: torch.Tensor) -> torch.Tensor:
    """Axis-aligned BEV rectangle (x1, y1, x2, y2) enclosing each rotated box (n, 9)."""
    cos, sin = torch.cos(boxes[:, 6]).abs(), torch.sin(boxes[:, 6]).abs()
    half_x = (boxes[:, 3] * cos + boxes[:, 4] * sin) / 2
    half_y = (boxes[:, 3] * sin + boxes[:, 4] * cos) / 2
    return torch.stack([boxes[:, 0] - half_x, boxes[:, 1] - half_y, boxes[:, 0] + half_x, boxes[:, 1] + half_y], -1)


def circle_nms(centres: torch.Tensor, scores: torch.Tensor, labels: torch.Tensor, radii: torch.Tensor) -> torch.Tensor:
    """Keep mask (n,) of CenterPoint's circle NMS over boxes with BEV `centres` (n, 2), `scores` (n,), class
    `labels` (n,) and a radius in metres per class (`radii` (C,)): greedily in descending score (ties: lower index
    first), each kept box suppresses the boxes of its class whose centres lie within its class's radius (distance
    <= radius; CenterPoint's `circle_nms` in det3d/core/utils/circle_nms_jit.py, whose `min_radius` is the radius
    squared, and which lets any class suppress any class of its task head: here each class is its own).

    Greedy NMS without a loop over boxes: with S[i, j] = "i ranks before j, same class, within the radius",
    keep[j] = no kept i with S[i, j]. Iterating that map from all-kept settles one more box in score order per
    round (a box depends only on the boxes ranked before it), so n rounds reach the greedy answer, and so does any
    round that changes nothing (the map's fixed point is unique). Host runs stop at that round; a traced export
    unrolls all n (MatMul and comparisons only)."""
    count = scores.shape[0]
    index = torch.arange(count, device=scores.device)
    ahead = (scores[:, None] > scores[None, :]) | ((scores[:, None] == scores[None, :]) & (index[:, None] < index[None, :]))
    near = ((centres[:, None, :] - centres[None, :, :]) ** 2).sum(-1) <= (radii[labels] ** 2)[None, :]
    suppresses = (ahead & near & (labels[:, None] == labels[None, :])).to(centres.dtype)
    keep = torch.ones(count, dtype=torch.bool, device=scores.device)
    tracing = torch.jit.is_tracing() or torch.onnx.is_in_onnx_export()
    for _ in range(count):
        settled = (keep.to(centres.dtype)[None, :] @ suppresses)[0] == 0
        if not tracing and torch.equal(settled, keep):
            break
        keep = settled
    return keep


def _suppress(boxes: torch.Tensor, score: torch.Tensor, label: torch.Tensor, model) -> torch.Tensor:
    """Indices of the boxes NMS keeps, in descending score: circle NMS with the model's radii, else IoU NMS."""
    from torchvision.ops import batched_nms

    if not model.circle_nms_radius_m:
        return batched_nms(bev_footprint_xyxy(boxes), score, label, model.nms_iou)
    radii = boxes.new_tensor([model.circle_nms_radius_m[name] for name in model.detection_classes])
    order = torch.argsort(score, descending=True, stable=True)
    return order[circle_nms(boxes[order, :2], score[order], label[order], radii)]


@torch.no_grad()
def top_peaks(heatmap: torch.Tensor, count: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(B, N) scores, (B, N) class labels and (B, N) flat cell indices of the `count` highest heatmap peaks (a cell
    that is the maximum of its 3x3 neighbourhood in its class): a fixed count, so the exported planner's object
    tokens (`stack.models.object_planner`) have static shapes; `decode_detections` starts from the same peaks."""
    heat = heatmap.float().sigmoid()
    batch, classes, grid_x, grid_y = heat.shape
    peaks = heat * (F.max_pool2d(heat, 3, stride=1, padding=1) == heat).to(heat.dtype)
    scores, flat = peaks.flatten(1).topk(min(count, classes * grid_x * grid_y), dim=1)
    return (scores, *divmod_index(flat, grid_x * grid_y))


def divmod_index(index: torch.Tensor, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(index // size, index % size) of a non-negative integer tensor, written with Div, Mul and Sub: ONNX's Mod is
    not among TensorRT's native operators (`stack.deploy.trt_ops`), and these peaks run inside the exported graph.
    Truncating division (one Div) equals floor division here; the exporter writes floor division of integers with
    a Mod to correct negative quotients."""
    quotient = torch.div(index, size, rounding_mode="trunc")
    return quotient, index - quotient * size


def decode_detections(outputs: dict[str, torch.Tensor], pipeline: Pipeline) -> list[Detections]:
    """Boxes, scores, labels and (with an `attribute_logits` output) attributes per sample (at most
    model.max_boxes, scores descending)."""
    model = pipeline.model
    batch, _, _, grid_y = outputs["heatmap"].shape
    scores, labels, cells = top_peaks(outputs["heatmap"], 4 * model.max_boxes)
    regression = outputs["box_regression"].float().flatten(2)  # (B, 10, X*Y)
    results = []
    for sample in range(batch):
        keep = scores[sample] >= max(model.score_threshold, 1e-6)
        score, label, cell = scores[sample][keep], labels[sample][keep], cells[sample][keep]
        boxes = boxes_from_regression(regression[sample][:, cell].T, (cell // grid_y).float(),
                                      (cell % grid_y).float(), pipeline)
        kept = _suppress(boxes, score, label, model)[: model.max_boxes]
        attributes = None if "attribute_logits" not in outputs else \
            decode_attributes(outputs["attribute_logits"][sample], cell[kept], label[kept], model.detection_classes)
        results.append(Detections(boxes[kept], score[kept], label[kept], attributes))
    return results


def decode_attributes(logits: torch.Tensor, cells: torch.Tensor, labels: torch.Tensor, classes) -> torch.Tensor:
    """(n,) the most likely attribute among those each detection's class may carry
    (`stack.metrics.detection.class_attributes`), read from one sample's logits (A, X, Y) at the detections'
    centre cells (flat indices `cells`); -1 for a class with no attributes."""
    from stack.metrics.detection import class_attributes

    allowed = torch.as_tensor(class_attributes(classes), device=logits.device)[labels]  # (n, A)
    at_cells = logits.float().flatten(1)[:, cells].T  # (n, A)
    best = at_cells.masked_fill(~allowed, float("-inf")).argmax(dim=1)
    return torch.where(allowed.any(dim=1), best, torch.full_like(best, -1))


def decode_depth(outputs: dict[str, torch.Tensor], pipeline: Pipeline) -> torch.Tensor:
    """Metric z-depth (B, N, H, W) at image resolution: the bin expectation, bilinearly upsampled."""
    depth_cfg, rig = pipeline.model.depth, pipeline.data.rig
    logits = outputs["depth_logits"]
    centres = depth_bin_centres(depth_cfg, device=logits.device, dtype=torch.float32)
    depth = expected_depth(logits, centres, dim=2)  # (B, N, h, w)
    size = (rig.image_height, rig.image_width)
    return F.interpolate(depth.flatten(0, 1)[:, None], size=size, mode="bilinear", align_corners=False
                         ).view(*depth.shape[:2], *size)


def decode_segmentation(outputs: dict[str, torch.Tensor], pipeline: Pipeline) -> torch.Tensor:
    """Class index (B, N, H, W) int64 at image resolution: argmax of bilinearly upsampled logits."""
    rig = pipeline.data.rig
    logits = outputs["seg_logits"].float()
    size = (rig.image_height, rig.image_width)
    upsampled = F.interpolate(logits.flatten(0, 1), size=size, mode="bilinear", align_corners=False)
    return upsampled.argmax(dim=1).view(*logits.shape[:2], *size)


def decode_plan(outputs: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """(best trajectory (B, T, 2), its probability (B,)): the highest-scoring mode."""
    probs = outputs["plan_scores"].float().softmax(dim=1)
    confidence, best = probs.max(dim=1)
    trajectories = outputs["plan_trajectories"].float()
    return trajectories[torch.arange(len(best), device=best.device), best], confidence


@torch.no_grad()
def decode_all(outputs: dict[str, torch.Tensor], pipeline: Pipeline) -> dict:
    """Every decoded prediction, keyed as `stack.metrics.suite.TaskMetrics.update` reads them."""
    plan, _ = decode_plan(outputs)
    return {"detections": decode_detections(outputs, pipeline), "depth": decode_depth(outputs, pipeline),
            "segmentation": decode_segmentation(outputs, pipeline), "plan": plan,
            "plan_modes": outputs["plan_trajectories"].float()}
