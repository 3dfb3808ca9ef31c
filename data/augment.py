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

Both backends draw each sample's parameters with `draw_params` from the same seeded
stream. The torch backend applies them to decoded rows (`augment_row`); the DALI backend
feeds them into its graph, which resizes, crops and jitters the pixels
(`stack.data.dali_augment`), and applies the label geometry here (`apply_geometry`).
Depth, semantics, intrinsics and every rotated label agree exactly; images within
the difference of two bilinear resamplers (tests/data/test_dali_augment.py).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from stack.batch import IGNORE_INDEX
from stack.pipeline import AugmentConfig
from stack.rig import scale_intrinsics


@dataclass(frozen=True)
class AugmentParams:
    """One sample's augmentation, drawn once (`draw_params`) and applied by either backend.

    The torch backend applies it to tensors (`apply_params`); the DALI backend feeds it into its
    graph for the pixels (`stack.data.dali_augment`) and applies the geometry here (`apply_geometry`),
    so the two cannot drift: same random stream, same numbers, same label arithmetic.
    """

    height: int
    width: int
    new_h: int
    new_w: int
    crop_y: int
    crop_x: int
    angle: float = 0.0
    """BEV rotation, radians."""
    colour: tuple | None = None
    """(brightness, contrast, saturation) factors, or None without colour jitter."""

    @property
    def resizes(self) -> bool:
        return (self.new_h, self.new_w, self.crop_y, self.crop_x) != (self.height, self.width, 0, 0)


def draw_params(config: AugmentConfig, height: int, width: int, rng: np.random.Generator) -> AugmentParams:
    """Draw one sample's parameters from `rng`, in the order the augmentations apply (scale, crop y, crop x,
    angle, the three jitter factors); a disabled augmentation draws nothing."""
    new_h, new_w, crop_y, crop_x = height, width, 0, 0
    low, high = config.resize_scale
    if (low, high) != (1.0, 1.0):
        new_h, new_w = resized_size(height, width, float(rng.uniform(low, high)))
        crop_y, crop_x = crop_offsets(height, width, new_h, new_w, rng)
    angle = math.radians(float(rng.uniform(-config.bev_rotate_deg, config.bev_rotate_deg))) \
        if config.bev_rotate_deg > 0 else 0.0
    colour = None
    if config.color_jitter > 0:
        colour = tuple(float(f) for f in rng.uniform(1 - config.color_jitter, 1 + config.color_jitter, 3))
    return AugmentParams(height, width, new_h, new_w, crop_y, crop_x, angle, colour)


def resized_size(height: int, width: int, scale: float) -> tuple[int, int]:
    return max(int(round(height * scale)), 1), max(int(round(width * scale)), 1)


def crop_offsets(height: int, width: int, new_h: int, new_w: int, rng: np.random.Generator) -> tuple[int, int]:
    """Top-left of the (height, width) window in the resized image; negative pads on that side."""
    crop_y = int(rng.integers(min(0, new_h - height), max(0, new_h - height) + 1))
    crop_x = int(rng.integers(min(0, new_w - width), max(0, new_w - width) + 1))
    return crop_y, crop_x


def nearest_indices(size_in: int, size_out: int, accumulate: bool = False) -> torch.Tensor:
    """Source index of each output pixel for a nearest resize: the pixel under the output pixel's centre,
    floor((i + 0.5) * in / out). Unlike torch's legacy `mode="nearest"` (floor(i * in / out)) this has no
    half-pixel shift against the intrinsics, which scale about pixel corners (`stack.rig.scale_intrinsics`).

    The float32 arithmetic is DALI's CPU `ResampleNN` (resampling_impl_cpu.h), so depth and semantics agree
    bit for bit across backends where the centre falls exactly on a pixel edge: columns are (i + 0.5) * s,
    rows (`accumulate`) start at 0.5 * s and add s per row, with s = float32(in) / float32(out)."""
    step = np.float32(size_in) / np.float32(size_out)
    if accumulate:
        steps = np.full(size_out, step, np.float32)
        steps[0] = np.float32(0.5) * step
        source = np.add.accumulate(steps, dtype=np.float32)  # sequential, as DALI's loop
    else:
        source = (np.arange(size_out, dtype=np.float32) + np.float32(0.5)) * step
    return torch.from_numpy(np.clip(np.floor(source).astype(np.int64), 0, size_in - 1))


def _place(tensor: torch.Tensor, height: int, width: int, crop_y: int, crop_x: int, fill) -> torch.Tensor:
    """Crop (positive offsets) or pad (negative) a (..., h, w) tensor to (..., height, width)."""
    out = torch.full((*tensor.shape[:-2], height, width), fill, dtype=tensor.dtype)
    h, w = tensor.shape[-2:]
    src_y, src_x = max(crop_y, 0), max(crop_x, 0)
    dst_y, dst_x = max(-crop_y, 0), max(-crop_x, 0)
    rows, cols = min(h - src_y, height - dst_y), min(w - src_x, width - dst_x)
    out[..., dst_y:dst_y + rows, dst_x:dst_x + cols] = tensor[..., src_y:src_y + rows, src_x:src_x + cols]
    return out


