"""The previous key frame of a sample (stack.data.sequences): found across shard boundaries, augmented with its
frame, and the ego motion since it, as a temporal network (model.temporal_frames=k) is given them; for k >= 2 the
frames before it too."""

import dataclasses
import math
from pathlib import Path

import numpy as np
import pytest
import torch

from stack.data import build_loader
from stack.data.sequences import previous_key, sequence_of, split_sequences
from stack.kinematics import previous_pose
from stack.data.shard_index import scan


def test_previous_key_steps_back_one_frame_within_its_sequence():
    assert previous_key("s00001f0002") == "s00001f0001"
    assert previous_key("d00003f0010") == "d00003f0009"
    assert previous_key("i01e00002f0001") == "i01e00002f0000"
    assert previous_key("s00001f0000") is None, "a sequence's first frame has none"
    assert previous_key("s00001") is None, "a clip key names no frame"


def test_a_key_names_its_sequence():
    assert sequence_of("s00001f0002") == "s00001" and sequence_of("d00003f0010") == "d00003"
    assert sequence_of("i01e00002f0001") == "i01e00002" and sequence_of("s00007") == "s00007"


def test_every_validation_frame_names_its_scene_in_the_order_deploy_reads_them(dataset):
    """The accuracy gate resamples whole scenes: deploy's validation frames (split order) carry the scene of each,
    and a scene's frames are the ones the shards store under its key."""
    from stack.deploy.validation import deploy_samples

    pipeline, manifest = dataset
    keys = _stored_keys(manifest, Path(pipeline.data.root), "val")
    assert split_sequences(pipeline, "val") == [key[:6] for key in keys]
    assert len(set(split_sequences(pipeline, "val"))) < len(keys), "several frames a scene"
    samples = deploy_samples(dataclasses.replace(pipeline, export=dataclasses.replace(
        pipeline.export, calibration_samples=2, sensitivity_samples=1, accuracy_samples=len(keys))))
    positions = [int(i.split("/")[1]) for i in samples.ids["accuracy"]]
    assert samples.accuracy_scenes == [keys[i][:6] for i in positions]
    assert f"({len(set(samples.accuracy_scenes))} scenes)" in samples.source


@pytest.mark.parametrize("radius", [8.0, 30.0, -15.0])
@pytest.mark.parametrize("turned", [0.05, 0.4])
def test_the_previous_pose_of_a_drive_along_an_arc_is_exact(radius, turned):
    """Along a circle the chord rule gives the earlier heading exactly: a car that turned by `turned` rad (left for a
    positive radius, right for a negative one) headed -turned (resp. +turned) then, in today's ego frame."""
    phi = turned * math.copysign(1.0, radius)
    r = abs(radius)
    before = np.array([-r * math.sin(turned), math.copysign(r * (1 - math.cos(turned)), radius)])
    past = np.stack([before * 3, before * 2, before * 1.5, before]).astype(np.float32)
    pose = previous_pose(past)
    assert np.allclose(pose[:2], before, atol=1e-6)
    assert math.isclose(float(pose[2]), -phi, abs_tol=1e-5)
    assert previous_pose(np.zeros((4, 2), np.float32)).tolist() == [0.0, 0.0, 0.0], "standing still, not turning"


def _stored_keys(manifest, root, split):
    return [key for shard in manifest["splits"][split] for key, _ in scan(str(root / shard["path"]))]


def test_the_loader_gives_each_frame_the_one_before_it(dataset, small_pipeline):
    """Unshuffled, every row's previous images are the row before it in its scene (also across a shard boundary:
    2 samples a shard, 3 frames a scene) and a first frame's are its own, with zero motion."""
    pipeline, manifest = dataset
    root = pipeline.data.root
    temporal = small_pipeline(root, "model.temporal_frames=1", "data.batch_size=1")
    keys = _stored_keys(manifest, Path(root), "train")
    rows = [batch for batch in build_loader(temporal, "train", 0, 1, shuffle=False, augment=False)]
    assert len(rows) == len(keys) >= 4 and len(manifest["splits"]["train"]) >= 2
    for position, (key, batch) in enumerate(zip(keys, rows)):
        if key.endswith("f0000"):
            assert torch.equal(batch.previous_images, batch.images)
            assert torch.equal(batch.previous_pose, torch.zeros(1, 3))
        else:
            assert torch.equal(batch.previous_images, rows[position - 1].images), key
            expected = previous_pose(batch.past_trajectory[0].numpy())
            assert np.allclose(batch.previous_pose[0].numpy(), expected) and float(batch.previous_pose.abs().sum()) > 0
    single = next(iter(build_loader(pipeline, "train", 0, 1, shuffle=False, augment=False)))
    assert single.previous_images is None, "a one-frame network's batches carry no previous frame"


