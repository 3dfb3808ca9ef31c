"""The camera calibration a deploy bundle is built for: one bundle per calibration, checked at every step.

Export lowers BEV pooling to constant gather tables (`stack.ops.FixedBevPool`): for every
non-empty BEV cell, the frustum points (camera, depth bin, feature pixel) that fall in it,
padded and chunked by points-per-cell. Those tables come from the cameras' intrinsics and
extrinsics, and so do their *shapes* (how many cells are hit, how many points each holds).
A network exported for one calibration pools another vehicle's images into the wrong cells
— silently: ONNX Runtime still matches PyTorch when both use the baked tables.

Why the calibration is baked rather than a runtime input:

- As graph inputs, the tables would need worst-case capacities (every cell × the most
  points any cell could receive), which multiplies the pooling's memory and work for
  every frame of every vehicle.
- The scatter formulation that takes geometry at run time needs ScatterND with
  `reduction=add`, which TensorRT 8.6 ignores (silently wrong sums) and 10.x rejects
  (DESIGN.md); the cumsum trick runs natively but loses precision in fp16.
- Production stacks that do take calibration at run time compute the tables on the host
  and pool in their own CUDA plugin: CUDA-BEVFusion (NVIDIA-AI-IOT/Lidar_AI_Solution,
  `bevfusion/src/bevfusion/camera-geometry.cu` + its `bevpool` kernel) and BEVDet-TensorRT
  (LCH1238/bevdet-tensorrt-cpp, `bevpool` plugin with host-side `InitViewTransformer`).
  This stack keeps to standard ONNX ops, so no plugin.

So a bundle is built FOR A NAMED CALIBRATION (a fleet builds one per vehicle): the
calibration is written into the bundle (`calibration.yaml`) and into the ONNX
`metadata_props` (`calibration`, `calibration_hash`); deploy refuses validation samples
recorded with another calibration, and the runtime (`stack.deploy.runner`) refuses frames
whose calibration differs.

Two notions of "same": `hash` identifies a calibration exactly (values rounded to
`HASH_DECIMALS`), and `compare` judges whether two calibrations pool into the same cells
within tolerances far below any calibration's own accuracy and far above float32 storage
rounding (shards store K and cam_to_ego as float32). Every check uses `compare`, and its
differences read "camera front: position differs by 3.0 cm, rotation by 1.20°".
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from stack.errors import StackError, missing_file_message
from stack.rig import rotation_angle_deg

BUNDLE_FILE = "calibration.yaml"
"""The calibration's file in a deploy bundle (and beside `stack export`'s model.onnx)."""
FORMAT = "stack-calibration/1"
"""`format` key of calibration files this module reads and writes."""
MAX_CALIBRATION_BYTES = 1024 * 1024
"""Largest calibration file read: the stack writes ~2 kB for six cameras."""
HASH_DECIMALS = 6
"""The hash rounds every value to 1e-6 (metres, pixels, rotation-matrix entries ~ 1e-6 rad)."""
ATOL_M, ATOL_PX, ATOL_DEG = 1e-3, 1e-2, 1e-2
"""Default tolerances of `compare`: 1 mm, 0.01 px, 0.01° (a 0.01° error moves a point 50 m away by 9 mm)."""
ORTHONORMAL_ATOL = 1e-4
"""How far R^T R may be from the identity before a rotation is refused (float32 storage gives ~1e-7)."""
FIX = ("Pass the calibration the data was recorded with (`stack data calibration DATA_ROOT --out FILE` writes it), "
       "or deploy with `--calibration FILE` for the vehicle the data comes from.")


class CalibrationMismatch(StackError):
    """A frame, sample or file whose camera calibration is not the one a bundle was built for."""


@dataclass(eq=False)
class Calibration:
    """Pinhole intrinsics and camera-to-ego poses of a rig, in the conventions of `stack.rig`."""

    image_width: int
    image_height: int
    cameras: tuple
    """Camera names, in the order the network takes its images."""
    intrinsics: np.ndarray
    """float64 (N, 3, 3) K in pixels of images of image_width x image_height."""
    cam_to_ego: np.ndarray
    """float64 (N, 4, 4) camera frame (OpenCV: x right, y down, z forward) -> ego frame (x forward, y left, z up)."""
    name: str = ""
    """What this calibration is (a vehicle id, "rig of pipeline tiny", a dataset); informational."""

    def __post_init__(self):
        self.cameras = tuple(str(c) for c in self.cameras)
        self.intrinsics = np.asarray(self.intrinsics, dtype=np.float64)
        self.cam_to_ego = np.asarray(self.cam_to_ego, dtype=np.float64)
        found = self.problems()
        if found:
            raise StackError(f"invalid camera calibration{f' {self.name!r}' if self.name else ''}:\n  "
                             + "\n  ".join(found))

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_rig(cls, rig) -> "Calibration":
        """The nominal calibration of a pipeline's `data.rig` (`stack.rig.rig_matrices`)."""
        from stack.rig import rig_matrices

        ks, poses = rig_matrices(rig)
        return cls(rig.image_width, rig.image_height, tuple(c.name for c in rig.cameras), ks, poses,
                   name="nominal data.rig")

    def as_rig(self):
        """This vehicle's cameras as a rig the simulator renders (`stack.rig.CalibratedRig`): the closed-loop gate
        drives a per-vehicle bundle through the cameras it was built for."""
        from stack.rig import CalibratedRig

        return CalibratedRig.from_matrices(self.image_width, self.image_height, self.cameras, self.intrinsics,
                                           self.cam_to_ego)

    @classmethod
    def from_batch(cls, batch, index: int, cameras, name: str = "") -> "Calibration":
        """The calibration sample `index` of a `stack.batch.Batch` was recorded with (after any resize/crop)."""
        height, width = batch.images.shape[-2:]
        return cls(int(width), int(height), tuple(cameras), batch.intrinsics[index].double().cpu().numpy(),
                   batch.cam_to_ego[index].double().cpu().numpy(), name=name)

    @classmethod
    def from_dict(cls, data, source: str = "calibration") -> "Calibration":
        """From the structure `to_dict` writes; any malformation is a StackError naming `source`."""
        if not isinstance(data, dict):
            raise StackError(f"{source}: expected a mapping with image_width, image_height and cameras "
                             f"(as `stack data calibration` writes), found {type(data).__name__}")
        if data.get("format", FORMAT) != FORMAT:
            raise StackError(f"{source}: format {data.get('format')!r}, this stack reads {FORMAT!r}")
        missing = [k for k in ("image_width", "image_height", "cameras") if k not in data]
        cameras = data.get("cameras")
        if missing or not isinstance(cameras, list) or not cameras:
            raise StackError(f"{source}: expected keys image_width, image_height and a non-empty list `cameras` "
                             f"of {{name, intrinsics (3x3), cam_to_ego (4x4)}}; missing or empty: "
                             f"{', '.join(missing) or 'cameras'}")
        width, height = _pixels(data, "image_width", source), _pixels(data, "image_height", source)
        try:
            names = [str(c["name"]) for c in cameras]
            ks = np.array([c["intrinsics"] for c in cameras], dtype=np.float64)
            poses = np.array([c["cam_to_ego"] for c in cameras], dtype=np.float64)
        except (KeyError, TypeError, ValueError, OverflowError) as exc:
            raise StackError(f"{source}: every camera needs name, intrinsics (3x3 numbers) and cam_to_ego (4x4 "
                             f"numbers) ({type(exc).__name__}: {exc})") from None
        try:
            calibration = cls(width, height, tuple(names), ks, poses, name=str(data.get("name", "")))
        except StackError as exc:
            raise StackError(f"{source}: {exc}") from None
        stated = data.get("hash")
        if stated is not None and stated != calibration.hash:
            raise StackError(f"{source}: its `hash` {str(stated)[:16]}… does not match its values "
                             f"({calibration.hash[:16]}…): the values were edited after it was written. "
                             f"Delete the hash line if the edit was intended.")
        return calibration

    @classmethod
    def load(cls, path: str | Path) -> "Calibration":
        """Read a YAML or JSON calibration file (safe loaders only: never a pickle; no alias bombs)."""
        from stack.config import YAML_ERRORS, YamlTooLargeError, parse_yaml_value
        from stack.safe_values import escaped
        from stack.user_json import parse_json

        path = Path(path)
        if not path.is_file():
            raise StackError(missing_file_message("calibration file", path,
                                                  "Write one with `stack data calibration DATA_ROOT --out FILE`."))
        again = "Write it again with `stack data calibration DATA_ROOT --out FILE`."
        try:
            size = path.stat().st_size
            if size > MAX_CALIBRATION_BYTES:
                raise StackError(f"calibration file {escaped(str(path))} holds {size:,} bytes; one is a few dozen "
                                 f"numbers (at most {MAX_CALIBRATION_BYTES:,} bytes are read). {again}")
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise StackError(f"calibration file {path} cannot be read as UTF-8 text ({exc}); expected the YAML or JSON "
                             f"that `stack data calibration --out FILE` writes.") from None
        try:
            data = parse_json(text, f"calibration file {escaped(str(path))}", "a calibration (a JSON object)", again,
                              max_bytes=MAX_CALIBRATION_BYTES) if path.suffix == ".json" else parse_yaml_value(text)
        except YamlTooLargeError as exc:
            raise StackError(f"calibration file {path} {exc}; one is a few dozen numbers. {again}") from None
        except YAML_ERRORS as exc:
            raise StackError(f"calibration file {path} is not valid {'JSON' if path.suffix == '.json' else 'YAML'}: "
                             f"{str(exc).splitlines()[0]}") from None
        return cls.from_dict(data, f"calibration file {path}")

    # ------------------------------------------------------------------ output
    def to_dict(self) -> dict:
        return {"format": FORMAT, "name": self.name, "hash": self.hash,
                "image_width": self.image_width, "image_height": self.image_height,
                "cameras": [{"name": n, "intrinsics": k.tolist(), "cam_to_ego": p.tolist()}
                            for n, k, p in zip(self.cameras, self.intrinsics, self.cam_to_ego)]}

    def to_yaml(self) -> str:
        import yaml

        header = ("# Camera calibration (stack.deploy.calibration): K in pixels of image_width x image_height,\n"
                  "# cam_to_ego maps OpenCV camera coordinates to the ego frame (x forward, y left, z up), metres.\n")
        return header + yaml.safe_dump(self.to_dict(), sort_keys=False, default_flow_style=None, width=200)

    def save(self, path: str | Path) -> Path:
        """Write YAML (or JSON for a `.json` path), whole or not at all; a path that cannot be a file (a folder,
        under a file, unwritable) is a StackError."""
        from stack.durable import write_atomic

        path = check_destination(path)
        text = json.dumps(self.to_dict(), indent=1) if path.suffix == ".json" else self.to_yaml()
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            write_atomic(path, text.encode())
        except OSError as exc:
            raise StackError(f"calibration file {path} cannot be written ({exc.strerror or exc}); give --out a path "
                             f"in a folder you can write") from None
        return path

    @property
    def hash(self) -> str:
        """sha256 of image size, camera names and every value rounded to 1e-6 (m, px, rotation entries)."""
        def rounded(array):
            return [f"{v:.{HASH_DECIMALS}f}" for v in (np.round(array, HASH_DECIMALS) + 0.0).ravel()]

        payload = {"size": [self.image_width, self.image_height], "cameras": list(self.cameras),
                   "intrinsics": rounded(self.intrinsics), "cam_to_ego": rounded(self.cam_to_ego[:, :3, :])}
        return hashlib.sha256(json.dumps(payload, separators=(",", ":")).encode()).hexdigest()

    # ------------------------------------------------------------------ checks
    def problems(self) -> list[str]:
        """What makes this calibration unusable (empty when it is sound)."""
        n = len(self.cameras)
        found = []
        if self.image_width <= 0 or self.image_height <= 0:
            found.append(f"image size {self.image_width}x{self.image_height}: expected positive width and height")
        if self.intrinsics.shape != (n, 3, 3) or self.cam_to_ego.shape != (n, 4, 4):
            return found + [f"{n} cameras need intrinsics of shape ({n}, 3, 3) and cam_to_ego ({n}, 4, 4); found "
                            f"{self.intrinsics.shape} and {self.cam_to_ego.shape}"]
        if len(set(self.cameras)) != n:
            found.append(f"camera names repeat: {list(self.cameras)}")
        for name, k, pose in zip(self.cameras, self.intrinsics, self.cam_to_ego):
            found += [f"camera {name}: {p}" for p in _camera_problems(k, pose, self.image_width, self.image_height)]
        return found

    def check_fits(self, rig, what: str = "the calibration") -> None:
        """Refuse a calibration whose cameras or image size are not the network's (the pipeline's `data.rig`)."""
        names = tuple(c.name for c in rig.cameras)
        if self.cameras != names or (self.image_width, self.image_height) != (rig.image_width, rig.image_height):
            raise CalibrationMismatch(
                f"{what} ({self.name or 'unnamed'}) has cameras {list(self.cameras)} at {self.image_width}x"
                f"{self.image_height}; the network takes cameras {list(names)} (in that order) at "
                f"{rig.image_width}x{rig.image_height} (data.rig). A calibration is per vehicle with the same cameras; "
                f"a different camera set or resolution needs a network trained for it.")

    def compare(self, other: "Calibration", atol_m: float = ATOL_M, atol_px: float = ATOL_PX,
                atol_deg: float = ATOL_DEG) -> list[str]:
        """Human-readable differences beyond the tolerances (empty when the two pool identically)."""
        if (self.image_width, self.image_height) != (other.image_width, other.image_height):
            return [f"image size {other.image_width}x{other.image_height}, expected {self.image_width}x{self.image_height}"]
        if self.cameras != other.cameras:
            return [f"cameras {list(other.cameras)}, expected {list(self.cameras)}"]
        found = []
        for name, k0, k1, p0, p1 in zip(self.cameras, self.intrinsics, other.intrinsics, self.cam_to_ego, other.cam_to_ego):
            parts = []
            shift = float(np.linalg.norm(p1[:3, 3] - p0[:3, 3]))
            if shift > atol_m:
                parts.append(f"position differs by {_length(shift)}")
            angle = rotation_angle_deg(p0[:3, :3], p1[:3, :3])
            if angle > atol_deg:
                parts.append(f"rotation by {angle:.2f}°")
            pixels = float(np.abs(k1 - k0).max())
            if pixels > atol_px:
                parts.append(f"intrinsics by up to {pixels:.2f} px (fx {k0[0, 0]:.2f} vs {k1[0, 0]:.2f}, "
                             f"cx {k0[0, 2]:.2f} vs {k1[0, 2]:.2f})")
            if parts:
                found.append(f"camera {name}: " + ", ".join(parts))
        return found


