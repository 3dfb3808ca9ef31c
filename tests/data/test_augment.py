"""Augmentation keeps labels consistent: a 3D point lands on the same image content before and after."""

import math

import numpy as np
import pytest
import torch

from stack.data import build_loader
from stack.data import augment
from stack.data.augment import apply_colour, augment_row, nearest_indices, resize_crop, rotate_bev
from stack.pipeline import AugmentConfig
from stack.rig import scale_intrinsics


def _row(pipeline):
    batch = next(iter(build_loader(pipeline, "val", 0, 1, augment=False)))
    return {name: tensor[0].clone() for name, tensor in batch.tensors().items()}


def _project(row, camera, point):
    cam = torch.linalg.inv(row["cam_to_ego"][camera].double()) @ torch.cat([point.double(), torch.ones(1, dtype=torch.float64)])
    uvw = row["intrinsics"][camera].double() @ cam[:3]
    return (uvw[:2] / uvw[2]).numpy(), float(cam[2])


def _visible_box(row):
    width, height = row["images"].shape[-1], row["images"].shape[-2]
    for index in range(len(row["box_labels"])):
        if row["box_labels"][index] < 0:
            continue
        for camera in range(len(row["intrinsics"])):
            (u, v), z = _project(row, camera, row["boxes"][index, :3])
            if z > 1 and 10 <= u < width - 10 and 10 <= v < height - 10:
                return index, camera, u, v
    raise AssertionError("no box in view")


def marked_pixel_misses(pipeline, augment, seeds=range(6)) -> list:
    """Projection consistency: mark the pixels around a visible box centre in the semantics, augment the row
    with `augment(row, rng)` (resize/crop and rotation at least), project the moved box centre through the
    updated intrinsics and pose, and list the seeds where it no longer lands on the mark."""
    misses = []
    for seed in seeds:
        row = _row(pipeline)
        index, camera, u, v = _visible_box(row)
        row["semantic"][camera] = 0
        row["semantic"][camera, int(v) - 2:int(v) + 3, int(u) - 2:int(u) + 3] = 7
        augment(row, np.random.default_rng(seed))
        (u2, v2), _ = _project(row, camera, row["boxes"][index, :3])
        inside = 0 <= int(v2) < row["semantic"].shape[-2] and 0 <= int(u2) < row["semantic"].shape[-1]
        if not inside or row["semantic"][camera, int(v2), int(u2)] != 7:
            misses.append((seed, (u, v), (u2, v2)))
    return misses


def _resize_crop_rotate(row, rng):
    resize_crop(row, float(rng.uniform(0.8, 1.25)), rng)
    rotate_bev(row, math.radians(float(rng.uniform(-30, 30))))


def test_box_centre_hits_the_same_marked_pixel_after_resize_crop_and_rotation(dataset):
    pipeline, _ = dataset
    assert marked_pixel_misses(pipeline, _resize_crop_rotate) == []


def test_an_intrinsics_update_without_the_crop_offset_misses_the_marked_pixel(dataset, monkeypatch):
    pipeline, _ = dataset
    monkeypatch.setattr(augment, "scale_intrinsics",
                        lambda k, sx, sy, crop_x=0.0, crop_y=0.0: scale_intrinsics(k, sx, sy))
    assert len(marked_pixel_misses(pipeline, _resize_crop_rotate)) >= 4


def test_nearest_resize_picks_the_pixel_under_each_output_centre():
    for size_in, size_out in ((64, 57), (128, 141), (256, 230), (256, 315), (7, 3)):
        centres = (np.arange(size_out) + 0.5) * size_in / size_out
        for accumulate in (False, True):  # columns and rows (DALI's two float32 orders)
            index = nearest_indices(size_in, size_out, accumulate).numpy()
            assert (index <= centres + 1e-4).all() and (centres - index < 1 + 1e-4).all()
            assert index.min() >= 0 and index.max() <= size_in - 1


def test_colour_transform_is_brightness_then_contrast_then_saturation():
    rng = np.random.default_rng(0)
    images = torch.from_numpy(rng.integers(0, 256, (2, 3, 8, 8), dtype=np.uint8))
    b, c, s = 1.2, 0.8, 0.7
    x = images.float() * b
    mean = x.mean(dim=(-3, -2, -1), keepdim=True)
    x = (x - mean) * c + mean
    grey = x.mean(dim=-3, keepdim=True)
    expected = ((x - grey) * s + grey).round().clamp(0, 255)
    row = {"images": images.clone()}
    apply_colour(row, (b, c, s))
    assert (row["images"].float() - expected).abs().max() <= 1


