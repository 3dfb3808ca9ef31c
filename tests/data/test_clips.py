"""Clip shards: H.264 per camera per scene, decoded on the CPU (PyAV) into the same Batch rows as frame shards."""

import tarfile
from pathlib import Path

import numpy as np
import pytest
import torch

from stack.data import build_loader
from stack.data.clips import decode_h264_gpu
from stack.video import decode_h264, encode_h264
from stack.errors import StackError


def _psnr(a, b):
    mse = np.mean((a.astype(np.float64) - b.astype(np.float64)) ** 2)
    return 10 * np.log10(255.0 ** 2 / max(mse, 1e-9))


def test_clip_frames_match_the_frame_shards(dataset, clips):
    frames_pipeline, _ = dataset
    clip_pipeline, manifest = clips
    assert manifest["layout"] == "clips" and manifest["frames_per_clip"] == frames_pipeline.data.world.frames_per_scene
    from_frames = list(build_loader(frames_pipeline, "val", 0, 1, shuffle=False, augment=False))
    from_clips = list(build_loader(clip_pipeline, "val", 0, 1, shuffle=False, augment=False))
    assert len(from_frames) == len(from_clips)
    for a, b in zip(from_frames, from_clips):
        assert b.mismatches(clip_pipeline) == []
        # same scene, same labels; pixels differ only by the two lossy codecs (JPEG q90 vs H.264 crf 18)
        for name in ("depth", "semantic", "boxes", "box_labels", "ego_status", "future_trajectory", "cam_to_ego"):
            assert torch.equal(getattr(a, name), getattr(b, name)), name
        assert _psnr(a.images.numpy(), b.images.numpy()) > 30


def test_a_temporal_network_gets_the_same_history_from_clips_as_from_frames(dataset, clips, small_pipeline):
    """k = 2: a clip holds its scene's key frames in order, so each row's previous and earlier images are the clip's
    rows before it (its first frame's: its own), posed as the frame shards' loader poses them."""
    frames_pipeline, _ = dataset
    k2 = ("model.temporal_frames=2", "data.batch_size=1")
    from_frames = list(build_loader(small_pipeline(frames_pipeline.data.root, *k2), "val", 0, 1, shuffle=False,
                                    augment=False))
    clip_pipeline = small_pipeline(clips[0].data.root, "data.layout=clips", *k2)
    from_clips = list(build_loader(clip_pipeline, "val", 0, 1, shuffle=False, augment=False))
    assert len(from_frames) == len(from_clips) > 2
    for position, (a, b) in enumerate(zip(from_frames, from_clips)):
        assert b.mismatches(clip_pipeline) == []
        assert torch.equal(a.previous_pose, b.previous_pose) and torch.equal(a.earlier_poses, b.earlier_poses)
        t = position % clips[1]["frames_per_clip"]  # the frame's index in its scene
        back = [from_clips[position - min(t, j)].images for j in (1, 2)]
        assert torch.equal(b.previous_images, back[0]) and torch.equal(b.earlier_images, back[1]), position
        assert _psnr(a.earlier_images.numpy(), b.earlier_images.numpy()) > 30
    moved = [b for b in from_clips if b.earlier_poses.any()]
    assert moved, "no frame had two before it"
    augmented = next(iter(build_loader(clip_pipeline, "train", 0, 1, shuffle=True, augment=True)))
    assert augmented.mismatches(clip_pipeline) == []


def test_a_clip_dataset_names_the_scene_of_every_frame_as_the_frame_dataset_does(dataset, clips):
    """The deploy gates count frames and resample whole scenes: a clip is one scene of frames_per_clip frames."""
    from stack.data.sequences import split_sequences
    from stack.deploy.validation import split_size

    frames_pipeline, _ = dataset
    clip_pipeline, _ = clips
    scenes = split_sequences(clip_pipeline, "val")
    assert scenes == split_sequences(frames_pipeline, "val") and len(set(scenes)) < len(scenes)
    assert split_size(clip_pipeline, "val") == split_size(frames_pipeline, "val") == len(scenes)


