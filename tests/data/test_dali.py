"""The DALI backend yields the same Batch as the torch backend (augmentation off), with equal rank lengths."""

import shutil
import tarfile

import pytest
import torch

from stack.data import build_loader
from stack.data.samples import BadSample
from stack.errors import StackError

JPEG_TOLERANCE = 3
"""Largest per-pixel difference allowed between two JPEG decoders (libjpeg-turbo vs nvJPEG rounding)."""


def _compare(torch_batches, dali_batches, pipeline, tolerance):
    assert len(torch_batches) == len(dali_batches) > 0
    for a, b in zip(torch_batches, dali_batches):
        assert b.mismatches(pipeline) == []
        assert (a.images.int() - b.images.cpu().int()).abs().max() <= tolerance
        for name in ("intrinsics", "cam_to_ego", "depth", "semantic", "boxes", "box_labels", "ego_status", "command",
                     "past_trajectory", "future_trajectory", "future_valid", "bev_rotation"):
            assert torch.equal(getattr(a, name), getattr(b, name).cpu()), name


@pytest.mark.parametrize("split", ["train", "val"])
def test_both_backends_agree_without_augmentation(dataset, small_pipeline, split):
    pipeline, _ = dataset
    dali = small_pipeline(pipeline.data.root, "data.backend=dali")
    torch_batches = list(build_loader(pipeline, split, 0, 1, shuffle=False, augment=False))
    dali_batches = list(build_loader(dali, split, 0, 1, shuffle=False, augment=False))
    _compare(torch_batches, dali_batches, pipeline, JPEG_TOLERANCE)


def test_both_backends_give_a_temporal_network_the_same_frames(dataset, small_pipeline):
    """k = 2, unshuffled, across shard boundaries and scene starts: DALI decodes each sample's previous key frames as
    more cameras and reads their poses as the torch backend does (`key_frame_history`), so every field agrees."""
    pipeline, _ = dataset
    k2 = ("model.temporal_frames=2", "data.batch_size=1")
    plain = small_pipeline(pipeline.data.root, *k2)
    dali = small_pipeline(pipeline.data.root, "data.backend=dali", *k2)
    torch_batches = list(build_loader(plain, "train", 0, 1, shuffle=False, augment=False))
    dali_batches = list(build_loader(dali, "train", 0, 1, shuffle=False, augment=False))
    _compare(torch_batches, dali_batches, plain, JPEG_TOLERANCE)
    for a, b in zip(torch_batches, dali_batches):
        for name in ("previous_images", "earlier_images"):
            assert (getattr(a, name).int() - getattr(b, name).int()).abs().max() <= JPEG_TOLERANCE, name
        assert torch.equal(a.previous_pose, b.previous_pose) and torch.equal(a.earlier_poses, b.earlier_poses)
    assert any(float(b.earlier_poses.abs().sum()) > 0 for b in dali_batches), "no frame had two before it"


@pytest.mark.parametrize("split", ["train", "val"])
def test_both_backends_read_clip_shards_alike(clips, small_pipeline, split):
    """Clip shards, k = 2, unshuffled: both backends decode the clips with PyAV and DALI takes the decoded frames
    into its graph, so every field, previous frames and poses included, is equal bit for bit."""
    pipeline, _ = clips
    k2 = ("data.layout=clips", "model.temporal_frames=2")
    plain, dali = small_pipeline(pipeline.data.root, *k2), small_pipeline(pipeline.data.root, "data.backend=dali", *k2)
    loader = build_loader(dali, split, 0, 1, shuffle=False, augment=False)
    torch_batches = list(build_loader(plain, split, 0, 1, shuffle=False, augment=False))
    dali_batches = list(loader)
    assert len(torch_batches) == len(dali_batches) == len(loader) > 1
    for a, b in zip(torch_batches, dali_batches):
        assert b.mismatches(dali) == []
        fields, dali_fields = a.tensors(), b.tensors()
        assert fields.keys() == dali_fields.keys()
        for name, tensor in fields.items():
            assert torch.equal(tensor, dali_fields[name]), name
    assert any(float(b.earlier_poses.abs().sum()) > 0 for b in dali_batches), "no frame had two before it"


@pytest.mark.gpu
def test_mixed_gpu_decode_agrees_with_the_cpu_backend(dataset, small_pipeline):
    pipeline, _ = dataset
    dali = small_pipeline(pipeline.data.root, "data.backend=dali")
    gpu_batches = list(build_loader(dali, "val", 0, 1, shuffle=False, augment=False))
    assert gpu_batches[0].images.device.type == "cpu"
    _compare(list(build_loader(pipeline, "val", 0, 1, shuffle=False, augment=False)), gpu_batches, pipeline, JPEG_TOLERANCE)


def test_dali_ranks_get_equal_batch_counts_and_disjoint_samples(dataset, small_pipeline):
    pipeline, _ = dataset
    dali = small_pipeline(pipeline.data.root, "data.backend=dali", "data.batch_size=1")
    per_rank = [list(build_loader(dali, "train", rank, 2, shuffle=True)) for rank in range(2)]
    assert len(per_rank[0]) == len(per_rank[1]) > 0
    keys = [tuple(b.past_trajectory[0].flatten().tolist()) for batches in per_rank for b in batches]
    assert len(keys) == len(set(keys))


def test_dali_augmentation_keeps_the_contract(dataset, small_pipeline):
    pipeline, _ = dataset
    dali = small_pipeline(pipeline.data.root, "data.backend=dali")
    batch = next(iter(build_loader(dali, "train", 0, 1, augment=True)))
    assert batch.mismatches(pipeline) == []


