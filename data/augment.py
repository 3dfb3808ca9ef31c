"""Training augmentation that keeps every label consistent with the pixels (BEVDet-style).

- Image resize by a random factor, then a random crop (or pad) back to the rig's
  size: images resample bilinearly, depth and semantics nearest, padding is
  depth 0 / IGNORE_INDEX, and the intrinsics follow (`stack.rig.scale_intrinsics`),
  so projecting a 3D point gives the same image content before and after.
- BEV rotation by a random yaw θ: the whole ego-frame scene rotates about the ego,
  boxes (centre, yaw, velocity), every `cam_to_ego`, and the ego's own past and
  future trajectories, and θ is recorded in the row (`Batch.bev_rotation`); images
  do not change. This is BEVDet's BEV data augmentation (BDA; Huang et al.,
  arXiv:2112.11790): one rotation applied to the BEV features (here through the
  camera poses the view transform uses) and to every BEV target alike.
- Colour jitter (brightness, contrast, saturation) on the images only.

Why rotate the trajectories too, and what the planner sees. Rotating boxes but not
the ego's plan leaves two frames in one sample: the collision loss would score a
plan in the body frame against boxes in the rotated frame, and the planner would
learn "drive along +x" from a scene whose road now runs along θ. UniAD avoids the
clash by keeping BEV augmentation away from planning (Hu et al., arXiv:2212.10156);
that gives up the augmentation's regularisation for the head that most needs the
scene. Here everything rotates, and the
rotation is given to the planner: `PlanningHead` still plans in the ego's body
frame (its ego status, a rotation-invariant speed / acceleration / yaw rate, rolled
out along +x, plus a learned residual), then turns its trajectories by θ into the
rotated BEV frame, so plan, targets and boxes share one frame; cos θ and sin θ also
enter its ego query, so it can relate the rotated BEV tokens to its body frame. At
evaluation and in export θ is 0 (`BevNet.forward(..., bev_rotation=None)`), and the
head is exactly the unrotated planner.

Both loader backends call `augment_row` on the rows they decode, so they
augment identically (same rows, same random stream, same `bev_rotation`).
"""

from __future__ import annotations

import math

import numpy as np
import torch
import torch.nn.functional as F

from stack.batch import IGNORE_INDEX
from stack.pipeline import AugmentConfig
from stack.rig import scale_intrinsics


def _place(tensor: torch.Tensor, height: int, width: int, crop_y: int, crop_x: int, fill) -> torch.Tensor:
    """Crop (positive offsets) or pad (negative) a (..., h, w) tensor to (..., height, width)."""
    out = torch.full((*tensor.shape[:-2], height, width), fill, dtype=tensor.dtype)
    h, w = tensor.shape[-2:]
    src_y, src_x = max(crop_y, 0), max(crop_x, 0)
    dst_y, dst_x = max(-crop_y, 0), max(-crop_x, 0)
    rows, cols = min(h - src_y, height - dst_y), min(w - src_x, width - dst_x)
    out[..., dst_y:dst_y + rows, dst_x:dst_x + cols] = tensor[..., src_y:src_y + rows, src_x:src_x + cols]
    return out


def resize_crop(row: dict, scale: float, rng: np.random.Generator) -> None:
    """Resize all cameras by `scale`, crop/pad back to the original size at a random offset; update K."""
    images = row["images"]
    height, width = images.shape[-2:]
    new_h, new_w = max(int(round(height * scale)), 1), max(int(round(width * scale)), 1)
    crop_y = int(rng.integers(min(0, new_h - height), max(0, new_h - height) + 1))
    crop_x = int(rng.integers(min(0, new_w - width), max(0, new_w - width) + 1))
    resized = F.interpolate(images.float(), size=(new_h, new_w), mode="bilinear", align_corners=False, antialias=scale < 1)
    row["images"] = _place(resized.round().clamp(0, 255).to(torch.uint8), height, width, crop_y, crop_x, 0)
    depth = F.interpolate(row["depth"][:, None], size=(new_h, new_w), mode="nearest")[:, 0]
    row["depth"] = _place(depth, height, width, crop_y, crop_x, 0.0)
    semantic = F.interpolate(row["semantic"][:, None].float(), size=(new_h, new_w), mode="nearest")[:, 0].to(row["semantic"].dtype)
    row["semantic"] = _place(semantic, height, width, crop_y, crop_x, IGNORE_INDEX)
    k = scale_intrinsics(row["intrinsics"].double().numpy(), new_w / width, new_h / height, crop_x, crop_y)
    row["intrinsics"] = torch.from_numpy(k).float()


def rotate_bev(row: dict, angle: float) -> None:
    """Rotate the scene about the ego by `angle` (radians, about z): boxes, velocities, camera poses and the ego's
    past and future trajectories; `bev_rotation` accumulates the angle (see the module docstring)."""
    c, s = math.cos(angle), math.sin(angle)
    rotation = torch.tensor([[c, -s], [s, c]], dtype=torch.float32)
    boxes = row["boxes"].clone()
    real = row["box_labels"] >= 0
    boxes[:, 0:2] = boxes[:, 0:2] @ rotation.T
    boxes[:, 7:9] = boxes[:, 7:9] @ rotation.T
    boxes[:, 6] = torch.remainder(boxes[:, 6] + angle + math.pi, 2 * math.pi) - math.pi
    row["boxes"] = torch.where(real[:, None], boxes, row["boxes"])
    transform = torch.eye(4)
    transform[:2, :2] = rotation
    row["cam_to_ego"] = transform @ row["cam_to_ego"]
    row["past_trajectory"] = row["past_trajectory"] @ rotation.T
    row["future_trajectory"] = row["future_trajectory"] @ rotation.T  # invalid waypoints are 0 and stay 0
    row["bev_rotation"] = torch.as_tensor(row.get("bev_rotation", 0.0), dtype=torch.float32) + angle


def jitter_colour(row: dict, strength: float, rng: np.random.Generator) -> None:
    """Random brightness, contrast and saturation factors in [1 - strength, 1 + strength]."""
    brightness, contrast, saturation = rng.uniform(1 - strength, 1 + strength, 3)
    images = row["images"].float() * brightness
    mean = images.mean(dim=(-3, -2, -1), keepdim=True)
    images = (images - mean) * contrast + mean
    grey = images.mean(dim=-3, keepdim=True)
    images = (images - grey) * saturation + grey
    row["images"] = images.round().clamp(0, 255).to(torch.uint8)


def augment_row(row: dict, config: AugmentConfig, rng: np.random.Generator) -> dict:
    """Apply the configured augmentations to one Batch row (in place) and return it."""
    low, high = config.resize_scale
    if (low, high) != (1.0, 1.0):
        resize_crop(row, float(rng.uniform(low, high)), rng)
    if config.bev_rotate_deg > 0:
        rotate_bev(row, math.radians(float(rng.uniform(-config.bev_rotate_deg, config.bev_rotate_deg))))
    if config.color_jitter > 0:
        jitter_colour(row, config.color_jitter, rng)
    return row
