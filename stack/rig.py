"""Camera rig geometry: intrinsics and camera-to-ego transforms from the pipeline's rig.

One place defines the conventions every stage shares (renderer, loaders, view
transform, export):

- ego frame: x forward, y left, z up; origin on the ground below the rear axle;
- camera frame (OpenCV): x right, y down, z along the optical axis;
- depth is z-depth along the optical axis, not ray length;
- a rig's nominal intrinsics are pinhole with square pixels and the principal point at the centre; one
  vehicle's measured cameras (`MeasuredCamera`, a `CalibratedRig`) may have any pinhole K and any mount.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from stack.pipeline import Camera, RigConfig


def intrinsics(camera: Camera, width: int, height: int) -> np.ndarray:
    """3x3 pinhole matrix K for an image of `width` x `height` pixels."""
    focal = (width / 2.0) / math.tan(math.radians(camera.hfov_deg) / 2.0)
    return np.array([[focal, 0.0, width / 2.0], [0.0, focal, height / 2.0], [0.0, 0.0, 1.0]])


def camera_to_ego(camera: Camera) -> np.ndarray:
    """4x4 transform taking camera-frame points to the ego frame."""
    yaw, pitch = math.radians(camera.yaw_deg), math.radians(camera.pitch_deg)
    forward = np.array([math.cos(pitch) * math.cos(yaw), math.cos(pitch) * math.sin(yaw), -math.sin(pitch)])
    right = np.array([math.sin(yaw), -math.cos(yaw), 0.0])
    down = np.cross(forward, right)
    transform = np.eye(4)
    transform[:3, :3] = np.stack([right, down, forward], axis=1)
    transform[:3, 3] = [camera.x, camera.y, camera.z]
    return transform


@dataclass(frozen=True)
class MeasuredCamera:
    """One vehicle's camera as calibrated (a `stack deploy --calibration` file): its own K and mount, where a
    `Camera` of `data.rig` is the nominal design. The simulator renders either, so a per-vehicle bundle can be
    driven through the cameras it was built for."""

    name: str
    intrinsics: tuple
    """3x3 K in pixels, row-major nested tuples."""
    cam_to_ego: tuple
    """4x4 camera frame -> ego frame, row-major nested tuples."""


@dataclass(frozen=True)
class CalibratedRig:
    """A rig of `MeasuredCamera`s: what `rig_matrices` and the renderer read of a `RigConfig` (image size, cameras
    in order), with measured matrices in place of nominal mounts."""

    image_width: int
    image_height: int
    cameras: tuple

    @classmethod
    def from_matrices(cls, width: int, height: int, names, ks: np.ndarray, poses: np.ndarray) -> "CalibratedRig":
        as_tuple = lambda m: tuple(tuple(float(v) for v in row) for row in np.asarray(m))  # noqa: E731
        return cls(int(width), int(height), tuple(MeasuredCamera(str(n), as_tuple(k), as_tuple(p))
                                                  for n, k, p in zip(names, ks, poses)))


def rig_matrices(rig: "RigConfig | CalibratedRig") -> tuple[np.ndarray, np.ndarray]:
    """(K of shape (N, 3, 3), camera_to_ego of shape (N, 4, 4)) for the rig's N cameras, float64."""
    ks = np.stack([np.array(c.intrinsics, np.float64) if isinstance(c, MeasuredCamera)
                   else intrinsics(c, rig.image_width, rig.image_height) for c in rig.cameras])
    poses = np.stack([np.array(c.cam_to_ego, np.float64) if isinstance(c, MeasuredCamera)
                      else camera_to_ego(c) for c in rig.cameras])
    return ks, poses


def scale_intrinsics(k: np.ndarray, scale_x: float, scale_y: float, crop_x: float = 0.0, crop_y: float = 0.0) -> np.ndarray:
    """K after resizing an image by (scale_x, scale_y) and then cropping (crop_x, crop_y) pixels off the top-left."""
    out = np.array(k, dtype=np.float64, copy=True)
    out[..., 0, :] *= scale_x
    out[..., 1, :] *= scale_y
    out[..., 0, 2] -= crop_x
    out[..., 1, 2] -= crop_y
    return out


def rotation_angle_deg(a: np.ndarray, b: np.ndarray) -> float:
    """Angle of the rotation taking `a` to `b` (both 3x3 rotations), degrees."""
    cosine = (np.trace(a.T @ b) - 1.0) / 2.0
    return math.degrees(math.acos(float(np.clip(cosine, -1.0, 1.0))))


def mount_of(k: np.ndarray, pose: np.ndarray, width: int) -> dict:
    """The rig parameters (data.rig.cameras.*: x, y, z, yaw_deg, pitch_deg, hfov_deg) of a stored camera: the
    inverse of `intrinsics` and `camera_to_ego`, roll aside (the rig has none)."""
    forward = pose[:3, 2]
    return {"x": float(pose[0, 3]), "y": float(pose[1, 3]), "z": float(pose[2, 3]),
            "yaw_deg": math.degrees(math.atan2(forward[1], forward[0])),
            "pitch_deg": math.degrees(-math.asin(float(np.clip(forward[2], -1.0, 1.0)))),
            "hfov_deg": math.degrees(2.0 * math.atan(width / 2.0 / float(k[0, 0])))}
