"""Hostile datasets and data commands: each is a clear error naming the file (and shard and key), exit 2."""

import contextlib
import io
import json
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_bad_input import _copy, _first_train_shard, _iterate, _rewrite  # noqa: E402

from stack.cli import main  # noqa: E402
from stack.data import build_loader  # noqa: E402
from stack.data.format import npy_bytes  # noqa: E402
from stack.data.samples import BadSample  # noqa: E402
from stack.errors import StackError  # noqa: E402


def run_cli(*argv) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(out):
        code = main(list(argv))
    return code, out.getvalue(), err.getvalue()


@pytest.mark.parametrize("manifest, needle", [
    ([], "(a JSON object); found a JSON array"),
    ("frames", "(a JSON object); found a JSON string"),
    ({"cameras": None}, "expected 'cameras' to be a JSON array, found null"),
    ({"splits": {"train": {"path": "x"}}}, "splits.train"),
    ({"splits": {"train": [{"path": "../../etc/passwd", "samples": 1}]}}, "leaves the dataset folder"),
    ({"splits": {"train": [{"path": "train/frames-000000.tar", "samples": "many"}]}}, "splits.train"),
    ({"image_size": [64]}, "expected 'image_size' to be [height, width]"),
])
def test_a_manifest_that_is_not_the_expected_object(dataset, tmp_path, small_pipeline, manifest, needle):
    pipeline, _, root = _copy(dataset, tmp_path, small_pipeline=small_pipeline)
    stored = json.loads((root / "manifest.json").read_text())
    broken = {**stored, **manifest} if isinstance(manifest, dict) else manifest
    (root / "manifest.json").write_text(json.dumps(broken))
    with pytest.raises(StackError, match=rf"manifest.json(: expected a dataset manifest| is not a dataset manifest:)"
                                         rf".*{_escape(needle)}"):
        build_loader(pipeline, "train", 0, 1)


def test_inspect_reports_a_broken_manifest_with_exit_2(dataset, tmp_path, small_pipeline):
    _, manifest, root = _copy(dataset, tmp_path, small_pipeline=small_pipeline)
    (root / "manifest.json").write_text("[1, 2]")
    code, _, err = run_cli("data", "inspect", str(_first_train_shard(root, manifest)), "--out", str(tmp_path / "x.png"))
    assert code == 2 and "expected a dataset manifest" in err and "found a JSON array" in err and "Traceback" not in err, err


@pytest.mark.parametrize("member, array, needle", [
    ("depth", np.zeros((6, 64, 127), np.float16), "expected float16 (6, 64, 128), found float16 (6, 64, 127)"),
    ("depth", np.zeros((6, 64, 128), np.float64), "expected float16 (6, 64, 128), found float64"),
    ("boxes", np.zeros((3, 9), np.float32), "expected float32 (any, 10), found float32 (3, 9)"),
    ("intrinsics", np.zeros((5, 3, 3), np.float32), "expected float32 (6, 3, 3)"),
    ("ego", np.zeros(2, np.float32), "expected float32 (3,), found float32 (2,)"),
])
def test_a_npy_member_of_the_wrong_shape_names_shard_key_and_member(dataset, tmp_path, small_pipeline, member, array,
                                                                    needle):
    pipeline, manifest, root = _copy(dataset, tmp_path, small_pipeline=small_pipeline)
    shard = _first_train_shard(root, manifest)
    _rewrite(shard, lambda name, data: npy_bytes(array) if name.endswith(f"f0001.{member}.npy") else data)
    with pytest.raises(BadSample, match=rf"frames-000000.tar, sample s\d+f0001: member {member}.npy: {_escape(needle)}"):
        _iterate(pipeline)
    code, _, err = run_cli("data", "inspect", str(shard), "--sample", "1", "--out", str(tmp_path / "x.png"))
    assert code == 2 and f"{member}.npy" in err and "Traceback" not in err, err


