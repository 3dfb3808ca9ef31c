"""The project's network as deploy sees it: rebuilt from a checkpoint, fixed to a calibration, fed from Batches.

Deploy never imports the trainer: `export_network` rebuilds `stack.models.build_model`
from the checkpoint's pipeline, loads the weights, and bakes one vehicle's camera
calibration into the BEV-pooling tables of the graph (`BevNet.fix_geometry`; why baked,
not a runtime input: `stack.deploy.calibration`), so the exported inputs are only what
changes per frame: the camera images (uint8, normalised inside the graph), the ego
status and the driving command. `metadata` is what the ONNX file carries so that a
runtime never guesses names, layouts, classes, calibration or normalisation.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from stack.deploy.calibration import Calibration
from stack.deploy.stateful import (EARLIER_IMAGES, EARLIER_POSES, KEY_FRAME_PERIOD_S, MEMORY_OUTPUT, PREVIOUS_IMAGES,
                                   STATE_INPUTS)
from stack.errors import StackError
from stack.models.outputs import output_names
from stack.pipeline import Pipeline

INPUTS = ("images", "ego_status", "command")
"""Exported graph inputs, in order (a stateful graph then takes stateful.STATE_INPUTS)."""


@dataclass
class ExportableNetwork:
    net: object
    """An nn.Module: net(images=..., ego_status=..., command=...[, STATE_INPUTS]) -> {output name: tensor}."""
    example: dict
    output_names: list
    metadata: dict
    calibration: Calibration
    """The camera calibration baked into the BEV pooling."""


def export_network(pipeline: Pipeline, state_dict: dict, calibration: Calibration | None = None) -> ExportableNetwork:
    """The trained network with `calibration` (default: the nominal `data.rig`) baked in, example inputs, metadata."""
    net = _loaded(pipeline, state_dict)
    calibration = calibration or Calibration.from_rig(pipeline.data.rig)
    calibration.check_fits(pipeline.data.rig)
    net.fix_geometry(calibration_geometry(net, calibration, pipeline.export.batch_size))
    stateful = bool(pipeline.model.temporal_frames)
    names = output_names(pipeline.model) + ([MEMORY_OUTPUT] if stateful else [])
    return ExportableNetwork(_Exported(net, stateful, names).eval(), example_inputs(pipeline), names,
                             metadata(pipeline, calibration),
                             calibration)


def training_path_network(pipeline: Pipeline, state_dict: dict, calibration: Calibration) -> torch.nn.Module:
    """The same network as training runs it: `stack.ops.bev_pool` with geometry computed from `calibration`
    on every call, not the baked FixedBevPool tables. The reference of export parity, so parity checks the
    lowering of the pooling for this calibration too (baked against baked would not)."""
    net = _loaded(pipeline, state_dict)
    return _PerCallGeometry(net, calibration_geometry(net, calibration, pipeline.export.batch_size),
                            bool(pipeline.model.temporal_frames)).eval()


def _loaded(pipeline: Pipeline, state_dict: dict):
    from stack.models import build_model

    net = build_model(pipeline)
    try:
        missing, unexpected = net.load_state_dict(state_dict, strict=False)
    except RuntimeError as exc:  # a weight of another shape: name the first few, not a traceback of hundreds
        mismatched = [line.strip() for line in str(exc).splitlines() if "size mismatch" in line]
        raise StackError(f"the checkpoint's weights do not fit the network its pipeline describes: "
                         f"{len(mismatched)} of another shape (e.g. {mismatched[:2]}). The checkpoint's weights and "
                         f"its stored pipeline disagree; export the checkpoint the pipeline was trained with.") from None
    if missing or unexpected:
        raise StackError(
            f"the checkpoint's weights do not fit the network its pipeline describes: "
            f"{len(missing)} missing (e.g. {missing[:3]}), {len(unexpected)} unexpected (e.g. {unexpected[:3]}). "
            f"It was written by another version of stack.models; retrain or export with that version."
        )
    return net.eval()


def calibration_geometry(net, calibration: Calibration, batch: int):
    """`net.geometry` (BEV pooling tables) of `calibration`, repeated for a batch of `batch` frames."""
    ks = torch.as_tensor(calibration.intrinsics, dtype=torch.float32).expand(batch, -1, -1, -1)
    poses = torch.as_tensor(calibration.cam_to_ego, dtype=torch.float32).expand(batch, -1, -1, -1)
    return net.geometry(ks, poses)


class _Exported(torch.nn.Module):
    """Keyword inputs INPUTS (+ STATE_INPUTS when `stateful`; the exporter's wrapper passes them by name); the
    outputs `names`, in their order (`stack.models.outputs.output_names`, then the memory when stateful)."""

    def __init__(self, net: torch.nn.Module, stateful: bool, names: list[str]):
        super().__init__()
        self.net, self.stateful, self.names = net, stateful, names

    def forward(self, images, ego_status, command, previous_bev=None, previous_pose=None, previous_valid=None):
        state = (None, previous_bev, previous_pose, previous_valid) if self.stateful else ()
        outputs = self.net(images, ego_status, command, None, *state)
        return {name: outputs[name] for name in self.names}  # training-only outputs stay out of the graph


class _PerCallGeometry(torch.nn.Module):
    """Keyword inputs as _Exported's, pooled with a fixed `geometry` through `bev_pool`."""

    def __init__(self, net: torch.nn.Module, geometry, stateful: bool = False):
        super().__init__()
        self.net, self.geometry, self.stateful = net, geometry, stateful

    def forward(self, images, ego_status, command, previous_bev=None, previous_pose=None, previous_valid=None):
        state = (None, previous_bev, previous_pose, previous_valid) if self.stateful else ()
        return self.net(images, ego_status, command, self.geometry, *state)


def example_inputs(pipeline: Pipeline) -> dict:
    """Zero-valued inputs of the exported graph's shapes and dtypes."""
    rig, batch = pipeline.data.rig, pipeline.export.batch_size
    inputs = {"images": torch.zeros(batch, len(rig.cameras), 3, rig.image_height, rig.image_width, dtype=torch.uint8),
              "ego_status": torch.zeros(batch, 3), "command": torch.zeros(batch, dtype=torch.int64)}
    if pipeline.model.temporal_frames:
        inputs.update(previous_bev=torch.zeros(_memory_shape(pipeline)), previous_pose=torch.zeros(batch, 3),
                      previous_valid=torch.zeros(batch))
    return inputs


def metadata(pipeline: Pipeline, calibration: Calibration | None = None) -> dict:
    """`metadata_props` of the exported graph (`calibration`: the baked one, default the nominal rig)."""
    from stack.batch import COMMANDS, EGO_STATUS_FIELDS
    from stack.config import pipeline_hash
    from stack.models.backbone import IMAGENET_MEAN, IMAGENET_STD
    from stack.models.outputs import output_layout
    from stack.pipeline import SCHEMA_VERSION

    rig = pipeline.data.rig
    calibration = calibration or Calibration.from_rig(rig)
    return {
        "pipeline_name": pipeline.name, "pipeline_hash": pipeline_hash(pipeline), "schema_version": str(SCHEMA_VERSION),
        "detection_classes": list(pipeline.model.detection_classes),
        "segmentation_classes": list(pipeline.model.segmentation_classes),
        "output_layout": output_layout(pipeline, pipeline.export.batch_size),
        # camera order and image size; the cameras' geometry is `calibration` (the nominal rig's Camera fields
        # would describe another vehicle when the bundle is built for a measured calibration)
        "rig": {"image_width": rig.image_width, "image_height": rig.image_height,
                "cameras": [c.name for c in rig.cameras]},
        "calibration": calibration.to_dict(), "calibration_hash": calibration.hash,
        "inputs": {"images": "uint8 RGB (B, N, 3, H, W), cameras in rig order, 0..255",
                   "ego_status": f"float32 (B, 3): {', '.join(EGO_STATUS_FIELDS)}",
                   "command": f"int64 (B,): index into {list(COMMANDS)}"},
        "input_normalisation": {"inside_graph": True, "mean_0_255": [m * 255 for m in IMAGENET_MEAN],
                                "std_0_255": [s * 255 for s in IMAGENET_STD]},
        **(_state_metadata(pipeline) if pipeline.model.temporal_frames else {}),
    }


def _memory_shape(pipeline: Pipeline) -> tuple:
    """(B, k C, X, Y) of a stateful graph's BEV memory at the export batch size: the (pre-encoded) view transform
    output of each of the k = model.temporal_frames key frames it carries."""
    from stack.ops.bev_pool import grid_cells

    model = pipeline.model
    return (pipeline.export.batch_size, model.neck_channels * model.temporal_frames, *grid_cells(model.bev))


def _state_metadata(pipeline: Pipeline) -> dict:
    """What a runtime needs to carry a stateful graph's memory from one key frame to the next."""
    shape = "x".join(map(str, _memory_shape(pipeline)))
    return {"state": {"memory_input": STATE_INPUTS[0], "memory_output": MEMORY_OUTPUT,
                      "period_s": KEY_FRAME_PERIOD_S, "period_tolerance_s": 0.1 * KEY_FRAME_PERIOD_S},
            "state_inputs": {
                "previous_bev": f"float32 {shape}: the {MEMORY_OUTPUT} output of the key frame {KEY_FRAME_PERIOD_S} s "
                                f"earlier ({pipeline.model.temporal_frames} BEV(s) of {pipeline.model.neck_channels} "
                                f"channels, newest first; any values where previous_valid is 0)",
                "previous_pose": "float32 (B, 3): x, y (m), yaw (rad) of the ego at that key frame, in the current "
                                 "ego frame",
                "previous_valid": "float32 (B,): 1 where previous_bev is given, 0 at a sequence start"}}


def batch_feeds(batch) -> list[dict]:
    """One numpy feed dict per sample of a `stack.batch.Batch` (graphs are exported at batch 1)."""
    images = batch.images.numpy()
    status = batch.ego_status.numpy().astype(np.float32)
    command = batch.command.numpy().astype(np.int64)
    feeds = [{"images": images[i:i + 1], "ego_status": status[i:i + 1], "command": command[i:i + 1]}
             for i in range(images.shape[0])]
    if batch.previous_images is not None:  # a temporal pipeline's batch: resolve with stateful.with_memory
        previous, pose = batch.previous_images.numpy(), batch.previous_pose.numpy().astype(np.float32)
        for i, feed in enumerate(feeds):
            feed.update({PREVIOUS_IMAGES: previous[i:i + 1], STATE_INPUTS[1]: pose[i:i + 1]})
    if batch.earlier_images is not None:  # k >= 2 key frames: the ones before the previous one
        earlier, poses = batch.earlier_images.numpy(), batch.earlier_poses.numpy().astype(np.float32)
        for i, feed in enumerate(feeds):
            feed.update({EARLIER_IMAGES: earlier[i:i + 1], EARLIER_POSES: poses[i:i + 1]})
    return feeds

