"""The policy interface of the closed loop, and the policies that need no network.

    policy.plan(observation) -> (T, 2) rear-axle xy in the current ego frame at WAYPOINT_STEP_S steps

As nuPlan's `AbstractPlanner` does, the loop knows policies only through this interface, so a new one is
one class and the loop never changes; as NAVSIM's agents declare their sensors, a policy class says
whether it uses the cameras (`uses_cameras`), and the loop renders only for those that do.

- `expert`: the privileged planner of the recorded scenes (`InteractiveWorld.expert_plan`: IDM along
  the route, seeing every road user). It is the upper bound, and its progress is the reference of
  NAVSIM's ego-progress term.
- `constant_velocity`: keeps its speed and heading; blind.
- `ego_rollout`: the ego-status rollout (`stack.kinematics.kinematic_rollout`, constant acceleration and
  yaw rate) that the planning head refines; blind. On nuScenes an ego-status-only MLP rivals
  perception-based planners in open loop (Zhai et al. 2023, "Rethinking the open-loop evaluation of
  end-to-end autonomous driving in nuScenes", AD-MLP; Li et al. 2024, "Is ego status all you need for
  open-loop end-to-end autonomous driving?"): in closed loop it must fail where the cameras matter.

Policies that run a network live with the runtime they use, not here: `stack.deploy.network_policies` has the
trained network in PyTorch (`checkpoint`) and a deployed bundle on ONNX Runtime (`bundle`). They reach the
loop through `PolicySpec.builder`, so nothing in `stack.sim` imports a model, a trainer or a runtime.

A policy is described by a picklable `PolicySpec` and built once per worker process (`build_policy`), so
episodes run in parallel. Each spec carries the latency its plans are delayed by in the loop, and how it
was obtained (measured, predicted, given).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np

from stack.errors import StackError
from stack.kinematics import WAYPOINT_STEP_S, best_plan

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
    """One of BASELINE_KINDS, or the kind of network policy `builder` builds (e.g. "checkpoint", "bundle")."""
    source: str = ""
    """Checkpoint file or bundle folder (network policies)."""
    model: str | None = None
    """Bundles: "int8", "fp32", or None for the model the bundle ships; or an ONNX file path when
    `source` is empty (the deploy gate drives models before their bundle is sealed)."""
    latency_s: float = 0.0
    """Delay before this policy's plan reaches the controller."""
    latency_how: str = "none (baseline)"
    builder: type | None = None
    """The `Policy` subclass that builds a network policy (`builder(spec, steps, pipeline)`), defined beside the
    runtime it uses; None for BASELINE_KINDS. A top-level class, so the spec pickles to worker processes."""
    guard: tuple = ()
    """Network policies: the plan guard settings it drives with, as sorted (key, value) pairs of
    `stack.pipeline.GuardConfig.settings` (score 0: the network alone); () for the baselines, and for a network
    policy the driving pipeline's `guard` section."""

    alone_of: str = ""
    """The network policy this one is the network alone of (the same model, its plan guard off): driven beside it
    so that a report shows which part drives; information, never a verdict."""

    @property
    def guard_settings(self) -> dict | None:
        """The guard settings this policy drives with, or None when its spec does not fix them."""
        return dict(self.guard) if self.guard else None

    @property
    def policy_class(self) -> type:
        if self.builder is not None:
            return self.builder
        if self.kind not in BASELINES:
            raise StackError(f"unknown policy kind {self.kind!r}: expected one of {', '.join(BASELINE_KINDS)}, or a "
                             f"network policy given with its builder (stack.deploy.network_policies)")
        return BASELINES[self.kind]

    @property
    def needs_cameras(self) -> bool:
        return self.policy_class.uses_cameras


class Policy:
    """Base class: `plan` maps an Observation to (steps, 2) ego-frame waypoints."""

    uses_cameras = False
    """Whether `plan` reads `observation.images` (the loop renders the rig only for policies that do)."""
    runtime = ""
    """What runs it, for the latency line of reports (e.g. "PyTorch", "ONNX Runtime")."""

    def __init__(self, spec: PolicySpec, steps: int, pipeline=None):
        self.spec, self.steps = spec, steps

    def plan(self, observation: Observation) -> np.ndarray:
        raise NotImplementedError

    @classmethod
    def stated_latency(cls, spec: PolicySpec) -> tuple[float, str] | None:
        """(seconds, how) when the policy's artifact states its latency on the target (a bundle's gate.json);
        None when it must be measured on this host."""
        return None


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


class NetworkPolicy(Policy):
    """Base of the policies that run the network: `infer` gives the network's outputs, `choose` the plan to drive
    from them (the best-scoring mode, `best_plan`; a subclass may guard it). Subclasses live with the runtime they
    use (PyTorch, ONNX Runtime)."""

    uses_cameras = True

    def infer(self, images: np.ndarray, ego_status: np.ndarray, command: np.ndarray) -> dict:
        """The network's outputs as numpy arrays (at least plan_trajectories (1, K, T, 2) and plan_scores (1, K)),
        from images uint8 (1, N, 3, H, W), ego status float32 (1, 3) and command int64 (1,)."""
        raise NotImplementedError

    def choose(self, outputs: dict) -> np.ndarray:
        """(T, 2) waypoints to drive from the network's outputs."""
        return best_plan(outputs["plan_trajectories"], outputs["plan_scores"])

    def plan(self, observation: Observation) -> np.ndarray:
        images = np.ascontiguousarray(observation.images.transpose(0, 3, 1, 2))[None]
        return self.choose(self.infer(images, observation.ego_status[None].astype(np.float32),
                                      np.array([observation.command], np.int64)))


BASELINES = {"expert": ExpertPolicy, "constant_velocity": ConstantVelocityPolicy, "ego_rollout": EgoRolloutPolicy}

_BUILT: dict = {}


def build_policy(spec: PolicySpec, pipeline) -> Policy:
    """The policy for `spec`, built once per process (networks load once per worker, not per episode)."""
    key = (spec, id(pipeline))
    if key not in _BUILT:
        _BUILT[key] = spec.policy_class(spec, pipeline.model.planning_steps, pipeline)
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
