"""The camera calibration each stored sample was recorded with, read without decoding any image.

Frame shards store `intrinsics.npy` and `cam_to_ego.npy` per sample, clip shards per clip
(`data/format.py`, `data/clips.py`); a dataset converted from nuScenes carries each scene's
real calibration there. `stack data calibration` reads them to write the calibration file a
deploy bundle is built for (`stack.deploy.calibration`). Only those two members are read
(`np.load(allow_pickle=False)`); images and labels are skipped by seeking past them.
"""

from __future__ import annotations

import io
import tarfile
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import numpy as np

from stack.data.format import MANIFEST
from stack.errors import StackError, missing_file_message

MEMBERS = ("intrinsics.npy", "cam_to_ego.npy")


@dataclass
class CameraRecord:
    """One sample's (or clip's) cameras: where it is and what it was recorded with."""

    shard: str
    key: str
    intrinsics: np.ndarray
    """float32 (N, 3, 3) as stored."""
    cam_to_ego: np.ndarray
    """float32 (N, 4, 4) as stored."""


def dataset_of(path: str | Path) -> tuple[Path, dict, list[Path]]:
    """(dataset root, its manifest, the shards to read) for a dataset root or one of its shards."""
    from stack.data.loader import read_manifest

    path = Path(path)
    if path.is_dir():
        manifest = read_manifest(path)
        shards = [path / entry["path"] for split in manifest.get("splits", {}).values() for entry in split]
        return path, manifest, shards
    if not path.is_file():
        raise StackError(missing_file_message("dataset or shard", path, "Give a data root (with manifest.json) "
                                              "or one of its .tar shards."))
    for root in (path.parent, path.parent.parent):
        if (root / MANIFEST).is_file():
            return root, read_manifest(root), [path]
    raise StackError(f"shard {path} has no {MANIFEST} beside it or one folder up; the camera names and image size "
                     f"come from there. Give the dataset root instead.")


def camera_records(shards: list[Path]) -> Iterator[CameraRecord]:
    """Every sample's stored intrinsics and cam_to_ego, shard by shard, in stored order."""
    for shard in shards:
        pending: dict = {}
        try:
            with tarfile.open(shard, "r:") as tar:
                for member in tar:
                    key, _, name = member.name.partition(".")
                    if name not in MEMBERS or not member.isfile():
                        continue
                    pending.setdefault(key, {})[name] = _npy(tar.extractfile(member).read(), shard, member.name)
                    if len(pending[key]) == len(MEMBERS):
                        found = pending.pop(key)
                        yield CameraRecord(str(shard), key, found["intrinsics.npy"], found["cam_to_ego.npy"])
        except (tarfile.TarError, OSError) as exc:
            raise StackError(f"shard {shard}: not a readable tar ({exc}); re-create the dataset") from None
        if pending:
            raise StackError(f"shard {shard}, sample {next(iter(pending))}: has one of {MEMBERS} but not the other; "
                             f"re-create the dataset")


def _npy(data: bytes, shard: Path, name: str) -> np.ndarray:
    try:
        return np.load(io.BytesIO(data), allow_pickle=False)
    except ValueError as exc:
        raise StackError(f"shard {shard}, member {name}: not a readable .npy ({exc}); re-create the dataset") from None


def describe(root: Path, manifest: dict) -> str:
    """A name for calibrations read from this dataset."""
    return f"{root.name} ({manifest.get('source', 'stack data make')})"


RIG_ATOL_M = 0.5
"""Largest distance between a camera's mount in data.rig and in the data: vehicles of one model differ by
centimetres; a camera on another part of the car (or another car) is metres away."""
RIG_ATOL_DEG = 5.0
"""Largest difference in orientation and field of view, degrees: calibrations of one rig differ by a degree or
two; another mount (data.rig.cameras.0.yaw_deg=40 for a front camera) by tens."""


