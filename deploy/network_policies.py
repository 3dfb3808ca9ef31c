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
from stack.models.post_processing import GUARD_READS
from stack.sim.policies import NetworkPolicy, PolicySpec

if TYPE_CHECKING:
    from stack.models.plan_guard import Odometry


def checkpoint_spec(name: str, path: str, **options) -> PolicySpec:
    """The trained network of checkpoint `path` (model.pt), driven in PyTorch; `options`: the PolicySpec's
    latency_s / latency_how / guard / alone_of."""
    return PolicySpec(name, "checkpoint", str(path), builder=CheckpointPolicy, **options)


def bundle_spec(name: str, bundle: str = "", model: str | None = None, **options) -> PolicySpec:
    """A bundle folder's model (`model`: "int8", "fp32" or None for the one it ships), or with no bundle an ONNX
    file `model` (the deploy gate drives models before their bundle is sealed), on ONNX Runtime."""
    return PolicySpec(name, "bundle", str(bundle), model, builder=BundlePolicy, **options)


def guard_spec(guard) -> tuple:
    """`PolicySpec.guard` for a `stack.pipeline.GuardConfig`: its settings as sorted (key, value) pairs."""
    return tuple(sorted(guard.settings().items()))


ALONE = "alone"
"""The suffix of a network-alone policy's name (`network_alone`)."""


def network_alone(spec: PolicySpec) -> PolicySpec:
    """The same network as `spec` driving its planner's own best candidate (no plan guard), named "<name> alone":
    driven beside a guarded policy so that the report shows which part drives."""
    from dataclasses import replace

    from stack.pipeline import GuardConfig

    return replace(spec, name=f"{spec.name} {ALONE}", guard=guard_spec(GuardConfig()), alone_of=spec.name)


def bundle_guard(folder: str | Path) -> dict:
    """The plan guard settings a bundle ships (gate.json's `post_processing`, which `stack deploy --verify` checks
    against the bundle's pipeline.yaml and its closed-loop gate), or a StackError for a bundle that records none."""
    from stack.deploy.bundle import read_gate
    from stack.pipeline import migrate_guard_settings

    recorded = read_gate(folder).get("post_processing")
    if not isinstance(recorded, dict) or not isinstance(recorded.get("guard"), dict):
        raise StackError(f"bundle {folder} records no plan post-processing (gate.json has no post_processing): it was "
                         f"built by an older stack or from a network without a planner, so nobody knows what it "
                         f"should drive with. Deploy it again.")
    return migrate_guard_settings(recorded["guard"], f"the plan guard settings bundle {folder} ships")


class GuardedNetworkPolicy(NetworkPolicy):
    """A network policy that drives its plan through the plan's post-processing (`stack.models.post_processing`):
    the guard settings its spec fixes (`PolicySpec.guard`: a bundle's own, or the network alone) or else the
    pipeline's, one guard per policy, fed the ego's odometry at each replan."""

    def __init__(self, spec: PolicySpec, steps: int, pipeline):
        super().__init__(spec, steps)
        self.pipeline, self._odometry = pipeline, None
        self.post_processing = post_processing_of(spec, pipeline)

    def plan(self, observation) -> np.ndarray:
        self._odometry = odometry(observation)
        return super().plan(observation)

    def choose(self, outputs: dict) -> np.ndarray:
        return self.post_processing.choose(outputs, self._odometry)


def post_processing_of(spec: PolicySpec, pipeline):
    """The `PlanPostProcessing` a network policy drives with: its spec's guard settings, or the pipeline's."""
    from stack.models.post_processing import PlanPostProcessing, guard_from_settings

    settings = spec.guard_settings
    return PlanPostProcessing(pipeline, None if settings is None else guard_from_settings(settings))


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
