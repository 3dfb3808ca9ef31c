"""The policies that drive the closed loop with a network, beside the runtimes they use.

`stack.sim` knows policies only through `stack.sim.policies.Policy`; these two run the project's network:

- `CheckpointPolicy` ("checkpoint"): the trained network in PyTorch (the weights `stack train` wrote), rebuilt
  through `stack.models` from the pipeline the checkpoint carries, as `stack eval` and export do.
- `BundlePolicy` ("bundle"): a deployed bundle's model on ONNX Runtime (`stack.deploy.runner.DeployedNetwork`),
  the model it ships or explicitly the INT8 / fp32 one; a TensorRT target's bundle states its latency on the
  target in gate.json (`stated_latency`).

`checkpoint_spec` and `bundle_spec` describe them as picklable `PolicySpec`s for `stack.sim.drive`.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from stack.errors import StackError
from stack.sim.policies import NetworkPolicy, PolicySpec

if TYPE_CHECKING:
    from stack.models.plan_guard import Odometry, PlanGuard


def checkpoint_spec(name: str, path: str, **latency) -> PolicySpec:
    """The trained network of checkpoint `path` (model.pt), driven in PyTorch."""
    return PolicySpec(name, "checkpoint", str(path), builder=CheckpointPolicy, **latency)


def bundle_spec(name: str, bundle: str = "", model: str | None = None, **latency) -> PolicySpec:
    """A bundle folder's model (`model`: "int8", "fp32" or None for the one it ships), or with no bundle an ONNX
    file `model` (the deploy gate drives models before their bundle is sealed), on ONNX Runtime."""
    return PolicySpec(name, "bundle", str(bundle), model, builder=BundlePolicy, **latency)


class GuardedNetworkPolicy(NetworkPolicy):
    """A network policy that drives its plan through the pipeline's plan guard (`guarded_plan`), one guard per
    policy, fed the ego's odometry at each replan."""

    def __init__(self, spec: PolicySpec, steps: int, pipeline):
        super().__init__(spec, steps)
        self.pipeline, self.guard, self._odometry = pipeline, plan_guard(pipeline), None

    def plan(self, observation) -> np.ndarray:
        self._odometry = odometry(observation)
        return super().plan(observation)

    def choose(self, outputs: dict) -> np.ndarray:
        return guarded_plan(outputs, self.pipeline, self.guard, self._odometry)


class CheckpointPolicy(GuardedNetworkPolicy):
    """The trained network in PyTorch, pooling with the rig's geometry (as in training and `stack eval`)."""

    runtime = "PyTorch"

    def __init__(self, spec: PolicySpec, steps: int, pipeline):
        super().__init__(spec, steps, pipeline)
        from stack.checkpoint.model_file import load_network

        _, self.net = load_network(spec.source, needs_planner=True)
        self.geometry = rig_geometry(self.net, pipeline.data.rig)
        if self.net.temporal_frames and pipeline.drive.replan_hz != 2.0:
            raise StackError(f"{spec.source} fuses the key frames 0.5 s apart before it (model.temporal_frames="
                             f"{self.net.temporal_frames}), so it must "
                             f"replan at 2 Hz; got drive.replan_hz={pipeline.drive.replan_hz}: set drive.replan_hz=2")
        self._memory, self._pose, self._episode = None, None, None

    def plan(self, observation) -> np.ndarray:
        """A temporal network carries its BEV memory from one replanning instant to the next (0.5 s apart) within an
        episode, and the ego's motion in between from odometry (the past trajectory, as training reads it)."""
        if self.net.temporal_frames:
            from stack.kinematics import previous_pose
            from stack.sim.recording import past_positions

            episode = tuple(observation.world.seed_words)
            if episode != self._episode or observation.time_s == 0.0:
                self._memory, self._episode = None, episode
            self._pose = previous_pose(past_positions(observation.world))
        return super().plan(observation)

    def infer(self, images: np.ndarray, ego_status: np.ndarray, command: np.ndarray) -> dict:
        import torch

        pose = None if self._memory is None else torch.from_numpy(self._pose)[None]
        with torch.inference_mode():
            out = self.net(torch.from_numpy(images), torch.from_numpy(ego_status), torch.from_numpy(command),
                           self.geometry, None, self._memory, pose)
        self._memory = out.get("bev_memory")
        return {name: out[name].float().numpy() for name in GUARD_READS}


