"""Synthetic Batches for benches and tests: a flat-ground scene seen by the pipeline's rig.

`random_batch` returns a `stack.batch.Batch` that passes `Batch.mismatches` for any
pipeline: the fixed rig's cameras, metric depth and road/sky semantics rendered
from a flat ground plane (z = 0), images painted by class with noise, random boxes
on the grid, and ego motion at constant speed and yaw rate (past and future
trajectories, command) — geometrically consistent, so depth, segmentation and
planning are learnable, not noise. The model and training benches time steps on it
(no loader in the way), so it ships with `stack`, beside `stack.batch`.
"""

from __future__ import annotations

import numpy as np
import torch

from stack.batch import BOX_FIELDS, IGNORE_INDEX, PAST_STEPS, Batch
from stack.pipeline import Pipeline
from stack.rig import rig_matrices

BOX_SIZES = {"car": (4.5, 1.9, 1.6), "truck": (8.0, 2.6, 3.2), "pedestrian": (0.7, 0.7, 1.75),
             "cyclist": (1.8, 0.7, 1.6)}
"""Typical (length, width, height) per class, metres; unknown classes use the car size."""
MAX_DEPTH_M = 80.0


def _ground_depth(pipeline: Pipeline) -> np.ndarray:
    """(N, H, W) z-depth of the ground plane per pixel; 0 where the ray misses it (sky)."""
    rig = pipeline.data.rig
    ks, poses = rig_matrices(rig)
    u, v = np.meshgrid(np.arange(rig.image_width) + 0.5, np.arange(rig.image_height) + 0.5)
    pixels = np.stack([u, v, np.ones_like(u)], axis=-1)
    rays = np.einsum("nij,hwj->nhwi", np.linalg.inv(ks), pixels)  # camera frame, z = 1
    down = np.einsum("nj,nhwj->nhw", poses[:, 2, :3], rays)  # ego z per unit of z-depth
    with np.errstate(divide="ignore"):
        depth = np.where(down < -1e-6, -poses[:, 2, 3, None, None] / down, 0.0)
    return np.where(depth <= MAX_DEPTH_M, depth, 0.0)


def _boxes(pipeline: Pipeline, rng: np.random.Generator, batch: int) -> tuple[np.ndarray, np.ndarray]:
    model, bev = pipeline.model, pipeline.model.bev
    boxes = np.zeros((batch, model.max_boxes, len(BOX_FIELDS)), np.float32)
    labels = np.full((batch, model.max_boxes), -1, np.int64)
    for b in range(batch):
        count = int(rng.integers(1, min(model.max_boxes, 8) + 1))
        labels[b, :count] = rng.integers(0, len(model.detection_classes), count)
        for i in range(count):
            size = BOX_SIZES.get(model.detection_classes[labels[b, i]], BOX_SIZES["car"])
            x = rng.uniform(*(0.8 * np.asarray(bev.x_range)))
            y = rng.uniform(*(0.8 * np.asarray(bev.y_range)))
            boxes[b, i] = [x, y, size[2] / 2, *size, rng.uniform(-np.pi, np.pi), *rng.normal(0, 2, 2)]
    return boxes, labels


def _ego_motion(rng: np.random.Generator, batch: int, steps: int):
    """Ego status, command, past and future xy at constant speed and yaw rate (0.5 s steps)."""
    speed, yaw_rate = rng.uniform(0, 12, batch), rng.uniform(-0.3, 0.3, batch)
    status = np.stack([speed, rng.normal(0, 0.5, batch), yaw_rate], -1).astype(np.float32)

    def positions(times: np.ndarray) -> np.ndarray:
        heading = yaw_rate[:, None] * times
        safe = np.where(np.abs(yaw_rate) < 1e-6, 1.0, yaw_rate)[:, None]
        x = np.where(np.abs(yaw_rate[:, None]) < 1e-6, speed[:, None] * times, speed[:, None] * np.sin(heading) / safe)
        y = np.where(np.abs(yaw_rate[:, None]) < 1e-6, 0.0, speed[:, None] * (1 - np.cos(heading)) / safe)
        return np.stack([x, y], -1).astype(np.float32)

    future = positions(0.5 * np.arange(1, steps + 1))
    past = positions(-0.5 * np.arange(PAST_STEPS, 0, -1))
    lateral = future[:, -1, 1]
    command = np.where(lateral > 2.0, 0, np.where(lateral < -2.0, 2, 1)).astype(np.int64)
    return status, command, past, future