@pytest.mark.parametrize("backend", ["torch", "dali"])
def test_clip_loader_gives_equal_batches_per_rank(clips, small_pipeline, backend):
    pipeline, _ = clips
    one = small_pipeline(pipeline.data.root, "data.layout=clips", "data.batch_size=1", "data.num_workers=2",
                         f"data.backend={backend}")
    loaders = [build_loader(one, "train", rank, 2, augment=False) for rank in range(2)]
    counts = [sum(1 for _ in loader) for loader in loaders]
    assert counts == [len(loaders[0]), len(loaders[1])] and counts[0] == counts[1] > 0


def test_h264_round_trip_and_determinism():
    rng = np.random.default_rng(0)
    frames = np.repeat(np.linspace(0, 255, 64 * 96 * 3).reshape(1, 64, 96, 3), 5, axis=0).astype(np.uint8)
    frames[:, 10:30, 20:50] = rng.integers(0, 255, 3, dtype=np.uint8)
    data = encode_h264(frames, 2.0)
    assert data == encode_h264(frames, 2.0)
    decoded = decode_h264(data)
    assert decoded.shape == frames.shape and _psnr(decoded, frames) > 35


@pytest.mark.parametrize("backend", ["torch", "dali"])
def test_layout_mismatch_is_explained(clips, small_pipeline, backend):
    pipeline, _ = clips
    with pytest.raises(StackError, match="data.layout=frames but .* holds clips shards"):
        build_loader(small_pipeline(pipeline.data.root, f"data.backend={backend}"), "train", 0, 1)


@pytest.mark.gpu
def test_dali_gpu_video_decode_gives_the_same_frames_as_pyav(clips):
    pipeline, manifest = clips
    with tarfile.open(Path(pipeline.data.root) / manifest["splits"]["train"][0]["path"]) as tar:
        videos = [tar.extractfile(m).read() for m in tar.getmembers() if m.name.endswith(".mp4")][:2]
    for cpu, gpu in zip((decode_h264(v) for v in videos), decode_h264_gpu(videos)):
        assert cpu.shape == gpu.shape
        assert _psnr(cpu, gpu) > 40  # same bitstream; only YUV->RGB conversion rounding differs


def test_inspect_draws_a_frame_of_a_clip_shard(clips, tmp_path):
    from stack.data.inspect import inspect_shard

    pipeline, manifest = clips
    shard = str(Path(pipeline.data.root) / manifest["splits"]["train"][0]["path"])
    out = inspect_shard(shard, 2, str(tmp_path / "clip.png"))
    assert Path(out).stat().st_size > 50_000
    with pytest.raises(StackError, match="has no sample 99"):
        inspect_shard(shard, 99, str(tmp_path / "none.png"))


# ----------------------------------------------------------------------------- hostile clips: named, never decoded blind

def _raw_h264(frames: np.ndarray) -> bytes:
    """An H.264 elementary stream (no container): it declares no frame count, so only decoding can count it."""
    import io

    import av

    buffer = io.BytesIO()
    with av.open(buffer, mode="w", format="h264") as container:
        stream = container.add_stream("libx264", rate=2)
        stream.width, stream.height, stream.pix_fmt = frames.shape[2], frames.shape[1], "yuv420p"
        for frame in frames:
            for packet in stream.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    return buffer.getvalue()


def _shorter(data: bytes) -> bytes:
    import io

    from stack.data.format import npy_bytes

    return npy_bytes(np.load(io.BytesIO(data))[:-1])


def _meta(change):
    import json

    return lambda data: json.dumps(change(json.loads(data))).encode()


