"""The shard format (schema version 2): WebDataset `.tar` files, a DALI index and a checksum file per shard, a manifest.

Layout of a dataset root::

    manifest.json            schema version, cameras, image size, class names, shards per split
    train/frames-000000.tar  WebDataset shard
    train/frames-000000.idx  DALI index of that shard (`fn.readers.webdataset(index_paths=...)`)
    train/frames-000000.sums hash of every member's bytes: {"algorithm": "xxh3_64", "samples": {key: {member: hash}}}
    val/...

Version 3 added each box's attribute (nuScenes' moving / stopped / parked ..., a third `box_ids` column, and
the manifest's `attribute_names`). Version 2 added the `.sums` file (version 1 shards had none): both loaders check every
member they read against it, so bytes that changed on disk or in a copy — a flipped bit
inside a JPEG's entropy-coded data still decodes, as garbage pixels — are named instead
of trained on. xxh3_64 (xxHash) rather than a cryptographic hash: this is corruption
detection, not tamper-proofing. It hashes JPEG members 3.0x as fast as zlib's CRC-32 and
large members at 117 against 6 GiB/s; checking every member of a sample costs 1.4 % of the
CPU time of decoding it (CRC-32: 7.3 %): docs/log/2026-11-23_member-checksums.md.

Frame shards hold one sample per key frame. Its key is `s{scene:05d}f{frame:04d}`
(no dots: WebDataset and DALI split the extension at the first dot). Members:

| member            | content                                                                 |
|-------------------|-------------------------------------------------------------------------|
| `{camera}.jpg`    | RGB JPEG of each rig camera (`manifest.cameras`, e.g. `front.jpg`)      |
| `depth.npy`       | float16 (N, H, W) metric z-depth, 0 = sky / no surface                  |
| `semantic.npy`    | uint8 (N, H, W) index into `manifest.semantic_classes`, 255 = unlabelled|
| `instance.npy`    | uint16 (N, H, W) track id of the agent seen, 0 = none                   |
| `intrinsics.npy`  | float32 (N, 3, 3) K in pixels of the stored images                      |
| `cam_to_ego.npy`  | float32 (N, 4, 4) camera frame -> ego frame                             |
| `boxes.npy`       | float32 (A, 10) ego-frame x y z length width height yaw vx vy visibility|
| `box_ids.npy`     | int32 (A, 3) class index into `manifest.detection_classes`, track id,   |
|                   | attribute index into `manifest.attribute_names` (-1: none)              |
| `boxes2d.npy`     | float32 (J, 6) camera index, track id, x0 y0 x1 y1 (pixels, visible part)|
| `ego.npy`         | float32 (3,) speed m/s, acceleration m/s^2, yaw rate rad/s              |
| `command.npy`     | int64 (1,) 0 left, 1 straight, 2 right                                  |
| `past.npy`        | float32 (4, 2) ego xy at -2.0 ... -0.5 s in the current ego frame       |
| `future.npy`      | float32 (6, 2) ego xy at +0.5 ... +3.0 s in the current ego frame       |
| `meta.json`       | {"schema": 2, "scene": int, "frame": int, "split": str}                 |

Labels are `.npy` because DALI decodes `.npy` (`fn.decoders.numpy`) but leaves
JSON as raw bytes. Tar members carry fixed mtime/uid/gid/mode and members are
written in a fixed order, so the same samples give byte-identical shards.

Any change to member names, dtypes, shapes or meaning bumps SCHEMA_VERSION; the
loaders refuse shards written with another version.
"""

from __future__ import annotations

import io
import json
import tarfile
from pathlib import Path

import numpy as np

from stack.failpoints import fail_point
from stack.user_json import read_json_or_none

SCHEMA_VERSION = 3
"""Version of the shard schema described above."""
ARRAY_MEMBERS = ("depth", "semantic", "instance", "intrinsics", "cam_to_ego", "boxes", "box_ids", "boxes2d",
                 "ego", "command", "past", "future")
"""Every `.npy` member of a frame sample, in the order they are written."""
DTYPES = {"depth": np.float16, "semantic": np.uint8, "instance": np.uint16, "intrinsics": np.float32,
          "cam_to_ego": np.float32, "boxes": np.float32, "box_ids": np.int32, "boxes2d": np.float32,
          "ego": np.float32, "command": np.int64, "past": np.float32, "future": np.float32}
