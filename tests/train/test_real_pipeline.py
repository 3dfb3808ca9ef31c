"""The real network on real rendered shards: `stack.train.fit` with both data backends, resume, `stack eval`."""

import json
import csv
import os
import subprocess
import sys
from pathlib import Path

import pytest

from stack.config import load_pipeline

REPO = Path(__file__).resolve().parents[2]
SMALL = ["data.rig.image_width=128", "data.rig.image_height=64", "data.world.scenes=3",
         "data.world.frames_per_scene=4", "data.world.agents_per_scene=8", "data.samples_per_shard=4",
         "data.world.val_fraction=0.34", "data.batch_size=2", "data.num_workers=0", "model.backbone=resnet10t",
         "model.neck_channels=16", "model.bev_channels=16", "model.bev.cell_size=3.2", "model.depth.bins=8",
         "model.max_boxes=16", "train.accelerator=cpu", "train.max_epochs=1", "train.log_every_n_steps=1",
         "train.checkpoint_every_n_steps=2", "train.warmup_steps=1"]


def small(root, *extra):
    return load_pipeline(overrides=[*SMALL, f"data.root={root}", *extra])


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    from stack.data.make import make_dataset

    root = tmp_path_factory.mktemp("world")
    make_dataset(small(root), log=lambda *_: None)
    return root


def losses(out):
    with open(Path(out) / "csv" / "metrics.csv") as handle:
        return [float(r["train/loss_total"]) for r in csv.DictReader(handle) if r.get("train/loss_total")]


@pytest.fixture(scope="module")
def trained(shards, tmp_path_factory):
    """backend -> (out_dir, module, trainer, stats) of SMALL trained on the shards, each backend once: the torch
    run is also the uninterrupted run the CLI test resumes and evaluates (it trained the same run again)."""
    from stack.train.fit import fit

    runs = {}

    def run(backend: str):
        if backend not in runs:
            out = tmp_path_factory.mktemp(f"fit-{backend}")
            runs[backend] = (out, *fit(small(shards, f"data.backend={backend}", f"train.out_dir={out}"), progress=False))
        return runs[backend]
    return run


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["torch", "dali"])
def test_real_network_trains_on_rendered_shards(trained, backend):
    out, module, trainer, stats = trained(backend)
    assert trainer.global_step == 4  # 8 train samples / batch 2 on one rank
    curve = losses(out)
    assert len(curve) == 4 and all(value == value for value in curve)
    assert stats.history and 0 < stats.history[-1]["perf/mfu"] < 1
    assert (out / "model.pt").is_file() and (out / "checkpoints" / "step-0000004.ckpt" / ".metadata").is_file()


@pytest.mark.slow
def test_resume_and_eval_through_the_cli(shards, trained, tmp_path):
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    base = [sys.executable, "-m", "stack"]
    full = trained("torch")[0]  # `stack train` runs this same fit; the resumed run below goes through the CLI
    resumed = subprocess.run([*base, "train", *SMALL, f"data.root={shards}", f"train.out_dir={tmp_path}/resumed",
                              f"train.resume={full}/checkpoints/step-0000002.ckpt"],
                             cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    # The CPU is deterministic for the same inputs (bf16 autocast or fp32): the resumed steps repeat exactly.
    assert losses(tmp_path / "resumed") == pytest.approx(losses(full)[2:], rel=1e-4)
    evaluated = subprocess.run([*base, "eval", f"{full}/model.pt", f"data.root={shards}", *SMALL],
                               cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert evaluated.returncode in (0, 1), evaluated.stderr[-3000:]  # 1: a 4-step model fails its bars
    for head in ("planning", "depth", "segmentation", "detection", "nuscenes"):
        assert f"| {head} |" in evaluated.stdout
    assert "detection, nuScenes (mAP and NDS barred above; the TP errors as information): NDS " in evaluated.stdout
    # the world labels every box's attribute; this network (the default model, no attribute head) predicts none
    assert "no attribute labels in the data" not in evaluated.stdout and "no attribute head" in evaluated.stdout
    assert (full / "eval" / "metrics.json").is_file() and (full / "eval" / "heads.png").is_file()
    on_train = subprocess.run([*base, "eval", "--split", "train", f"{full}/model.pt", f"data.root={shards}",
                               *SMALL], cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert on_train.returncode in (0, 1), on_train.stderr[-3000:]
    assert "train batches" in on_train.stdout
    scored = json.loads((full / "eval-train" / "metrics.json").read_text())
    assert scored["detection/gt_boxes"] > 0 and scored != json.loads((full / "eval" / "metrics.json").read_text())