def test_mismatched_box_and_id_counts(dataset, tmp_path, small_pipeline):
    pipeline, manifest, root = _copy(dataset, tmp_path, small_pipeline=small_pipeline)
    _rewrite(_first_train_shard(root, manifest),
             lambda name, data: npy_bytes(np.zeros((0, 3), np.int32)) if name.endswith("f0000.box_ids.npy") else data)
    boxes = np.load(io.BytesIO(_member(_first_train_shard(root, manifest), "f0000.boxes.npy")))
    if len(boxes) == 0:
        pytest.skip("the rendered sample has no boxes")
    with pytest.raises(BadSample, match="boxes.npy holds .* boxes but box_ids.npy 0"):
        _iterate(pipeline)


def test_inspect_writes_into_a_missing_folder(dataset, tmp_path):
    pipeline, manifest = dataset
    shard = Path(pipeline.data.root) / manifest["splits"]["train"][0]["path"]
    out = tmp_path / "new" / "deeper" / "mosaic.png"
    code, stdout, err = run_cli("data", "inspect", str(shard), "--out", str(out))
    assert code == 0, err
    assert out.is_file() and out.read_bytes()[:4] == b"\x89PNG" and str(out) in stdout
    code, stdout, err = run_cli("data", "inspect", str(shard), "--out", str(tmp_path / "new"))  # a folder: inside it
    assert code == 0 and (tmp_path / "new" / f"{shard.stem}-0.png").is_file(), err


@pytest.mark.parametrize("index, needle", [("-1", "expected a sample index >= 0"), ("999", "has no sample 999")])
def test_inspect_sample_out_of_range(dataset, tmp_path, index, needle):
    pipeline, manifest = dataset
    shard = Path(pipeline.data.root) / manifest["splits"]["train"][0]["path"]
    code, _, err = run_cli("data", "inspect", str(shard), "--sample", index, "--out", str(tmp_path / "x.png"))
    assert code == 2 and needle in err and "Traceback" not in err, err
    assert not (tmp_path / "x.png").exists()


def test_inspect_out_under_a_file(dataset, tmp_path):
    pipeline, manifest = dataset
    shard = Path(pipeline.data.root) / manifest["splits"]["train"][0]["path"]
    (tmp_path / "blocker").write_text("a file")
    code, _, err = run_cli("data", "inspect", str(shard), "--out", str(tmp_path / "blocker" / "x.png"))
    assert code == 2 and "is a file" in err, err


# ---------------------------------------------------------------- nuScenes tables


@pytest.fixture
def nuscenes_source(tmp_path, small_pipeline):
    pytest.importorskip("nuscenes", reason="needs nuscenes-devkit (pip install --no-deps nuscenes-devkit pyquaternion)")
    from test_convert import write_fixture

    source = tmp_path / "nuscenes"
    pipeline = small_pipeline(tmp_path / "out")
    write_fixture(source, pipeline.data.rig)
    return source, pipeline


def _break_table(source: Path, table: str, change) -> None:
    path = source / "v1.0-mini" / f"{table}.json"
    rows = json.loads(path.read_text())
    result = change(rows)
    path.write_text(result if isinstance(result, str) else json.dumps(result))


@pytest.mark.parametrize("table, change, needle", [
    ("sample_data", None, "sample_data.json is missing"),
    ("ego_pose", lambda rows: json.dumps(rows)[:-40], "ego_pose.json: expected a nuScenes table; found invalid JSON"),
    ("scene", lambda rows: {"scenes": rows}, "scene.json: expected a nuScenes table (a JSON array); found a JSON object"),
    ("log", lambda rows: "[" * 200_000 + "]" * 200_000, "log.json: expected a nuScenes table; found JSON nested more"),
    ("ego_pose", lambda rows: json.dumps(rows).replace("]", ", 1e999]", 1), "ego_pose.json: expected a nuScenes table; "
                                                                            "found the number 1e999"),
    ("sample", lambda rows: [{**r, "scene_token": "nowhere"} if i == 1 else r for i, r in enumerate(rows)],
     "sample.json: record 'scene-0061-1' has scene_token='nowhere', which is no token of scene.json"),
    ("sample_data", lambda rows: [{**r, "calibrated_sensor_token": "gone"} for r in rows],
     "calibrated_sensor_token='gone'"),
    ("instance", lambda rows: [{k: v for k, v in r.items() if k != "category_token"} for r in rows],
     "instance.json: record 'i-car' has no 'category_token' field"),
])
def test_broken_nuscenes_tables_name_the_table(nuscenes_source, table, change, needle):
    from stack.data.convert import convert

    source, pipeline = nuscenes_source
    if change is None:
        (source / "v1.0-mini" / f"{table}.json").unlink()
    else:
        _break_table(source, table, change)
    with pytest.raises(StackError, match=_escape(needle)):
        convert(pipeline, "nuscenes", str(source), "v1.0-mini")
    assert not (Path(pipeline.data.root) / "manifest.json").exists()


