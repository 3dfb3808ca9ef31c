"""`stack data convert --from nuscenes` on a tiny nuScenes-format dataset written here (2 scenes x 3 samples)."""

import json
import math
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

pytest.importorskip("nuscenes", reason="needs nuscenes-devkit (pip install --no-deps nuscenes-devkit pyquaternion)")
from pyquaternion import Quaternion  # noqa: E402  (installed with the devkit)

from stack.data import build_loader  # noqa: E402
from stack.metrics.detection import ATTRIBUTES  # noqa: E402
from stack.rig import camera_to_ego  # noqa: E402

CHANNELS = ["CAM_FRONT", "CAM_FRONT_LEFT", "CAM_FRONT_RIGHT", "CAM_BACK", "CAM_BACK_LEFT", "CAM_BACK_RIGHT"]
SCENES = {"scene-0061": "train", "scene-0103": "val"}  # official v1.0-mini split names
WIDTH, HEIGHT, FOCAL = 320, 180, 253.2
SPEED, HEADING = 5.0, 0.3
LIDAR_OFFSET = np.array([0.9, 0.0, 1.8])


def _ego(t):
    return np.array([100.0 + SPEED * t * math.cos(HEADING), 50.0 + SPEED * t * math.sin(HEADING), 0.0])


def _to_global(t, local):
    c, s = math.cos(HEADING), math.sin(HEADING)
    return _ego(t) + np.array([c * local[0] - s * local[1], s * local[0] + c * local[1], local[2]])


def write_fixture(root: Path, rig) -> None:
    tables = {name: [] for name in ("category", "attribute", "visibility", "instance", "sensor", "calibrated_sensor",
                                    "ego_pose", "log", "scene", "sample", "sample_data", "sample_annotation", "map")}
    tables["category"] = [{"token": "c-car", "name": "vehicle.car", "description": ""},
                          {"token": "c-ped", "name": "human.pedestrian.adult", "description": ""}]
    tables["visibility"] = [{"token": str(i), "level": f"v{i}", "description": ""} for i in range(1, 5)]
    tables["attribute"] = [{"token": "at-moving", "name": "vehicle.moving", "description": ""}]
    tables["log"] = [{"token": "log", "logfile": "", "vehicle": "", "date_captured": "", "location": "boston-seaport"}]
    tables["map"] = [{"token": "map", "log_tokens": ["log"], "category": "", "filename": ""}]
    for index, channel in enumerate(CHANNELS + ["LIDAR_TOP"]):
        tables["sensor"].append({"token": f"s-{channel}", "channel": channel, "modality": "lidar" if channel == "LIDAR_TOP" else "camera"})
        if channel == "LIDAR_TOP":
            pose, k = np.eye(4), []
            pose[:3, 3] = LIDAR_OFFSET
        else:
            pose = camera_to_ego(rig.cameras[index])
            k = [[FOCAL, 0, WIDTH / 2], [0, FOCAL, HEIGHT / 2], [0, 0, 1]]
        tables["calibrated_sensor"].append({"token": f"cs-{channel}", "sensor_token": f"s-{channel}",
                                            "translation": pose[:3, 3].tolist(),
                                            "rotation": list(Quaternion(matrix=pose[:3, :3], atol=1e-6)), "camera_intrinsic": k})
    (root / "samples").mkdir(parents=True)
    for scene_index, name in enumerate(SCENES):
        tokens = [f"{name}-{i}" for i in range(3)]
        tables["scene"].append({"token": name, "log_token": "log", "nbr_samples": 3, "first_sample_token": tokens[0],
                                "last_sample_token": tokens[-1], "name": name, "description": ""})
        for i, token in enumerate(tokens):
            t = 0.5 * i
            tables["sample"].append({"token": token, "timestamp": int((scene_index * 100 + t) * 1e6), "scene_token": name,
                                     "prev": tokens[i - 1] if i else "", "next": tokens[i + 1] if i < 2 else ""})
            tables["ego_pose"].append({"token": f"ep-{token}", "timestamp": 0, "translation": _ego(t).tolist(),
                                       "rotation": list(Quaternion(axis=[0, 0, 1], angle=HEADING))})
            _sample_data(root, tables, token, scene_index)
            _annotations(tables, token, tokens, i, t)
    tables["instance"] = [{"token": f"i-{n}", "category_token": c, "nbr_annotations": 6, "first_annotation_token": "",
                           "last_annotation_token": ""} for n, c in (("car", "c-car"), ("ped", "c-ped"))]
    version = root / "v1.0-mini"
    version.mkdir()
    for name, rows in tables.items():
        (version / f"{name}.json").write_text(json.dumps(rows))


