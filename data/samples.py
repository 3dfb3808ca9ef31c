"""From stored members to the tensors of one `stack.batch.Batch` row, shared by both loader backends.

`check_members` and `decode_arrays` turn a sample's raw members into arrays, and
every failure (missing member, unreadable `.npy`, truncated JPEG, wrong schema
version) becomes a `BadSample` naming the shard and the key. `to_fields` maps
the stored class names onto the pipeline's class lists, keeps the boxes seen by
at least one camera (nearest first, padded to `model.max_boxes`), and cuts or
pads the future trajectory to `model.planning_steps`. `collate` stacks rows into
a `Batch`.
"""

from __future__ import annotations

import io
from dataclasses import dataclass, fields

import numpy as np
import torch

from stack.batch import IGNORE_INDEX, Batch
from stack.data.format import ARRAY_MEMBERS, SCHEMA_VERSION
from stack.errors import StackError
from stack.safe_values import escaped
from stack.pipeline import Pipeline


class BadSample(StackError):
    """A sample (or shard) that cannot be read; the message names the shard and the key."""


LOADER_MEMBERS = tuple(name for name in ARRAY_MEMBERS if name != "instance")
"""`.npy` members the loaders need (instance ids are not part of a Batch)."""


def check_members(sample: dict, cameras: list, shard: str) -> None:
    """Raise BadSample unless every member the schema requires is present and the schema version matches."""
    key = escaped(str(sample.get("__key__", "?")))
    required = [f"{c}.jpg" for c in cameras] + [f"{n}.npy" for n in ARRAY_MEMBERS] + ["meta.json"]
    missing = [name for name in required if name not in sample]
    if missing:
        raise BadSample(f"shard {shard}, sample {key}: missing member(s) {', '.join(missing)}; expected every member "
                        f"of schema {SCHEMA_VERSION} (see stack.data.format); re-create the shard with `stack data make`")
    version = read_meta(sample["meta.json"], f"shard {shard}, sample {key}: meta.json",
                        f"{{\"schema\": {SCHEMA_VERSION}, ...}}").get("schema")
    if version != SCHEMA_VERSION:
        raise BadSample(f"shard {shard}, sample {key}: schema version {version!r}, this stack reads version "
                        f"{SCHEMA_VERSION}; re-create the shards with this version's `stack data make`")


MAX_META_BYTES = 1024 * 1024
"""Largest meta.json member read: the stack writes a few hundred bytes (a clip's, a few kB per 100 frames)."""


def read_meta(data, where: str, expected: str) -> dict:
    """A sample's or clip's meta.json member as a dict, read through the bounded JSON reader
    (`stack.user_json`: size, nesting and numbers checked); a BadSample naming `where` otherwise."""
    from stack.user_json import parse_json

    try:
        return parse_json(data, where, expected, "Re-create the shard with `stack data make`.",
                          max_bytes=MAX_META_BYTES)
    except StackError as exc:
        raise BadSample(str(exc)) from None


NPY_HEADERS: dict = {}
"""Parsed `.npy` headers by their bytes: a dataset has a few distinct ones (shapes), so each is parsed once."""


def read_npy(data: bytes) -> np.ndarray:
    """A `.npy` member as a read-only array over `data`, without a copy.

    `np.load` parses every header with `ast.literal_eval` and copies the data: 0.05 ms a
    member, 0.5 ms of a sample's 10 members, a third of the DALI loader's Python time. The
    header is parsed by numpy's own reader the first time its bytes are seen; object
    dtypes are refused as `np.load(allow_pickle=False)` refuses them (no pickles)."""
    if data[:6] != b"\x93NUMPY" or len(data) < 10:
        raise ValueError("no .npy magic string at the start")
    start = 10 if data[6] == 1 else 12
    end = start + int.from_bytes(data[8:start], "little")
    header = data[6:end]
    if header not in NPY_HEADERS:
        if len(NPY_HEADERS) > 4096:  # a dataset of ever-new shapes must not grow this without bound
            NPY_HEADERS.clear()
        stream = io.BytesIO(data)
        major, _ = np.lib.format.read_magic(stream)
        read_header = np.lib.format.read_array_header_1_0 if major == 1 else np.lib.format.read_array_header_2_0
        shape, fortran, dtype = read_header(stream)
        if dtype.hasobject:
            raise ValueError("object arrays cannot be loaded when allow_pickle=False")
        NPY_HEADERS[header] = (shape, fortran, dtype)
    shape, fortran, dtype = NPY_HEADERS[header]
    array = np.frombuffer(data, dtype, int(np.prod(shape)), end)
    return array.reshape(shape[::-1]).T if fortran else array.reshape(shape)