def test_a_missing_camera_image_names_the_scene_and_keeps_the_previous_dataset(nuscenes_source):
    from stack.data.convert import convert

    source, pipeline = nuscenes_source
    root = Path(pipeline.data.root)
    convert(pipeline, "nuscenes", str(source), "v1.0-mini")
    before = {p.relative_to(root): p.read_bytes() for p in root.rglob("*") if p.is_file()}
    next((source / "samples" / "CAM_FRONT").glob("scene-0103-1.jpg")).unlink()  # the second scene's
    with pytest.raises(StackError, match="nuScenes scene 'scene-0103': cannot be converted .*scene-0103-1.jpg"):
        convert(pipeline, "nuscenes", str(source), "v1.0-mini")
    after = {p.relative_to(root): p.read_bytes() for p in root.rglob("*") if p.is_file() and ".staging" not in p.parts}
    assert after == before  # the converted dataset is untouched; the next run removes the unfinished staging folder
    assert len(list(build_loader(pipeline, "val", 0, 1, shuffle=False, augment=False))) > 0


def test_cli_convert_with_a_dangling_token_exits_2(nuscenes_source, tmp_path):
    source, _ = nuscenes_source
    _break_table(source, "sample_annotation", lambda rows: [{**rows[0], "instance_token": "ghost"}, *rows[1:]])
    code, _, err = run_cli("data", "convert", "--from", "nuscenes", "--source", str(source),
                           "data.rig.image_width=128", "data.rig.image_height=64", f"data.root={tmp_path / 'out'}")
    assert code == 2 and "sample_annotation.json" in err and "'ghost'" in err and "Traceback" not in err, err


def _member(shard: Path, suffix: str) -> bytes:
    import tarfile

    with tarfile.open(shard) as tar:
        member = next(m for m in tar.getmembers() if m.name.endswith(suffix))
        return tar.extractfile(member).read()


def _escape(text: str) -> str:
    import re

    return re.escape(text)


# ---------------------------------------------------------------- member contents both loaders refuse by name

BACKENDS = ["torch", "dali"]


def _broken(dataset, tmp_path, small_pipeline, backend, changes: dict):
    """A copy of the dataset whose sample f0001 (first train shard) has each member in `changes` replaced by
    change(stored bytes) -> bytes (checksums follow: the shard was written wrong), and its pipeline."""
    pipeline, manifest, root = _copy(dataset, tmp_path, f"data.backend={backend}", small_pipeline=small_pipeline)
    shard = _first_train_shard(root, manifest)
    _rewrite(shard, lambda name, data: next((change(data) for member, change in changes.items()
                                             if name.endswith(f"f0001.{member}")), data))
    return pipeline


def _npy(change):
    """A change of a `.npy` member's array (a writable copy of the stored one)."""
    return lambda data: npy_bytes(change(np.load(io.BytesIO(data)).copy()))


