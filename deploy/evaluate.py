"""Scoring a runtime's outputs per head with the project's metrics (`stack.metrics`).

The accuracy gate calls one evaluator twice, on the fp32 and on the INT8 model, over
the same validation samples: raw outputs are decoded exactly as the trainer's
validation does (`stack.models.decoders`) and scored per head:

| head | metric | better |
|---|---|---|
| detection | nuScenes mAP (`DetectionMetric`) | higher |
| segmentation | mIoU (`SegmentationMetric`) | higher |
| depth | AbsRel (`DepthMetric`) | lower |
| planning | L2 at 3 s, UniAD convention (`PlanningMetric`) | lower |
"""

from __future__ import annotations

import math

import numpy as np
import torch

from stack.deploy.accuracy import HeadBudget
from stack.deploy.network import batch_feeds


def head_budgets(target, pipeline) -> list[HeadBudget]:
    """The four heads with the target's budgets."""
    budget = target.accuracy_budget
    return [HeadBudget("detection", "detection_map", budget.detection_map, True),
            HeadBudget("segmentation", "segmentation_miou", budget.segmentation_miou, True),
            HeadBudget("depth", "depth_abs_rel", budget.depth_abs_rel, False),
            HeadBudget("planning", planning_key(pipeline), budget.planning_l2_3s_m, False)]


def planning_key(pipeline) -> str:
    """L2 at 3 s, or at the planner's last horizon when it plans less than 3 s ahead."""
    seconds = min(3.0, pipeline.model.planning_steps * 0.5)
    return f"planning_l2_{seconds:g}s_m"


def make_evaluator(pipeline, batches: list):
    """An accuracy.Evaluator over `batches` (stack.batch.Batch), one runtime call per sample."""
    feeds = [batch_feeds(batch) for batch in batches]

    def evaluate(run) -> dict:
        from stack.metrics.depth import DepthMetric
        from stack.metrics.detection import DetectionMetric
        from stack.metrics.planning import PlanningMetric
        from stack.metrics.segmentation import SegmentationMetric

        model = pipeline.model
        metrics = (DetectionMetric(model.detection_classes), SegmentationMetric(model.segmentation_classes),
                   DepthMetric(), PlanningMetric(model.planning_steps))
        for batch, samples in zip(batches, feeds):
            outputs = _stack([run(sample) for sample in samples])
            _update(metrics, outputs, batch, pipeline)
        return _summarise(metrics, pipeline)

    return evaluate


def _stack(per_sample: list[dict]) -> dict:
    return {name: torch.from_numpy(np.concatenate([out[name] for out in per_sample])) for name in per_sample[0]}


def _update(metrics, outputs: dict, batch, pipeline) -> None:
    from stack.models.decoders import decode_depth, decode_detections, decode_plan, decode_segmentation

    detection, segmentation, depth, planning = metrics
    detection.update_detections(decode_detections(outputs, pipeline), batch.boxes, batch.box_labels)
    segmentation.update(decode_segmentation(outputs, pipeline), batch.semantic)
    depth.update(decode_depth(outputs, pipeline), batch.depth)
    plan, _ = decode_plan(outputs)
    planning.update(plan, batch.future_trajectory, batch.future_valid, batch.boxes, batch.box_labels,
                    batch.past_trajectory, modes=outputs["plan_trajectories"])


def _summarise(metrics, pipeline) -> dict:
    detection, segmentation, depth, planning = (m.compute() for m in metrics)
    seconds = min(3.0, pipeline.model.planning_steps * 0.5)
    return {"detection_map": detection["mAP"], "segmentation_miou": segmentation["mIoU"],
            "depth_abs_rel": depth["AbsRel"], planning_key(pipeline): planning.get(f"L2_at_{seconds:g}s", math.nan)}