def decode_arrays(sample: dict, shard: str, names=ARRAY_MEMBERS) -> dict:
    """The `.npy` members `names` as (read-only) arrays."""
    arrays = {}
    for name in names:
        try:
            arrays[name] = read_npy(sample[f"{name}.npy"])
        except (ValueError, OSError, EOFError, SyntaxError) as exc:
            raise BadSample(f"shard {shard}, sample {sample.get('__key__')}: member {name}.npy is not a readable .npy "
                            f"({exc}); re-create the shard") from exc
    return arrays


def decode_jpeg(data: bytes, shard: str, key: str, member: str) -> np.ndarray:
    """RGB uint8 (H, W, 3) of a JPEG member; truncated or corrupt data raises BadSample."""
    from PIL import Image

    try:
        with Image.open(io.BytesIO(data)) as image:
            image.load()
            return np.asarray(image if image.mode == "RGB" else image.convert("RGB"))
    except (OSError, ValueError, SyntaxError) as exc:
        raise BadSample(f"shard {shard}, sample {key}: member {member} is not a decodable JPEG ({exc}); "
                        "re-create the shard, or set data.skip_bad_samples=true to skip such samples") from exc


FRAME_HEADERS = frozenset(range(0xC0, 0xD0)) - {0xC4, 0xC8, 0xCC}
"""JPEG start-of-frame markers (baseline, progressive, ...); 0xC4/0xC8/0xCC are other segments in that range."""


def jpeg_size(data: bytes) -> tuple[int, int] | None:
    """(height, width) from a JPEG's frame header without decoding it (a few segments are skipped); None when
    no frame header comes before the data ends or a segment is malformed."""
    if data[:2] != b"\xff\xd8":
        return None
    at = 2
    while at + 9 <= len(data) and data[at] == 0xFF:
        marker = data[at + 1]
        if marker in FRAME_HEADERS:
            return int.from_bytes(data[at + 5:at + 7], "big"), int.from_bytes(data[at + 7:at + 9], "big")
        at += 1 if marker == 0xFF else 2 + int.from_bytes(data[at + 2:at + 4], "big")  # 0xFF: fill byte
    return None


def check_jpeg_sizes(sample: dict, cameras: list, image_size: list, shard: str) -> None:
    """BadSample unless every camera's JPEG has the manifest's size ([height, width]): a valid JPEG of another
    size would fail as a shape error in the batch (torch) or inside the DALI graph, without naming the member."""
    key = sample.get("__key__")
    for camera in cameras:
        size = jpeg_size(sample[f"{camera}.jpg"])
        if size is None:
            raise BadSample(f"shard {shard}, sample {key}: member {camera}.jpg is not a decodable JPEG (no frame "
                            "header); re-create the shard, or set data.skip_bad_samples=true to skip such samples")
        if list(size) != list(image_size):
            raise BadSample(f"shard {shard}, sample {key}: member {camera}.jpg is {size[1]}x{size[0]} pixels, "
                            f"expected {image_size[1]}x{image_size[0]} (the manifest's image_size); re-create the "
                            "shard with `stack data make`, or set data.skip_bad_samples=true to skip such samples")


@dataclass
class ClassMaps:
    """Lookup tables from the classes stored in the shards to the pipeline's class lists."""

    semantic: np.ndarray
    detection: np.ndarray
    semantic_is_identity: bool = False
    """Stored ids already are the pipeline's ids (stored masks hold only those ids and IGNORE_INDEX)."""

    @classmethod
    def build(cls, manifest: dict, pipeline: Pipeline) -> "ClassMaps":
        classes = len(pipeline.model.segmentation_classes)
        if classes > IGNORE_INDEX:  # ids 0 .. classes-1 must stay below IGNORE_INDEX
            raise StackError(f"model.segmentation_classes lists {classes} classes; Batch.semantic is uint8 with "
                             f"{IGNORE_INDEX} (IGNORE_INDEX) for unlabelled pixels, so at most {IGNORE_INDEX} classes fit")
        semantic = np.full(256, IGNORE_INDEX, np.uint8)
        for index, name in enumerate(manifest["semantic_classes"]):
            if name in pipeline.model.segmentation_classes:
                semantic[index] = pipeline.model.segmentation_classes.index(name)
        detection = np.array([pipeline.model.detection_classes.index(n) if n in pipeline.model.detection_classes else -1
                              for n in manifest["detection_classes"]] + [-1], np.int64)
        stored = len(manifest["semantic_classes"])
        return cls(semantic, detection, bool((semantic[:stored] == np.arange(stored)).all()))


