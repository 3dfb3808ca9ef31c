"""The world generator: determinism, the shard schema, and labels that agree with the pixels."""

import io
import json
import tarfile
from pathlib import Path

import numpy as np
import pytest

from stack.data.format import ARRAY_MEMBERS, DTYPES, SCHEMA_VERSION
from stack.rig import rig_matrices


def _members(path):
    with tarfile.open(path) as tar:
        return {m.name: tar.extractfile(m).read() for m in tar.getmembers()}


def _sample(root, split="train", index=0):
    manifest = json.loads((Path(root) / "manifest.json").read_text())
    members = _members(Path(root) / manifest["splits"][split][0]["path"])
    key = sorted({name.split(".")[0] for name in members})[index]
    return key, {name.split(".", 1)[1]: data for name, data in members.items() if name.startswith(key + ".")}


@pytest.mark.slow
def test_same_seed_gives_byte_identical_shards_whatever_the_worker_count(tmp_path, dataset, small_pipeline):
    from stack.data.make import make_dataset

    pipeline, manifest = dataset
    again = small_pipeline(tmp_path, "data.world.workers=1")
    make_dataset(again, log=lambda *_: None)
    for split in ("train", "val"):
        for shard in manifest["splits"][split]:
            for suffix in (".tar", ".idx", ".sums"):
                first = (Path(pipeline.data.root) / shard["path"]).with_suffix(suffix).read_bytes()
                assert first == (tmp_path / shard["path"]).with_suffix(suffix).read_bytes(), shard
    assert (Path(pipeline.data.root) / "manifest.json").read_bytes() == (tmp_path / "manifest.json").read_bytes()


def test_another_seed_gives_another_world(tmp_path, dataset, small_pipeline):
    from stack.data.make import render_scene

    pipeline, _ = dataset
    other = small_pipeline(tmp_path, "data.world.seed=7", "data.world.frames_per_scene=1")
    first = dict(render_scene((pipeline, 0, "train", "cpu"))[0][1])
    second = dict(render_scene((other, 0, "train", "cpu"))[0][1])
    assert first["front.jpg"] != second["front.jpg"]


def test_split_by_scene_and_manifest_counts(dataset):
    pipeline, manifest = dataset
    assert manifest["schema"] == SCHEMA_VERSION
    scenes = {}
    for split, shards in manifest["splits"].items():
        for shard in shards:
            names = _members(Path(pipeline.data.root) / shard["path"])
            keys = {n.split(".")[0] for n in names}
            assert len(keys) == shard["samples"] <= pipeline.data.samples_per_shard
            for name, data in names.items():
                if name.endswith("meta.json"):
                    meta = json.loads(data)
                    assert meta["split"] == split and meta["schema"] == SCHEMA_VERSION
                    scenes.setdefault(meta["scene"], set()).add(split)
    assert all(len(splits) == 1 for splits in scenes.values()), scenes
    assert {s for splits in scenes.values() for s in splits} == {"train", "val"}


def test_every_schema_member_has_its_dtype_and_shape(dataset):
    pipeline, _ = dataset
    _, sample = _sample(pipeline.data.root)
    n, h, w = len(pipeline.data.rig.cameras), pipeline.data.rig.image_height, pipeline.data.rig.image_width
    arrays = {name: np.load(io.BytesIO(sample[f"{name}.npy"])) for name in ARRAY_MEMBERS}
    for name, array in arrays.items():
        assert array.dtype == DTYPES[name], name
    assert arrays["depth"].shape == arrays["semantic"].shape == arrays["instance"].shape == (n, h, w)
    assert arrays["boxes"].shape[1] == 10 and arrays["box_ids"].shape == (len(arrays["boxes"]), 3)
    assert arrays["past"].shape == (4, 2) and arrays["future"].shape == (6, 2)
    for camera in pipeline.data.rig.cameras:
        assert sample[f"{camera.name}.jpg"][:2] == b"\xff\xd8"
    ks, poses = rig_matrices(pipeline.data.rig)
    np.testing.assert_allclose(arrays["intrinsics"], ks, rtol=1e-6)
    np.testing.assert_allclose(arrays["cam_to_ego"], poses, atol=1e-6)


