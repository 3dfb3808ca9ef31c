"""`BevNet`: the multi-task BEV perception/planning network as one plain nn.Module.

Data flow (per frame, N cameras):

    images ─► timm backbone + FPN ─┬─► segmentation head (stride segmentation_stride)
                                   └─► depth/context head (stride feature_stride)
    softmax(depth) x context ─► bev_pool (lift-splat, stack.ops) ─► BEV pre-encoder ─► BEV encoder
        (model.temporal_frames = k: the k previous key frames' pre-encoded BEVs, warped by the ego motion, are
         concatenated before the encoder: stack.models.temporal, BEVDet4D; the pre-encoder has
         model.temporal_pre_blocks residual blocks, none by default)
    BEV ─┬─► CenterPoint heatmap + box regression
         └─► planning head (ego query attends BEV tokens) ─► K trajectories + scores
             (planned in the body frame, turned by the batch's BEV-augmentation yaw, if any)

Geometry enters as data, outside the traced graph: training computes a
`BevPoolGeometry` per batch from its intrinsics/cam_to_ego (`BevNet.geometry`),
while export calls `fix_geometry` once, which bakes the fixed rig's pooling tables
into the module as constants (`stack.ops.FixedBevPool`, standard ONNX ops), and for a
camera-aware depth head (model.depth.camera_aware) the rig's camera vectors beside them,
after which `forward` ignores its `geometry` argument. `forward` has no data-dependent
Python control flow and, for a fixed rig, static shapes. Outputs are named
(`stack.models.outputs.OUTPUTS`).
"""

from __future__ import annotations

import torch
from torch import nn

from stack.batch import COMMANDS, Batch
from stack.errors import StackError
from stack.models.backbone import ImageEncoder
from stack.models.bev_heads import BevEncoder, DetectionHead, PlanningHead
from stack.models.path_speed_head import PathSpeedPlanningHead
from stack.models.temporal import warp_previous_bev
from stack.models.image_heads import DepthContextHead, SegmentationHead, camera_vector
from stack.models.layers import ResidualBlock
from stack.metrics.detection import ATTRIBUTES
from stack.ops.bev_pool import BevPoolGeometry, bev_geometry, bev_pool, grid_cells
from stack.pipeline import LossWeights, Pipeline

COMPONENTS = ("image_encoder", "depth_head", "segmentation_head", "view_transform", "bev_pre_encoder", "bev_encoder",
              "detection_head", "planning_head")
"""Top-level submodules in data-flow order (benchmarks and activation checkpointing name them)."""


class ViewTransform(nn.Module):
    """Lift-splat through `stack.ops.bev_pool`; `fixed` (a FixedBevPool) replaces the geometry for export."""

    def __init__(self):
        super().__init__()
        self.fixed: nn.Module | None = None

    def forward(self, depth_probs: torch.Tensor, context: torch.Tensor, geometry: BevPoolGeometry | None):
        if self.fixed is not None:
            return self.fixed(depth_probs, context)
        if geometry is None:
            raise StackError("BevNet.forward needs the pooling geometry of this batch's cameras: pass "
                             "model.geometry(batch.intrinsics, batch.cam_to_ego) (or call forward_batch), "
                             "or bake a fixed rig once with model.fix_geometry(model.rig_geometry(batch_size)).")
        return bev_pool(depth_probs, context, geometry)