def _set(index, value):
    def change(array):
        array[index] = value
        return array
    return _npy(change)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("member, array, needle", [
    ("depth", np.zeros((6, 64, 127), np.float16), "member depth.npy: expected float16 (6, 64, 128), found float16 "
                                                  "(6, 64, 127)"),
    ("semantic", np.zeros((6, 64, 128), np.int64), "member semantic.npy: expected uint8 (6, 64, 128), found int64"),
])
def test_both_loaders_name_a_dense_member_of_the_wrong_shape(dataset, tmp_path, small_pipeline, backend, member,
                                                             array, needle):
    """DALI decodes depth and semantics in its graph, which cannot name the member: they are checked before."""
    pipeline = _broken(dataset, tmp_path, small_pipeline, backend, {f"{member}.npy": lambda _: npy_bytes(array)})
    with pytest.raises(BadSample, match=rf"frames-000000.tar, sample s\d+f0001: {_escape(needle)}"):
        _iterate(pipeline)


@pytest.mark.parametrize("backend", BACKENDS)
def test_both_loaders_name_a_valid_jpeg_of_the_wrong_size(dataset, tmp_path, small_pipeline, backend):
    from stack.data.format import encode_jpeg

    jpeg = encode_jpeg(np.zeros((32, 96, 3), np.uint8), 90)
    pipeline = _broken(dataset, tmp_path, small_pipeline, backend, {"front.jpg": lambda _: jpeg})
    with pytest.raises(BadSample, match=r"frames-000000.tar, sample s\d+f0001: member front.jpg is 96x32 pixels, "
                                        r"expected 128x64 \(the manifest's image_size\)"):
        _iterate(pipeline)


def _one_box(class_id, attribute=-1):
    """boxes.npy and box_ids.npy with one visible box of class `class_id` and attribute `attribute`."""
    box = np.array([[10, 0, 1, 4, 2, 1.5, 0, 0, 0, 1]], np.float32)
    return {"boxes.npy": lambda _: npy_bytes(box),
            "box_ids.npy": lambda _: npy_bytes(np.array([[class_id, 7, attribute]], np.int32))}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("changes, needle", [
    (_one_box(999), "member box_ids.npy: expected ids 0-3 (the manifest's detection classes), found 999"),
    (_one_box(-2), "member box_ids.npy: expected ids 0-3 (the manifest's detection classes), found -2"),
    (_one_box(0, 8), "member box_ids.npy: expected ids 0-7 or -1 (none) (the manifest's attribute names), found 8"),
    ({"semantic.npy": _set((2, 5, 7), 200)},
     "member semantic.npy: expected ids 0-9 or 255 (unlabelled) (the manifest's semantic classes), found 200"),
    ({"command.npy": _set(0, 7)}, "member command.npy: expected ids 0-2 (0 left, 1 straight, 2 right), found 7"),
    ({"depth.npy": _set((1, 3, 3), np.nan)}, "member depth.npy: expected finite depths in metres, found nan or inf"),
    ({"depth.npy": _set((1, 3, 3), np.inf)}, "member depth.npy: expected finite depths in metres, found nan or inf"),
    ({"ego.npy": _set(0, np.nan)}, "member ego.npy: expected finite numbers, found nan at index [0]"),
    ({"past.npy": _set((1, 0), np.nan)}, "member past.npy: expected finite numbers, found nan at index [1, 0]"),
    ({"future.npy": _set((2, 1), np.nan)}, "member future.npy: expected finite numbers, found nan at index [2, 1]"),
    ({"future.npy": _set((2, 0), np.inf)}, "member future.npy: expected finite numbers, found inf at index [2, 0]"),
    ({**_one_box(1), "boxes.npy": lambda _: npy_bytes(np.full((1, 10), np.nan, np.float32))},
     "member boxes.npy: expected finite numbers, found nan at index [0, 0]"),
    ({"intrinsics.npy": _set((0, 0, 0), np.nan)}, "member intrinsics.npy: expected finite numbers, found nan"),
])
def test_both_loaders_refuse_labels_out_of_range_or_not_finite(dataset, tmp_path, small_pipeline, backend, changes,
                                                              needle):
    """A class id past the manifest's lists is an index error (or a silently wrong class) in the loss, a NaN label
    reaches the loss and the metrics as nan: each is named with its shard, sample and member instead."""
    pipeline = _broken(dataset, tmp_path, small_pipeline, backend, changes)
    with pytest.raises(BadSample, match=rf"frames-000000.tar, sample s\d+f0001: {_escape(needle)}"):
        _iterate(pipeline)