def check_destination(path: str | Path) -> Path:
    """`path` as a Path, unless it cannot be a calibration file: a folder, or under a file (a StackError)."""
    path = Path(path)
    if path.is_dir():
        raise StackError(f"calibration file {path} is a folder; give --out a file path (e.g. {path / 'vehicle.yaml'})")
    blocking = next((parent for parent in path.parents if parent.exists() and not parent.is_dir()), None)
    if blocking is not None:
        raise StackError(f"calibration file {path} lies under {blocking}, which is a file; give --out a path in a "
                         f"folder (or move that file away)")
    return path


def _pixels(data: dict, key: str, source: str) -> int:
    """data[key] as a pixel count: a whole number from 1 to MAX_IMAGE_SIDE (128.0 is 128; 128.5, inf, a text are not)."""
    from stack.pipeline.data_config import MAX_IMAGE_SIDE

    value = data[key]
    whole = (isinstance(value, int) and not isinstance(value, bool)) or (isinstance(value, float) and value.is_integer())
    if not whole or not 1 <= value <= MAX_IMAGE_SIDE:
        raise StackError(f"{source}: {key} is {value!r:.40}, expected a whole number of pixels from 1 to "
                         f"{MAX_IMAGE_SIDE} (the image size the intrinsics are for, as `stack data calibration` writes "
                         f"it)")
    return int(value)