def label_fields(arrays: dict, maps: ClassMaps, pipeline: Pipeline) -> dict:
    """The small (per-sample) fields of a Batch row: geometry, boxes, ego status, trajectories."""
    ids = arrays["box_ids"].reshape(-1, 3)
    labels = maps.detection[ids[:, 0]] if len(ids) else np.zeros(0, np.int64)
    boxes = arrays["boxes"].reshape(-1, 10)
    keep = (boxes[:, 9] > 0) & (labels >= 0)
    boxes, labels, attributes = boxes[keep, :9], labels[keep], ids[keep, 2]
    order = np.argsort(np.hypot(boxes[:, 0], boxes[:, 1]), kind="stable")[:pipeline.model.max_boxes]
    padded = np.zeros((pipeline.model.max_boxes, 9), np.float32)
    padded_labels = np.full(pipeline.model.max_boxes, -1, np.int64)
    padded_attributes = np.full(pipeline.model.max_boxes, -1, np.int64)
    padded[:len(order)], padded_labels[:len(order)] = boxes[order], labels[order]
    padded_attributes[:len(order)] = attributes[order]
    steps = pipeline.model.planning_steps
    future = np.zeros((steps, 2), np.float32)
    stored = arrays["future"][:steps]
    future[:len(stored)] = stored
    valid = np.zeros(steps, bool)
    valid[:len(stored)] = np.isfinite(stored).all(axis=1)
    future[~valid] = 0.0
    return {
        "intrinsics": torch.from_numpy(arrays["intrinsics"].astype(np.float32)),
        "cam_to_ego": torch.from_numpy(arrays["cam_to_ego"].astype(np.float32)),
        "boxes": torch.from_numpy(padded), "box_labels": torch.from_numpy(padded_labels),
        "box_attributes": torch.from_numpy(padded_attributes),
        "ego_status": torch.from_numpy(arrays["ego"].astype(np.float32)),
        "command": torch.tensor(int(arrays["command"][0]), dtype=torch.int64),
        "past_trajectory": torch.from_numpy(arrays["past"].astype(np.float32)),
        "future_trajectory": torch.from_numpy(future), "future_valid": torch.from_numpy(valid),
        "bev_rotation": torch.tensor(0.0, dtype=torch.float32),  # augment.rotate_bev sets it
    }


def to_fields(images: np.ndarray, arrays: dict, maps: ClassMaps, pipeline: Pipeline) -> dict:
    """One Batch row (no batch dimension) as tensors; `images` is (N, H, W, 3) uint8."""
    semantic = arrays["semantic"]
    return {  # depth and semantics stay as narrow as stored (float16, uint8): see stack.batch
        "images": torch.from_numpy(images).permute(0, 3, 1, 2),  # a view: `collate` transposes while stacking
        "depth": torch.from_numpy(np.array(arrays["depth"], np.float16)),
        "semantic": torch.from_numpy(np.array(semantic, np.uint8) if maps.semantic_is_identity
                                     else maps.semantic[semantic]),
        **label_fields(arrays, maps, pipeline),
    }


def collate(rows: list) -> Batch:
    """Stack Batch rows (dicts from `to_fields`) into a Batch.

    numpy stacks: torch.stack of large CPU tensors runs through the intra-op
    thread pool, which on a busy machine was 15-40x slower than one memcpy per row.
    """
    return Batch(**stack_fields(rows, [f.name for f in fields(Batch) if f.name in rows[0]]))


def stack_fields(rows: list, names) -> dict:
    """{name: the rows' tensors stacked on a new leading axis} (see `collate` for why numpy stacks).

    Each field is written once: strided rows (the images' HWC -> CHW view) are transposed by the
    stack itself, and in a DataLoader worker the output lives in shared memory from the start, as
    torch's `default_collate` does, so sending the batch to the main process copies nothing more."""
    from torch.utils.data import get_worker_info

    in_worker = get_worker_info() is not None
    stacked = {}
    for name in names:
        first = rows[0][name]
        shape = (len(rows), *first.shape)
        if in_worker:
            storage = first._typed_storage()._new_shared(len(rows) * first.numel(), device="cpu")
            out = first.new(storage).resize_(shape)
        else:
            out = torch.empty(shape, dtype=first.dtype)
        np.stack([row[name].numpy() for row in rows], out=out.numpy())
        stacked[name] = out
    return stacked
