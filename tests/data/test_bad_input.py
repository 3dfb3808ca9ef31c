"""Bad data: a clear error naming the shard and key (CLI exit 2, no traceback), or counted skips when asked."""

import json
import os
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

from stack.data import build_loader
from stack.data.format import SCHEMA_VERSION
from stack.data.format import member_hash
from stack.data.samples import BadSample
from stack.errors import StackError

REPO = Path(__file__).resolve().parents[2]


def _copy(dataset, tmp_path, *overrides, small_pipeline):
    pipeline, manifest = dataset
    root = tmp_path / "copy"
    shutil.copytree(pipeline.data.root, root)
    return small_pipeline(root, *overrides), manifest, root


def _rewrite(shard: Path, change, checksums: bool = True):
    """Rewrite `shard` with change(name, data) -> bytes or None (drop the member).

    With `checksums` the `.sums` file follows the new bytes (a shard written wrong, which the
    decoders must catch); without, it keeps the old ones (bytes changed after writing)."""
    
    with tarfile.open(shard) as tar:
        members = [(m.name, tar.extractfile(m).read()) for m in tar.getmembers()]
    sums = json.loads(shard.with_suffix(".sums").read_text())
    with tarfile.open(shard, "w", format=tarfile.USTAR_FORMAT) as tar:
        for name, data in members:
            data = change(name, data)
            if data is not None:
                info = tarfile.TarInfo(name)
                info.size = len(data)
                tar.addfile(info, __import__("io").BytesIO(data))
                key, member = name.split(".", 1)
                if checksums:
                    sums["samples"][key][member] = member_hash(data)
    shard.with_suffix(".sums").write_text(json.dumps(sums))


def _first_train_shard(root, manifest):
    return root / manifest["splits"]["train"][0]["path"]


def _iterate(pipeline):
    return [batch for batch in build_loader(pipeline, "train", 0, 1, shuffle=False, augment=False)]


def test_truncated_jpeg_names_shard_key_and_member(dataset, tmp_path, small_pipeline):
    pipeline, manifest, root = _copy(dataset, tmp_path, small_pipeline=small_pipeline)
    shard = _first_train_shard(root, manifest)
    _rewrite(shard, lambda name, data: data[:len(data) // 3] if name.endswith("f0001.front.jpg") else data)
    with pytest.raises(BadSample, match=r"frames-000000.tar.*s0000\df0001.*front.jpg.*JPEG"):
        _iterate(pipeline)


def test_skip_bad_samples_counts_them_and_keeps_the_batch_count(dataset, tmp_path, small_pipeline):
    pipeline, manifest, root = _copy(dataset, tmp_path, "data.skip_bad_samples=true", small_pipeline=small_pipeline)
    shard = _first_train_shard(root, manifest)
    _rewrite(shard, lambda name, data: data[:100] if name.endswith("f0001.front.jpg") else data)
    loader = build_loader(pipeline, "train", 0, 1, shuffle=False, augment=False)
    batches = list(loader)
    assert len(batches) == len(loader)
    assert loader.skipped.value == 1


def test_missing_member_is_named(dataset, tmp_path, small_pipeline):
    pipeline, manifest, root = _copy(dataset, tmp_path, small_pipeline=small_pipeline)
    _rewrite(_first_train_shard(root, manifest), lambda name, data: None if name.endswith("f0000.depth.npy") else data)
    with pytest.raises(BadSample, match=r"frames-000000.tar.*f0000.*missing member\(s\) depth.npy"):
        _iterate(pipeline)


def test_wrong_schema_version_in_a_sample(dataset, tmp_path, small_pipeline):
    pipeline, manifest, root = _copy(dataset, tmp_path, small_pipeline=small_pipeline)

    def bump(name, data):
        return json.dumps({**json.loads(data), "schema": 99}).encode() if name.endswith(".meta.json") else data

    _rewrite(_first_train_shard(root, manifest), bump)
    with pytest.raises(BadSample, match=rf"frames-000000.tar.*schema version 99.*reads version {SCHEMA_VERSION}"):
        _iterate(pipeline)


def test_wrong_schema_version_in_the_manifest(dataset, tmp_path, small_pipeline):
    pipeline, _, root = _copy(dataset, tmp_path, small_pipeline=small_pipeline)
    manifest = json.loads((root / "manifest.json").read_text())
    (root / "manifest.json").write_text(json.dumps({**manifest, "schema": 0}))
    with pytest.raises(StackError, match=r"manifest.json: schema version 0"):
        build_loader(pipeline, "train", 0, 1)


@pytest.mark.parametrize("damage", ["empty", "garbage", "cut"])
def test_corrupt_or_empty_tar_names_the_shard(dataset, tmp_path, damage, small_pipeline):
    pipeline, manifest, root = _copy(dataset, tmp_path, small_pipeline=small_pipeline)
    shard = _first_train_shard(root, manifest)
    data = shard.read_bytes()
    shard.write_bytes({"empty": b"", "garbage": os.urandom(4096), "cut": data[:len(data) // 2 + 100]}[damage])
    with pytest.raises(BadSample, match=r"frames-000000.tar"):
        _iterate(pipeline)


def test_empty_shard_list_and_missing_dataset(dataset, tmp_path, small_pipeline):
    pipeline, _, root = _copy(dataset, tmp_path, small_pipeline=small_pipeline)
    manifest = json.loads((root / "manifest.json").read_text())
    manifest["splits"]["val"] = []
    (root / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(StackError, match=r"split 'val'.*lists no shards"):
        build_loader(pipeline, "val", 0, 1)
    with pytest.raises(StackError, match=r"no dataset at .*nowhere.*stack data make"):
        build_loader(small_pipeline(tmp_path / "nowhere"), "train", 0, 1)


def _stack(*args):
    return subprocess.run([sys.executable, "-m", "stack", *args], cwd=REPO, capture_output=True, text=True, timeout=300)


def test_cli_inspect_bad_shard_exits_2_without_traceback(tmp_path):
    bad = tmp_path / "bad.tar"
    bad.write_bytes(b"not a tar at all" * 64)
    result = _stack("data", "inspect", str(bad))
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr and "bad.tar" in result.stderr
    missing = _stack("data", "inspect", str(tmp_path / "nope.tar"))
    assert missing.returncode == 2 and "does not exist" in missing.stderr
    unknown = _stack("data", "render")
    assert unknown.returncode == 2 and "make, inspect, convert" in unknown.stderr


def test_cli_inspect_writes_a_mosaic(dataset, tmp_path):
    pipeline, manifest = dataset
    out = tmp_path / "mosaic.png"
    result = _stack("data", "inspect", str(Path(pipeline.data.root) / manifest["splits"]["train"][0]["path"]),
                    "--out", str(out), "--sample", "1")
    assert result.returncode == 0, result.stderr
    from PIL import Image

    with Image.open(out) as image:
        assert image.width > 1000 and image.height > 800
