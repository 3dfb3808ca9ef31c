"""A dataset rendered on another CPU: the same geometry and labels, within stated tolerances.

The same config and seed give byte-identical shards on one machine (test_world.py renders twice). Across
CPUs they need not: numpy's float64 sin/cos/exp and PyTorch's float32 kernels differ in the last bits per
instruction set (AVX-512, AVX2, SSE4.2), so a world state may differ by ~1e-14 m, and a float32 label or a
pixel at a knife edge may round the other way. What a user may rely on is below; the test renders the
session's small dataset again in a process limited to an SSE4.2 CPU's kernels (`stack.cpu_emulation`; natively
when this run already emulates that CPU) and compares every member of every shard.
"""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import tarfile
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from stack.config import pipeline_to_yaml
from stack.cpu_emulation import EMULATED_CPUS, emulated_cpu_env

REPO = Path(__file__).resolve().parents[2]

LABEL_ATOL = 1e-4
"""Boxes, 2D boxes, trajectories, ego state and calibration (float32: m, m/s, rad, px) may differ by this much."""
DEPTH_RTOL = 2e-3
"""Depth (float16, metres) relative to its value: two float16 steps."""
LABEL_PIXELS = 1e-4
"""Share of semantic and instance pixels that may differ (a ray grazing an edge may hit the other primitive)."""
RGB_LEVELS, RGB_PIXELS = 8, 1e-3
"""At most this share of camera pixels may differ by more than this many grey levels (after JPEG)."""
EXACT = ("box_ids", "command")
"""Integer labels per frame: equal."""


def _members(root: Path) -> dict:
    """{(shard, member name): bytes} of every shard of a dataset."""
    found = {}
    for shard in sorted(root.glob("*/*.tar")):
        with tarfile.open(shard) as tar:
            for member in tar.getmembers():
                found[(str(shard.relative_to(root)), member.name)] = tar.extractfile(member).read()
    return found


def _difference(name: str, here: bytes, there: bytes) -> str | None:
    """How one member rendered on the other CPU falls outside the tolerances (None: within them)."""
    kind = name.split(".")[-2] if name.endswith(".npy") else name.rsplit(".", 1)[-1]
    if name.endswith(".jpg"):
        a, b = (np.asarray(Image.open(io.BytesIO(data)).convert("RGB"), np.int16) for data in (here, there))
        if a.shape != b.shape:
            return f"image shape {b.shape}, here {a.shape}"
        off = float((np.abs(a - b).max(axis=-1) > RGB_LEVELS).mean())
        return f"{off:.2%} of pixels differ by more than {RGB_LEVELS} levels" if off > RGB_PIXELS else None
    if name.endswith(".json"):
        return None if json.loads(here) == json.loads(there) else f"{there!r} != {here!r}"
    a, b = np.load(io.BytesIO(here)), np.load(io.BytesIO(there))
    if a.shape != b.shape or a.dtype != b.dtype:
        return f"{b.dtype} {b.shape}, here {a.dtype} {a.shape}"
    if kind in EXACT:
        return None if np.array_equal(a, b) else f"{int((a != b).sum())} values differ"
    if kind in ("semantic", "instance"):
        off = float((a != b).mean())
        return f"{off:.4%} of pixels differ" if off > LABEL_PIXELS else None
    a, b = a.astype(np.float64), b.astype(np.float64)
    both_finite = np.isfinite(a) & np.isfinite(b)
    if not np.array_equal(np.isfinite(a), np.isfinite(b)) or not np.array_equal(a[~both_finite], b[~both_finite]):
        return "finite and infinite values in other places"
    error = np.abs(a - b)[both_finite]
    if kind == "depth":
        worst = (error / np.maximum(np.abs(a[both_finite]), 1e-3)).max(initial=0.0)
        return f"depth off by {worst:.2e} of its value" if worst > DEPTH_RTOL else None
    worst = error.max(initial=0.0)
    return f"off by {worst:.2e}" if worst > LABEL_ATOL else None


@pytest.mark.slow
def test_a_dataset_rendered_with_another_cpus_kernels_matches_in_geometry_and_labels(dataset, tmp_path):
    pipeline, _ = dataset
    here = os.environ.get("STACK_EMULATED_CPU")
    env = {key: value for key, value in os.environ.items()
           if key not in ("STACK_EMULATED_CPU", "NPY_DISABLE_CPU_FEATURES", *EMULATED_CPUS["avx2"])}
    if here != "x86-64-v2":
        env.update(emulated_cpu_env("x86-64-v2"))
    config = tmp_path / "pipeline.yaml"
    config.write_text(pipeline_to_yaml(pipeline))
    # `stack data make`, in a process that first checks that it computes as that CPU would.
    program = ("import sys\nfrom stack.cpu_emulation import emulation_problems\nfrom stack.cli import main\n"
               "level = sys.argv[1]\nproblems = emulation_problems(level) if level != 'native' else []\n"
               "sys.exit(f'not emulated: {problems}' if problems else main(sys.argv[2:]))")
    result = subprocess.run([sys.executable, "-c", program, "x86-64-v2" if here != "x86-64-v2" else "native",
                             "data", "make", "-c", str(config), f"data.root={tmp_path / 'other'}"],
                            cwd=REPO, env={**env, "PYTHONWARNINGS": "ignore"}, capture_output=True, text=True,
                            timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    ours, theirs = _members(Path(pipeline.data.root)), _members(tmp_path / "other")
    assert sorted(theirs) == sorted(ours)  # the same shards, samples and members
    assert {name.split(".", 1)[1] for _, name in ours} >= {"front.jpg", "depth.npy", "semantic.npy", "boxes.npy"}
    problems = [f"{shard} {name}: {problem}" for (shard, name), data in sorted(ours.items())
                if (problem := _difference(name, data, theirs[(shard, name)])) is not None]
    assert not problems, "\n".join(problems[:20])


def test_the_comparison_sees_a_label_off_by_more_than_its_tolerance():
    """The tolerances are tight enough to catch a real change: a box moved by 1 mm, a class flipped on 1% of a
    camera's pixels, a depth 1% further."""
    def npy(array):
        buffer = io.BytesIO()
        np.save(buffer, array)
        return buffer.getvalue()

    boxes = np.array([[10.0, 2.0, 0.5, 4.5, 1.9, 1.6, 0.3, 1.0, 0.0, 1.0]], np.float32)
    assert _difference("s0.boxes.npy", npy(boxes), npy(boxes + np.float32(LABEL_ATOL / 2))) is None
    assert _difference("s0.boxes.npy", npy(boxes), npy(boxes + np.float32(1e-3))) is not None
    semantic = np.zeros((6, 64, 128), np.uint8)
    flipped = semantic.copy()
    flipped[0, :, :13] = 1  # ~1.7% of one camera, 0.17% of the frame
    assert _difference("s0.semantic.npy", npy(semantic), npy(flipped)) is not None
    depth = np.full((6, 64, 128), 20.0, np.float16)
    assert _difference("s0.depth.npy", npy(depth), npy((depth * 1.01).astype(np.float16))) is not None
    assert _difference("s0.command.npy", npy(np.int64(1)), npy(np.int64(2))) is not None
