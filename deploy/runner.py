"""`DeployedNetwork`: the one interface a deployed bundle is run through (closed-loop simulation, replay, tools).

    net = DeployedNetwork.open("runs/tiny/export/cpu")          # the precision the bundle ships
    outputs = net.infer(images, ego_status, command, calibration)  # {output name: array}
    plan = net.plan(images, ego_status, command, calibration, odometry)  # (T, 2): what the car drives

A stateful network (model.temporal_frames=k: it fuses the BEV memory of the key frame 0.5 s earlier, k BEVs) also
takes each frame's time and the ego's motion since that key frame, and carries its memory itself:

    outputs = net.infer(images, ego_status, command, calibration, time_s=t, previous_pose=pose)
    net.reset()                                                   # at a scene start

`plan` is what a car runs: the frame through the network, then the plan's post-processing the bundle ships
(gate.json's `post_processing`, `stack.models.post_processing`: the decoding and plan guard settings its
closed-loop gate drove with), carried from frame to frame until `reset`.

`open` checks the bundle against its gate.json (`stack.deploy.bundle.verify_bundle`: every
file the one the gate scored), reads the camera calibration the network was built for
(`calibration.yaml`, and the same hash in the ONNX metadata) and starts an ONNX Runtime
session on the chosen model. `infer` takes one frame and the calibration it was taken
with, and raises `CalibrationMismatch` rather than run a frame from cameras the network's
pooling tables do not describe (`stack.deploy.calibration` says why they are baked). Output
names and layouts are those of `stack.models.outputs`, also in `metadata["output_layout"]`.
"""

from __future__ import annotations

import numbers
from pathlib import Path

import numpy as np

from stack.deploy.calibration import BUNDLE_FILE as CALIBRATION_FILE
from stack.deploy.calibration import Calibration, CalibrationMismatch
from stack.deploy.stateful import STATE_INPUTS
from stack.errors import StackError

MODEL_FILES = {"int8": "model.int8.onnx", "fp32": "model.onnx"}
"""The two precisions a bundle may carry."""


class NotForDeployment(StackError):
    """A bundle whose gates did not pass, or built below the quality bar (`stack deploy --allow-below-bar`)."""

    def __init__(self, folder: Path, gate: dict):
        why = gate.get("failures") or gate.get("below_bar") or ["its gate.json does not say it is for deployment"]
        state = "its gates failed" if not gate.get("passed") else "it is below the quality bar (--allow-below-bar)"
        more = " ..." if len(why) > 3 else ""
        super().__init__(f"bundle {folder} is NOT FOR DEPLOYMENT: {state}: {'; '.join(why[:3])}{more}. Deploy a "
                         f"network that passes every gate, or open it for experiments with allow_below_bar=True "
                         f"(`stack drive` does).")