MANIFEST = "manifest.json"
SIDECARS = (".idx", ".sums")
"""Files that belong to each shard `x.tar`, beside it: `x.idx`, `x.sums`."""
CHECKSUM = "xxh3_64"
"""The `.sums` algorithm: `member_hash`, xxHash's XXH3 64-bit of each member's bytes."""


def member_hash(data) -> int:
    """xxh3_64 of a member's bytes (bytes or a contiguous uint8 array)."""
    import xxhash

    return xxhash.xxh3_64_intdigest(data)


def sample_key(scene: int, frame: int) -> str:
    return f"s{scene:05d}f{frame:04d}"


def npy_bytes(array: np.ndarray) -> bytes:
    buffer = io.BytesIO()
    np.save(buffer, np.ascontiguousarray(array), allow_pickle=False)
    return buffer.getvalue()


def encode_jpeg(image: np.ndarray, quality: int) -> bytes:
    from PIL import Image

    buffer = io.BytesIO()
    Image.fromarray(image).save(buffer, format="JPEG", quality=quality, subsampling=2)
    return buffer.getvalue()


def dataset_files(root: Path) -> list[str]:
    """Paths (relative to `root`) of every shard and sidecar its manifest lists; [] when there is no
    readable manifest. These are the only files `stack data make` ever replaces or deletes."""
    manifest = read_json_or_none(Path(root) / MANIFEST)
    try:
        return manifest_files(manifest) if manifest is not None else []
    except (OSError, ValueError):
        return []


def manifest_files(manifest: dict) -> list[str]:
    """Shards and sidecars a manifest lists, relative to its dataset; paths that would leave the dataset
    (absolute, or through `..`) and entries of another shape are left out; [] for a malformed manifest."""
    try:
        shards = [entry["path"] for split in manifest["splits"].values() for entry in split]
    except (KeyError, TypeError, AttributeError):
        return []
    return [str(Path(path).with_suffix(suffix)) for path in shards for suffix in (".tar", *SIDECARS)
            if isinstance(path, str) and Path(path).suffix == ".tar" and ".." not in Path(path).parts
            and not Path(path).is_absolute()]


class ShardWriter:
    """Writes samples to numbered `.tar` shards with deterministic headers, plus a DALI index per shard.

    The DALI index (format "v1.2", as `wds2idx` writes it) lists per sample every
    member's extension, data offset, size and name, so `fn.readers.webdataset`
    can seek without scanning; the `.sums` file holds each member's xxh3_64. Each
    shard is written to a `.tmp` name and renamed when complete, so an interrupted
    run never leaves a truncated shard behind.
    """

    def __init__(self, folder: Path, prefix: str, samples_per_shard: int):
        self.folder, self.prefix, self.limit = Path(folder), prefix, samples_per_shard
        self.folder.mkdir(parents=True, exist_ok=True)
        self.shards: list = []
        self._tar = None

    def _open(self) -> None:
        name = f"{self.prefix}-{len(self.shards):06d}.tar"
        self._path = self.folder / name
        self._file = open(self._path.with_suffix(".tar.tmp"), "wb")
        self._tar = tarfile.open(fileobj=self._file, mode="w", format=tarfile.USTAR_FORMAT)
        self._index: list = []
        self._sums: dict = {}
        self.shards.append({"path": name, "samples": 0})

    def write(self, key: str, members: list) -> None:
        """Add one sample: `members` is [(extension, bytes)] in a fixed order."""
        if self._tar is None:
            self._open()
        entries, sums = [], {}
        for extension, payload in members:
            fail_point("shard-write")
            info = tarfile.TarInfo(f"{key}.{extension}")
            info.size, info.mtime, info.mode, info.uid, info.gid = len(payload), 0, 0o644, 0, 0
            info.uname = info.gname = ""
            header_offset = self._file.tell()
            self._tar.addfile(info, io.BytesIO(payload))
            entries.append(f"{extension} {header_offset + tarfile.BLOCKSIZE} {len(payload)} {info.name}")
            sums[extension] = member_hash(payload)
        self._index.append(" ".join(entries))
        self._sums[key] = sums
        self.shards[-1]["samples"] += 1
        if self.shards[-1]["samples"] >= self.limit:
            self.close_shard()

    def close_shard(self) -> None:
        if self._tar is None:
            return
        self._tar.close()
        self._file.close()
        self._path.with_suffix(".tar.tmp").rename(self._path)
        index = f"v1.2 {len(self._index)}\n" + "\n".join(self._index) + "\n"
        self._path.with_suffix(".idx").write_text(index)
        sums = {"algorithm": CHECKSUM, "samples": self._sums}
        self._path.with_suffix(".sums").write_text(json.dumps(sums, sort_keys=True, separators=(",", ":")) + "\n")
        self._tar = None