@pytest.mark.parametrize("backend", BACKENDS)
def test_future_waypoints_past_the_recording_are_rows_of_nan(dataset, tmp_path, small_pipeline, backend):
    """The nuScenes conversion marks waypoints past the end of a scene with whole rows of NaN: still read, as
    invalid waypoints."""
    pipeline = _broken(dataset, tmp_path, small_pipeline, backend, {"future.npy": _set(slice(3, None), np.nan)})
    batches = _iterate(pipeline)
    assert any((~b.future_valid[:, 3:]).all(dim=1).any() for b in batches)
    assert all(torch_isfinite(b.future_trajectory) for b in batches)


def torch_isfinite(tensor) -> bool:
    import torch

    return bool(torch.isfinite(tensor).all())


# ------------------------------------------------------------------------ JSON inside shards: meta.json and .sums

@pytest.mark.parametrize("meta, needle", [
    (b"[" * 200_000 + b"]" * 200_000, "nested more than 64 levels deep"),
    (b'{"schema": 1e999}', "the number 1e999"),
    (b'{"schema": ' + b"9" * 5000 + b"}", "(5000 digits)"),
    (b'{"schema": 3, "pad": "' + b"x" * (2 * 1024 * 1024) + b'"}', "of at most 1,048,576 bytes"),
    (b"\xff\xfe binary", "binary data"),
])
def test_a_hostile_meta_json_is_a_bad_sample_naming_shard_and_key(dataset, tmp_path, small_pipeline, meta, needle):
    """A sample's meta.json goes through the bounded reader: deep nesting, huge numbers, a member of megabytes
    are one BadSample naming shard and key (skippable with data.skip_bad_samples), not a RecursionError."""
    pipeline, manifest, root = _copy(dataset, tmp_path, small_pipeline=small_pipeline)
    shard = _first_train_shard(root, manifest)
    _rewrite(shard, lambda name, data: meta if name.endswith("f0001.meta.json") else data)
    with pytest.raises(BadSample, match=rf"frames-000000.tar, sample s\d+f0001: meta.json: expected \{{\"schema\".*"
                                        rf"{_escape(needle)}"):
        _iterate(pipeline)
    code, _, err = run_cli("data", "inspect", str(shard), "--sample", "1", "--out", str(tmp_path / "x.png"))
    assert code == 2 and "meta.json" in err and len(err.strip().splitlines()) == 1 and "Traceback" not in err, err


@pytest.mark.parametrize("sums, needle", [
    ("[" * 200_000 + "]" * 200_000, "nested more than 64 levels deep"),
    ('{"algorithm": "xxh3_64", "samples": {}, "n": 1e999}', "the number 1e999"),
    ('{"algorithm": "xxh3_64", "samples": []}', "found the keys ['algorithm', 'samples']"),
    (None, "should map each member to its xxh3_64 (an integer); found {'back.jpg': 'ff'"),
])
def test_a_hostile_checksum_file_is_a_bad_sample_naming_it(dataset, tmp_path, small_pipeline, sums, needle):
    """A shard's .sums file is JSON a user's folder holds: read bounded, its hashes checked to be integers before
    any is compared or printed as hex."""
    pipeline, manifest, root = _copy(dataset, tmp_path, small_pipeline=small_pipeline)
    path = _first_train_shard(root, manifest).with_suffix(".sums")
    if sums is None:
        table = json.loads(path.read_text())
        table["samples"] = {key: {member: "ff" for member in members} for key, members in table["samples"].items()}
        sums = json.dumps(table)
    path.write_text(sums)
    with pytest.raises(BadSample, match=rf"frames-000000.sums.*{_escape(needle)}"):
        _iterate(pipeline)
