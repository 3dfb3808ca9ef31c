"""Scoring a runtime's outputs per head with the project's metrics (`stack.metrics`).

Only the deploy adapter lives here (an exported runtime called per sample, decoded by `decode_all`); the scoring
and the bars are `stack eval`'s own (`stack.metrics.suite`, `stack.metrics.bars`), and `stack deploy`'s accuracy
and quality gates call it (`stack.deploy.entrypoints`).

The accuracy gate calls one evaluator twice, on the fp32 and on the INT8 model, over
the same validation samples: raw outputs are decoded exactly as training's evaluation
does (`stack.models.decoders.decode_all`) and scored with the same suite
(`stack.metrics.suite.TaskMetrics`), per head:

| head | metric | better |
|---|---|---|
| detection | nuScenes mAP (`DetectionMetric`) | higher |
| segmentation | mIoU (`SegmentationMetric`) | higher |
| depth | AbsRel (`DepthMetric`) | lower |
| planning | L2 at 3 s, UniAD convention (`PlanningMetric`) | lower |

Beside them, as information with no budget, the report prints the detection head's NDS and its five TP errors
for fp32 and INT8 (`stack.metrics.detection.summary`).

Planning is also held to its prior, as `stack eval` holds it: the planner is a residual on
the ego-status rollout, so INT8 must not turn a planner that beats `stack.metrics.bars`' planning bar x the
rollout's L2 (on the same frames) into one that does not.

Each frame keeps its own metric accumulators, so the gate can rescore any resample of the
frames without running the network again (the paired bootstrap in `stack.deploy.gates.accuracy`).
"""

from __future__ import annotations

import math

import numpy as np
import torch

from stack.deploy.gates.accuracy import HeadBudget, Scores
from stack.deploy.exportable import batch_feeds
from stack.metrics.bars import bar_ratio


def head_budgets(target, pipeline) -> list[HeadBudget]:
    """The four heads with the target's budgets. Where the target drives closed loop, planning's open-loop L2 drop
    is information: the closed-loop gate judges what INT8 does to the driving (open-loop L2 does not predict it;
    `stack.metrics.bars`)."""
    budget, lenient = target.accuracy_budget, target.accuracy_inconclusive_passes
    return [HeadBudget("detection", "detection_map", budget.detection_map, True, inconclusive_passes=lenient),
            HeadBudget("segmentation", "segmentation_miou", budget.segmentation_miou, True, inconclusive_passes=lenient),
            HeadBudget("depth", "depth_abs_rel", budget.depth_abs_rel, False, inconclusive_passes=lenient),
            HeadBudget("planning", planning_key(pipeline), budget.planning_l2_3s_m, False,
                       prior_metric=f"{planning_key(pipeline)}_ego_rollout", prior_factor=bar_ratio("planning"),
                       inconclusive_passes=lenient, judged=target.closed_loop.episodes <= 0)]


def planning_seconds(pipeline) -> float:
    """3 s, or the planner's last horizon when it plans less than 3 s ahead."""
    return min(3.0, pipeline.model.planning_steps * 0.5)


def planning_key(pipeline) -> str:
    """L2 at `planning_seconds`."""
    return f"planning_l2_{planning_seconds(pipeline):g}s_m"


def make_evaluator(pipeline, batches: list, scenes: list | None = None):
    """An accuracy.Evaluator over `batches` (stack.batch.Batch; one frame each), one runtime call per sample;
    `scenes` names each frame's scene, the unit the gate's bootstrap resamples (None: frames)."""
    feeds = [batch_feeds(batch) for batch in batches]  # once: the gate scores every attempt on the same frames

    def evaluate(run) -> Scores:
        frames = frame_metrics(pipeline, batches, feeds, run)

        def on(indices) -> dict:
            return _summarise(merged_metrics(pipeline, frames, indices), pipeline)

        return Scores(on(range(len(frames))), len(frames), on, scenes)

    return evaluate


def make_quality_evaluator(pipeline, batches: list):
    """run -> every metric `stack eval` computes (`TaskMetrics.compute()`, baselines included) of a runtime over
    `batches`: what the quality gate holds to `stack eval`'s bars."""
    def evaluate(run) -> dict:
        frames = frame_metrics(pipeline, batches, [batch_feeds(batch) for batch in batches], run)
        return merged_metrics(pipeline, frames, range(len(frames)))

    return evaluate


def frame_metrics(pipeline, batches: list, feeds: list, run) -> list:
    """One `TaskMetrics` per batch of `run`'s decoded outputs on its `feeds` (`batch_feeds` of that batch), so any
    resample of frames can be rescored."""
    from stack.metrics.suite import TaskMetrics
    from stack.models.decoders import decode_all

    frames = []
    for batch, samples in zip(batches, feeds):
        metrics = TaskMetrics(pipeline)
        metrics.update(decode_all(_stack([run(sample) for sample in samples]), pipeline), batch)
        frames.append(metrics)
    return frames


def merged_metrics(pipeline, frames: list, indices) -> dict:
    """`stack eval`'s metrics (`TaskMetrics.compute()`, baselines included) of the frames at `indices`."""
    from stack.metrics.suite import TaskMetrics

    total = TaskMetrics(pipeline)
    for index in indices:
        total.merge(frames[int(index)])
    return total.compute()

def _stack(per_sample: list[dict]) -> dict:
    return {name: torch.from_numpy(np.concatenate([out[name] for out in per_sample])) for name in per_sample[0]}


def _summarise(values: dict, pipeline) -> dict:
    """The gated figures, and the detection figures the report prints as information (NDS and its TP errors:
    `stack.metrics.detection.summary`)."""
    from stack.metrics.detection import SUMMARY_KEYS

    seconds = planning_seconds(pipeline)
    return {**{f"detection/{key}": values[f"detection/{key}"] for key in SUMMARY_KEYS},
            "detection_map": values["detection/mAP"], "segmentation_miou": values["segmentation/mIoU"],
            "depth_abs_rel": values["depth/AbsRel"],
            planning_key(pipeline): values.get(f"planning/L2_at_{seconds:g}s", math.nan),
            f"{planning_key(pipeline)}_ego_rollout": values.get(f"planning/baseline_ego_rollout/L2_at_{seconds:g}s",
                                                                 math.nan)}
