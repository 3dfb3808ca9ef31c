"""Corruption inside a member's bytes — a JPEG that still decodes, as garbage pixels — is named by both loaders."""

import io
import json
import shutil
import tarfile

import numpy as np
import pytest
from PIL import Image

from stack.data.loader import build_loader
from stack.data.format import SCHEMA_VERSION, member_hash
from stack.data.samples import BadSample
from stack.errors import StackError


def _corrupt_copy(dataset, tmp_path, small_pipeline, *overrides):
    """A copy of the dataset whose first train shard has 16 bytes flipped in the middle of the
    entropy-coded data (after the SOS marker) of sample ...f0001's front.jpg; its .sums untouched."""
    pipeline, manifest = dataset
    root = tmp_path / "copy"
    shutil.copytree(pipeline.data.root, root)
    shard = root / manifest["splits"]["train"][0]["path"]
    data = bytearray(shard.read_bytes())
    with tarfile.open(shard) as tar:
        member = next(m for m in tar.getmembers() if m.name.endswith("f0001.front.jpg"))
    jpeg = bytes(data[member.offset_data:member.offset_data + member.size])
    scan = jpeg.index(b"\xff\xda") + 64  # inside the scan, past the SOS header
    middle = member.offset_data + (scan + len(jpeg) - 2) // 2
    for i in range(middle, middle + 16):
        data[i] ^= 0x5A if data[i] not in (0xFF, 0xA5) else 0  # never forge or break a marker
    shard.write_bytes(bytes(data))
    corrupt = bytes(data[member.offset_data:member.offset_data + member.size])
    return small_pipeline(root, *overrides), jpeg, corrupt, member.name.split(".")[0]


def test_flipped_bytes_inside_a_jpeg_still_decode_but_the_loader_names_them(dataset, tmp_path, small_pipeline):
    pipeline, clean, corrupt, key = _corrupt_copy(dataset, tmp_path, small_pipeline)
    pixels = [np.asarray(Image.open(io.BytesIO(b)).convert("RGB"), np.int16) for b in (clean, corrupt)]
    assert pixels[0].shape == pixels[1].shape and np.abs(pixels[0] - pixels[1]).max() > 20  # silent garbage
    with pytest.raises(BadSample, match=rf"frames-000000\.tar, sample {key}: member front\.jpg is corrupt \(xxh3_64"):
        list(build_loader(pipeline, "train", 0, 1, shuffle=False, augment=False))


def test_skip_bad_samples_counts_a_corrupt_member(dataset, tmp_path, small_pipeline):
    pipeline, *_ = _corrupt_copy(dataset, tmp_path, small_pipeline, "data.skip_bad_samples=true")
    loader = build_loader(pipeline, "train", 0, 1, shuffle=False, augment=False)
    assert len(list(loader)) == len(loader) and loader.skipped.value == 1


def test_a_frame_whose_previous_key_frame_is_corrupt_is_skipped_too(dataset, tmp_path, small_pipeline):
    """A temporal network's sample reads its previous key frame as checked as its own members: the frame after the
    corrupt one (...f0002, whose previous frame is ...f0001) is not given garbage pixels as its history."""
    pipeline, *_ = _corrupt_copy(dataset, tmp_path, small_pipeline, "data.skip_bad_samples=true",
                                 "model.temporal_frames=1")
    loader = build_loader(pipeline, "train", 0, 1, shuffle=False, augment=False)
    assert len(list(loader)) == len(loader) and loader.skipped.value == 2


def test_dali_names_the_corrupt_member_too(dataset, tmp_path, small_pipeline):
    pytest.importorskip("nvidia.dali")
    pipeline, _, _, key = _corrupt_copy(dataset, tmp_path, small_pipeline, "data.backend=dali")
    with pytest.raises(BadSample, match=rf"frames-000000\.tar, sample {key}: member front\.jpg is corrupt"):
        list(build_loader(pipeline, "train", 0, 1, shuffle=False, augment=False))


def test_every_member_of_every_shard_has_its_crc32(dataset):
    pipeline, manifest = dataset
    for entry in manifest["splits"]["train"]:
        shard = f"{pipeline.data.root}/{entry['path']}"
        sums = json.loads(open(shard.replace(".tar", ".sums")).read())
        assert sums["algorithm"] == "xxh3_64"
        with tarfile.open(shard) as tar:
            for m in tar.getmembers():
                key, member = m.name.split(".", 1)
                assert sums["samples"][key][member] == member_hash(tar.extractfile(m).read())


def test_a_shard_without_its_checksum_file_is_named(dataset, tmp_path, small_pipeline):
    pipeline, manifest = dataset
    root = tmp_path / "copy"
    shutil.copytree(pipeline.data.root, root)
    (root / manifest["splits"]["train"][0]["path"].replace(".tar", ".sums")).unlink()
    with pytest.raises(BadSample, match=r"frames-000000\.sums: expected the checksum file of shard .*frames-000000\.tar "
                                        r"\(a JSON file\); found nothing"):
        list(build_loader(small_pipeline(root), "train", 0, 1, shuffle=False, augment=False))


def test_a_dataset_of_schema_1_without_checksums_is_refused_clearly(dataset, tmp_path, small_pipeline):
    pipeline, _ = dataset
    root = tmp_path / "copy"
    shutil.copytree(pipeline.data.root, root)
    manifest = json.loads((root / "manifest.json").read_text())
    (root / "manifest.json").write_text(json.dumps({**manifest, "schema": 1}))
    with pytest.raises(StackError, match=rf"schema version 1, this stack reads version {SCHEMA_VERSION}; re-create the dataset"):
        build_loader(small_pipeline(root), "train", 0, 1)
