"""All four task metrics together, fed from decoded predictions and a Batch.

`TaskMetrics(pipeline)` holds the detection, segmentation, depth and planning
metrics configured from the pipeline; `update(predictions, batch)` takes the
decoded predictions as plain tensors (see `stack.models.decoders.decode_all`, which
produces exactly this mapping) and `compute()` returns one flat dict keyed
`<task>/<metric>`, ready for a logger or a report.

The metrics math of evaluation lives here alone: `stack eval` (`stack.train.evaluate`, a PyTorch network over a
loader) and `stack deploy`'s gates (`stack.deploy.gates.head_scores`, a runtime per sample) both feed it.
"""

from __future__ import annotations

from typing import Any, Mapping

import torch

from stack.metrics.depth import DepthMetric
from stack.metrics.detection import DetectionMetric, class_ranges
from stack.metrics.planning import PlanningMetric
from stack.metrics.segmentation import SegmentationMetric
from stack.pipeline import Pipeline

TASKS = ("detection", "segmentation", "depth", "depth_road_users", "planning")
"""The accumulators, each reported under its own prefix; depth_road_users is the depth error on the pixels of the
classes the detector finds (what places a road user in the BEV), beside the whole image's."""

PREDICTION_KEYS = ("detections", "depth", "segmentation", "plan", "plan_modes")
"""Keys `update` reads: per-sample detections (objects with boxes/scores/labels, optionally attributes), depth (B, N, H, W) m,
segmentation (B, N, H, W) class index, plan (B, T, 2), plan_modes (B, K, T, 2)."""


class TaskMetrics:
    """Detection, segmentation, depth and planning metrics for one pipeline, accumulated over batches."""

    def __init__(self, pipeline: Pipeline):
        model = pipeline.model
        (x0, x1), (y0, y1) = model.bev.x_range, model.bev.y_range
        grid_radius = min(-x0, x1, -y0, y1) if min(-x0, x1, -y0, y1) > 0 else float("inf")
        self.detection = DetectionMetric(model.detection_classes, ranges=class_ranges(model.detection_classes, grid_radius))
        self.segmentation = SegmentationMetric(model.segmentation_classes)
        self.depth = DepthMetric(min_depth=1e-3, max_depth=model.depth.max_m)
        self.road_user_classes = model.road_user_classes()
        self.depth_road_users = DepthMetric(min_depth=1e-3, max_depth=model.depth.max_m)
        self.planning = PlanningMetric(steps=model.planning_steps)

    def update(self, predictions: Mapping[str, Any], batch) -> None:
        missing = [key for key in PREDICTION_KEYS if key not in predictions]
        if missing:
            raise KeyError(f"predictions lack {missing}; expected keys {PREDICTION_KEYS} (decode_all gives them)")
        # A batch without attribute labels (built by hand) scores every match's attribute as the devkit scores
        # a GT box without one (stack.metrics.detection).
        self.detection.update_detections(predictions["detections"], batch.boxes, batch.box_labels,
                                         getattr(batch, "box_attributes", None))
        self.segmentation.update(predictions["segmentation"], batch.semantic)
        self.depth.update(predictions["depth"], batch.depth)
        road_users = torch.isin(batch.semantic.long(), torch.tensor(self.road_user_classes, device=batch.semantic.device))
        self.depth_road_users.update(predictions["depth"], batch.depth, road_users)
        self.planning.update(predictions["plan"], batch.future_trajectory, batch.future_valid, batch.boxes,
                             batch.box_labels, batch.past_trajectory, predictions["plan_modes"], batch.ego_status)

    def compute(self) -> dict[str, float]:
        out = {}
        for task in TASKS:
            out.update({f"{task}/{key}": value for key, value in getattr(self, task).compute().items()})
        return out

    def reset(self) -> None:
        for task in TASKS:
            getattr(self, task).reset()

    def merge(self, other: "TaskMetrics") -> None:
        """Fold in another accumulator, e.g. each rank's from `torch.distributed.all_gather_object`."""
        for task in TASKS:
            getattr(self, task).merge(getattr(other, task))
