"""The frame-batched renderer against the camera-by-camera reference (`raycast_reference`), on seeded scenes.

Depth, semantics, instance ids, 3D/2D boxes and visibility must be identical (the method is exact: the same
float32 operations per pixel and primitive). RGB (8-bit, the same sensor noise) must be identical on at least
99.99 % of pixels, and every pixel that differs must be one where the two sun-shadow tests disagree: the
reference pre-selects shadow candidates with `torch.cdist`, whose matrix-product distance loses points at
the rim of small casters' discs (a 0.12 m head 40 m from the origin); the new grid test computes distances
directly. The checks are shown to fail when a primitive kind is dropped or the shadow test is wrong.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from stack import bench_only
from stack.sim.world import frame as fast
from stack.sim.world import render
from stack.sim.world.scene import simulate
from stack.pipeline import RigConfig

reference = bench_only.load("raycast_reference")

MIX = {"car": 0.3, "truck": 0.2, "pedestrian": 0.3, "cyclist": 0.2}
TINY_RIG = RigConfig(image_width=256, image_height=128)
FULL_CAMERA = RigConfig(cameras=RigConfig().cameras[:1])
"""One camera of the default rig at full size (704 x 256)."""
RGB_SAME = 0.9999
"""Fraction of RGB pixels that must be identical."""
EXACT = ("depth", "semantic", "instance", "boxes", "box_ids", "visibility", "boxes2d", "intrinsics", "cam_to_ego")


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """One torch thread, as in `stack data make`'s workers (and no oversubscription on a busy machine)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def scenes():
    """Three seeded tiny-preset scenes (40 road users within 40 m), built once."""
    return [simulate(np.random.default_rng([11, seed]), 2, 2.0, 40, 40.0, MIX) for seed in range(3)]


_REFERENCE: dict = {}


def _reference_frame(scene, step: int, rig: RigConfig) -> dict:
    """The reference's frame, rendered once per (scene, step, rig) for all tests of this module."""
    key = (id(scene), step, rig.image_width, len(rig.cameras))
    if key not in _REFERENCE:
        with torch.no_grad():
            _REFERENCE[key] = reference.render_frame(scene, step, rig,
                                                     reference.TorchGround(scene.town.ground, 5, "cpu"),
                                                     np.random.default_rng(3), "cpu")
    return _REFERENCE[key]


class _Silent:
    """A noise generator that adds none, so image differences are shading differences only."""

    @staticmethod
    def normal(loc, scale, size):
        return np.zeros(size)


def problems(scene, step: int, rig: RigConfig) -> list[str]:
    """What differs between the two renderers on one frame (empty: they agree)."""
    with torch.no_grad():
        new = fast.render_frame(scene, step, rig, fast.TorchGround(scene.town.ground, 5, "cpu"),
                                np.random.default_rng(3), "cpu")
    old = _reference_frame(scene, step, rig)
    found = [f"{key} differs ({np.count_nonzero(new[key] != old[key]) if new[key].shape == old[key].shape else 'shape'})"
             for key in EXACT if new[key].shape != old[key].shape or not np.array_equal(new[key], old[key])]
    differs = (new["images"] != old["images"]).any(-1)
    if differs.mean() > 1 - RGB_SAME:
        found.append(f"RGB differs on {100 * differs.mean():.3f} % of pixels")
    if differs.any() and not found:
        found += _unexplained(scene, step, rig, differs)
    return found


def _unexplained(scene, step, rig, differs) -> list[str]:
    """Differing RGB pixels where the two renderers agree on which pixels the sun lights (there should be none).

    A pixel is unlit (in shadow or facing away) where the noiseless image equals the one with the sun below."""
    shadowed = {}
    for name, module in (("new", fast), ("old", reference)):
        real = module.render_frame(scene, step, rig, module.TorchGround(scene.town.ground, 5, "cpu"), _Silent(), "cpu")
        night = scene.light.copy()
        night[1] = -np.pi / 2  # the sun straight below: no pixel is sunlit, every sunlit pixel changes
        dark = module.render_frame(dataclasses.replace(scene, light=night), step, rig,
                                   module.TorchGround(scene.town.ground, 5, "cpu"), _Silent(), "cpu")
        shadowed[name] = (real["images"] == dark["images"]).all(-1)
    other = differs & (shadowed["new"] == shadowed["old"])
    return [f"RGB differs on {int(other.sum())} pixels where both shadow tests agree"] if other.any() else []