def test_rotation_moves_boxes_velocities_cameras_and_the_ego_trajectories_together(dataset):
    pipeline, _ = dataset
    row = _row(pipeline)
    real = row["box_labels"] >= 0
    box = int(torch.nonzero(real)[0])
    row["boxes"][box, :2] = row["future_trajectory"][3]  # a box that sits on the plan's 2 s waypoint
    row["past_trajectory"][0] = torch.tensor([-6.0, 1.0])
    before = {k: v.clone() for k, v in row.items()}
    rotate_bev(row, math.radians(20))
    np.testing.assert_allclose(row["boxes"][real, :2].norm(dim=1), before["boxes"][real, :2].norm(dim=1), rtol=1e-5)
    np.testing.assert_allclose(row["boxes"][real, 7:9].norm(dim=1), before["boxes"][real, 7:9].norm(dim=1), atol=1e-5)
    yaw_change = torch.remainder(row["boxes"][real, 6] - before["boxes"][real, 6], 2 * math.pi)
    np.testing.assert_allclose(yaw_change, math.radians(20), atol=1e-5)
    # the ego's trajectories turn with the scene: the waypoint still sits on the box centre
    np.testing.assert_allclose(row["future_trajectory"][3], row["boxes"][box, :2], atol=1e-5)
    turned = torch.atan2(row["past_trajectory"][0, 1], row["past_trajectory"][0, 0]) - math.atan2(1.0, -6.0)
    np.testing.assert_allclose(torch.remainder(turned, 2 * math.pi), math.radians(20), atol=1e-5)
    np.testing.assert_allclose(row["future_trajectory"].norm(dim=-1), before["future_trajectory"].norm(dim=-1),
                               atol=1e-5)
    assert row["bev_rotation"].dtype == torch.float32 and float(row["bev_rotation"]) == pytest.approx(math.radians(20))
    # a camera sees exactly the same ego-frame point after rotating both
    for camera in range(len(row["intrinsics"])):
        a, _ = _project(before, camera, before["boxes"][box, :3])
        b, _ = _project(row, camera, row["boxes"][box, :3])
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-3)


def test_padding_waypoints_stay_zero_and_rotations_accumulate(dataset):
    pipeline, _ = dataset
    row = _row(pipeline)
    row["future_valid"][-2:] = False
    row["future_trajectory"][-2:] = 0.0
    rotate_bev(row, 0.3)
    rotate_bev(row, -0.1)
    assert (row["future_trajectory"][-2:] == 0).all()
    assert float(row["bev_rotation"]) == pytest.approx(0.2)


def test_loaders_record_the_rotation_zero_without_augmentation_and_the_drawn_one_with_it(dataset, small_pipeline):
    pipeline, _ = dataset
    plain = next(iter(build_loader(pipeline, "train", 0, 1, shuffle=False, augment=False)))
    assert plain.bev_rotation.dtype == torch.float32 and (plain.bev_rotation == 0).all()
    rotating = small_pipeline(pipeline.data.root, "data.augment.bev_rotate_deg=30")
    turned = next(iter(build_loader(rotating, "train", 0, 1, shuffle=False, augment=True)))
    assert turned.mismatches(rotating) == []
    assert (turned.bev_rotation != 0).all() and (turned.bev_rotation.abs() <= math.radians(30)).all()
    for i, angle in enumerate(turned.bev_rotation.tolist()):  # each row's plan turned by its own angle
        c, s = math.cos(angle), math.sin(angle)
        expected = plain.future_trajectory[i] @ torch.tensor([[c, -s], [s, c]]).T
        np.testing.assert_allclose(turned.future_trajectory[i], expected, atol=1e-4)


def test_augmented_batches_keep_the_contract_and_padding(dataset):
    pipeline, _ = dataset
    row = _row(pipeline)
    out = augment_row({k: v.clone() for k, v in row.items()}, AugmentConfig(resize_scale=[0.7, 0.8], bev_rotate_deg=10,
                                                                           color_jitter=0.3), np.random.default_rng(0))
    for name, value in row.items():
        assert out[name].shape == value.shape and out[name].dtype == value.dtype, name
    padding = out["box_labels"] < 0
    assert (out["boxes"][padding] == 0).all()
    # shrinking pads the bottom/right or top/left with unlabelled pixels and zero depth
    assert (out["semantic"] == 255).any() and ((out["semantic"] == 255) <= (out["depth"] == 0)).all()
    assert not torch.equal(out["images"], row["images"])
