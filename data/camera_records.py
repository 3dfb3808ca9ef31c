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