def random_batch(pipeline: Pipeline, batch_size: int = 2, seed: int = 0) -> Batch:
    """A consistent synthetic Batch for `pipeline` (passes `Batch.mismatches`)."""
    rng = np.random.default_rng(seed)
    rig, model = pipeline.data.rig, pipeline.model
    classes = model.segmentation_classes
    ks, poses = rig_matrices(rig)
    ground = _ground_depth(pipeline)
    depth = np.broadcast_to(ground, (batch_size, *ground.shape)).copy()
    semantic = np.where(depth > 0, classes.index("road") if "road" in classes else 0,
                        classes.index("sky") if "sky" in classes else len(classes) - 1)
    semantic = np.where(rng.random(depth.shape) < 0.02, IGNORE_INDEX, semantic).astype(np.uint8)
    palette = rng.integers(0, 256, (256, 3))
    images = palette[semantic].transpose(0, 1, 4, 2, 3) + rng.normal(0, 12, (*depth.shape[:2], 3, *depth.shape[2:]))
    boxes, labels = _boxes(pipeline, rng, batch_size)
    status, command, past, future = _ego_motion(rng, batch_size, model.planning_steps)
    valid = np.ones((batch_size, model.planning_steps), bool)
    valid[-1, -1] = batch_size == 1  # one sample whose scene ends before the last waypoint
    n = len(rig.cameras)
    as_float = dict(dtype=torch.float32)
    temporal = {}
    if model.temporal_frames:  # the frames 0.5 s apart before it: the same scene a few pixels back each, and the poses
        from stack.kinematics import previous_pose

        def shifted(frames_back: int) -> torch.Tensor:
            return torch.as_tensor(np.clip(np.roll(images, 2 * frames_back, axis=-1), 0, 255).astype(np.uint8))

        pose = np.stack([previous_pose(p) for p in past])
        temporal = {"previous_images": shifted(1), "previous_pose": torch.as_tensor(pose)}
        if model.temporal_frames > 1:  # constant speed and yaw rate: every key frame moved as the last one did
            temporal.update(earlier_images=torch.cat([shifted(j) for j in range(2, model.temporal_frames + 1)], dim=1),
                            earlier_poses=torch.as_tensor(np.repeat(pose[:, None], model.temporal_frames - 1, 1)))
    return Batch(
        images=torch.as_tensor(np.clip(images, 0, 255).astype(np.uint8)),
        intrinsics=torch.as_tensor(ks, **as_float).expand(batch_size, n, 3, 3).contiguous(),
        cam_to_ego=torch.as_tensor(poses, **as_float).expand(batch_size, n, 4, 4).contiguous(),
        depth=torch.as_tensor(depth, dtype=torch.float16), semantic=torch.as_tensor(semantic),
        boxes=torch.as_tensor(boxes), box_labels=torch.as_tensor(labels),
        ego_status=torch.as_tensor(status), command=torch.as_tensor(command),
        past_trajectory=torch.as_tensor(past), future_trajectory=torch.as_tensor(future),
        future_valid=torch.as_tensor(valid), bev_rotation=torch.zeros(batch_size, dtype=torch.float32), **temporal,
        box_attributes=torch.as_tensor(_attributes(model.detection_classes, labels, rng)),
    )


def _attributes(classes, labels: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """(B, M) a random attribute each box's class may carry (`class_attributes`); -1 for none and padding."""
    from stack.metrics.detection import class_attributes

    allowed = class_attributes(classes)
    out = np.full(labels.shape, -1, np.int64)
    for index in zip(*np.nonzero(labels >= 0)):
        choices = np.flatnonzero(allowed[labels[index]])
        out[index] = rng.choice(choices) if len(choices) else -1
    return out