class DeployedNetwork:
    """A verified bundle's network on ONNX Runtime, for one camera calibration. Create it with `open`."""

    def __init__(self, session, path: Path, metadata: dict, calibration: Calibration, post_processing=None):
        self.session, self.path, self.metadata, self.calibration = session, path, metadata, calibration
        self.post_processing = post_processing
        """The plan's post-processing (`stack.models.post_processing.PlanPostProcessing`) `plan` applies; None for
        a bundle that records none (`plan` refuses it)."""
        self.output_names = [output.name for output in session.get_outputs()]
        self.pipeline_hash = metadata.get("pipeline_hash", "")
        self._inputs = {i.name: i for i in session.get_inputs()}
        self.state = metadata.get("state") if STATE_INPUTS[0] in self._inputs else None
        """For a stateful graph: memory_input, memory_output, period_s, period_tolerance_s (its metadata)."""
        if STATE_INPUTS[0] in self._inputs and not isinstance(self.state, dict):
            raise StackError(f"{path.name} takes {STATE_INPUTS[0]} but its metadata has no 'state' entry saying how to "
                             f"carry it: export it again with this stack")
        self._memories: list[tuple[float, np.ndarray]] = []
        self.fused_memory = False
        """Whether the last `infer` fused a kept memory (False: it started a sequence)."""

    @classmethod
    def open(cls, bundle_dir: str | Path, model: str | None = None, threads: int = 0,
             allow_below_bar: bool = False) -> "DeployedNetwork":
        """The bundle's shipped model (`model=None`) or its "int8" / "fp32" model, after verifying the bundle.
        A bundle that is not for deployment (a failed gate, or built below the quality bar with
        --allow-below-bar) is refused unless `allow_below_bar` (experiments, simulation)."""
        from stack.deploy.export import read_metadata
        from stack.deploy.runtime import ort_session

        folder = Path(bundle_dir)
        gate = _verified_gate(folder)
        if not gate.get("for_deployment") and not allow_below_bar:
            raise NotForDeployment(folder, gate)
        path = folder / _model_file(folder, gate, model)
        calibration = Calibration.load(folder / CALIBRATION_FILE) if (folder / CALIBRATION_FILE).is_file() else None
        if calibration is None:
            raise StackError(f"bundle {folder} has no {CALIBRATION_FILE}: it was built before bundles recorded the "
                             f"camera calibration they are for. Deploy again (`stack deploy --calibration FILE`).")
        metadata = read_metadata(path)
        if metadata.get("calibration_hash") != calibration.hash:
            raise CalibrationMismatch(
                f"{path.name} was exported for calibration hash {str(metadata.get('calibration_hash'))[:12]}, but the "
                f"bundle's {CALIBRATION_FILE} has {calibration.hash[:12]}: the bundle mixes files of two builds. "
                f"Deploy again.")
        return cls(ort_session(path, threads), path, metadata, calibration, _shipped_post_processing(folder, gate))

    @classmethod
    def from_model(cls, model_path: str | Path, threads: int = 0, post_processing=None) -> "DeployedNetwork":
        """A model file on its own, before it is sealed into a bundle (the deploy gates drive models they are
        still judging); its calibration comes from the ONNX metadata it was exported with, its post-processing
        (for `plan`) is the one given."""
        from stack.deploy.export import read_metadata
        from stack.deploy.runtime import ort_session

        path = Path(model_path)
        metadata = read_metadata(path)
        if "calibration" not in metadata:
            raise StackError(f"{path} carries no camera calibration in its metadata: export it again with this stack")
        calibration = Calibration.from_dict(metadata["calibration"], source=f"{path.name} metadata")
        if calibration.hash != metadata.get("calibration_hash"):
            raise CalibrationMismatch(f"{path.name}: its metadata's calibration does not match its calibration_hash")
        return cls(ort_session(path, threads), path, metadata, calibration, post_processing)

    def plan(self, images: np.ndarray, ego_status: np.ndarray, command: np.ndarray, calibration: Calibration,
             odometry=None, time_s: float | None = None, previous_pose: np.ndarray | None = None) -> np.ndarray:
        """(T, 2) float64 waypoints (rear axle, current ego frame, 0.5 s apart) the car drives after this frame:
        `infer`'s outputs through the bundle's own post-processing. `odometry` (`stack.models.plan_guard.Odometry`:
        the ego's pose in a fixed frame and its speed) feeds the guard's rules that look across frames; without it
        each frame is judged alone."""
        if self.post_processing is None:
            raise StackError(f"{self.path.parent} records no plan post-processing (gate.json has no post_processing): "
                             f"it was built by an older stack or from a network without a planner. Deploy it again.")
        outputs = self.infer(images, ego_status, command, calibration, time_s=time_s, previous_pose=previous_pose)
        return self.post_processing.choose(outputs, odometry)

    def infer(self, images: np.ndarray, ego_status: np.ndarray, command: np.ndarray, calibration: Calibration,
              time_s: float | None = None, previous_pose: np.ndarray | None = None) -> dict[str, np.ndarray]:
        """Run one frame: uint8 (1, N, 3, H, W) images in the bundle's camera order, float32 (1, 3) ego status
        (speed, acceleration, yaw rate), int64 (1,) command; `calibration` is the cameras' calibration now.

        A stateful network (`self.state`) also needs `time_s`, the frame's time in seconds on a clock that runs
        forward, and `previous_pose`, float32 (1, 3): x, y (m) and yaw (rad) of the ego `period_s` earlier in the
        current ego frame (odometry). It fuses the memory it kept from the frame `period_s` earlier (within
        `period_tolerance_s`), or starts a sequence where it has none: the first frame, after `reset`, after a
        gap. The network was trained on that period only, so memories of other ages are never fused."""
        self.check_calibration(calibration)
        feeds = {"images": images, "ego_status": ego_status, "command": command}
        if self.state:
            feeds.update(self._state_feeds(time_s, previous_pose))
        for name, value in feeds.items():
            self._check_input(name, value)
        outputs = dict(zip(self.output_names, self.session.run(self.output_names, feeds)))
        if self.state:
            self._memories.append((float(time_s), outputs[self.state["memory_output"]]))
        return outputs

    def reset(self) -> None:
        """Forget the kept memories and the guard's state: the next frame starts a sequence (a scene start, a new
        drive)."""
        self._memories.clear()
        self.fused_memory = False
        if self.post_processing is not None:
            self.post_processing.reset()

    def _state_feeds(self, time_s, previous_pose) -> dict[str, np.ndarray]:
        """previous_bev / previous_pose / previous_valid for the frame at `time_s`; drops memories too old to fuse."""
        period, tolerance = float(self.state["period_s"]), float(self.state["period_tolerance_s"])
        if time_s is None or previous_pose is None:
            raise StackError(f"{self.path.name} is a stateful network (it fuses the BEV memory of the frame {period} s "
                             f"earlier): infer needs time_s (the frame's time, seconds) and previous_pose (float32 "
                             f"(1, 3): x, y, yaw of the ego {period} s earlier in the current ego frame)")
        if not isinstance(time_s, numbers.Real) or isinstance(time_s, bool) or not np.isfinite(time_s):
            raise StackError(f"infer time_s: expected a finite number of seconds, found {time_s!r}")
        if self._memories and time_s <= self._memories[-1][0]:
            raise StackError(f"infer time_s={time_s} does not come after the previous frame's {self._memories[-1][0]}: "
                             f"frames must come in time order; call reset() when a new scene or drive starts")
        self._memories = [(t, m) for t, m in self._memories if time_s - t <= period + tolerance]
        ages = [abs(time_s - t - period) for t, _ in self._memories]
        self.fused_memory = bool(ages) and min(ages) <= tolerance
        shape = [d if isinstance(d, int) else 1 for d in self._inputs[STATE_INPUTS[0]].shape]
        memory = self._memories[int(np.argmin(ages))][1] if self.fused_memory else np.zeros(shape, np.float32)
        return {STATE_INPUTS[0]: memory, STATE_INPUTS[1]: previous_pose,
                STATE_INPUTS[2]: np.full((shape[0],), float(self.fused_memory), np.float32)}

    def check_calibration(self, calibration: Calibration) -> None:
        """Raise CalibrationMismatch unless `calibration` pools into the same BEV cells as the bundle's."""
        if not isinstance(calibration, Calibration):
            raise StackError(f"infer needs the frame's camera calibration as a stack.deploy.calibration.Calibration, "
                             f"found {type(calibration).__name__}")
        differences = self.calibration.compare(calibration)
        if differences:
            raise CalibrationMismatch(
                f"this frame's camera calibration ({calibration.name or 'unnamed'}, hash {calibration.hash[:12]}) is not "
                f"the one bundle {self.path.parent} was built for ({self.calibration.name or 'unnamed'}, hash "
                f"{self.calibration.hash[:12]}):\n  " + "\n  ".join(differences)
                + "\nIts BEV pooling would put features in the wrong cells. Deploy a bundle for this calibration "
                  "(`stack deploy --calibration FILE`).")

    def _check_input(self, name: str, value) -> None:
        spec = self._inputs[name]
        expected_type = spec.type.removeprefix("tensor(").removesuffix(")")
        expected_type = {"float": "float32", "double": "float64"}.get(expected_type, expected_type)
        shape = [d if isinstance(d, int) else None for d in spec.shape]
        found = (str(getattr(value, "dtype", type(value).__name__)), list(getattr(value, "shape", [])))
        fits = isinstance(value, np.ndarray) and found[0] == expected_type and len(shape) == len(found[1]) \
            and all(e is None or e == f for e, f in zip(shape, found[1]))
        if not fits:
            raise StackError(f"infer input {name!r}: expected a numpy {expected_type} array of shape {shape} "
                             f"({self.metadata.get('inputs', {}).get(name, '')}), found {found[0]} {found[1]}")