def _sample_data(root, tables, token, scene_index):
    for channel in CHANNELS + ["LIDAR_TOP"]:
        folder = root / "samples" / channel
        folder.mkdir(exist_ok=True)
        if channel == "LIDAR_TOP":
            filename = folder / f"{token}.pcd.bin"
            ys, zs = np.meshgrid(np.linspace(-4, 4, 40), np.linspace(-1.5, 1.0, 20))
            points = np.stack([np.full(ys.size, 10.0), ys.ravel(), zs.ravel(), np.zeros(ys.size), np.zeros(ys.size)], 1)
            points.astype(np.float32).tofile(filename)
        else:
            filename = folder / f"{token}.jpg"
            Image.new("RGB", (WIDTH, HEIGHT), (40 * (CHANNELS.index(channel) + 1), 90, 30 * scene_index)).save(filename)
        tables["sample_data"].append({"token": f"sd-{token}-{channel}", "sample_token": token, "ego_pose_token": f"ep-{token}",
                                      "calibrated_sensor_token": f"cs-{channel}", "timestamp": 0, "fileformat": "",
                                      "is_key_frame": True, "height": HEIGHT, "width": WIDTH,
                                      "filename": str(filename.relative_to(root)), "prev": "", "next": ""})


def _annotations(tables, token, tokens, i, t):
    for name, local, size, lidar in (("car", [15.0, 0.0, 0.8], [1.9, 4.5, 1.6], 30), ("ped", None, [0.6, 0.6, 1.7], 0)):
        attributes = ["at-moving"] if name == "car" else []
        centre = _to_global(t, local) if local else np.array([120.0, 58.0, 0.85])
        tables["sample_annotation"].append({
            "token": f"a-{name}-{token}", "sample_token": token, "instance_token": f"i-{name}", "visibility_token": "4",
            "attribute_tokens": attributes, "translation": centre.tolist(), "size": size,
            "rotation": list(Quaternion(axis=[0, 0, 1], angle=HEADING)), "num_lidar_pts": lidar, "num_radar_pts": 0,
            "prev": f"a-{name}-{tokens[i - 1]}" if i else "", "next": f"a-{name}-{tokens[i + 1]}" if i < 2 else ""})


def test_convert_a_tiny_nuscenes_dataset(tmp_path, small_pipeline):
    source, out = tmp_path / "nuscenes", tmp_path / "shards"
    pipeline = small_pipeline(out)
    write_fixture(source, pipeline.data.rig)
    from stack.data.convert import convert

    manifest = convert(pipeline, "nuscenes", str(source), "v1.0-mini")
    assert [sum(s["samples"] for s in manifest["splits"][k]) for k in ("train", "val")] == [3, 3]
    batches = list(build_loader(pipeline, "val", 0, 1, shuffle=False, augment=False))
    batch = batches[0]
    assert batch.mismatches(pipeline) == []
    np.testing.assert_allclose(batch.intrinsics[0, 0, 0, 0], FOCAL * 128 / WIDTH, rtol=1e-5)
    # the car rides 15 m ahead of the lidar's ego frame at the ego's speed; the pedestrian is unseen by lidar
    assert (batch.box_labels[0] >= 0).sum() == 1 and batch.box_labels[0, 0] == 0
    np.testing.assert_allclose(batch.boxes[0, 0, :2], [15.0, 0.0], atol=1e-3)
    np.testing.assert_allclose(batch.boxes[0, 0, 3:7], [4.5, 1.9, 1.6, 0.0], atol=1e-3)
    np.testing.assert_allclose(batch.boxes[0, 0, 7:9], [SPEED, 0.0], atol=1e-3)
    assert batch.box_attributes[0, 0] == ATTRIBUTES.index("vehicle.moving")  # the annotation's attribute
    assert manifest["attribute_names"] == list(ATTRIBUTES)
    # ego: straight at SPEED; future 0.5 s apart, invalid past the scene end
    np.testing.assert_allclose(batch.future_trajectory[0, :2], [[2.5, 0.0], [5.0, 0.0]], atol=1e-3)
    assert batch.future_valid[0].tolist() == [True, True, False, False, False, False]
    assert batch.command[0] == 1 and abs(float(batch.ego_status[0, 0]) - SPEED) < 1e-3
    # lidar depth: the wall 10 m ahead of the lidar is 10 + 0.9 - 1.7 m in front of the front camera
    front = batch.depth[0, 0]
    assert (front > 0).sum() > 20
    np.testing.assert_allclose(front[front > 0], 10.0 + LIDAR_OFFSET[0] - pipeline.data.rig.cameras[0].x, atol=0.01)  # float16
    assert (batch.semantic == 255).all()


@pytest.mark.slow
def test_cli_convert_and_its_bad_input(tmp_path, small_pipeline):
    import subprocess
    import sys

    source = tmp_path / "nuscenes"
    write_fixture(source, small_pipeline(tmp_path).data.rig)
    repo = Path(__file__).resolve().parents[2]
    base = [sys.executable, "-m", "stack", "data", "convert", "data.rig.image_width=128", "data.rig.image_height=64",
            f"data.root={tmp_path / 'out'}", "--from", "nuscenes"]
    result = subprocess.run([*base, "--source", str(source)], cwd=repo, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert "scene-0103 (3 samples) -> val" in result.stdout
    missing = subprocess.run([*base, "--source", str(tmp_path / "nowhere")], cwd=repo, capture_output=True, text=True, timeout=300)
    assert missing.returncode == 2 and "Traceback" not in missing.stderr and "v1.0-mini" in missing.stderr