@pytest.mark.parametrize("member, change, needle", [
    ("depth.npy", _shorter, r"depth.npy holds 2 frames, expected 3 \(meta.json's frames\)"),
    ("future.npy", _shorter, r"future.npy holds 2 frames, expected 3"),
    ("meta.json", lambda _: b"{\"frames\": 3,", r"meta.json: expected \{\"schema\".*found invalid JSON"),
    ("meta.json", _meta(lambda m: {k: v for k, v in m.items() if k != "frames"}), r"meta.json has no 'frames'"),
    ("meta.json", _meta(lambda m: {**m, "frames": "3"}), r"meta.json 'frames' is '3', expected 3"),
    ("meta.json", _meta(lambda m: {**m, "frames": 30}), r"meta.json 'frames' is 30, expected 3 \(the manifest's "
                                                        r"frames_per_clip\)"),
    ("front.mp4", lambda _: encode_h264(np.zeros((3, 32, 64, 3), np.uint8), 2.0),
     r"front.mp4 is 64x32 pixels, expected 128x64 \(the manifest's image_size\)"),
    ("front.mp4", lambda _: encode_h264(np.zeros((40, 64, 128, 3), np.uint8), 2.0),
     r"front.mp4 declares 40 frames, expected 3"),
    ("front.mp4", lambda _: _raw_h264(np.zeros((12, 64, 128, 3), np.uint8)), r"front.mp4 holds more than 3 frames"),
    ("front.mp4", lambda _: encode_h264(np.zeros((2, 64, 128, 3), np.uint8), 2.0), r"front.mp4 .* 2 frames, "
                                                                                   r"expected 3"),
], ids=["labels-short", "future-short", "meta-not-json", "meta-no-frames", "meta-frames-text", "meta-frames-30",
        "camera-other-size", "declares-40-frames", "undeclared-12-frames", "video-short"])
def test_a_hostile_clip_is_named_with_what_was_expected(clips, tmp_path, small_pipeline, member, change, needle):
    """Each is a BadSample naming shard, clip and member, with what was expected and found, and the fix (re-render
    with `stack data make`); the videos are checked against the manifest before their frames are converted."""
    from tests.data.test_bad_input import _copy, _first_train_shard, _rewrite

    pipeline, manifest, root = _copy(clips, tmp_path, "data.layout=clips", small_pipeline=small_pipeline)
    shard = _first_train_shard(root, manifest)
    first = sorted({name.split(".")[0] for name in tarfile.open(shard).getnames()})[0]
    _rewrite(shard, lambda name, data: change(data) if name == f"{first}.{member}" else data)
    with pytest.raises(StackError, match=rf"shard .*clips-000000.tar, clip {first}: {needle}.*stack data make"):
        list(build_loader(pipeline, "train", 0, 1, shuffle=False, augment=False))


def test_every_camera_at_another_size_than_the_manifest_is_refused_by_both_loaders(clips, tmp_path, small_pipeline):
    from tests.data.test_bad_input import _copy, _first_train_shard, _rewrite

    small = encode_h264(np.zeros((3, 48, 96, 3), np.uint8), 2.0)
    for backend in ("torch", "dali"):
        pipeline, manifest, root = _copy(clips, tmp_path / backend, "data.layout=clips", f"data.backend={backend}",
                                         small_pipeline=small_pipeline)
        _rewrite(_first_train_shard(root, manifest), lambda name, data: small if name.endswith(".mp4") else data)
        with pytest.raises(StackError, match=r"clip s\d+: front.mp4 is 96x48 pixels, expected 128x64"):
            list(build_loader(pipeline, "train", 0, 1, shuffle=False, augment=False))


def test_inspect_names_a_clip_whose_meta_is_not_json(clips, tmp_path, small_pipeline):
    from tests.data.test_bad_input import _copy, _first_train_shard, _rewrite
    from tests.data.test_hostile_data import run_cli

    pipeline, manifest, root = _copy(clips, tmp_path, "data.layout=clips", small_pipeline=small_pipeline)
    shard = _first_train_shard(root, manifest)
    _rewrite(shard, lambda name, data: b"\xff not json" if name.endswith("meta.json") else data)
    code, _, err = run_cli("data", "inspect", str(shard), "--out", str(tmp_path / "x.png"))
    assert code == 2 and len(err.strip().splitlines()) == 1 and "meta.json: expected {\"schema\"" in err, err
    # cameras of two sizes (inspect has no manifest to hold them to): the second camera is named
    pipeline, manifest, root = _copy(clips, tmp_path / "sizes", "data.layout=clips", small_pipeline=small_pipeline)
    shard = _first_train_shard(root, manifest)
    small = encode_h264(np.zeros((3, 32, 64, 3), np.uint8), 2.0)
    _rewrite(shard, lambda name, data: small if name.endswith("front_left.mp4") else data)
    code, _, err = run_cli("data", "inspect", str(shard), "--out", str(tmp_path / "y.png"))
    assert code == 2 and "front_left.mp4 is 64x32 pixels, expected 128x64" in err, err
