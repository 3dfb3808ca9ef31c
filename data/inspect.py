"""`stack data inspect SHARD`: one sample as a PNG mosaic that a person can check at a glance.

Left: every camera with the 3D boxes projected as wireframes (colour = class),
its depth (turbo colour map, metres) and its semantic segmentation. Right: a
bird's-eye view of the ego frame with every box, its velocity arrow, the
camera frusta, and the ego's past (grey) and future (red) trajectory.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np

from stack.data.format import MANIFEST
from stack.data.loader import ShortShard, check_arrays, read_manifest, read_piece
from stack.sim.world.roads import SEG_CLASSES
from stack.data.samples import check_members, decode_arrays, decode_jpeg
from stack.data.sharding import Piece
from stack.sim.world.traffic import CLASSES
from stack.errors import StackError

CLASS_COLOURS = {"car": "#1f77b4", "truck": "#9467bd", "pedestrian": "#d62728", "cyclist": "#ff7f0e"}
SEG_COLOURS = np.array([[128, 64, 128], [255, 255, 255], [244, 35, 232], [70, 70, 70], [107, 142, 35],
                        [70, 130, 180], [0, 0, 142], [0, 0, 70], [220, 20, 60], [255, 150, 0]], np.uint8)
EDGES = [(0, 1), (1, 2), (2, 3), (3, 0), (4, 5), (5, 6), (6, 7), (7, 4), (0, 4), (1, 5), (2, 6), (3, 7)]


def box_corners(box: np.ndarray) -> np.ndarray:
    """(8, 3) ego-frame corners of a box row (x, y, z, l, w, h, yaw, ...): bottom face first, front-left first."""
    x, y, z, length, width, height, yaw = box[:7]
    dx = np.array([1, 1, -1, -1, 1, 1, -1, -1]) * length / 2
    dy = np.array([1, -1, -1, 1, 1, -1, -1, 1]) * width / 2
    dz = np.array([-1, -1, -1, -1, 1, 1, 1, 1]) * height / 2
    c, s = math.cos(yaw), math.sin(yaw)
    return np.stack([x + c * dx - s * dy, y + s * dx + c * dy, z + dz], axis=1)


def _load(shard: str, index: int) -> tuple[str, list, np.ndarray, dict]:
    """(key, camera names, images (N, H, W, 3), label arrays) of frame `index` of a frame or clip shard."""
    if not Path(shard).is_file():
        raise StackError(f"shard {shard} does not exist; expected a .tar written by `stack data make`")
    first = next(iter(read_piece(Piece(shard, 0, 1))), {})
    if any(name.endswith(".mp4") for name in first):
        from stack.data.clips import clip_meta, decode_clip, frame_arrays

        frames = clip_meta(first, shard)["frames"]
        sample = list(read_piece(Piece(shard, index // frames, index // frames + 1)))[0]
        cameras = [name[:-4] for name in sample if name.endswith(".mp4")]
        clip, videos = decode_clip(sample, cameras, shard)
        return f"{sample['__key__']} frame {index % frames}", cameras, videos[:, index % frames], \
            frame_arrays(clip, index % frames)
    sample = list(read_piece(Piece(shard, index, index + 1)))[0]
    key = sample["__key__"]
    cameras = [name[:-4] for name in sample if name.endswith(".jpg")]
    check_members(sample, cameras, shard)
    images = np.stack([decode_jpeg(sample[f"{c}.jpg"], shard, key, f"{c}.jpg") for c in cameras])
    arrays = decode_arrays(sample, shard)
    check_arrays(arrays, {"cameras": cameras, "image_size": list(images.shape[1:3])}, shard, key, values=False)
    return key, cameras, images, arrays


def _draw_boxes(axis, arrays: dict, camera: int, classes: list) -> None:
    k, ego_to_cam = arrays["intrinsics"][camera], np.linalg.inv(arrays["cam_to_ego"][camera])
    for box, (cls, *_) in zip(arrays["boxes"], arrays["box_ids"]):
        if box[9] <= 0:
            continue
        corners = np.c_[box_corners(box), np.ones(8)] @ ego_to_cam.T
        for a, b in EDGES:
            if corners[a, 2] < 0.2 or corners[b, 2] < 0.2:
                continue
            points = (k @ corners[[a, b], :3].T).T
            points = points[:, :2] / points[:, 2:]
            axis.plot(points[:, 0], points[:, 1], color=CLASS_COLOURS.get(classes[cls], "y"), linewidth=1.2)


def _bev(axis, arrays: dict, classes: list, extent: float = 50.0) -> None:
    from matplotlib.patches import Polygon

    for box, (cls, *_) in zip(arrays["boxes"], arrays["box_ids"]):
        colour = CLASS_COLOURS.get(classes[cls], "y")
        corners = box_corners(box)[:4, :2]
        axis.add_patch(Polygon(corners[:, ::-1] * [-1, 1], closed=True, fill=box[9] > 0, alpha=0.8 if box[9] > 0 else 0.4,
                               edgecolor=colour, facecolor=colour))
        axis.arrow(-box[1], box[0], -box[8] * 0.5, box[7] * 0.5, color=colour, width=0.15, length_includes_head=True)
    for pose, k in zip(arrays["cam_to_ego"], arrays["intrinsics"]):
        half = math.atan(k[0, 2] / k[0, 0])
        for side in (-1, 1):
            direction = pose[:3, :3] @ np.array([side * math.tan(half), 0.0, 1.0])
            direction = direction[:2] / np.linalg.norm(direction[:2]) * 12
            axis.plot([-pose[1, 3], -pose[1, 3] - direction[1]], [pose[0, 3], pose[0, 3] + direction[0]], color="0.6", lw=0.7)
    ego = box_corners(np.array([1.3, 0.0, 0.8, 4.6, 1.9, 1.6, 0.0]))[:4, :2]
    axis.add_patch(Polygon(ego[:, ::-1] * [-1, 1], closed=True, color="k"))
    past, future = arrays["past"], arrays["future"][np.isfinite(arrays["future"]).all(axis=1)]
    axis.plot(-past[:, 1], past[:, 0], "o-", color="0.45", ms=3, label="past 2 s")
    axis.plot(-future[:, 1], future[:, 0], "o-", color="red", ms=3, label="future 3 s")
    axis.set_xlim(-extent, extent)
    axis.set_ylim(-extent, extent)
    axis.set_aspect("equal")
    axis.grid(alpha=0.3)
    axis.set_title("bird's-eye view (ego frame): filled boxes are seen by a camera, outlined ones are hidden;"
                   " arrows: velocity over 0.5 s", fontsize=9)
    axis.set_xlabel("-y (m, right)")
    axis.set_ylabel("x (m, forward)")
    for name, colour in CLASS_COLOURS.items():
        axis.plot([], [], "s", color=colour, label=name)
    axis.legend(loc="lower right", fontsize=8)


def inspect_shard(shard: str, index: int = 0, out: str | None = None) -> str:
    """Write the mosaic of sample `index` of `shard` (frame `index` for clip shards) to `out` (default: beside
    the shard); returns the path."""
    if index < 0:
        raise StackError(f"--sample {index}: expected a sample index >= 0 (0 is the shard's first sample)")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    try:
        key, cameras, images, arrays = _load(shard, index)
    except ShortShard as exc:
        raise StackError(f"shard {shard} has no sample {index} (it holds {exc.samples} samples; a clip shard's "
                         "samples are clips, and --sample counts their frames); use a smaller --sample") from None
    out_path = _output_path(shard, index, out)
    root = Path(shard).parent.parent
    manifest = read_manifest(root) if (root / MANIFEST).is_file() else {}
    classes = manifest.get("detection_classes", list(CLASSES))
    semantic_names = manifest.get("semantic_classes", list(SEG_CLASSES))
    cols = min(3, len(cameras))
    rows = math.ceil(len(cameras) / cols)
    aspect = images.shape[1] / images.shape[2]
    figure = plt.figure(figsize=(5.0 * cols + 11, 3 * rows * 5.0 * aspect + 2.0), dpi=110)
    grid = figure.add_gridspec(3 * rows, cols + 2, bottom=0.08, top=0.93, wspace=0.08)
    for camera, name in enumerate(cameras):
        r, c = divmod(camera, cols)
        for layer, content in enumerate(_layers(images, arrays, camera)):
            axis = figure.add_subplot(grid[layer * rows + r, c])
            axis.imshow(content, interpolation="nearest")
            if layer == 0:
                _draw_boxes(axis, arrays, camera, classes)
                axis.set_xlim(0, images.shape[2])
                axis.set_ylim(images.shape[1], 0)
            axis.set_title(f"{name} · {('rgb + 3D boxes', 'depth 0-60 m', 'semantics')[layer]}", fontsize=9)
            axis.axis("off")
    _bev(figure.add_subplot(grid[:, cols:]), arrays, classes)
    command = ("left", "straight", "right")[int(arrays["command"][0])]
    speed, accel, yaw_rate = arrays["ego"]
    from matplotlib.patches import Patch

    swatches = [Patch(facecolor=SEG_COLOURS[i] / 255, edgecolor="0.5", label=name)
                for i, name in enumerate(semantic_names[:len(SEG_COLOURS)])]
    figure.legend(handles=swatches, loc="lower center", ncol=len(swatches), fontsize=9, title="semantic classes")
    figure.suptitle(f"{Path(shard).name} · sample {key} · command {command} · speed {speed:.1f} m/s · "
                    f"accel {accel:+.1f} m/s² · yaw rate {yaw_rate:+.2f} rad/s", fontsize=12)
    figure.savefig(out_path, bbox_inches="tight")
    plt.close(figure)
    return str(out_path)


def _output_path(shard: str, index: int, out: str | None) -> Path:
    """--out as given (its folder created when missing), inside it when it is a folder, else beside the shard."""
    default_name = f"{Path(shard).stem}-{index}.png"
    if not out:
        return Path(shard).with_name(default_name)
    path = Path(out)
    if path.is_dir():
        return path / default_name
    blocking = next((p for p in path.parents if p.exists() and not p.is_dir()), None)
    if blocking is not None:
        raise StackError(f"--out {out}: {blocking} is a file, so no folder can be made there; give a PNG path in a folder")
    path.parent.mkdir(parents=True, exist_ok=True)
    return path


def _layers(images: np.ndarray, arrays: dict, camera: int) -> list:
    import matplotlib

    depth = arrays["depth"][camera].astype(np.float32)
    coloured = matplotlib.colormaps["turbo"](np.clip(depth / 60.0, 0, 1))[..., :3]
    coloured[depth == 0] = 0.0
    semantic = arrays["semantic"][camera]
    seg = np.where(semantic[..., None] < len(SEG_COLOURS), SEG_COLOURS[np.minimum(semantic, len(SEG_COLOURS) - 1)], 0)
    return [images[camera], coloured, seg.astype(np.uint8)]