@pytest.mark.parametrize("index", range(3))
def test_tiny_rig_matches_reference(scenes, index):
    scene = scenes[index]
    assert problems(scene, int(scene.key_steps[index % len(scene.key_steps)]), TINY_RIG) == []


def test_full_size_camera_matches_reference(scenes):
    scene = scenes[0]
    assert problems(scene, int(scene.key_steps[-1]), FULL_CAMERA) == []


def test_a_dropped_primitive_kind_is_caught(scenes, monkeypatch):
    """Cylinders (people, cyclists, trunks) never hit: depth, semantics and instances must disagree."""
    monkeypatch.setitem(render._PAIRS, "cylinders", lambda o, geometry, owner, d: torch.full_like(d[0], float("inf")))
    found = problems(scenes[0], int(scenes[0].key_steps[0]), TINY_RIG)
    assert any(item.startswith("depth") for item in found) and any(item.startswith("instance") for item in found)


def test_a_wrong_shadow_test_is_caught(scenes, monkeypatch):
    """Boxes cast no shadow (buildings, vehicles): only RGB changes, and the RGB check must see it."""
    monkeypatch.setitem(render._TOWARD, "boxes", lambda origin, sun, boxes: torch.zeros(len(origin), dtype=torch.bool))
    found = problems(scenes[0], int(scenes[0].key_steps[0]), TINY_RIG)
    assert found and all(item.startswith("RGB") for item in found)


def test_box_rectangles_are_conservative(scenes, monkeypatch):
    """Box rectangles from projected corners that are one pixel short lose box pixels (the margin matters)."""
    original = render._box_rects

    def short(*args):
        rects = original(*args)
        return rects + np.array([1, -1, 1, -1])

    monkeypatch.setattr(render, "_box_rects", short)
    assert any(item.startswith("depth") for item in problems(scenes[0], int(scenes[0].key_steps[0]), TINY_RIG))


def _member_hashes(root) -> dict:
    """{(shard, sample, member): xxh3_64} of every member a dataset's shards recorded."""
    from pathlib import Path

    from stack.data.checksums import load_sums

    return {(shard.name, key, member): digest for shard in sorted(Path(root).glob("*/*.tar"))
            for key, members in load_sums(shard).items() for member, digest in members.items()}


def test_recorded_shards_match_the_reference_but_for_jpegs(small_pipeline, tmp_path, monkeypatch):
    """`stack data make` with either renderer: every member but the camera JPEGs is byte-identical."""
    from stack.data.make import make_dataset

    hashes = {}
    for name in ("new", "reference"):
        if name == "reference":
            monkeypatch.setattr(fast, "render_frame", reference.render_frame)
            monkeypatch.setattr(fast, "TorchGround", reference.TorchGround)
        pipeline = small_pipeline(tmp_path / name, "data.world.scenes=2", "data.world.frames_per_scene=2",
                                  "data.world.agents_per_scene=40", "data.world.workers=1")
        make_dataset(pipeline, log=lambda *_: None)
        hashes[name] = _member_hashes(tmp_path / name)
    assert hashes["new"].keys() == hashes["reference"].keys()
    exact = {key for key in hashes["new"] if not key[2].endswith(".jpg")}
    assert {key[2] for key in exact} >= {"depth.npy", "semantic.npy", "instance.npy", "boxes.npy", "boxes2d.npy"}
    assert [key for key in exact if hashes["new"][key] != hashes["reference"][key]] == []
