"""The plan's post-processing: from one frame's network outputs to the trajectory the car drives.

The network proposes candidates and scores them; what drives is chosen after it, on the host: the detections are
decoded (`stack.models.decoders.decode_detections`, the model section's decoding keys) and the plan guard
(`stack.models.plan_guard`, the `guard` section) drops the candidates that run into them. Every runtime that drives
uses this one class: the checkpoint and bundle policies of the closed loop (`stack.deploy.network_policies`), the
deploy gate's drives, and a bundle's own `stack.deploy.runner.DeployedNetwork.plan`, so the plan a car computes
from a bundle is the plan its closed-loop gate scored.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from stack.errors import StackError
from stack.pipeline import GuardConfig

GUARD_READS = ("plan_trajectories", "plan_scores", "heatmap", "box_regression", "seg_logits", "depth_logits")
"""The outputs the post-processing chooses a plan from."""


def post_processing_record(pipeline) -> dict:
    """What a bundle's gate.json records of the post-processing it ships (`post_processing`): the guard settings and
    the detection decoding they read, exactly as the closed-loop gate drove them."""
    model = pipeline.model
    return {"guard": pipeline.guard.settings(),
            "decoding": {"score_threshold": float(model.score_threshold), "nms_iou": float(model.nms_iou),
                         "max_boxes": int(model.max_boxes),
                         "circle_nms_radius_m": {k: float(v) for k, v in model.circle_nms_radius_m.items()}},
            "implementation": f"{__name__}.PlanPostProcessing"}


def guard_from_settings(settings: dict) -> GuardConfig:
    """The `GuardConfig` of recorded settings (`GuardConfig.settings`, e.g. a bundle's gate.json), validated; a
    StackError naming what is wrong otherwise. Settings recorded before a rule was removed read as today's when they
    had it off (`stack.pipeline.migrate_guard_settings`), and are refused when they had it on."""
    from stack.pipeline import GUARD_KEYS, migrate_guard_settings

    settings = migrate_guard_settings(settings)
    if not isinstance(settings, dict) or any(key not in settings for key in GUARD_KEYS) or not all(
            isinstance(settings[key], (int, float)) and not isinstance(settings[key], bool) for key in GUARD_KEYS):
        raise StackError(f"plan guard settings: expected a number for each of {', '.join(GUARD_KEYS)}, found "
                         f"{str(settings)[:200]}")
    guard = GuardConfig(**{key: float(settings[key]) for key in GUARD_KEYS})
    problems = guard.problems()
    if problems:
        raise StackError("plan guard settings: " + "; ".join(f"guard.{key}: {why}" for key, why in problems))
    return guard


class PlanPostProcessing:
    """The post-processing of one drive (or one car's run), frame after frame: `choose` is called once per replan
    with that frame's outputs and the ego's odometry; `reset` starts a new drive. `guard` defaults to the
    pipeline's; `GuardConfig()` (score 0) is the network alone: its own best-scoring candidate."""

    def __init__(self, pipeline, guard: GuardConfig | None = None):
        from stack.models.plan_guard import PlanGuard

        self.pipeline = pipeline if guard is None else replace(pipeline, guard=guard)
        self.settings = self.pipeline.guard
        self.guard = PlanGuard.from_config(self.settings)

    @property
    def guarded(self) -> bool:
        """Whether the plan guard is on (a score above 0) or the network drives alone."""
        return bool(self.settings.score)

    def reset(self) -> None:
        self.guard.reset()

    def choose(self, outputs: dict, odometry=None) -> np.ndarray:
        """(T, 2) waypoints: the best-scoring candidate, or with the guard on the best one that runs into none of the
        network's own detections scoring at least `guard.score`. Without `odometry` (`stack.models.plan_guard
        .Odometry`) the rule that looks across replans (restart) is skipped: one frame alone."""
        import torch

        from stack.models.decoders import decode_detections
        from stack.kinematics import best_plan
        from stack.models.plan_guard import best_clear

        trajectories, scores = outputs["plan_trajectories"], outputs["plan_scores"]
        if not self.guarded or not (np.isfinite(trajectories).all() and np.isfinite(scores).all()):
            return best_plan(trajectories, scores)
        detected = decode_detections({name: torch.from_numpy(np.asarray(outputs[name]))
                                      for name in ("heatmap", "box_regression")}, self.pipeline)[0]
        if self.settings.segmentation or self.settings.depth:
            detected = supported_detections(detected, outputs, self.pipeline)
        candidates, candidate_scores = torch.from_numpy(trajectories[0]), torch.from_numpy(scores[0])
        if odometry is None:
            near = detected.scores >= self.settings.score
            hits = self.guard.conflicts(candidates, detected.boxes[near])
            best = best_clear(candidates, candidate_scores, hits)
        else:
            best = self.guard.choose(candidates, candidate_scores, detected.boxes, detected.scores, odometry)
        return np.asarray(trajectories[0, best], np.float64)


def supported_detections(detected, outputs: dict, pipeline):
    """`detected` without the boxes the network's own segmentation does not see (`guard.segmentation`,
    `stack.models.plan_guard.segmentation_support`) or where its depth head puts no surface (`guard.depth`,
    `stack.models.plan_guard.depth_support`), in the cameras of the pipeline's rig."""
    import torch

    from stack.models.decoders import Detections
    from stack.models.plan_guard import depth_support, segmentation_support
    from stack.rig import rig_matrices

    model, rig, guard = pipeline.model, pipeline.data.rig, pipeline.guard
    near = detected.scores >= guard.score
    if not bool(near.any()):
        return detected
    ks, poses = (torch.from_numpy(m) for m in rig_matrices(rig))
    size, keep = (rig.image_height, rig.image_width), torch.ones(len(detected.scores), dtype=torch.bool)
    if guard.segmentation:
        things = road_user_probabilities(_read(outputs, "seg_logits", "segmentation"), model)
        support = segmentation_support(detected.boxes[near], things, ks, poses, size)
        keep[near] &= support >= guard.segmentation
    if guard.depth:
        probabilities = depth_probabilities(_read(outputs, "depth_logits", "depth"))
        keep[near] &= depth_support(detected.boxes[near], probabilities, (model.depth.min_m, model.depth.max_m),
                                    ks, poses, size) >= guard.depth
    return Detections(detected.boxes[keep], detected.scores[keep], detected.labels[keep],
                      None if detected.attributes is None else detected.attributes[keep])


def _read(outputs: dict, name: str, key: str):
    """The network output `name` that `guard.<key>` reads, or a StackError that says what to do."""
    if name not in outputs:
        raise StackError(f"guard.{key} reads the network's {name} output, which this model does not have (it gives "
                         f"{', '.join(sorted(outputs))}): set guard.{key}=0, or drive a model exported with every "
                         f"output (stack export)")
    return outputs[name]


def _softmax_over_classes(logits):
    """(N, C, h, w) torch softmax over dim 1 of one sample's logits (1, N, C, h, w), a numpy or torch array."""
    import torch

    return torch.from_numpy(np.asarray(logits[0], np.float32)).softmax(dim=1)


def road_user_probabilities(seg_logits, model):
    """(N, h, w) torch: each camera's probability of a road-user class (car, truck, pedestrian, cyclist) per
    segmentation cell, from the network's seg_logits (1, N, S, h, w) of one sample."""
    return _softmax_over_classes(seg_logits)[:, model.road_user_classes()].sum(dim=1)


def depth_probabilities(depth_logits):
    """(N, D, h, w) torch: each camera's depth-bin probabilities per lift cell, from the network's depth_logits
    (1, N, D, h, w) of one sample (`stack.models.plan_guard.depth_support` reads them)."""
    return _softmax_over_classes(depth_logits)
