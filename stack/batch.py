"""`Batch`: the one typed structure that every loader yields and every model consumes.

Both data backends (WebDataset + DataLoader, and DALI) produce exactly this: same
fields, shapes and dtypes, so the model and trainer never know which backend ran.
B = batch, N = cameras, H x W = image size of the rig, M = `model.max_boxes`
(padded), T = `model.planning_steps`, P = past steps (4 = 2 s at 0.5 s).

Conventions (ego frame, camera frame, z-depth) are those of `stack.rig`.

Dense per-pixel labels travel as narrow as the shards store them: `depth` float16 and
`semantic` uint8: 3 bytes a pixel where float32 + int64 took 12, four times the images'
own 3, and every byte is copied out of the decoder, collated, pinned and sent to the device. The
consumers widen on the device where arithmetic needs it: the loss takes
`depth.float()` and `semantic.long()` (`stack.models.losses`), the metrics widen to
float64/int64. float16 rather than uint16 millimetres because it is exactly what the
shards hold (`stack.data.format`), so nothing is rounded twice: it is exact for every
stored value, with 1/1024 relative resolution (3 cm at 50 m), and reaches 65 km where
uint16 mm would stop at 65.5 m. `IGNORE_INDEX` (255) fits uint8, and
`stack.data.samples.ClassMaps` refuses a pipeline with more than 255 segmentation classes.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # torch is imported by callers; keeping it out keeps `import stack` lean
    import torch

    from stack.pipeline import Pipeline

IGNORE_INDEX = 255
"""Semantic label of pixels that carry no class (excluded from loss and metrics)."""
COMMANDS = ("left", "straight", "right")
"""High-level driving commands, by index."""
BOX_FIELDS = ("x", "y", "z", "length", "width", "height", "yaw", "vx", "vy")
"""Columns of `Batch.boxes`: centre (m), size (m), yaw (rad, CCW from ego x), velocity (m/s), ego frame."""
EGO_STATUS_FIELDS = ("speed", "acceleration", "yaw_rate")
"""Columns of `Batch.ego_status`: m/s, m/s^2, rad/s."""
PAST_STEPS = 4
"""Past ego positions carried per sample (-2.0 s ... -0.5 s)."""


@dataclass
class Batch:
    """A batch of multi-camera frames with labels for all four tasks."""

    images: "torch.Tensor"
    """uint8 (B, N, 3, H, W) RGB; the model normalises (so export keeps the same input)."""
    intrinsics: "torch.Tensor"
    """float32 (B, N, 3, 3) pinhole K in pixels of `images` (after any resize/crop)."""
    cam_to_ego: "torch.Tensor"
    """float32 (B, N, 4, 4) camera frame -> ego frame (after any BEV augmentation)."""
    depth: "torch.Tensor"
    """float16 (B, N, H, W) metric z-depth; 0 where there is no surface (sky) or no label (widen with `.float()`)."""
    semantic: "torch.Tensor"
    """uint8 (B, N, H, W) index into `model.segmentation_classes`; IGNORE_INDEX where unlabelled (widen with
    `.long()` for losses that index by it)."""
    boxes: "torch.Tensor"
    """float32 (B, M, 9) 3D boxes in the ego frame, columns BOX_FIELDS; padding rows are zero."""
    box_labels: "torch.Tensor"
    """int64 (B, M) index into `model.detection_classes`; -1 marks padding."""
    ego_status: "torch.Tensor"
    """float32 (B, 3) columns EGO_STATUS_FIELDS."""
    command: "torch.Tensor"
    """int64 (B,) index into COMMANDS."""
    past_trajectory: "torch.Tensor"
    """float32 (B, PAST_STEPS, 2) past ego xy in the current (BEV-augmented) ego frame, oldest first."""
    future_trajectory: "torch.Tensor"
    """float32 (B, T, 2) future ego xy in the current (BEV-augmented) ego frame at 0.5 s steps (the planning target)."""
    future_valid: "torch.Tensor"
    """bool (B, T) False where the scene ends before that waypoint."""
    bev_rotation: "torch.Tensor | None" = None
    """float32 (B,) radians: the yaw by which BEV augmentation rotated this frame's scene, boxes, cameras and
    trajectories about the ego (`stack.data.augment.rotate_bev`); 0 without augmentation, at evaluation and in
    export. None (a Batch built by hand) means zeros."""
    previous_images: "torch.Tensor | None" = None
    """uint8 (B, N, 3, H, W): the key frame 0.5 s earlier in the same sequence, augmented as `images` (the same
    frame at a sequence start); only for a network with model.temporal_frames >= 1 (`stack.data.sequences`)."""
    previous_pose: "torch.Tensor | None" = None
    """float32 (B, 3): x, y (m), yaw (rad) of the ego at the previous key frame in the current ego body frame
    (before BEV rotation); zeros at a sequence start. With `previous_images`."""
    earlier_images: "torch.Tensor | None" = None
    """uint8 (B, (k - 1) N, 3, H, W): the key frames before the previous one (1.0, 1.5 ... s earlier), newest first,
    N cameras each, augmented as `images`; where the sequence has no such frame, the oldest frame it has. Only for
    model.temporal_frames = k >= 2."""
    earlier_poses: "torch.Tensor | None" = None
    """float32 (B, k - 1, 3): the ego pose at each of `earlier_images`' frames in the ego frame of the key frame
    after it (the first: in the previous key frame's); zeros where the sequence has no such frame."""
    box_attributes: "torch.Tensor | None" = None
    """int64 (B, M) each box's nuScenes attribute, an index into `stack.metrics.detection.ATTRIBUTES` (moving,
    stopped, parked ...); -1 for none and for padding. Both loaders fill it; None (a Batch built by hand) means
    no attribute labels, which the attribute loss skips and the metrics score as the devkit does."""

    def __post_init__(self):
        if self.bev_rotation is None:
            import torch

            self.bev_rotation = torch.zeros(self.images.shape[0], dtype=torch.float32, device=self.images.device)

    def tensors(self) -> dict:
        """{field name: tensor} of every field this batch carries (the previous frame's only for a temporal network)."""
        return {f.name: getattr(self, f.name) for f in fields(self) if getattr(self, f.name) is not None}

    def to(self, device, non_blocking: bool = False) -> "Batch":
        """The same batch with every tensor on `device`."""
        return Batch(**{name: tensor.to(device, non_blocking=non_blocking) for name, tensor in self.tensors().items()})

    def pin_memory(self) -> "Batch":
        """The same batch in page-locked memory (what DataLoader(pin_memory=True) calls): its copy to a GPU is then
        asynchronous and at full PCIe speed, where a pageable one is staged and blocks the host."""
        return Batch(**{name: tensor.pin_memory() for name, tensor in self.tensors().items()})

    def expected_shapes(self, pipeline: "Pipeline") -> dict[str, tuple]:
        """Shape and dtype name of every field for this pipeline, with B taken from `images`."""
        b, n = self.images.shape[0], len(pipeline.data.rig.cameras)
        h, w = pipeline.data.rig.image_height, pipeline.data.rig.image_width
        m, t, k = pipeline.model.max_boxes, pipeline.model.planning_steps, pipeline.model.temporal_frames
        return {
            "images": ((b, n, 3, h, w), "uint8"), "intrinsics": ((b, n, 3, 3), "float32"),
            "cam_to_ego": ((b, n, 4, 4), "float32"), "depth": ((b, n, h, w), "float16"),
            "semantic": ((b, n, h, w), "uint8"), "boxes": ((b, m, len(BOX_FIELDS)), "float32"),
            "box_labels": ((b, m), "int64"), "ego_status": ((b, len(EGO_STATUS_FIELDS)), "float32"),
            "command": ((b,), "int64"), "past_trajectory": ((b, PAST_STEPS, 2), "float32"),
            "future_trajectory": ((b, t, 2), "float32"), "future_valid": ((b, t), "bool"),
            "bev_rotation": ((b,), "float32"),
            **({"previous_images": ((b, n, 3, h, w), "uint8"), "previous_pose": ((b, 3), "float32")}
               if pipeline.model.temporal_frames else {}),
            **({"earlier_images": ((b, (k - 1) * n, 3, h, w), "uint8"), "earlier_poses": ((b, k - 1, 3), "float32")}
               if k > 1 else {}),
            **({"box_attributes": ((b, m), "int64")} if self.box_attributes is not None else {}),
        }

    def mismatches(self, pipeline: "Pipeline") -> list[str]:
        """Fields whose shape or dtype differ from what `pipeline` implies (empty when all agree)."""
        found = []
        for name, (shape, dtype) in self.expected_shapes(pipeline).items():
            tensor = getattr(self, name)
            actual = (tuple(tensor.shape), str(tensor.dtype).removeprefix("torch."))
            if actual != (shape, dtype):
                found.append(f"{name}: expected {dtype} {shape}, found {actual[1]} {actual[0]}")
        return found
