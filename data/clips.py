"""Clip shards: one H.264 MP4 per camera per scene, plus per-frame labels (schema version `stack.data.format.SCHEMA_VERSION`, layout `clips`).

A clip sample's key is `s{scene:05d}`; its members:

| member            | content                                                                   |
|-------------------|---------------------------------------------------------------------------|
| `{camera}.mp4`    | H.264 (yuv420p, no B-frames) of that camera's T key frames at the frame rate |
| `depth.npy`       | float16 (T, N, H, W)                                                      |
| `semantic.npy`    | uint8 (T, N, H, W)                                                        |
| `instance.npy`    | uint16 (T, N, H, W)                                                       |
| `intrinsics.npy`, `cam_to_ego.npy` | as in frame shards (the rig is fixed over a clip)        |
| `boxes.npy`       | float32 (T, A, 10), rows as in frame shards (A = agents of the scene)     |
| `box_ids.npy`     | int32 (T, A, 3)                                                           |
| `boxes2d.npy`     | float32 (J, 7): frame index, then the frame-shard columns                 |
| `ego.npy`, `command.npy`, `past.npy`, `future.npy` | per frame, stacked on a leading T axis  |
| `meta.json`       | {"schema": SCHEMA_VERSION, "layout": "clips", "scene": int, "frames": T, "split": str} |

Videos are encoded with PyAV's bundled libx264 (single-threaded, bit-exact
flags, so shards stay byte-identical for a seed). On the CPU they decode with
PyAV, for either backend (`data.backend=dali` feeds the decoded frames to its graph,
`stack.data.dali_loader`); on a GPU DALI's `fn.experimental.decoders.video` (NVDEC) decodes the same
bytes (`decode_h264_gpu`) — DALI cannot decode H.264 on the CPU.
"""

from __future__ import annotations

import json

import numpy as np

from stack.data.format import ARRAY_MEMBERS, DTYPES, SCHEMA_VERSION, npy_bytes
from stack.video import VideoMismatch, decode_h264, encode_h264

PER_CLIP = ("intrinsics", "cam_to_ego")
"""Members stored once per clip rather than per frame."""


def _padded(rows: list, width: int, fill, dtype) -> np.ndarray:
    most = max((len(r) for r in rows), default=0)
    out = np.full((len(rows), most, width), fill, dtype)
    for t, row in enumerate(rows):
        out[t, :len(row)] = row
    return out


def clip_members(frames: list, cameras: list, meta: dict, rate_hz: float) -> list:
    """[(extension, bytes)] of one clip sample from the scene's frame dicts (see stack.sim.world.frame)."""
    members = [(f"{name}.mp4", encode_h264(np.stack([f["images"][i] for f in frames]), rate_hz))
               for i, name in enumerate(cameras)]
    for name in ARRAY_MEMBERS:
        if name in PER_CLIP:
            array = frames[0][name]
        elif name == "boxes":
            array = _padded([f["boxes"] for f in frames], 10, np.nan, np.float32)
        elif name == "box_ids":
            array = _padded([f["box_ids"] for f in frames], 3, -1, np.int32)
        elif name == "boxes2d":
            array = np.concatenate([np.c_[np.full(len(f["boxes2d"]), t), f["boxes2d"]] for t, f in enumerate(frames)])
            array = array.reshape(-1, 7)
        else:
            array = np.stack([f[name] for f in frames])
        members.append((f"{name}.npy", npy_bytes(np.asarray(array, DTYPES[name]))))
    payload = {"schema": SCHEMA_VERSION, "layout": "clips", "frames": len(frames), **meta}
    members.append(("meta.json", json.dumps(payload, sort_keys=True).encode()))
    return members


def frame_arrays(clip: dict, t: int) -> dict:
    """The frame-shard arrays of frame `t` of a decoded clip (padding boxes dropped)."""
    arrays = {}
    for name, array in clip.items():
        if name in PER_CLIP:
            arrays[name] = array
        elif name == "boxes":
            arrays[name] = array[t][np.isfinite(array[t]).all(axis=1)]
        elif name == "box_ids":
            arrays[name] = array[t][array[t][:, 0] >= 0]
        elif name == "boxes2d":
            arrays[name] = array[array[:, 0] == t, 1:]
        else:
            arrays[name] = array[t]
    return arrays


