"""`stack data convert --from nuscenes`: a nuScenes-format dataset to the same frame shards as the world.

Read through `nuscenes-devkit` (tables, boxes, velocities, point clouds). Per key
frame (sample):

- cameras: rig camera `front_left` reads channel `CAM_FRONT_LEFT` (name upper-cased
  with a `CAM_` prefix); images are resized to the rig's size and intrinsics
  scaled to match (`stack.rig.scale_intrinsics`); `cam_to_ego` is the calibrated
  sensor pose. Both frames follow nuScenes' conventions, which are ours.
- depth: LIDAR_TOP points projected into every camera (sparse z-depth, 0 where no
  point lands, nearest point per pixel) as in BEVDepth; semantics are all
  IGNORE_INDEX and instance ids 0 (nuScenes has no dense image labels).
- boxes: annotations moved into the ego frame of LIDAR_TOP, velocity from the
  devkit (NaN → 0), visibility from the visibility level (0 without lidar or
  radar points). Categories map to car / truck (incl. bus, trailer, construction)
  / pedestrian / cyclist (bicycle, motorcycle); others are dropped.
- ego: past 2 s and future 3 s from the ego poses of neighbouring samples (2 Hz,
  0.5 s apart), future rows NaN past the scene end, past rows repeat the first
  pose; speed/acceleration/yaw rate by finite differences; the command is left /
  right when the 3 s future ends more than 2 m to the side, else straight.

Scenes go to train/val by the devkit's official splits for the version, or by
`data.world.val_fraction` for versions it does not know.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np

from stack.data import staging
from stack.data.format import ShardWriter, frame_members, sample_key, write_manifest
from stack.data.make import split_of
from stack.sim.world.roads import SEG_CLASSES
from stack.metrics.detection import ATTRIBUTES
from stack.sim.world.traffic import CLASSES
from stack.errors import StackError
from stack.pipeline import Pipeline
from stack.rig import scale_intrinsics
from stack.user_json import read_json

CATEGORY_PREFIXES = (("vehicle.car", "car"), ("vehicle.truck", "truck"), ("vehicle.bus", "truck"),
                     ("vehicle.trailer", "truck"), ("vehicle.construction", "truck"),
                     ("human.pedestrian", "pedestrian"), ("vehicle.bicycle", "cyclist"), ("vehicle.motorcycle", "cyclist"))
VISIBILITY = {"1": 0.2, "2": 0.5, "3": 0.7, "4": 0.9}
"""nuScenes visibility level -> fraction visible (the middle of its bin)."""
NUSCENES_TABLE_BYTES = 16 * 1024 ** 3
"""Largest nuScenes table read: the full release's sample_data.json and ego_pose.json run to the order of a GB,
past the bounded reader's default, which is sized for the stack's own files."""
TABLES = ("category", "attribute", "visibility", "instance", "sensor", "calibrated_sensor", "ego_pose", "log",
          "scene", "sample", "sample_data", "sample_annotation", "map")
"""The tables of a nuScenes version folder that nuscenes-devkit loads (one `<name>.json` each)."""
REFERENCES = {("scene", "log_token"): "log", ("scene", "first_sample_token"): "sample",
              ("sample", "scene_token"): "scene", ("sample", "next"): "sample", ("sample", "prev"): "sample",
              ("sample_data", "sample_token"): "sample", ("sample_data", "ego_pose_token"): "ego_pose",
              ("sample_data", "calibrated_sensor_token"): "calibrated_sensor",
              ("calibrated_sensor", "sensor_token"): "sensor", ("sample_annotation", "sample_token"): "sample",
              ("sample_annotation", "instance_token"): "instance", ("instance", "category_token"): "category"}
"""(table, field) -> the table whose token it names; the conversion follows each of these."""


def _class_of(category: str) -> int:
    for prefix, name in CATEGORY_PREFIXES:
        if category.startswith(prefix):
            return CLASSES.index(name)
    return -1


def _pose_matrix(record: dict) -> np.ndarray:
    from pyquaternion import Quaternion

    pose = np.eye(4)
    pose[:3, :3] = Quaternion(record["rotation"]).rotation_matrix
    pose[:3, 3] = record["translation"]
    return pose


def _open(source: str, version: str):
    try:
        from nuscenes.nuscenes import NuScenes
    except ImportError as exc:
        raise StackError("converting nuScenes needs nuscenes-devkit: `pip install --no-deps nuscenes-devkit pyquaternion` "
                         "(its numpy<2 pin conflicts with this stack; the parts used here work with numpy 2)") from exc
    if not source or not (Path(source) / version).is_dir():
        raise StackError(f"expected a nuScenes dataset with tables in {Path(source or '.') / version}; pass --source DIR "
                         "(the folder holding samples/ and the version folder) and --version")
    check_tables(Path(source) / version)
    return NuScenes(version=version, dataroot=source, verbose=False)


def check_tables(folder: Path) -> None:
    """Every table present, a JSON list of records with tokens, and every reference the conversion follows
    resolving, or a StackError naming the table (the devkit would stop with a bare KeyError or traceback)."""
    tables = {name: _read_table(folder, name) for name in TABLES}
    tokens = {name: {row["token"] for row in rows} for name, rows in tables.items()}
    for (table, field), target in REFERENCES.items():
        for row in tables[table]:
            value = row.get(field)
            if field not in row and field not in ("next", "prev"):
                raise StackError(f"nuScenes table {folder / table}.json: record {row['token']!r} has no '{field}' "
                                 "field; the table is not in nuScenes format. Re-extract the dataset.")
            if value and value not in tokens[target]:
                raise StackError(f"nuScenes table {folder / table}.json: record {row['token']!r} has {field}="
                                 f"{value!r}, which is no token of {target}.json (a dangling reference). The dataset "
                                 "is incomplete or was edited; re-extract it.")


def _read_table(folder: Path, name: str) -> list:
    path = folder / f"{name}.json"
    if not path.is_file():
        raise StackError(f"nuScenes table {path} is missing; a version folder holds {', '.join(TABLES)} "
                         "(as .json). Re-extract the dataset, or pass the right --source / --version.")
    rows = read_json(path, "a nuScenes table", "Re-extract the dataset.", expect=list,
                     max_bytes=NUSCENES_TABLE_BYTES)
    if not isinstance(rows, list) or not all(isinstance(r, dict) and isinstance(r.get("token"), str) for r in rows):
        raise StackError(f"nuScenes table {path}: expected a JSON list of records, each with a 'token' string, "
                         f"found {type(rows).__name__ if not isinstance(rows, list) else 'records without tokens'}; "
                         "re-extract the dataset.")
    return rows


def _camera(nusc, sample: dict, camera, rig) -> tuple:
    """(resized RGB, K for the rig size, cam_to_ego, ego_from_global at the camera's timestamp)."""
    from PIL import Image

    record = nusc.get("sample_data", sample["data"][f"CAM_{camera.name.upper()}"])
    calibration = nusc.get("calibrated_sensor", record["calibrated_sensor_token"])
    with Image.open(Path(nusc.dataroot) / record["filename"]) as image:
        width, height = image.size
        resized = np.asarray(image.convert("RGB").resize((rig.image_width, rig.image_height), Image.BILINEAR))
    k = scale_intrinsics(np.array(calibration["camera_intrinsic"]), rig.image_width / width, rig.image_height / height)
    ego = nusc.get("ego_pose", record["ego_pose_token"])
    return resized, k, _pose_matrix(calibration), np.linalg.inv(_pose_matrix(ego))


def _lidar_depth(nusc, sample: dict, ks, cam_to_ego, rig) -> np.ndarray:
    """Sparse z-depth (N, H, W) from LIDAR_TOP points (in the lidar's ego frame)."""
    from nuscenes.utils.data_classes import LidarPointCloud

    depth = np.zeros((len(ks), rig.image_height, rig.image_width), np.float32)
    if "LIDAR_TOP" not in sample["data"]:
        return depth
    record = nusc.get("sample_data", sample["data"]["LIDAR_TOP"])
    points = LidarPointCloud.from_file(str(Path(nusc.dataroot) / record["filename"])).points[:3]
    lidar_to_ego = _pose_matrix(nusc.get("calibrated_sensor", record["calibrated_sensor_token"]))
    ego_points = lidar_to_ego[:3, :3] @ points + lidar_to_ego[:3, 3:4]
    for index, (k, pose) in enumerate(zip(ks, cam_to_ego)):
        cam = np.linalg.inv(pose)[:3, :3] @ ego_points + np.linalg.inv(pose)[:3, 3:4]
        cam = cam[:, cam[2] > 0.5]
        uv = (k @ cam)[:2] / cam[2]
        u, v = np.floor(uv).astype(int)
        inside = (u >= 0) & (u < rig.image_width) & (v >= 0) & (v < rig.image_height)
        order = np.argsort(-cam[2, inside])  # far first, so the nearest point per pixel is written last
        depth[index, v[inside][order], u[inside][order]] = cam[2, inside][order]
    return depth


def _reference(nusc, sample: dict) -> dict:
    """The sample_data whose ego pose defines the sample's ego frame (LIDAR_TOP, else the first camera)."""
    channel = "LIDAR_TOP" if "LIDAR_TOP" in sample["data"] else sorted(sample["data"])[0]
    return nusc.get("sample_data", sample["data"][channel])


def _boxes(nusc, sample: dict, ego_from_global: np.ndarray, tracks: dict) -> tuple[np.ndarray, np.ndarray]:
    """(boxes (A, 10) in the ego frame with visibility, [class, track id, attribute] (A, 3)); the attribute is the
    annotation's first (nuScenes gives a box at most one), -1 for none."""
    rows, ids = [], []
    rotation = ego_from_global[:3, :3]
    for token in sample["anns"]:
        annotation = nusc.get("sample_annotation", token)
        cls = _class_of(annotation["category_name"])
        if cls < 0:
            continue
        box = nusc.get_box(token)
        centre = rotation @ box.center + ego_from_global[:3, 3]
        heading = rotation @ box.orientation.rotation_matrix[:, 0]
        velocity = np.nan_to_num(rotation @ nusc.box_velocity(token))
        width, length, height = box.wlh
        seen = annotation["num_lidar_pts"] + annotation["num_radar_pts"] > 0
        visibility = VISIBILITY.get(annotation["visibility_token"], 0.5) if seen else 0.0
        rows.append([centre[0], centre[1], centre[2], length, width, height, math.atan2(heading[1], heading[0]),
                     velocity[0], velocity[1], visibility])
        names = [nusc.get("attribute", token)["name"] for token in annotation["attribute_tokens"]]
        attribute = ATTRIBUTES.index(names[0]) if names and names[0] in ATTRIBUTES else -1
        ids.append([cls, tracks.setdefault(annotation["instance_token"], len(tracks) + 1), attribute])
    return np.array(rows, np.float32).reshape(-1, 10), np.array(ids, np.int32).reshape(-1, 3)


def _boxes_2d(boxes: np.ndarray, ids: np.ndarray, ks, cam_to_ego, rig) -> np.ndarray:
    """[camera, track, x0, y0, x1, y1] of boxes whose corners all lie in front of a camera and overlap its image."""
    from stack.data.inspect import box_corners

    rows = []
    for box, (_, track, _) in zip(boxes, ids):
        corners = np.c_[box_corners(box), np.ones(8)]
        for index, (k, pose) in enumerate(zip(ks, cam_to_ego)):
            cam = (np.linalg.inv(pose) @ corners.T)[:3]
            if (cam[2] < 0.1).any():
                continue
            uv = (k @ cam)[:2] / cam[2]
            x0, y0 = np.clip(uv.min(axis=1), 0, [rig.image_width, rig.image_height])
            x1, y1 = np.clip(uv.max(axis=1), 0, [rig.image_width, rig.image_height])
            if x1 > x0 and y1 > y0:
                rows.append([index, track, x0, y0, x1, y1])
    return np.array(rows, np.float32).reshape(-1, 6)


def _neighbours(nusc, sample: dict, direction: str, count: int) -> list:
    out, current = [], sample
    for _ in range(count):
        if not current[direction]:
            break
        current = nusc.get("sample", current[direction])
        out.append(current)
    return out


def _ego_labels(nusc, sample: dict, ego_from_global: np.ndarray) -> dict:
    def position(s):
        pose = nusc.get("ego_pose", _reference(nusc, s)["ego_pose_token"])
        return (ego_from_global @ np.r_[pose["translation"], 1.0])[:2], s["timestamp"] * 1e-6, pose

    past = [position(s) for s in _neighbours(nusc, sample, "prev", 4)][::-1]
    future = [position(s) for s in _neighbours(nusc, sample, "next", 6)]
    here = position(sample)
    past_xy = np.array([p[0] for p in past] or [here[0]])
    past_xy = np.concatenate([np.repeat(past_xy[:1], 4 - len(past), axis=0), past_xy])[-4:]
    future_xy = np.full((6, 2), np.nan, np.float32)
    if future:
        future_xy[:len(future)] = [p[0] for p in future]
    before, after = (past[-1] if past else here), (future[0] if future else here)
    dt = max(after[1] - before[1], 1e-3)
    speed = float(np.linalg.norm(after[0] - before[0]) / dt)
    speed_before = np.linalg.norm(here[0] - before[0]) / max(here[1] - before[1], 1e-3)
    speed_after = np.linalg.norm(after[0] - here[0]) / max(after[1] - here[1], 1e-3)
    yaw = [_yaw(p[2]) for p in (before, after)]
    end = future_xy[len(future) - 1] if future else np.zeros(2)
    command = 0 if end[1] > 2.0 else 2 if end[1] < -2.0 else 1
    return {"ego": np.array([speed, (speed_after - speed_before) / max(dt / 2, 1e-3),
                             math.remainder(yaw[1] - yaw[0], 2 * math.pi) / dt], np.float32),
            "command": np.array([command], np.int64), "past": past_xy.astype(np.float32), "future": future_xy}


def _yaw(pose: dict) -> float:
    from pyquaternion import Quaternion

    return float(Quaternion(pose["rotation"]).yaw_pitch_roll[0])


def _frame(nusc, sample: dict, rig, tracks: dict) -> dict:
    images, ks, poses = [], [], []
    for camera in rig.cameras:
        if f"CAM_{camera.name.upper()}" not in sample["data"]:
            raise StackError(f"nuScenes sample {sample['token']} has no channel CAM_{camera.name.upper()} for rig camera "
                             f"{camera.name!r}; name the rig cameras after nuScenes channels (front, front_left, ...)")
        image, k, pose, _ = _camera(nusc, sample, camera, rig)
        images.append(image), ks.append(k), poses.append(pose)
    ks, poses = np.stack(ks), np.stack(poses)
    ego_from_global = np.linalg.inv(_pose_matrix(nusc.get("ego_pose", _reference(nusc, sample)["ego_pose_token"])))
    boxes, ids = _boxes(nusc, sample, ego_from_global, tracks)
    shape = (len(ks), rig.image_height, rig.image_width)
    return {"images": np.stack(images), "depth": _lidar_depth(nusc, sample, ks, poses, rig),
            "semantic": np.full(shape, 255, np.uint8), "instance": np.zeros(shape, np.uint16),
            "intrinsics": ks, "cam_to_ego": poses, "boxes": boxes, "box_ids": ids,
            "boxes2d": _boxes_2d(boxes, ids, ks, poses, rig), **_ego_labels(nusc, sample, ego_from_global)}


def _split_names(version: str) -> dict:
    from nuscenes.utils.splits import create_splits_scenes

    splits = create_splits_scenes()
    pairs = {"v1.0-mini": ("mini_train", "mini_val"), "v1.0-trainval": ("train", "val")}
    if version not in pairs:
        return {}
    return {**{n: "train" for n in splits[pairs[version][0]]}, **{n: "val" for n in splits[pairs[version][1]]}}


def convert(pipeline: Pipeline, source_format: str | None, source: str | None, version: str) -> dict:
    """Convert `source` (nuScenes layout) into frame shards under `data.root`; returns the manifest.

    Like `stack data make`, the shards are written into `data.root/.staging/` and swapped in only
    when the conversion is complete (`stack.data.staging`): a bad table, a missing image or a kill
    leaves the previous dataset as it was."""
    if source_format != "nuscenes":
        raise StackError(f"expected --from nuscenes (the one source format supported), found {source_format!r}")
    nusc = _open(source, version)
    root, rig = Path(pipeline.data.root), pipeline.data.rig
    official = _split_names(version)
    stage = staging.prepare(root, print)
    writers = {s: ShardWriter(stage / s, "frames", pipeline.data.samples_per_shard) for s in ("train", "val")}
    tracks: dict = {}
    scenes = sorted(nusc.scene, key=lambda s: s["name"])
    for scene_index, scene in enumerate(scenes):
        try:
            _convert_scene(nusc, scene, scene_index, len(scenes), official, pipeline, writers, tracks)
        except (KeyError, OSError) as exc:  # a field missing from a record, or a file the tables name
            raise StackError(f"nuScenes scene {scene.get('name')!r}: cannot be converted ({type(exc).__name__}: "
                             f"{exc}); a record lacks that field or a file is missing under {source}. "
                             "Re-extract the dataset.") from None
    for writer in writers.values():
        writer.close_shard()
    write_manifest(stage, {
        "cameras": [c.name for c in rig.cameras], "image_size": [rig.image_height, rig.image_width],
        "semantic_classes": list(SEG_CLASSES), "detection_classes": list(CLASSES),
        "attribute_names": list(ATTRIBUTES), "layout": "frames",
        "frame_rate_hz": 2.0, "source": f"nuscenes {version}",
        "splits": {s: [{"path": f"{s}/{x['path']}", "samples": x["samples"]} for x in w.shards] for s, w in writers.items()},
    })
    return staging.commit(root, print)


def _convert_scene(nusc, scene: dict, scene_index: int, scenes: int, official: dict, pipeline: Pipeline,
                   writers: dict, tracks: dict) -> None:
    """Every key frame of one scene into its split's shards."""
    rig = pipeline.data.rig
    split = official.get(scene["name"]) or split_of(scene_index, scenes, pipeline.data.world.val_fraction)
    sample, frame_index = nusc.get("sample", scene["first_sample_token"]), 0
    while True:
        frame = _frame(nusc, sample, rig, tracks)
        meta = {"scene": scene_index, "frame": frame_index, "split": split, "source": f"nuscenes:{scene['name']}"}
        writers[split].write(sample_key(scene_index, frame_index),
                             frame_members(frame, [c.name for c in rig.cameras], meta, pipeline.data.jpeg_quality))
        frame_index += 1
        if not sample["next"]:
            break
        sample = nusc.get("sample", sample["next"])
    print(f"converted {scene['name']} ({frame_index} samples) -> {split}", flush=True)
