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

import numpy as np

from stack.errors import StackError
from stack.sim.policies import Observation, Policy, PolicySpec


def checkpoint_spec(name: str, path: str, **latency) -> PolicySpec:
    """The trained network of checkpoint `path` (model.pt), driven in PyTorch."""
    return PolicySpec(name, "checkpoint", str(path), builder=CheckpointPolicy, **latency)


def bundle_spec(name: str, bundle: str = "", model: str | None = None, **latency) -> PolicySpec:
    """A bundle folder's model (`model`: "int8", "fp32" or None for the one it ships), or with no bundle an ONNX
    file `model` (the deploy gate drives models before their bundle is sealed), on ONNX Runtime."""
    return PolicySpec(name, "bundle", str(bundle), model, builder=BundlePolicy, **latency)


def best_plan(trajectories: np.ndarray, scores: np.ndarray) -> np.ndarray:
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

    uses_cameras = True
    runtime = "PyTorch"

    def __init__(self, spec: PolicySpec, steps: int, pipeline):
        super().__init__(spec, steps)
        import torch

        from stack.checkpoint.model_file import check_weights_fit, load_model_checkpoint
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
        return best_plan(out["plan_trajectories"].float().numpy(), out["plan_scores"].float().numpy())


class BundlePolicy(Policy):
    """A deployed model on ONNX Runtime, fed the calibration of the rig the world renders."""

    uses_cameras = True
    runtime = "ONNX Runtime"

    @classmethod
    def stated_latency(cls, spec: PolicySpec) -> tuple[float, str] | None:
        return bundle_latency(spec.source) if spec.source else None

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
        return best_plan(out["plan_trajectories"], out["plan_scores"])


def check_has_planner(state_dict: dict, path: str) -> None:
    """A checkpoint whose weights hold no planning head cannot drive: say so before any episode runs."""
    if not any(key.startswith("planning_head.") for key in state_dict):
        raise StackError(f"checkpoint {path} has no planning head (no planning_head.* weights): it cannot drive. "
                         f"Drive a checkpoint of the full multi-task network that `stack train` writes "
                         f"(runs/<preset>/train/model.pt).")


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