MAX_CLIP_FRAMES = 10_000
"""The most frames a clip's meta.json may name where no manifest says how many (data.world.frames_per_scene's
bound)."""
FIX = "re-create the shard with `stack data make`"


def clip_meta(sample: dict, shard: str, frames: int | None = None) -> dict:
    """The clip's meta.json, checked: a JSON object of this schema whose `frames` is the clip's frame count
    (`frames`, the manifest's frames_per_clip, where known); a BadSample naming shard and clip otherwise."""
    from stack.data.samples import BadSample, read_meta
    from stack.safe_values import escaped

    where = f"shard {shard}, clip {escaped(str(sample.get('__key__')))}: meta.json"
    meta = read_meta(sample["meta.json"], where, f"{{\"schema\": {SCHEMA_VERSION}, \"frames\": T, ...}}")
    if meta.get("schema") != SCHEMA_VERSION:
        raise BadSample(f"{where}: schema version {meta.get('schema')!r:.40}, this stack reads version "
                        f"{SCHEMA_VERSION}; re-create the shards with `stack data make`")
    wanted = f"{frames} (the manifest's frames_per_clip)" if frames is not None else \
        f"the clip's frame count, 1 to {MAX_CLIP_FRAMES:,}"
    if "frames" not in meta:
        raise BadSample(f"{where} has no 'frames', expected {wanted}; {FIX}")
    count = meta["frames"]
    if (not isinstance(count, int) or isinstance(count, bool) or not 1 <= count <= MAX_CLIP_FRAMES
            or (frames is not None and count != frames)):
        raise BadSample(f"{where} 'frames' is {count!r:.40}, expected {wanted}; {FIX}")
    return meta


def check_clip_arrays(arrays: dict, frames: int, shard: str, key) -> None:
    """BadSample unless every per-frame label array holds `frames` frames (boxes and box ids (T, A, k), boxes2d
    (J, 7) with frame indices below `frames`): `frame_arrays` can then cut each frame's arrays, and
    `stack.data.loader.check_arrays` checks their shapes and values."""
    from stack.data.samples import BadSample

    for name, array in arrays.items():
        where = f"shard {shard}, clip {key}: {name}.npy"
        if name == "boxes2d":
            if array.ndim != 2 or array.shape[1] != 7:
                raise BadSample(f"{where}: expected (J, 7) rows of frame index and a 2D box, found shape "
                                f"{tuple(array.shape)}; {FIX}")
            index = array[:, 0]
            if not (np.isfinite(index).all() and (index == np.round(index)).all()
                    and ((0 <= index) & (index < frames)).all()):
                raise BadSample(f"{where}: frame indices must be 0 to {frames - 1} (meta.json's frames), found "
                                f"{sorted(set(index.tolist()))[:8]}; {FIX}")
        elif name not in PER_CLIP:
            if not array.ndim or len(array) != frames:
                raise BadSample(f"{where} holds {len(array) if array.ndim else 'no'} frames, expected {frames} "
                                f"(meta.json's frames); {FIX}")
            if name in ("boxes", "box_ids") and array.ndim != 3:
                raise BadSample(f"{where}: expected (T, A, {10 if name == 'boxes' else 3}), found shape "
                                f"{tuple(array.shape)}; {FIX}")


