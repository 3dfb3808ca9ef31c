"""Augmentation in the DALI graph agrees with the torch backend's, and keeps labels on their pixels."""

from pathlib import Path

import numpy as np
import pytest
import torch

from stack.data import augment, build_loader
from stack.data.augment import apply_geometry, draw_params
from stack.data.dali_augment import GraphAugment
from stack.pipeline import AugmentConfig
from stack.rig import scale_intrinsics
from tests.data.test_augment import marked_pixel_misses
from tests.data.test_dali import JPEG_TOLERANCE
from tests.data.test_sequences import _stored_keys

pytest.importorskip("nvidia.dali")

STRONG = ("data.augment.resize_scale=[0.7,1.3]", "data.augment.bev_rotate_deg=30", "data.augment.color_jitter=0.3",
          "train.seed=5")
"""Wider than the defaults, so crops, pads, shrinking and enlarging all occur in a few batches."""

RESAMPLE_TOLERANCE = 8
"""Largest per-pixel difference allowed between DALI's and torch's bilinear resize (antialiased when shrinking)
plus colour jitter of the same uint8 cameras. Measured over 30 draws at scales 0.7-1.3 on rendered cameras: at
most 6 levels, on the resized image's edge rows and columns, where the two filters treat their support
differently; 0.23 % of pixels differ by more than 1, the mean difference is 0.002. The loader test adds the
JPEG decoders' difference."""

GEOMETRY = ("intrinsics", "cam_to_ego", "boxes", "box_labels", "past_trajectory", "future_trajectory", "future_valid",
            "bev_rotation")


def _through_graph(row: dict, params, config: AugmentConfig) -> dict:
    """`row`'s cameras, depth and semantics augmented by a one-sample DALI graph, its geometry in Python."""
    from nvidia.dali import fn, pipeline_def, types

    height, width = row["images"].shape[-2:]
    graph = GraphAugment(config, height, width)
    cameras = len(row["images"])

    @pipeline_def(batch_size=1, num_threads=1, device_id=None, exec_dynamic=True, prefetch_queue_depth=1)
    def one_row():
        images = [fn.external_source(name=f"camera{c}", layout="HWC") for c in range(cameras)]
        depth = fn.external_source(name="depth")
        semantic = fn.external_source(name="semantic")
        images, depth, semantic = graph.apply(fn, types, images, depth, semantic)
        return fn.transpose(fn.stack(*images), perm=[0, 3, 1, 2]), depth, semantic

    pipe = one_row()
    pipe.build()
    for c in range(cameras):
        pipe.feed_input(f"camera{c}", [row["images"][c].permute(1, 2, 0).contiguous().numpy()])
    pipe.feed_input("depth", [row["depth"].numpy()])
    pipe.feed_input("semantic", [row["semantic"].numpy()])
    graph.feed(pipe, [params])
    images, depth, semantic = (np.array(out.as_tensor())[0] for out in pipe.run())
    out = {**row, "images": torch.from_numpy(images), "depth": torch.from_numpy(depth),
           "semantic": torch.from_numpy(semantic)}
    apply_geometry(out, params)
    return out


def _row(pipeline):
    batch = next(iter(build_loader(pipeline, "val", 0, 1, augment=False)))
    return {name: tensor[0].clone() for name, tensor in batch.tensors().items()}


@pytest.mark.parametrize("jitter", ["0.3", "0"])  # without jitter DALI prunes its parameter sources
def test_graph_and_torch_agree_on_the_same_row_and_parameters(dataset, small_pipeline, jitter):
    pipeline, _ = dataset
    config = small_pipeline(pipeline.data.root, *STRONG, f"data.augment.color_jitter={jitter}").data.augment
    row = _row(pipeline)
    height, width = row["images"].shape[-2:]
    rng = np.random.default_rng(3)
    shrunk = enlarged = 0
    for _ in range(6):
        params = draw_params(config, height, width, rng)
        shrunk, enlarged = shrunk + (params.new_h < height), enlarged + (params.new_h > height)
        torch_row = augment.apply_params({k: v.clone() for k, v in row.items()}, params)
        dali_row = _through_graph({k: v.clone() for k, v in row.items()}, params, config)
        for name in ("depth", "semantic", *GEOMETRY):
            assert torch.equal(torch_row[name], dali_row[name]), (name, params)
        difference = (torch_row["images"].int() - dali_row["images"].int()).abs()
        assert difference.max() <= RESAMPLE_TOLERANCE, params
        assert (difference > 1).float().mean() < 0.01, params  # only rounding and the edges differ
    assert shrunk and enlarged


def test_both_loaders_augment_alike_for_the_same_seed(dataset, small_pipeline):
    pipeline, _ = dataset
    plain = small_pipeline(pipeline.data.root, *STRONG)
    dali = small_pipeline(pipeline.data.root, "data.backend=dali", *STRONG)
    torch_batches = list(build_loader(plain, "train", 0, 1, shuffle=False, augment=True))
    dali_batches = list(build_loader(dali, "train", 0, 1, shuffle=False, augment=True))
    reference = list(build_loader(plain, "train", 0, 1, shuffle=False, augment=False))
    assert len(torch_batches) == len(dali_batches) == len(reference) > 0
    for a, b, unaugmented in zip(torch_batches, dali_batches, reference):
        assert b.mismatches(dali) == []
        assert not torch.equal(a.intrinsics, unaugmented.intrinsics) and (a.bev_rotation != 0).all()
        for name in ("depth", "semantic", *GEOMETRY):
            assert torch.equal(getattr(a, name), getattr(b, name)), name
        assert (a.images.int() - b.images.int()).abs().max() <= RESAMPLE_TOLERANCE + JPEG_TOLERANCE


