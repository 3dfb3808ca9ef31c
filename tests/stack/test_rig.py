"""Rig conventions: ego x forward / y left / z up, OpenCV camera axes, z-depth."""

import numpy as np
import pytest

from stack.config import load_pipeline
from stack.rig import camera_to_ego, intrinsics, rig_matrices, scale_intrinsics

RIG = load_pipeline().data.rig


def project(k, cam_to_ego, point_ego):
    cam = np.linalg.inv(cam_to_ego) @ np.append(point_ego, 1.0)
    uvw = k @ cam[:3]
    return uvw[:2] / uvw[2], cam[2]


@pytest.mark.parametrize("index", range(len(RIG.cameras)))
def test_point_on_the_optical_axis_projects_to_the_centre(index):
    camera = RIG.cameras[index]
    k, pose = intrinsics(camera, RIG.image_width, RIG.image_height), camera_to_ego(camera)
    ahead = pose[:3, 3] + 10.0 * pose[:3, 2]
    (u, v), depth = project(k, pose, ahead)
    assert (u, v) == pytest.approx((RIG.image_width / 2, RIG.image_height / 2))
    assert depth == pytest.approx(10.0)


def test_front_camera_axes():
    camera = RIG.cameras[0]
    k, pose = intrinsics(camera, RIG.image_width, RIG.image_height), camera_to_ego(camera)
    centre = np.array([camera.x + 20.0, camera.y, camera.z])
    (u_left, _), _ = project(k, pose, centre + [0, 2.0, 0])    # ego +y is to the left
    (_, v_up), _ = project(k, pose, centre + [0, 0, 2.0])      # ego +z is up
    assert u_left < RIG.image_width / 2 and v_up < RIG.image_height / 2


def test_horizontal_fov_spans_the_image():
    camera = RIG.cameras[0]
    k = intrinsics(camera, RIG.image_width, RIG.image_height)
    half = np.radians(camera.hfov_deg / 2)
    u = k[0, 0] * np.tan(half) + k[0, 2]
    assert u == pytest.approx(RIG.image_width)


def test_rotations_are_orthonormal():
    _, poses = rig_matrices(RIG)
    for rotation in poses[:, :3, :3]:
        assert rotation @ rotation.T == pytest.approx(np.eye(3))
        assert np.linalg.det(rotation) == pytest.approx(1.0)


def test_scale_intrinsics_matches_resized_projection():
    k = intrinsics(RIG.cameras[0], RIG.image_width, RIG.image_height)
    point = np.array([1.0, -0.5, 8.0])
    uv = (k @ point)[:2] / point[2]
    scaled = scale_intrinsics(k, 0.5, 0.5, crop_x=10, crop_y=4)
    uv2 = (scaled @ point)[:2] / point[2]
    assert uv2 == pytest.approx(uv * 0.5 - [10, 4])