def test_dali_names_the_shards_of_an_undecodable_jpeg(dataset, small_pipeline, tmp_path):
    pipeline, manifest = dataset
    root = tmp_path / "copy"
    shutil.copytree(pipeline.data.root, root)
    shard = root / manifest["splits"]["train"][0]["path"]
    data = bytearray(shard.read_bytes())
    with tarfile.open(shard) as tar:
        member = next(m for m in tar.getmembers() if m.name.endswith("front.jpg"))
    data[member.offset_data + 200:member.offset_data + member.size] = b"\x00" * (member.size - 200)
    shard.write_bytes(bytes(data))
    dali = small_pipeline(root, "data.backend=dali")
    with pytest.raises(BadSample, match="frames-000000.tar"):
        list(build_loader(dali, "train", 0, 1, shuffle=False, augment=False))
    with pytest.raises(StackError, match="backend=torch only"):
        build_loader(small_pipeline(root, "data.backend=dali", "data.skip_bad_samples=true"), "train", 0, 1)


@pytest.mark.parametrize("damage", ["empty tar", "cut tar"])
def test_dali_names_the_shards_it_cannot_open(dataset, small_pipeline, tmp_path, damage):
    pipeline, manifest = dataset
    root = tmp_path / "copy"
    shutil.copytree(pipeline.data.root, root)
    shard = root / manifest["splits"]["train"][0]["path"]
    data = shard.read_bytes()
    shard.write_bytes(b"" if damage == "empty tar" else data[:len(data) // 2 + 100])
    dali = small_pipeline(root, "data.backend=dali")
    with pytest.raises(BadSample, match="frames-000000"):
        list(build_loader(dali, "train", 0, 1, shuffle=False, augment=False))


def test_shards_are_indexed_from_the_tar_itself(dataset, small_pipeline, tmp_path):
    """Both loaders find members by the tar's headers, so a lost `.idx` file costs nothing."""
    pipeline, manifest = dataset
    root = tmp_path / "copy"
    shutil.copytree(pipeline.data.root, root)
    for entry in manifest["splits"]["train"]:
        (root / entry["path"]).with_suffix(".idx").unlink()
    expected = list(build_loader(pipeline, "train", 0, 1, shuffle=False, augment=False))
    for backend in ("torch", "dali"):
        found = list(build_loader(small_pipeline(root, f"data.backend={backend}"), "train", 0, 1, shuffle=False,
                                  augment=False))
        _compare(expected, found, pipeline, JPEG_TOLERANCE)


def test_dali_graph_is_built_once_and_its_outputs_outlive_later_epochs(dataset, small_pipeline, monkeypatch):
    """One build per loader, not per epoch; the Batch tensors share DALI's buffers without a copy, so a batch
    kept from the first epoch must still hold its data after DALI ran two more epochs."""
    from stack.data import dali_loader

    pipeline, _ = dataset
    builds = []
    real = dali_loader.build_pipeline
    monkeypatch.setattr(dali_loader, "build_pipeline", lambda *a, **k: builds.append(1) or real(*a, **k))
    loader = build_loader(small_pipeline(pipeline.data.root, "data.backend=dali"), "train", 0, 1, augment=False)
    kept = list(loader)
    copies = [(b.images.clone(), b.depth.clone(), b.semantic.clone()) for b in kept]
    list(loader), list(loader)
    assert len(builds) == 1
    for batch, (images, depth, semantic) in zip(kept, copies):
        assert torch.equal(batch.images, images) and torch.equal(batch.depth, depth)
        assert torch.equal(batch.semantic, semantic)


def test_both_backends_draw_the_same_bev_rotation_for_the_same_seed(dataset, small_pipeline):
    pipeline, _ = dataset
    rotating = ("data.augment.bev_rotate_deg=30", "train.seed=11")
    plain = small_pipeline(pipeline.data.root, *rotating)
    dali = small_pipeline(pipeline.data.root, "data.backend=dali", *rotating)
    torch_batches = list(build_loader(plain, "train", 0, 1, shuffle=False, augment=True))
    dali_batches = list(build_loader(dali, "train", 0, 1, shuffle=False, augment=True))
    assert len(torch_batches) == len(dali_batches) > 0
    for a, b in zip(torch_batches, dali_batches):
        assert (a.bev_rotation != 0).all()
        assert torch.equal(a.bev_rotation, b.bev_rotation)
        torch.testing.assert_close(a.future_trajectory, b.future_trajectory)
        torch.testing.assert_close(a.boxes, b.boxes)


def test_an_abandoned_epoch_leaves_nothing_behind_for_the_next(dataset, small_pipeline):
    """DALI runs batch k + 1 while batch k is handed out: an epoch left after one batch must not leak its
    scheduled run into the next epoch."""
    pipeline, _ = dataset
    dali = small_pipeline(pipeline.data.root, "data.backend=dali", "data.batch_size=1")
    loader = build_loader(dali, "train", 0, 1, augment=False)
    loader.set_epoch(2)
    whole = list(loader)
    loader.set_epoch(1)
    next(iter(loader))
    loader.set_epoch(2)
    again = list(loader)
    assert len(again) == len(whole) > 2
    for a, b in zip(whole, again):
        assert torch.equal(a.images, b.images) and torch.equal(a.past_trajectory, b.past_trajectory)