def _arrays(pipeline, index):
    _, sample = _sample(pipeline.data.root, index=index)
    return {name: np.load(io.BytesIO(sample[f"{name}.npy"])) for name in ARRAY_MEMBERS}


def test_every_box_carries_the_attribute_its_road_user_has_in_the_world(dataset):
    """The attribute column is the world's state, as nuScenes names it: a car in the parking strip is parked, one
    in traffic moving or stopped by its speed (the box's vx, vy), a pedestrian moving or standing, a cyclist riding;
    the manifest names the attributes."""
    from stack.metrics.detection import ATTRIBUTES
    from stack.sim.world.scene import MOVING_ABOVE_M_S

    pipeline, manifest = dataset
    assert manifest["attribute_names"] == list(ATTRIBUTES)
    seen = set()
    for index in range(manifest["splits"]["train"][0]["samples"]):
        arrays = _arrays(pipeline, index)
        for box, (cls, _, attribute) in zip(arrays["boxes"], arrays["box_ids"]):
            kind, name = manifest["detection_classes"][cls], ATTRIBUTES[attribute]
            moving = np.hypot(box[7], box[8]) > MOVING_ABOVE_M_S
            if kind == "pedestrian":
                assert name == ("pedestrian.moving" if moving else "pedestrian.standing")
            elif kind == "cyclist":
                assert name == "cycle.with_rider"
            else:
                assert name in ("vehicle.parked", "vehicle.stopped") if not moving else name == "vehicle.moving"
            seen.add(name)
    assert {"vehicle.moving", "vehicle.parked", "pedestrian.moving"} <= seen, seen


def test_sky_has_no_depth_and_the_ground_depth_follows_the_camera_height(dataset):
    pipeline, _ = dataset
    arrays = _arrays(pipeline, 0)
    sky = arrays["semantic"] == 5
    assert sky.any() and (arrays["depth"][sky] == 0).all()
    assert (arrays["depth"][~sky] > 0).all()
    # the bottom image row of a level camera at height z sees flat ground at z-depth f * z / (v - cy)
    k, camera = arrays["intrinsics"][0], pipeline.data.rig.cameras[0]
    bottom = arrays["depth"][0, -1].astype(np.float32)
    road_like = np.isin(arrays["semantic"][0, -1], [0, 1, 2, 4])
    expected = k[1, 1] * camera.z / (pipeline.data.rig.image_height - 0.5 - k[1, 2])
    assert road_like.mean() > 0.5
    np.testing.assert_allclose(bottom[road_like], expected, rtol=0.01)


def test_visible_boxes_project_onto_their_own_instance_pixels(dataset):
    pipeline, _ = dataset
    checked = 0
    for index in range(2):
        arrays = _arrays(pipeline, index)
        ks, poses = arrays["intrinsics"], arrays["cam_to_ego"]
        for row, (box, (cls, track, _)) in enumerate(zip(arrays["boxes"], arrays["box_ids"])):
            for cam in range(len(ks)):
                mask = arrays["instance"][cam] == track
                if mask.sum() < 30:
                    continue
                centre = np.linalg.inv(poses[cam]) @ np.array([box[0], box[1], box[2], 1.0])
                u, v, _ = ks[cam] @ centre[:3] / centre[2]
                ys, xs = np.nonzero(mask)
                # the box centre projects inside the object's visible extent, and depth agrees with the box
                assert xs.min() - 3 <= u <= xs.max() + 3 and ys.min() - 3 <= v <= ys.max() + 3, (track, cam)
                depth = arrays["depth"][cam][mask].astype(np.float32)
                assert abs(np.median(depth) - centre[2]) < max(box[3], box[4]), (track, cam)
                assert box[9] > 0
                checked += 1
    assert checked >= 2