def check_rig(rig, root: str | Path, split: str, what: str) -> None:
    """Refuse to train or evaluate with a `data.rig` (`rig`) that is not the dataset's cameras: names, count and
    order (the manifest), image size, and each camera's mount and field of view in the split's first sample,
    within RIG_ATOL_M / RIG_ATOL_DEG. The loaders read the cameras the manifest lists whatever data.rig says, so
    a one-camera rig trained silently on six cameras, and its model then drove a one-camera world."""
    from stack.data.loader import read_manifest, split_shards

    if not (Path(root) / MANIFEST).is_file():
        return  # no dataset yet: the loader says so where it always did, after the out_dir checks
    manifest = read_manifest(root)
    shards = [Path(path) for path, _ in split_shards(manifest, root, split)]
    record = next(camera_records(shards[:1]), None)
    if record is not None:
        check_record(record, manifest)
    differences = rig_differences(rig, manifest, record)
    if differences:
        raise StackError(f"data.rig is not the cameras of the dataset at {root} that {what}:\n  "
                         + "\n  ".join(differences) + "\nSet data.rig to the cameras the data was recorded with "
                         "(the dataset's values are above), or render a dataset for this rig with `stack data make`")


def check_record(record: CameraRecord, manifest: dict) -> None:
    """A StackError naming shard, sample and member unless the stored cameras have the dtype and shape of the
    schema for the manifest's cameras ((N, 3, 3) and (N, 4, 4) float32; a clip stores them once) and finite values."""
    from stack.data.format import array_problem, label_problem

    for name, array in (("intrinsics", record.intrinsics), ("cam_to_ego", record.cam_to_ego)):
        problem = array_problem(name, array, len(manifest["cameras"]), manifest["image_size"]) \
            or label_problem(name, array, manifest)
        if problem:
            raise StackError(f"shard {record.shard}, sample {record.key}: member {name}.npy: {problem} (the "
                             f"{len(manifest['cameras'])} cameras of its manifest); re-create the dataset with "
                             f"`stack data make` (or `stack data convert`)")


def rig_differences(rig, manifest: dict, record: CameraRecord | None) -> list[str]:
    """What differs between `rig` (data.rig) and a dataset (its manifest and one sample's stored cameras)."""
    names = [camera.name for camera in rig.cameras]
    if names != manifest["cameras"]:
        return [f"cameras: data.rig has {len(names)} ({', '.join(names)}), the dataset {len(manifest['cameras'])} "
                f"({', '.join(manifest['cameras'])}), in that order"]
    found = []
    if [rig.image_height, rig.image_width] != list(manifest["image_size"]):
        height, width = manifest["image_size"]
        found.append(f"image size: data.rig {rig.image_width}x{rig.image_height}, the dataset {width}x{height} "
                     "(data.rig.image_width, data.rig.image_height)")
    if record is None or found:
        return found
    for index, camera in enumerate(rig.cameras):
        found += [f"camera {index} ({camera.name}): {d}" for d in _mount_differences(
            camera, record.intrinsics[index].astype(np.float64), record.cam_to_ego[index].astype(np.float64),
            rig.image_width)]
    return found


def _mount_differences(camera, k: np.ndarray, pose: np.ndarray, width: int) -> list[str]:
    from stack.rig import camera_to_ego, mount_of, rotation_angle_deg

    stored, nominal = mount_of(k, pose, width), vars(camera)
    found = []
    if float(np.linalg.norm([stored[a] - nominal[a] for a in "xyz"])) > RIG_ATOL_M:
        found.append("position " + _pair(nominal, stored, ("x", "y", "z"), "m"))
    if rotation_angle_deg(camera_to_ego(camera)[:3, :3], pose[:3, :3]) > RIG_ATOL_DEG:
        found.append("orientation " + _pair(nominal, stored, ("yaw_deg", "pitch_deg"), "degrees"))
    if abs(stored["hfov_deg"] - camera.hfov_deg) > RIG_ATOL_DEG:
        found.append("field of view " + _pair(nominal, stored, ("hfov_deg",), "degrees"))
    return found


def _pair(nominal: dict, stored: dict, keys: tuple, unit: str) -> str:
    """'yaw_deg=40, pitch_deg=0 in data.rig, yaw_deg=0.0, pitch_deg=0.0 in the data (degrees)'."""
    given = ", ".join(f"{key}={nominal[key]:g}" for key in keys)
    recorded = ", ".join(f"{key}={stored[key]:.2f}" for key in keys)
    return f"{given} in data.rig, {recorded} in the data ({unit})"