class BevNet(nn.Module):
    """Images + geometry + ego status + command → named outputs (see stack.models.outputs)."""

    def __init__(self, pipeline: Pipeline):
        super().__init__()
        model, rig = pipeline.model, pipeline.data.rig
        self.pipeline = pipeline
        self.loss_weights: LossWeights = model.loss_weights
        self.cameras, self.image_size = len(rig.cameras), (rig.image_height, rig.image_width)
        self.grid = grid_cells(model.bev)
        channels = model.neck_channels
        self.image_encoder = ImageEncoder(model.backbone, model.backbone_checkpoint, channels,
                                          model.segmentation_stride, model.feature_stride)
        self.depth_head = DepthContextHead(channels, model.depth.bins, model.depth.camera_aware)
        self.fixed_cameras: torch.Tensor | None = None
        """The rig's `camera_vector` baked by `fix_geometry` for a camera-aware depth head (export)."""
        self.segmentation_head = SegmentationHead(channels, len(model.segmentation_classes))
        self.view_transform = ViewTransform()
        self.temporal_frames = model.temporal_frames
        self.bev_pre_encoder = nn.Sequential(*(ResidualBlock(channels, channels)
                                               for _ in range(model.temporal_pre_blocks)))
        self.bev_encoder = BevEncoder(channels * (1 + self.temporal_frames), model.bev_channels)
        self.detection_head = DetectionHead(model.bev_channels, len(model.detection_classes),
                                            len(ATTRIBUTES) if model.attribute_head else 0)
        if model.planning_accelerations:
            bev = model.bev
            self.planning_head = PathSpeedPlanningHead(
                model.bev_channels, len(model.detection_classes), self.grid, (tuple(bev.x_range), tuple(bev.y_range)),
                list(model.planning_accelerations), model.planning_steps, len(COMMANDS), model.path_points,
                model.path_spacing_m, model.planning_layers, model.planning_width, model.planning_collision_weight,
                model.planning_velocity, model.planning_objects, bev.cell_size, model.score_threshold)
        else:
            self.planning_head = PlanningHead(model.bev_channels, self.grid, model.planning_modes,
                                              model.planning_steps, len(COMMANDS), model.planning_layers,
                                              model.planning_width)

    def forward(self, images: torch.Tensor, ego_status: torch.Tensor, command: torch.Tensor,
                geometry: BevPoolGeometry | None = None, bev_rotation: torch.Tensor | None = None,
                previous_bev: torch.Tensor | None = None, previous_pose: torch.Tensor | None = None,
                previous_valid: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
        """`bev_rotation` (B,) radians is the BEV augmentation's yaw (`Batch.bev_rotation`); None means 0 and is
        what export passes, so the exported graph keeps its inputs and, at 0, its outputs.

        With model.temporal_frames = k > 0, `previous_bev` (B, k C, X, Y) is the `bev_memory` output of the key frame
        0.5 s earlier (that frame's BEV and the k - 1 before it, all on that frame's cells, newest first) and
        `previous_pose` (B, 3) the ego pose then (`Batch.previous_pose`); None at a sequence start, where the frame
        is fused with itself k times (BEVDet4D). `bev_memory` is this frame's, for the next: this frame's BEV and
        the k - 1 newest of the warped memory, so one warp by one ego motion per key frame carries all k.
        `previous_valid` (B,), 1 or 0, says per sample whether `previous_bev` holds a memory or the sample starts a
        sequence: the exported stateful graph's way of saying None per sample (stack.deploy.exportable)."""
        batch, cameras = images.shape[:2]
        fine, lift = self.image_encoder(images.flatten(0, 1))
        depth_logits, context = self.depth_head(lift, self._cameras(geometry))
        seg_logits = self.segmentation_head(fine)
        depth_logits = depth_logits.unflatten(0, (batch, cameras))
        context = context.unflatten(0, (batch, cameras))
        bev = self.bev_pre_encoder(self.view_transform(depth_logits.softmax(dim=2), context, geometry))
        memory = bev
        if self.temporal_frames:
            aligned = self._aligned_previous(bev, previous_bev, previous_pose, bev_rotation)
            if previous_valid is not None:
                aligned = torch.where(previous_valid.view(-1, 1, 1, 1) > 0.5, aligned, self._repeated(bev))
            if self.temporal_frames > 1:  # this frame's BEV, then the k - 1 newest of the memory it fused
                memory = torch.cat([bev, aligned[:, :bev.shape[1] * (self.temporal_frames - 1)]], dim=1)
            bev = torch.cat([bev, aligned], dim=1)
        bev = self.bev_encoder(bev)
        detections = self.detection_head(bev)
        heatmap, box_regression = detections["heatmap"], detections["box_regression"]
        outputs = {"depth_logits": depth_logits, "seg_logits": seg_logits.unflatten(0, (batch, cameras)), **detections}
        if self.temporal_frames:
            outputs["bev_memory"] = memory
        if isinstance(self.planning_head, PathSpeedPlanningHead):
            outputs.update(self.planning_head(bev, heatmap, ego_status, command, bev_rotation, box_regression))
        else:
            trajectories, scores = self.planning_head(bev, ego_status, command, bev_rotation)
            outputs.update(plan_trajectories=trajectories, plan_scores=scores)
        return outputs

    def _aligned_previous(self, bev: torch.Tensor, previous_bev: torch.Tensor | None,
                          previous_pose: torch.Tensor | None, bev_rotation: torch.Tensor | None) -> torch.Tensor:
        """The previous frames' BEVs (k C channels) on this frame's cells; this frame's own, k times, where there
        are none."""
        if previous_bev is None:
            return self._repeated(bev)
        if previous_pose is None:
            raise StackError("BevNet.forward got previous_bev without previous_pose: pass the ego pose of the previous "
                             "key frame in the current ego frame (Batch.previous_pose)")
        ranges = self.pipeline.model.bev
        return warp_previous_bev(previous_bev, previous_pose, bev_rotation, tuple(ranges.x_range), tuple(ranges.y_range))

    def _repeated(self, bev: torch.Tensor) -> torch.Tensor:
        """A sequence start's memory: the frame's own BEV in each of the k slots."""
        return bev.repeat(1, self.temporal_frames, 1, 1) if self.temporal_frames > 1 else bev

    def memory(self, images: torch.Tensor, geometry: BevPoolGeometry | None) -> torch.Tensor:
        """The pre-encoded BEV of one frame without the heads: the previous key frame's `bev_memory`, computed in
        training without a gradient (BEVDet4D)."""
        batch, cameras = images.shape[:2]
        _, lift = self.image_encoder(images.flatten(0, 1))
        depth_logits, context = self.depth_head(lift, self._cameras(geometry))
        return self.bev_pre_encoder(self.view_transform(depth_logits.unflatten(0, (batch, cameras)).softmax(dim=2),
                                                        context.unflatten(0, (batch, cameras)), geometry))

    def _cameras(self, geometry: BevPoolGeometry | None) -> torch.Tensor | None:
        """The camera vectors a camera-aware depth head reads (None for the plain head): baked at export, otherwise
        from the cameras the batch's geometry was built from."""
        if self.depth_head.camera_gates is None:
            return None
        if self.fixed_cameras is not None:
            return self.fixed_cameras
        if geometry is None or geometry.intrinsics is None or geometry.cam_to_ego is None:
            raise StackError("this network's depth head reads each camera's calibration (model.depth.camera_aware): "
                             "pass the geometry model.geometry(batch.intrinsics, batch.cam_to_ego) builds, or bake a "
                             "fixed rig with model.fix_geometry(model.rig_geometry(batch_size))")
        return camera_vector(geometry.intrinsics, geometry.cam_to_ego, self.image_size)

    def geometry(self, intrinsics: torch.Tensor, cam_to_ego: torch.Tensor) -> BevPoolGeometry:
        """Pooling tables for this batch's cameras (B, N, 3, 3) and (B, N, 4, 4)."""
        model = self.pipeline.model
        return bev_geometry(intrinsics, cam_to_ego, self.image_size, model.feature_stride, model.depth, model.bev)

    def rig_geometry(self, batch: int, device: torch.device | str = "cpu") -> BevPoolGeometry:
        """Pooling tables of the pipeline's fixed rig (`stack.rig.rig_matrices`) at batch size `batch`."""
        from stack.rig import rig_matrices

        ks, poses = rig_matrices(self.pipeline.data.rig)
        ks = torch.as_tensor(ks, dtype=torch.float32, device=device).expand(batch, -1, -1, -1)
        poses = torch.as_tensor(poses, dtype=torch.float32, device=device).expand(batch, -1, -1, -1)
        return self.geometry(ks, poses)

    def fix_geometry(self, geometry: BevPoolGeometry | None) -> None:
        """Bake `geometry` into the module (export); None returns to per-call geometry (training)."""
        from stack.ops.bev_pool_onnx import FixedBevPool

        self.view_transform.fixed = None if geometry is None else FixedBevPool(geometry).to(geometry.device)
        self.fixed_cameras = None
        if geometry is not None and self.depth_head.camera_gates is not None:
            self.fixed_cameras = camera_vector(geometry.intrinsics, geometry.cam_to_ego, self.image_size)

    def forward_batch(self, batch: Batch, fuse_previous: bool = True) -> dict[str, torch.Tensor]:
        """`forward` on a Batch, with its geometry computed from the batch's cameras. `fuse_previous=False` gives a
        temporal network the input of a sequence's first frame (the frame fused with itself) instead of the batch's
        previous key frame (`stack.metrics.motion`)."""
        geometry = None if self.view_transform.fixed is not None else self.geometry(batch.intrinsics, batch.cam_to_ego)
        previous = None
        if self.temporal_frames and fuse_previous:
            with torch.no_grad():
                previous = self.previous_memory(batch, geometry)
        return self(batch.images, batch.ego_status, batch.command, geometry, batch.bev_rotation, previous,
                    batch.previous_pose)

    def previous_memory(self, batch: Batch, geometry: BevPoolGeometry | None) -> torch.Tensor:
        """The `bev_memory` the previous key frame would have output (B, k C, X, Y), from the batch's k previous key
        frames: the oldest's BEV as a sequence start's memory, then each newer frame's BEV with the memory before
        it warped onto its cells, as the deployed graph carries it from frame to frame (so the recurrence and this
        window give the same memory, exactly: the k - 1 slots a start repeats are pushed out before they count)."""
        k, cameras = self.temporal_frames, self.cameras
        needed = {"previous_images": batch.previous_images, "previous_pose": batch.previous_pose}
        if k > 1:
            needed.update(earlier_images=batch.earlier_images, earlier_poses=batch.earlier_poses)
        missing = [name for name, tensor in needed.items() if tensor is None]
        if missing:
            raise StackError(f"this network fuses the {k} previous key frame(s) (model.temporal_frames={k}) but the "
                             f"batch carries no {', '.join(missing)}: load it with the torch loader of a pipeline with "
                             f"model.temporal_frames={k}")
        frames = [batch.previous_images]  # newest first
        if k > 1:
            frames += list(batch.earlier_images.unflatten(1, (k - 1, cameras)).unbind(1))
        memory = self._repeated(self.memory(frames[-1], geometry))
        ranges = self.pipeline.model.bev
        for older, frame in reversed(list(enumerate(frames[:-1]))):
            aligned = warp_previous_bev(memory, batch.earlier_poses[:, older], batch.bev_rotation,
                                        tuple(ranges.x_range), tuple(ranges.y_range))
            bev = self.memory(frame, geometry)
            memory = torch.cat([bev, aligned[:, :bev.shape[1] * (k - 1)]], dim=1)
        return memory

    def loss(self, outputs: dict[str, torch.Tensor], batch: Batch) -> dict[str, torch.Tensor]:
        """Per-term losses, per-task sums, and `total` weighted by `model.loss_weights`."""
        from stack.models.losses import multitask_loss

        return multitask_loss(outputs, batch, self.pipeline)