def _shipped_post_processing(folder: Path, gate: dict):
    """The `PlanPostProcessing` a verified bundle ships: its pipeline.yaml's network decoding with gate.json's
    guard settings (`verify_bundle` checked that the two agree); None for a bundle that records none."""
    from stack.config import pipeline_from_yaml
    from stack.models.post_processing import PlanPostProcessing, guard_from_settings

    recorded, pipeline_file = gate.get("post_processing"), folder / "pipeline.yaml"
    if not isinstance(recorded, dict) or not pipeline_file.is_file():
        return None
    pipeline = pipeline_from_yaml(pipeline_file.read_text(), source=f"the pipeline of bundle {folder}")
    return PlanPostProcessing(pipeline, guard_from_settings(recorded["guard"]))


def _verified_gate(folder: Path) -> dict:
    """gate.json after `verify_bundle` (every file is the one the gate scored; BundleMismatch otherwise)."""
    from stack.deploy.orchestrate import verify_bundle

    return verify_bundle(folder)


def _model_file(folder: Path, gate: dict, model: str | None) -> str:
    """The file of the requested precision, or the one gate.json says the bundle ships."""
    if model is not None:
        if model not in MODEL_FILES:
            raise StackError(f"model={model!r}: expected one of {sorted(MODEL_FILES)} or None (the shipped model)")
        if not (folder / MODEL_FILES[model]).is_file():
            raise StackError(f"bundle {folder} has no {MODEL_FILES[model]} (its target {gate.get('target', '?')} "
                             f"ships {gate.get('precision', '?')}); open it with model=None")
        return MODEL_FILES[model]
    shipped = gate.get("shipped")
    if isinstance(shipped, dict) and shipped.get("file"):
        if shipped["file"] not in MODEL_FILES.values() or not (folder / shipped["file"]).is_file():
            raise StackError(f"bundle {folder}: gate.json ships {shipped['file']}, which is not in the bundle. Deploy again.")
        return shipped["file"]
    for name in (MODEL_FILES["int8"], MODEL_FILES["fp32"]):
        if (folder / name).is_file():
            return name
    raise StackError(f"bundle {folder} holds neither model.int8.onnx nor model.onnx. Deploy again.")