def _camera_problems(k: np.ndarray, pose: np.ndarray, width: int, height: int) -> list[str]:
    if not (np.isfinite(k).all() and np.isfinite(pose).all()):
        return ["non-finite values (NaN or Inf) in its intrinsics or cam_to_ego"]
    found = []
    if k[0, 0] <= 0 or k[1, 1] <= 0:
        found.append(f"focal lengths fx={k[0, 0]:g}, fy={k[1, 1]:g}: expected positive pixels")
    if not np.allclose(k[2], [0.0, 0.0, 1.0]) or abs(k[1, 0]) > 1e-9:
        found.append(f"intrinsics {k.tolist()}: expected a pinhole K [[fx, s, cx], [0, fy, cy], [0, 0, 1]]")
    if not (0 <= k[0, 2] <= width and 0 <= k[1, 2] <= height):
        found.append(f"principal point ({k[0, 2]:g}, {k[1, 2]:g}) lies outside the {width}x{height} image: "
                     f"is K for another resolution? Scale it with stack.rig.scale_intrinsics")
    if not np.allclose(pose[3], [0.0, 0.0, 0.0, 1.0]):
        found.append(f"cam_to_ego last row {pose[3].tolist()}: expected [0, 0, 0, 1]")
    rotation = pose[:3, :3]
    error = float(np.abs(rotation.T @ rotation - np.eye(3)).max())
    if error > ORTHONORMAL_ATOL or np.linalg.det(rotation) <= 0:
        found.append(f"cam_to_ego rotation is not a proper rotation (|R^T R - I| = {error:.2e}, det "
                     f"{np.linalg.det(rotation):+.4f}; expected < {ORTHONORMAL_ATOL:g} and +1)")
    return found