def frame_members(frame: dict, cameras: list, meta: dict, jpeg_quality: int) -> list:
    """[(extension, bytes)] of one frame sample, in schema order."""
    members = [(f"{name}.jpg", encode_jpeg(frame["images"][i], jpeg_quality)) for i, name in enumerate(cameras)]
    for name in ARRAY_MEMBERS:
        members.append((f"{name}.npy", npy_bytes(np.asarray(frame[name], DTYPES[name]))))
    members.append(("meta.json", json.dumps({"schema": SCHEMA_VERSION, **meta}, sort_keys=True).encode()))
    return members


def write_manifest(root: Path, manifest: dict) -> dict:
    """Write `manifest.json` (with the schema version) and return what was written."""
    manifest = {"schema": SCHEMA_VERSION, **manifest}
    (Path(root) / MANIFEST).write_text(manifest_text(manifest))
    return manifest


def manifest_text(manifest: dict) -> str:
    """manifest.json's text: one layout for every writer, so equal manifests are equal bytes (the swap compares
    manifests by sha256)."""
    return json.dumps(manifest, indent=2, sort_keys=True) + "\n"


MANIFEST_FIELDS = {"schema": int, "cameras": list, "image_size": list, "semantic_classes": list,
                   "detection_classes": list, "attribute_names": list, "splits": dict}
"""Top-level keys every manifest has, with their JSON types; the loaders read each of them."""


def manifest_problem(manifest) -> str | None:
    """What is wrong with the structure of a parsed manifest.json, or None when the loaders can read it.

    Shard paths must stay inside the dataset folder (relative, no `..`): a manifest is
    input, and the loaders open whatever it lists.
    """
    if not isinstance(manifest, dict):
        return f"expected a JSON object with keys {', '.join(MANIFEST_FIELDS)}, found a JSON {_json_kind(manifest)}"
    for name, kind in MANIFEST_FIELDS.items():
        if not isinstance(manifest.get(name), kind):
            return f"expected '{name}' to be a JSON {_json_kind(kind())}, found {_json_kind(manifest.get(name), True)}"
    size = manifest["image_size"]
    if len(size) != 2 or not all(isinstance(v, int) and v > 0 for v in size):
        return f"expected 'image_size' to be [height, width] in pixels, found {size!r:.80}"
    if not all(isinstance(c, str) for c in manifest["cameras"]) or not manifest["cameras"]:
        return f"expected 'cameras' to be a non-empty list of camera names, found {manifest['cameras']!r:.80}"
    for split, shards in manifest["splits"].items():
        for index, entry in enumerate(shards if isinstance(shards, list) else [shards]):
            path = entry.get("path") if isinstance(entry, dict) else None
            samples = entry.get("samples") if isinstance(entry, dict) else None
            if not isinstance(path, str) or not isinstance(samples, int) or samples < 0 or not isinstance(shards, list):
                return (f"expected splits.{split} to be a list of {{\"path\": \"{split}/frames-000000.tar\", "
                        f"\"samples\": N}}, found {entry!r:.80} at index {index}")
            if Path(path).is_absolute() or ".." in Path(path).parts:
                return f"splits.{split}[{index}] path {path!r} leaves the dataset folder; shard paths are relative to it"
    return None