def test_boxes_2d_are_the_extent_of_the_visible_instance(dataset):
    pipeline, _ = dataset
    arrays = _arrays(pipeline, 0)
    assert len(arrays["boxes2d"])
    for cam, track, x0, y0, x1, y1 in arrays["boxes2d"]:
        ys, xs = np.nonzero(arrays["instance"][int(cam)] == track)
        assert (x0, y0, x1, y1) == (xs.min(), ys.min(), xs.max() + 1, ys.max() + 1)


def test_ego_trajectory_is_consistent_with_its_speed(dataset):
    pipeline, _ = dataset
    arrays = _arrays(pipeline, 1)
    speed = float(arrays["ego"][0])
    first_step = float(np.linalg.norm(arrays["future"][0]))
    assert abs(first_step - speed * 0.5) < 1.5
    assert arrays["future"][-1, 0] > arrays["future"][0, 0] - 1e-3 and arrays["past"][0, 0] < 0
    assert int(arrays["command"][0]) in (0, 1, 2)


@pytest.mark.slow
def test_cli_make_writes_shards_and_reports_them(tmp_path):
    import subprocess
    import sys

    repo = Path(__file__).resolve().parents[2]
    result = subprocess.run([sys.executable, "-m", "stack", "data", "make", "data.rig.image_width=64",
                             "data.rig.image_height=32", "data.world.scenes=2", "data.world.frames_per_scene=2",
                             "data.world.workers=1", f"data.root={tmp_path}"], cwd=repo, capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stderr
    assert "train: 2 samples in 1 shards" in result.stdout and "scene 2/2 written to val" in result.stdout
    assert (tmp_path / "train" / "frames-000000.idx").read_text().startswith("v1.2 2\n")


@pytest.mark.gpu
def test_rendering_on_cuda_matches_the_cpu(dataset):
    from stack.data.make import render_scene

    pipeline, _ = dataset
    cpu = dict(render_scene((pipeline, 0, "train", "cpu"))[0][1])
    cuda = dict(render_scene((pipeline, 0, "train", "cuda"))[0][1])
    semantic = [np.load(io.BytesIO(result["semantic.npy"])) for result in (cpu, cuda)]
    depth = [np.load(io.BytesIO(result["depth.npy"])).astype(np.float32) for result in (cpu, cuda)]
    assert (semantic[0] == semantic[1]).mean() > 0.995  # float rounding may flip a few edge pixels
    np.testing.assert_allclose(np.median(np.abs(depth[0] - depth[1])), 0.0, atol=1e-3)


def test_make_replaces_its_own_shards_and_keeps_other_files(tmp_path, small_pipeline):
    from stack.data.make import make_dataset

    (tmp_path / "train").mkdir()
    (tmp_path / "train" / "notes.txt").write_text("mine")
    (tmp_path / "train" / "frames-000099.tar").write_bytes(b"a user's own shard: no manifest lists it")
    (tmp_path / "manifest.json").write_text("{}")
    pipeline = small_pipeline(tmp_path, "data.world.scenes=1", "data.world.frames_per_scene=1")
    manifest = make_dataset(pipeline, log=lambda *_: None)
    assert (tmp_path / "train" / "notes.txt").read_text() == "mine"
    assert (tmp_path / "train" / "frames-000099.tar").read_bytes().startswith(b"a user's own shard")
    assert json.loads((tmp_path / "manifest.json").read_text()) == manifest
    assert not (tmp_path / ".staging").exists()


def test_agents_start_within_the_spawn_radius_of_the_ego():
    from stack.sim.world.scene import simulate

    for radius in (25.0, 70.0):
        scene = simulate(np.random.default_rng(3), frames=2, rate_hz=2.0, agent_count=20, spawn_radius=radius)
        ego_start = np.array(scene.ego.history[0][:2])
        starts = np.array([agent.history[0][:2] for agent in scene.agents])
        assert len(starts) >= 10, f"only {len(starts)} of 20 agents placed within {radius} m"
        assert np.linalg.norm(starts - ego_start, axis=1).max() < radius


def test_class_mix_sets_the_share_of_each_agent_class():
    from stack.sim.world.scene import simulate

    only_trucks = simulate(np.random.default_rng(4), frames=2, rate_hz=2.0, agent_count=8, class_mix={"truck": 1.0})
    assert only_trucks.agents and {agent.kind for agent in only_trucks.agents} == {"truck"}
    mixed = simulate(np.random.default_rng(4), frames=2, rate_hz=2.0, agent_count=30,
                     class_mix={"pedestrian": 1.0, "cyclist": 1.0})
    assert {agent.kind for agent in mixed.agents} == {"pedestrian", "cyclist"}


def test_bad_class_mix_is_refused_with_the_classes_it_accepts():
    from stack.config import ConfigError, load_pipeline

    with pytest.raises(ConfigError, match=r"class_mix.*expected non-negative weights.*'truck'"):
        load_pipeline([], ["data.world.class_mix.car=-1"])


@pytest.mark.slow
def test_mount_jitter_moves_each_scenes_cameras_and_the_labels_follow(tmp_path, small_pipeline):
    """Each scene's vehicle carries its cameras at its own height (one draw per camera per scene); the stored
    calibration is the rendered one, so the ground's depth follows the moved camera, and the data still counts as
    data.rig's (train and eval accept it)."""
    from stack.data.camera_records import check_rig
    from stack.data.make import make_dataset

    pipeline = small_pipeline(tmp_path, "data.world.mount_jitter_m=0.3")
    make_dataset(pipeline, log=lambda *_: None)
    nominal = rig_matrices(pipeline.data.rig)[1][:, 2, 3]
    manifest, heights = json.loads((tmp_path / "manifest.json").read_text()), {}
    members = {name: data for shard in manifest["splits"]["train"] for name, data in
               _members(tmp_path / shard["path"]).items()}
    for key in sorted({name.split(".")[0] for name in members}):  # scenes 0 and 1, three frames each
        sample = {name.split(".", 1)[1]: data for name, data in members.items() if name.startswith(key + ".")}
        pose = np.load(io.BytesIO(sample["cam_to_ego.npy"]))
        heights.setdefault(int(json.loads(sample["meta.json"])["scene"]), []).append(pose[:, 2, 3])
        depth = np.load(io.BytesIO(sample["depth.npy"]))[0, -1].astype(np.float32)
        semantic = np.load(io.BytesIO(sample["semantic.npy"]))[0, -1]
        k, road_like = np.load(io.BytesIO(sample["intrinsics.npy"]))[0], np.isin(semantic, [0, 1, 2, 4])
        expected = k[1, 1] * pose[0, 2, 3] / (pipeline.data.rig.image_height - 0.5 - k[1, 2])
        assert road_like.mean() > 0.5
        np.testing.assert_allclose(depth[road_like], expected, rtol=0.01)  # the moved camera's ground, exactly
    first, second = (np.stack(heights[scene]) for scene in sorted(heights))
    assert (first == first[0]).all() and (second == second[0]).all()  # one rig per vehicle, all its frames
    assert 0 < np.abs(first[0] - nominal).max() <= 0.3 and not np.allclose(first[0], second[0])
    check_rig(pipeline.data.rig, tmp_path, "train", "it would train on")


def test_a_mount_jitter_past_the_rig_tolerance_is_refused():
    from stack.config import load_pipeline
    from stack.errors import ConfigError

    with pytest.raises(ConfigError, match=r"mount_jitter_m.*got 0\.6; must be between 0\.0 and 0\.4"):
        load_pipeline(overrides=["data.world.mount_jitter_m=0.6"])