def augmented_intrinsics(intrinsics: torch.Tensor, params: AugmentParams) -> torch.Tensor:
    """K after the resize and crop of `params` (float64 arithmetic, float32 result)."""
    k = scale_intrinsics(intrinsics.double().numpy(), params.new_w / params.width, params.new_h / params.height,
                         params.crop_x, params.crop_y)
    return torch.from_numpy(k).float()


def apply_resize_crop(row: dict, params: AugmentParams) -> None:
    """Resize every camera to (new_h, new_w) (images bilinear, antialiased when shrinking; depth and semantics
    nearest) and crop/pad back at (crop_y, crop_x) with depth 0 / IGNORE_INDEX; update K."""
    height, width, new_h, new_w = params.height, params.width, params.new_h, params.new_w
    resized = F.interpolate(row["images"].float(), size=(new_h, new_w), mode="bilinear", align_corners=False,
                            antialias=new_h < height or new_w < width)
    row["images"] = _place(resized.round().clamp(0, 255).to(torch.uint8), height, width, params.crop_y,
                           params.crop_x, 0)
    rows, cols = nearest_indices(height, new_h, accumulate=True), nearest_indices(width, new_w)
    for name, fill in (("depth", 0.0), ("semantic", IGNORE_INDEX)):
        nearest = row[name].index_select(-2, rows).index_select(-1, cols)
        row[name] = _place(nearest, height, width, params.crop_y, params.crop_x, fill)
    row["intrinsics"] = augmented_intrinsics(row["intrinsics"], params)


def resize_crop(row: dict, scale: float, rng: np.random.Generator) -> None:
    """Resize all cameras by `scale`, crop/pad back to the original size at a random offset; update K."""
    height, width = row["images"].shape[-2:]
    new_h, new_w = resized_size(height, width, scale)
    crop_y, crop_x = crop_offsets(height, width, new_h, new_w, rng)
    apply_resize_crop(row, AugmentParams(height, width, new_h, new_w, crop_y, crop_x))


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


def colour_transform(brightness: float, contrast: float, saturation: float) -> tuple[np.ndarray, float]:
    """Colour jitter as one affine map per pixel: out = A @ rgb + shift * mean, `mean` the camera image's mean.

    Brightness scales, contrast scales about the (scaled) image mean, saturation scales about each pixel's
    grey (mean of R, G, B): b*(m + c*(x - m)) is linear in x plus b*(1 - c)*m, and the saturation matrix
    S = s*I + (1 - s)/3 fixes grey, so A = b*c*S and shift = b*(1 - c). The DALI graph applies the same A
    and shift (`fn.coord_transform`), the torch backend below."""
    matrix = saturation * np.eye(3) + (1.0 - saturation) / 3.0
    return (brightness * contrast * matrix).astype(np.float32), float(brightness * (1.0 - contrast))


def apply_colour(row: dict, colour: tuple) -> None:
    matrix, shift = colour_transform(*colour)
    images = row["images"].float()
    mean = images.mean(dim=(-3, -2, -1), keepdim=True)
    images = torch.einsum("ij,...jhw->...ihw", torch.from_numpy(matrix), images) + shift * mean
    row["images"] = images.round().clamp(0, 255).to(torch.uint8)


def jitter_colour(row: dict, strength: float, rng: np.random.Generator) -> None:
    """Random brightness, contrast and saturation factors in [1 - strength, 1 + strength]."""
    apply_colour(row, tuple(float(f) for f in rng.uniform(1 - strength, 1 + strength, 3)))


def apply_geometry(row: dict, params: AugmentParams) -> None:
    """The label side of `params` (intrinsics, BEV rotation): what the DALI backend applies in Python."""
    if params.resizes:
        row["intrinsics"] = augmented_intrinsics(row["intrinsics"], params)
    if params.angle:
        rotate_bev(row, params.angle)


def apply_params(row: dict, params: AugmentParams) -> dict:
    """Apply `params` to one Batch row (in place) and return it: the torch backend's augmentation.

    A row with the previous key frames (`previous_images`, `earlier_images`, model.temporal_frames) gets one
    augmentation for every frame, as BEVDet4D requires: their pixels are resized, cropped and jittered together (as more
    cameras), and the BEV rotation turns both ego frames alike (the network conjugates the ego motion by it)."""
    cameras = row["images"].shape[0]
    history = [name for name in ("previous_images", "earlier_images") if name in row]
    counts = [row[name].shape[0] for name in history]
    if history:
        row["images"] = torch.cat([row["images"], *(row.pop(name) for name in history)])
    if params.resizes:
        apply_resize_crop(row, params)
    if params.angle:
        rotate_bev(row, params.angle)
    if params.colour is not None:
        apply_colour(row, params.colour)
    if history:
        parts = row["images"].split([cameras, *counts])
        row["images"] = parts[0]
        row.update(zip(history, parts[1:]))
    return row


def augment_row(row: dict, config: AugmentConfig, rng: np.random.Generator) -> dict:
    """Draw parameters for one Batch row and apply them (in place); returns the row."""
    height, width = row["images"].shape[-2:]
    return apply_params(row, draw_params(config, height, width, rng))