def array_problem(name: str, array: np.ndarray, cameras: int, image_size: list) -> str | None:
    """What is wrong with the dtype or shape of a frame sample's `.npy` member (see the table above)."""
    height, width = image_size
    expected = {"depth": (cameras, height, width), "semantic": (cameras, height, width),
                "instance": (cameras, height, width), "intrinsics": (cameras, 3, 3), "cam_to_ego": (cameras, 4, 4),
                "boxes": (None, 10), "box_ids": (None, 3), "boxes2d": (None, 6), "ego": (3,), "command": (1,),
                "past": (None, 2), "future": (None, 2)}[name]
    fits = len(array.shape) == len(expected) and all(e is None or e == s for e, s in zip(expected, array.shape))
    if array.dtype != DTYPES[name] or not fits:
        dims = ", ".join("any" if e is None else str(e) for e in expected)
        shape = f"({dims},)" if len(expected) == 1 else f"({dims})"
        return f"expected {np.dtype(DTYPES[name]).name} {shape}, found {array.dtype.name} {tuple(array.shape)}"
    return None


FINITE_MEMBERS = ("intrinsics", "cam_to_ego", "boxes", "boxes2d", "ego", "past")
"""Float members whose every value is a measurement: a NaN or inf in them is damage, not a marker."""
COMMANDS = 3
"""Values of `command.npy`: 0 left, 1 straight, 2 right."""
UNLABELLED = 255
"""The `semantic.npy` value of a pixel without a class."""
NO_ATTRIBUTE = -1
"""The attribute column of `box_ids.npy` for a box without an attribute."""


def label_problem(name: str, array: np.ndarray, manifest: dict) -> str | None:
    """What is wrong with the values of a member of the right dtype and shape (`array_problem`): a NaN, or a class
    id outside the manifest's lists, would otherwise reach the loss or the metrics as nan or an index error, far
    from the shard."""
    if name == "depth":
        bits = array.view(np.uint16) & 0x7FFF  # float16 with every exponent bit set is inf or nan
        return "expected finite depths in metres, found nan or inf" if bits.size and bits.max() >= 0x7C00 else None
    if name in FINITE_MEMBERS:
        return _not_finite(array, ~np.isfinite(array))
    if name == "future":  # a row of NaN marks a waypoint past the end of the recording (nuScenes conversion)
        finite = np.isfinite(array)
        partial = (finite.any(axis=1) != finite.all(axis=1))[:, None]
        return _not_finite(array, np.isinf(array) | (~finite & partial))
    if name == "box_ids":
        return (_ids_problem(array[:, 0], len(manifest["detection_classes"]), "the manifest's detection classes")
                or _ids_problem(array[:, 2], len(manifest["attribute_names"]), "the manifest's attribute names",
                                also=NO_ATTRIBUTE, also_means="none"))
    if name == "semantic":
        return _ids_problem(array, len(manifest["semantic_classes"]), "the manifest's semantic classes",
                            also=UNLABELLED)
    if name == "command":
        return _ids_problem(array, COMMANDS, "0 left, 1 straight, 2 right")
    return None


def _not_finite(array: np.ndarray, broken: np.ndarray) -> str | None:
    if not broken.any():
        return None
    where = tuple(int(i) for i in np.argwhere(broken)[0])
    return f"expected finite numbers, found {array[where]} at index {list(where)}"


def _ids_problem(ids: np.ndarray, count: int, meaning: str, also: int | None = None,
                 also_means: str = "unlabelled") -> str | None:
    """Ids must lie in [0, count) (or equal `also`); min/max first, so a good array costs two passes."""
    if not ids.size or (ids.min() >= 0 and ids.max() < count):
        return None
    bad = ((ids < 0) | (ids >= count)) & (ids != also if also is not None else True)
    if not bad.any():
        return None
    allowed = f"0-{count - 1}" + (f" or {also} ({also_means})" if also is not None else "")
    return f"expected ids {allowed} ({meaning}), found {int(ids[bad].flat[0])}"


def _json_kind(value, with_value: bool = False) -> str:
    kinds = {dict: "object", list: "array", str: "string", bool: "boolean", int: "number", float: "number"}
    kind = "null" if value is None else kinds.get(type(value), type(value).__name__)
    return f"{kind} {value!r:.40}" if with_value and not isinstance(value, (dict, list)) and value is not None else kind