def test_both_loaders_augment_every_frame_of_a_temporal_sample_alike(dataset, small_pipeline):
    """k = 1: the graph augments a sample's previous key frame with the sample's own parameters, as the torch
    backend does; at a scene start the previous frame is the frame itself, so the two stay equal bit for bit."""
    pipeline, manifest = dataset
    k1 = ("model.temporal_frames=1", "data.batch_size=1", *STRONG)
    plain, dali = small_pipeline(pipeline.data.root, *k1), small_pipeline(pipeline.data.root, "data.backend=dali", *k1)
    torch_batches = list(build_loader(plain, "train", 0, 1, shuffle=False, augment=True))
    dali_batches = list(build_loader(dali, "train", 0, 1, shuffle=False, augment=True))
    keys = _stored_keys(manifest, Path(pipeline.data.root), "train")
    assert len(torch_batches) == len(dali_batches) == len(keys) > 0 and any(k.endswith("f0000") for k in keys)
    for key, a, b in zip(keys, torch_batches, dali_batches):
        assert b.mismatches(dali) == []
        assert (a.previous_images.int() - b.previous_images.int()).abs().max() <= RESAMPLE_TOLERANCE + JPEG_TOLERANCE
        assert torch.equal(a.previous_pose, b.previous_pose) and torch.equal(a.bev_rotation, b.bev_rotation)
        if key.endswith("f0000"):
            assert torch.equal(b.previous_images, b.images), key


def test_graph_augmentation_keeps_a_box_centre_on_its_marked_pixel(dataset, small_pipeline):
    pipeline, _ = dataset
    config = small_pipeline(pipeline.data.root, *STRONG).data.augment
    assert marked_pixel_misses(pipeline, _graph_augment(config)) == []


def test_a_graph_whose_intrinsics_ignore_the_crop_offset_fails_projection_consistency(dataset, small_pipeline,
                                                                                      monkeypatch):
    pipeline, _ = dataset
    config = small_pipeline(pipeline.data.root, *STRONG).data.augment
    monkeypatch.setattr(augment, "scale_intrinsics",
                        lambda k, sx, sy, crop_x=0.0, crop_y=0.0: scale_intrinsics(k, sx, sy))
    assert len(marked_pixel_misses(pipeline, _graph_augment(config))) >= 4


def _graph_augment(config):
    def apply(row, rng):
        height, width = row["images"].shape[-2:]
        row.update(_through_graph(row, draw_params(config, height, width, rng), config))
    return apply


@pytest.mark.gpu
def test_graph_augmentation_on_the_gpu_agrees_with_the_torch_backend(dataset, small_pipeline):
    """With a GPU the images are decoded (nvJPEG) and augmented on the device; the jitter's image mean comes
    back to the CPU as an argument input (`GraphAugment._jitter`)."""
    pipeline, _ = dataset
    plain = small_pipeline(pipeline.data.root, *STRONG)
    dali = small_pipeline(pipeline.data.root, "data.backend=dali", *STRONG)
    torch_batches = list(build_loader(plain, "train", 0, 1, shuffle=False, augment=True))
    gpu_batches = list(build_loader(dali, "train", 0, 1, shuffle=False, augment=True))
    for a, b in zip(torch_batches, gpu_batches, strict=True):
        for name in ("depth", "semantic", *GEOMETRY):
            assert torch.equal(getattr(a, name), getattr(b, name).cpu()), name
        assert (a.images.int() - b.images.cpu().int()).abs().max() <= RESAMPLE_TOLERANCE + JPEG_TOLERANCE


def test_both_loaders_shuffle_and_augment_clip_frames_alike(clips, small_pipeline):
    """Clip shards, k = 1, shuffled and augmented: DALI plans the clips, draws each clip's parameters and mixes its
    frames through the shuffle buffer as the torch backend's one loader process does, so the batches hold the same
    frames in the same order with the same labels; pixels differ only by the two resize filters."""
    pipeline, manifest = clips
    k1 = ("data.layout=clips", "model.temporal_frames=1", "data.batch_size=2", *STRONG)
    plain, dali = small_pipeline(pipeline.data.root, *k1), small_pipeline(pipeline.data.root, "data.backend=dali", *k1)
    for epoch in (0, 1):
        loaders = [build_loader(config, "train", 0, 1, shuffle=True, augment=True) for config in (plain, dali)]
        for loader in loaders:
            loader.set_epoch(epoch)
        torch_batches, dali_batches = (list(loader) for loader in loaders)
        assert len(torch_batches) == len(dali_batches) == len(loaders[1]) > 1
        order = [b.past_trajectory.flatten(1).sum(1).tolist() for b in dali_batches]
        assert order != sorted(order), "the frames came unshuffled"
        for a, b in zip(torch_batches, dali_batches):
            assert b.mismatches(dali) == []
            for name in ("depth", "semantic", "previous_pose", *GEOMETRY):
                assert torch.equal(getattr(a, name), getattr(b, name)), name
            for name in ("images", "previous_images"):
                assert (getattr(a, name).int() - getattr(b, name).int()).abs().max() <= RESAMPLE_TOLERANCE, name
