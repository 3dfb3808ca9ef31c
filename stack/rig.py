"""Camera rig geometry: intrinsics and camera-to-ego transforms from the pipeline's rig.

One place defines the conventions every stage shares (renderer, loaders, view
transform, export):

- ego frame: x forward, y left, z up; origin on the ground below the rear axle;
- camera frame (OpenCV): x right, y down, z along the optical axis;
- depth is z-depth along the optical axis, not ray length;
- intrinsics are pinhole with square pixels and the principal point at the centre.
"""

from __future__ import annotations

import math

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


def rig_matrices(rig: RigConfig) -> tuple[np.ndarray, np.ndarray]:
    """(K of shape (N, 3, 3), camera_to_ego of shape (N, 4, 4)) for the rig's N cameras, float64."""
    ks = np.stack([intrinsics(c, rig.image_width, rig.image_height) for c in rig.cameras])
    poses = np.stack([camera_to_ego(c) for c in rig.cameras])
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
