"""Policies that drive the ego in closed loop, all behind one interface: an observation in, a plan out.

    policy.plan(observation) -> (T, 2) rear-axle xy in the current ego frame at WAYPOINT_STEP_S steps

- `expert`: the privileged planner of the recorded scenes (`InteractiveWorld.expert_plan`: IDM along
  the route, seeing every road user). It is the upper bound, and its progress is the reference of
  NAVSIM's ego-progress term.
- `constant_velocity`: keeps its speed and heading; blind.
- `ego_rollout`: the ego-status rollout (`stack.kinematics.kinematic_rollout`, constant acceleration and
  yaw rate) that the planning head refines; blind. On nuScenes an ego-status-only MLP rivals
  perception-based planners in open loop (Zhai et al. 2023, "Rethinking the open-loop evaluation of
  end-to-end autonomous driving in nuScenes", AD-MLP; Li et al. 2024, "Is ego status all you need for
  open-loop end-to-end autonomous driving?"): in closed loop it must fail where the cameras matter.
- `checkpoint`: the trained network in PyTorch (the weights `stack train` wrote).
- `bundle`: a deployed bundle's model on ONNX Runtime (`stack.deploy.runner.DeployedNetwork`), its shipped
  model or explicitly the INT8 / fp32 one.

A policy is described by a picklable `PolicySpec` and built once per worker process (`build_policy`), so
episodes run in parallel. Each spec carries the latency its plans are delayed by in the loop, and how it
was obtained (measured, predicted, given).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from stack.errors import StackError
from stack.kinematics import WAYPOINT_STEP_S

NETWORK_KINDS = ("checkpoint", "bundle")
BASELINE_KINDS = ("expert", "constant_velocity", "ego_rollout")


@dataclass
class Observation:
    """What a policy gets at a replanning step."""

    time_s: float
    ego_status: np.ndarray
    """float32 (3,): speed (m/s), longitudinal acceleration (m/s^2), yaw rate (rad/s) (stack.batch)."""
    command: int
    """0 left, 1 straight, 2 right (stack.batch.COMMANDS)."""
    images: np.ndarray | None
    """uint8 (N, H, W, 3) of the rig's cameras at this step; None for policies that need no cameras."""
    world: object
    """The InteractiveWorld; only the privileged expert reads it."""


@dataclass(frozen=True)
class PolicySpec:
    """A picklable description of a policy: what drives, from which file, and its latency."""

    name: str
    """Label in reports (e.g. "expert", "checkpoint", "bundle int8")."""
    kind: str
    """One of BASELINE_KINDS or NETWORK_KINDS."""
    source: str = ""
    """Checkpoint file or bundle folder (network policies)."""
    model: str | None = None
    """Bundles: "int8", "fp32", or None for the model the bundle ships; or an ONNX file path when
    `source` is empty (the deploy gate drives models before their bundle is sealed)."""
    latency_s: float = 0.0
    """Delay before this policy's plan reaches the controller."""
    latency_how: str = "none (baseline)"

    @property
    def needs_cameras(self) -> bool:
        return self.kind in NETWORK_KINDS


class Policy:
    """Base class: `plan` maps an Observation to (steps, 2) ego-frame waypoints."""

    def __init__(self, spec: PolicySpec, steps: int):
        self.spec, self.steps = spec, steps

    def plan(self, observation: Observation) -> np.ndarray:
        raise NotImplementedError


class ExpertPolicy(Policy):
    def plan(self, observation: Observation) -> np.ndarray:
        return np.asarray(observation.world.expert_plan(self.steps, WAYPOINT_STEP_S), np.float64)


class ConstantVelocityPolicy(Policy):
    def plan(self, observation: Observation) -> np.ndarray:
        t = WAYPOINT_STEP_S * np.arange(1, self.steps + 1)
        return np.stack([float(observation.ego_status[0]) * t, np.zeros_like(t)], axis=1)


class EgoRolloutPolicy(Policy):
    def plan(self, observation: Observation) -> np.ndarray:
        import torch

        from stack.kinematics import kinematic_rollout

        status = torch.from_numpy(np.asarray(observation.ego_status, np.float32)[None])
        return kinematic_rollout(status, self.steps)[0].double().numpy()


def _best_plan(trajectories: np.ndarray, scores: np.ndarray) -> np.ndarray:
    """The highest-scoring mode, as `stack.models.decoders.decode_plan` picks it.

    A network whose output is not finite (diverged weights, a broken INT8 model) has no plan: the
    car falls back to stopping where it is (every waypoint at the ego's position), the minimal-risk
    manoeuvre of ISO 21448 / SAE J3016's fallback, and the episode scores what that costs (no
    progress) instead of the evaluation, or the deploy gate, dying on the controller's check."""
    if not (np.isfinite(trajectories).all() and np.isfinite(scores).all()):
        return np.zeros(trajectories.shape[2:], np.float64)
    return np.asarray(trajectories[0, int(np.argmax(scores[0]))], np.float64)