def decode_clip(sample: dict, cameras: list, shard: str, pool=None, image_size: list | None = None,
                frames: int | None = None) -> tuple[dict, np.ndarray]:
    """(label arrays, uint8 videos (N, T, H, W, 3)) of a clip sample; bad members raise BadSample. With `pool` (a
    `concurrent.futures` executor) the cameras' videos decode in its threads: libavcodec runs without the GIL.

    `image_size` ([height, width]) and `frames` are the manifest's (without them every camera must have the first
    one's size, and meta.json says the count). The labels and meta.json are checked first, and every video against
    them from what its container declares before a frame is decoded (`stack.video.decode_h264`)."""
    from stack.data.samples import LOADER_MEMBERS, BadSample, decode_arrays

    key = sample.get("__key__")
    required = [f"{c}.mp4" for c in cameras] + [f"{n}.npy" for n in LOADER_MEMBERS] + ["meta.json"]
    missing = [name for name in required if name not in sample]
    if missing:
        raise BadSample(f"shard {shard}, clip {key}: missing member(s) {', '.join(missing)}; {FIX}")
    count = clip_meta(sample, shard, frames)["frames"]
    arrays = decode_arrays(sample, shard, LOADER_MEMBERS)
    check_clip_arrays(arrays, count, shard, key)
    sources = {"size": "the manifest's image_size" if image_size else f"the size of {cameras[0]}.mp4",
               "frames": "meta.json's frames", "codec": "the clip format"}

    def video(camera: str, size) -> np.ndarray:
        try:
            return decode_h264(sample[f"{camera}.mp4"], count, size)
        except VideoMismatch as exc:
            raise BadSample(f"shard {shard}, clip {key}: {camera}.mp4 {exc} ({sources[exc.about]}); {FIX}") from None
        except Exception as exc:  # PyAV raises its own error family (av.error.*)
            raise BadSample(f"shard {shard}, clip {key}: member {camera}.mp4 is not decodable H.264 ({exc}); "
                            f"{FIX}") from exc

    size = image_size
    first = [] if size else [video(cameras[0], None)]
    size = size or first[0].shape[1:3]
    videos = first + list((pool.map if pool is not None else map)(lambda c: video(c, size), cameras[len(first):]))
    return arrays, np.stack(videos)


def clip_frames(reader, sums, manifest: dict, shard: str, index: int, pool=None) -> tuple[dict, list, np.ndarray]:
    """(the stored clip sample, each frame's label arrays checked against the manifest, the clip's uint8 videos
    (N, T, H, W, 3)) of the clip at (shard, index), read by `reader` (a SampleReader) and hashed against its shard's
    table (`sums`, a ShardSums; None reads unhashed): what both backends read of a clip (`pool`: see
    `decode_clip`)."""
    from stack.data.loader import check_arrays

    sample = reader.read(shard, index)
    if sums is not None:
        sums.check_sample(sample, shard)
    clip, videos = decode_clip(sample, manifest["cameras"], shard, pool, manifest["image_size"],
                               manifest.get("frames_per_clip"))
    frames = [frame_arrays(clip, t) for t in range(videos.shape[1])]
    for t, arrays in enumerate(frames):
        check_arrays(arrays, manifest, shard, f"{sample.get('__key__')} frame {t}")
    return sample, frames, videos


def clip_history(pasts: list, t: int, frames: int) -> list:
    """[(frame index in the clip, ego pose then)] of the `frames` key frames before frame `t` of a clip, newest first,
    as `stack.data.loader.key_frame_history` finds a frame sample's: the frame before, posed in the ego frame of the
    one after it by that one's past trajectory (`pasts`: each frame's `past` array); at the scene start the oldest
    frame there is stands in with zero motion (BEVDet4D)."""
    from stack.kinematics import previous_pose

    history, newest = [], t
    for _ in range(frames):
        if newest == 0:
            history.append((0, np.zeros(3, np.float32)))
        else:
            history.append((newest - 1, previous_pose(pasts[newest])))
            newest -= 1
    return history


def decode_h264_gpu(videos: list, device_id: int = 0) -> list:
    """Decode MP4 bytes on the GPU with DALI (NVDEC), as uint8 RGB (T, H, W, 3) numpy arrays."""
    from nvidia.dali import fn, pipeline_def, types

    @pipeline_def(batch_size=len(videos), num_threads=1, device_id=device_id)
    def decode():
        data = fn.external_source(source=lambda: [np.frombuffer(v, np.uint8) for v in videos], batch=True,
                                  dtype=types.UINT8, cycle=False)
        return fn.experimental.decoders.video(data, device="mixed")

    pipe = decode()
    pipe.build()
    (frames,) = pipe.run()
    frames = frames.as_cpu()
    return [np.array(frames[i]) for i in range(len(videos))]