class BundlePolicy(GuardedNetworkPolicy):
    """A deployed model on ONNX Runtime, fed the calibration of the rig the world renders."""

    runtime = "ONNX Runtime"

    @classmethod
    def stated_latency(cls, spec: PolicySpec) -> tuple[float, str] | None:
        return bundle_latency(spec.source) if spec.source else None

    def __init__(self, spec: PolicySpec, steps: int, pipeline):
        super().__init__(spec, steps, pipeline)
        from stack.deploy.calibration import Calibration
        from stack.deploy.runner import DeployedNetwork

        if spec.source:
            # simulation is where a network below the quality bar is studied: drive it (drive.md says so)
            self.net = DeployedNetwork.open(spec.source, spec.model, threads=1, allow_below_bar=True)
        else:
            self.net = DeployedNetwork.from_model(spec.model, threads=1)
        self.calibration = Calibration.from_rig(pipeline.data.rig)
        if self.net.state:
            replans_per_period = self.net.state["period_s"] * pipeline.drive.replan_hz
            if abs(replans_per_period - round(replans_per_period)) > 1e-6 or round(replans_per_period) < 1:
                raise StackError(f"{spec.model} is a stateful network that fuses the frame {self.net.state['period_s']} "
                                 f"s earlier, which replanning at drive.replan_hz={pipeline.drive.replan_hz} never "
                                 f"gives it: set drive.replan_hz to a multiple of {1 / self.net.state['period_s']:g}")
        self._episode, self._state = None, {}

    def plan(self, observation) -> np.ndarray:
        """A stateful graph's memory is carried by DeployedNetwork, forgotten at an episode's start; the ego's
        motion since the key frame 0.5 s earlier comes from odometry, as the checkpoint's does."""
        if self.net.state:
            from stack.kinematics import previous_pose
            from stack.sim.recording import past_positions

            episode = tuple(observation.world.seed_words)
            if episode != self._episode or observation.time_s == 0.0:
                self.net.reset()
                self._episode = episode
            self._state = {"time_s": float(observation.time_s),
                           "previous_pose": previous_pose(past_positions(observation.world))[None]}
        return super().plan(observation)

    def infer(self, images: np.ndarray, ego_status: np.ndarray, command: np.ndarray) -> dict:
        return self.net.infer(images, ego_status, command, self.calibration, **self._state)


GUARD_READS = ("plan_trajectories", "plan_scores", "heatmap", "box_regression", "seg_logits", "depth_logits")
"""The outputs a network policy chooses its plan from (`guarded_plan`)."""


def guarded_plan(outputs: dict, pipeline, guard: PlanGuard | None = None,
                 odometry: Odometry | None = None) -> np.ndarray:
    """(T, 2) waypoints: the best-scoring candidate, or with `model.plan_guard_score` > 0 the best one that runs into
    none of the network's own detections scoring at least that (`stack.models.plan_guard`). A policy passes its
    drive's `guard` and the ego's `odometry` for the rules that look across replans (confirmation, restart)."""
    import torch

    from stack.models.decoders import decode_detections
    from stack.models.plan_guard import PlanGuard, best_clear
    from stack.sim.policies import best_plan

    trajectories, scores, model = outputs["plan_trajectories"], outputs["plan_scores"], pipeline.model
    if not model.plan_guard_score or not (np.isfinite(trajectories).all() and np.isfinite(scores).all()):
        return best_plan(trajectories, scores)
    detected = decode_detections({name: torch.from_numpy(np.asarray(outputs[name]))
                                  for name in ("heatmap", "box_regression")}, pipeline)[0]
    if model.plan_guard_segmentation or model.plan_guard_depth:
        detected = supported_detections(detected, outputs, pipeline)
    candidates, candidate_scores = torch.from_numpy(trajectories[0]), torch.from_numpy(scores[0])
    if guard is None or odometry is None:
        near = detected.scores >= model.plan_guard_score
        hits = PlanGuard.from_model(model).conflicts(candidates, detected.boxes[near], detected.scores[near])
        best = best_clear(candidates, candidate_scores, hits)
    else:
        best = guard.choose(candidates, candidate_scores, detected.boxes, detected.scores, odometry)
    return np.asarray(trajectories[0, best], np.float64)