class CheckpointPolicy(Policy):
    """The trained network in PyTorch, pooling with the rig's geometry (as in training and `stack eval`)."""

    def __init__(self, spec: PolicySpec, steps: int, pipeline):
        super().__init__(spec, steps)
        import torch

        from stack.checkpoint import check_weights_fit, load_model_checkpoint
        from stack.models import build_model
        from stack.rig import rig_matrices

        stored, state_dict, _ = load_model_checkpoint(spec.source)
        check_has_planner(state_dict, spec.source)
        check_weights_fit(stored, state_dict, spec.source)
        self.net = build_model(stored)
        self.net.load_state_dict(state_dict)
        self.net.eval()
        ks, poses = rig_matrices(pipeline.data.rig)
        self.geometry = self.net.geometry(torch.tensor(ks, dtype=torch.float32)[None],
                                          torch.tensor(poses, dtype=torch.float32)[None])

    def plan(self, observation: Observation) -> np.ndarray:
        import torch

        images = torch.from_numpy(np.ascontiguousarray(observation.images.transpose(0, 3, 1, 2)))[None]
        with torch.inference_mode():
            out = self.net(images, torch.from_numpy(observation.ego_status[None].astype(np.float32)),
                           torch.tensor([observation.command], dtype=torch.int64), self.geometry)
        return _best_plan(out["plan_trajectories"].float().numpy(), out["plan_scores"].float().numpy())


class BundlePolicy(Policy):
    """A deployed model on ONNX Runtime, fed the calibration of the rig the world renders."""

    def __init__(self, spec: PolicySpec, steps: int, pipeline):
        super().__init__(spec, steps)
        from stack.deploy.calibration import Calibration
        from stack.deploy.runner import DeployedNetwork

        if spec.source:
            self.net = DeployedNetwork.open(spec.source, spec.model, threads=1)
        else:
            self.net = DeployedNetwork.from_model(spec.model, threads=1)
        self.calibration = Calibration.from_rig(pipeline.data.rig)

    def plan(self, observation: Observation) -> np.ndarray:
        images = np.ascontiguousarray(observation.images.transpose(0, 3, 1, 2))[None]
        out = self.net.infer(images, observation.ego_status[None].astype(np.float32),
                             np.array([observation.command], np.int64), self.calibration)
        return _best_plan(out["plan_trajectories"], out["plan_scores"])


def check_has_planner(state_dict: dict, path: str) -> None:
    """A checkpoint whose weights hold no planning head cannot drive: say so before any episode runs."""
    if not any(key.startswith("planning_head.") for key in state_dict):
        raise StackError(f"checkpoint {path} has no planning head (no planning_head.* weights): it cannot drive. "
                         f"Drive a checkpoint of the full multi-task network that `stack train` writes "
                         f"(runs/<preset>/train/model.pt).")


_BUILT: dict = {}


def build_policy(spec: PolicySpec, pipeline) -> Policy:
    """The policy for `spec`, built once per process (networks load once per worker, not per episode)."""
    key = (spec, id(pipeline))
    if key not in _BUILT:
        steps = pipeline.model.planning_steps
        classes = {"expert": ExpertPolicy, "constant_velocity": ConstantVelocityPolicy,
                   "ego_rollout": EgoRolloutPolicy}
        if spec.kind in classes:
            _BUILT[key] = classes[spec.kind](spec, steps)
        elif spec.kind == "checkpoint":
            _BUILT[key] = CheckpointPolicy(spec, steps, pipeline)
        elif spec.kind == "bundle":
            _BUILT[key] = BundlePolicy(spec, steps, pipeline)
        else:
            raise StackError(f"unknown policy kind {spec.kind!r}; expected one of {BASELINE_KINDS + NETWORK_KINDS}")
    return _BUILT[key]


def measure_latency(policy: Policy, observation: Observation, warmup: int = 2, runs: int = 7) -> float:
    """Median seconds per `plan` on this host, one thread (as each worker runs it)."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for _ in range(warmup):
            policy.plan(observation)
        times = []
        for _ in range(runs):
            start = time.perf_counter()
            policy.plan(observation)
            times.append(time.perf_counter() - start)
    finally:
        torch.set_num_threads(threads)
    return float(np.median(times))


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