def _length(metres: float) -> str:
    if metres >= 1.0:
        return f"{metres:.2f} m"
    return f"{metres * 100:.1f} cm" if metres >= 0.01 else f"{metres * 1000:.2f} mm"


def check_samples(batches: list, calibration: Calibration, what: str) -> None:
    """Refuse `batches` (stack.batch.Batch) holding a sample recorded with another calibration.

    Deploy calibrates INT8 ranges, checks parity and scores accuracy on these samples with
    the bundle's baked geometry: a sample from another vehicle would be pooled into the
    wrong cells and judged as if that were the network's fault, or pass by luck.
    """
    index = 0
    for batch in batches:
        for row in range(batch.images.shape[0]):
            try:
                sample = Calibration.from_batch(batch, row, calibration.cameras)
            except StackError as exc:
                raise CalibrationMismatch(f"{what}, sample {index}: {exc}") from None
            differences = calibration.compare(sample)
            if differences:
                raise CalibrationMismatch(
                    f"{what}, sample {index}, was recorded with another camera calibration than the one the bundle "
                    f"is built for ({calibration.name or 'unnamed'}, hash {calibration.hash[:12]}):\n  "
                    + "\n  ".join(differences) + f"\n{FIX}")
            index += 1


def dataset_calibration(path: str, sample: int | None = None) -> Calibration:
    """The calibration a dataset (root or shard) was recorded with: sample `sample`'s, or, with None,
    the one every sample shares (a StackError names the first that differs: one bundle per calibration)."""
    from stack.data.camera_records import camera_records, dataset_of, describe

    root, manifest, shards = dataset_of(path)
    height, width = manifest.get("image_size", [0, 0])
    cameras, name = manifest.get("cameras", []), describe(root, manifest)
    first, count = None, 0
    for count, record in enumerate(camera_records(shards), start=1):
        try:
            found = Calibration(width, height, cameras, record.intrinsics, record.cam_to_ego, name=name)
        except StackError as exc:
            raise StackError(f"shard {record.shard}, sample {record.key}: {exc}") from None
        if sample is not None and count - 1 == sample:
            found.name = f"{name}, sample {record.key}"
            return found
        if sample is not None:
            continue
        if first is None:
            first, first_key = found, record.key
        elif differences := first.compare(found):
            raise CalibrationMismatch(
                f"{path} holds more than one camera calibration: sample {record.key} in {record.shard} differs from "
                f"{first_key}:\n  " + "\n  ".join(differences) + "\nA bundle is built for one calibration: pick one "
                "with --sample I, and deploy on data recorded with it (one data root per vehicle).")
    if first is None:
        wanted = f"sample {sample}" if sample is not None else "a sample"
        raise StackError(f"{path} holds {count} samples with stored cameras (intrinsics.npy, cam_to_ego.npy); "
                         f"expected {wanted}. Samples count from 0 in stored order.")
    return first