def supported_detections(detected, outputs: dict, pipeline):
    """`detected` without the boxes the network's own segmentation does not see (`model.plan_guard_segmentation`,
    `stack.models.plan_guard.segmentation_support`) or where its depth head puts no surface (`model.plan_guard_depth`,
    `stack.models.plan_guard.depth_support`), in the cameras of the pipeline's rig."""
    import torch

    from stack.models.decoders import Detections
    from stack.models.plan_guard import depth_support, segmentation_support
    from stack.rig import rig_matrices

    model, rig = pipeline.model, pipeline.data.rig
    near = detected.scores >= model.plan_guard_score
    if not bool(near.any()):
        return detected
    ks, poses = (torch.from_numpy(m) for m in rig_matrices(rig))
    size, keep = (rig.image_height, rig.image_width), torch.ones(len(detected.scores), dtype=torch.bool)
    if model.plan_guard_segmentation:
        things = road_user_probabilities(_read(outputs, "seg_logits", "plan_guard_segmentation"), model)
        support = segmentation_support(detected.boxes[near], things, ks, poses, size)
        keep[near] &= support >= model.plan_guard_segmentation
    if model.plan_guard_depth:
        probabilities = depth_probabilities(_read(outputs, "depth_logits", "plan_guard_depth"))
        keep[near] &= depth_support(detected.boxes[near], probabilities, (model.depth.min_m, model.depth.max_m),
                                    ks, poses, size) >= model.plan_guard_depth
    return Detections(detected.boxes[keep], detected.scores[keep], detected.labels[keep],
                      None if detected.attributes is None else detected.attributes[keep])


def _read(outputs: dict, name: str, key: str):
    """The network output `name` that `model.<key>` reads, or a StackError that says what to do."""
    if name not in outputs:
        raise StackError(f"model.{key} reads the network's {name} output, which this model does not have (it gives "
                         f"{', '.join(sorted(outputs))}): set model.{key}=0, or drive a model exported with every "
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


def plan_guard(pipeline) -> PlanGuard:
    """The plan guard of a drive with `pipeline`'s `model.plan_guard_*` settings, one per policy."""
    from stack.models.plan_guard import PlanGuard

    return PlanGuard.from_model(pipeline.model)


def odometry(observation) -> Odometry:
    """The ego's pose and speed at a replanning instant, from the simulated car's odometry (its exact pose in the
    world frame, as the past trajectory a temporal network reads comes from it too)."""
    from stack.models.plan_guard import Odometry

    x, y, yaw = observation.world.ego_state()[:3]
    return Odometry(float(observation.time_s), float(x), float(y), float(yaw), float(observation.ego_status[0]))


def rig_geometry(net, rig):
    """The network's pooling geometry for `rig`'s cameras (batch of one), computed once per policy."""
    import torch

    from stack.rig import rig_matrices

    ks, poses = rig_matrices(rig)
    return net.geometry(torch.tensor(ks, dtype=torch.float32)[None], torch.tensor(poses, dtype=torch.float32)[None])


def bundle_latency(bundle: str | Path) -> tuple[float, str] | None:
    """(seconds, how) from gate.json for bundles whose target is not this host (TensorRT targets): the
    median the gate measured on the target's GPU or predicted with the latency model. None for ONNX
    Runtime targets, whose latency is measured here. A gate.json that is not valid JSON or lacks the
    gate's fields is refused with what to do (`stack.deploy.bundle.read_gate`), not a traceback."""
    from stack.deploy.bundle import read_gate

    gate = read_gate(bundle)
    if gate.get("runtime") != "tensorrt":
        return None
    fps = gate.get("fps") if isinstance(gate.get("fps"), dict) else {}
    median = fps.get("median_ms")
    if not isinstance(median, (int, float)) or not math.isfinite(median):
        raise StackError(f"bundle {bundle}: gate.json has no median latency for target {gate.get('target')}; "
                         f"deploy it again or give drive.latency_ms")
    mode = fps.get("mode", "predicted")
    return median / 1000.0, f"{mode} for {gate.get('target')} ({median:.2f} ms median, gate.json)"