def test_the_loader_gives_each_frame_the_k_before_it_and_the_oldest_it_has_where_the_scene_starts(dataset,
                                                                                                small_pipeline):
    """k = 2, unshuffled: a row's earlier images are the frame two back in its scene (the previous frame's own
    previous), posed in the previous frame's ego frame as that frame's past trajectory says; a scene's second frame
    repeats its first with zero motion, and a first frame repeats itself in both."""
    pipeline, manifest = dataset
    root = pipeline.data.root
    k2 = small_pipeline(root, "model.temporal_frames=2", "data.batch_size=1")
    keys = _stored_keys(manifest, Path(root), "train")
    rows = list(build_loader(k2, "train", 0, 1, shuffle=False, augment=False))
    assert len(rows) == len(keys) and any(key.endswith("f0002") for key in keys)
    for position, (key, batch) in enumerate(zip(keys, rows)):
        assert batch.mismatches(k2) == [], key
        frame = int(key[-4:])
        if frame == 0:
            assert torch.equal(batch.earlier_images, batch.images)
            assert torch.equal(batch.earlier_poses, torch.zeros(1, 1, 3))
        elif frame == 1:
            assert torch.equal(batch.earlier_images, rows[position - 1].images), key
            assert torch.equal(batch.earlier_poses, torch.zeros(1, 1, 3)), key
        else:
            assert torch.equal(batch.earlier_images, rows[position - 2].images), key
            assert torch.equal(batch.earlier_poses[:, 0], rows[position - 1].previous_pose), key
            assert float(batch.earlier_poses.abs().sum()) > 0
        if frame:
            assert torch.equal(batch.previous_images, rows[position - 1].images), key


def test_every_frame_of_a_row_gets_one_augmentation(dataset, small_pipeline):
    """k = 2: a first frame's previous and earlier images are its own pixels, so after augmentation all three must be
    equal bit for bit (same resize, crop and colour jitter)."""
    pipeline, manifest = dataset
    k2 = small_pipeline(pipeline.data.root, "model.temporal_frames=2", "data.batch_size=1")
    keys = _stored_keys(manifest, Path(pipeline.data.root), "train")
    firsts = [batch for key, batch in zip(keys, build_loader(k2, "train", 0, 1, shuffle=False, augment=True))
              if key.endswith("f0000")]
    assert firsts
    for batch in firsts:
        assert torch.equal(batch.previous_images, batch.images) and torch.equal(batch.earlier_images, batch.images)


def test_both_frames_of_a_row_get_one_augmentation(dataset, small_pipeline):
    """BEVDet4D's rule: a first frame's previous images are its own pixels, so after augmentation they must still
    equal the augmented images bit for bit (same resize, crop and colour jitter)."""
    pipeline, manifest = dataset
    temporal = small_pipeline(pipeline.data.root, "model.temporal_frames=1", "data.batch_size=1")
    keys = _stored_keys(manifest, Path(pipeline.data.root), "train")
    rows = list(build_loader(temporal, "train", 0, 1, shuffle=False, augment=True))
    firsts = [batch for key, batch in zip(keys, rows) if key.endswith("f0000")]
    assert firsts
    for batch in firsts:
        assert torch.equal(batch.previous_images, batch.images)
    plain = list(build_loader(temporal, "train", 0, 1, shuffle=False, augment=False))
    assert any(not torch.equal(a.images, b.images) for a, b in zip(rows, plain)), "augmentation was on"


def test_a_temporal_network_refuses_what_cannot_give_it_the_previous_frame(small_pipeline, tmp_path):
    from stack.errors import StackError

    for override, named in (("data.world.frame_rate_hz=4", "frame_rate_hz"), ("drive.replan_hz=4", "drive.replan_hz"),
                            ("model.temporal_frames=5", "temporal_frames")):
        extra = [] if override.startswith("model.") else ["model.temporal_frames=1"]
        with pytest.raises(StackError, match=named.replace(".", r"\.")):
            small_pipeline(tmp_path, *extra, override)
