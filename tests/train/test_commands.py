"""`stack train` / `stack profile` / `stack eval` pieces: dry-run launchers, bad input, profiler output, verdicts."""

import itertools
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from standin import TinyMultiTask, synthetic_batch, tiny_pipeline  # noqa: E402

from stack.metrics.bars import verdicts
from stack.train.evaluate import evaluate
from stack.train.profile import profile_steps

REPO = Path(__file__).resolve().parents[2]
TINY = ["-c", "configs/pipeline.yaml", "-c", "configs/presets/tiny.yaml"]


def stack(*args):
    return subprocess.run([sys.executable, "-m", "stack", *args], cwd=REPO, capture_output=True, text=True,
                          env={**os.environ, "PYTHONWARNINGS": "ignore"}, timeout=300)


def test_slurm_dry_run_prints_the_script_and_writes_it(tmp_path):
    result = stack("train", *TINY, "train.launcher=slurm", "train.devices=2", f"train.out_dir={tmp_path}", "--dry-run")
    assert result.returncode == 0, result.stderr
    assert "#SBATCH --ntasks-per-node=2" in result.stdout and "train.launcher=local" in result.stdout
    written = list((tmp_path / "slurm").glob("train-*.sbatch"))
    assert len(written) == 1 and written[0].read_text() == result.stdout


def test_torchrun_dry_run_prints_the_command():
    result = stack("train", *TINY, "train.launcher=torchrun", "train.num_nodes=2", "train.rendezvous=head:29400",
                   "--dry-run")
    assert result.returncode == 0, result.stderr
    assert "torch.distributed.run --nnodes=2" in result.stdout and "--rdzv-endpoint=head:29400" in result.stdout


def test_local_dry_run_prints_the_command_and_trains_nothing(tmp_path):
    """As with the other launchers, --dry-run says what would run and runs nothing: no training, no out_dir, no
    tracking store (it trained for real)."""
    out = tmp_path / "out"
    result = stack("train", *TINY, f"train.out_dir={out}", f"data.root={tmp_path / 'no-data-yet'}", "--dry-run")
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith(f"{sys.executable} -m stack train -c ") and "train.launcher=local" in result.stdout
    assert f"into {out}; dry run: nothing trained or written" in result.stderr
    assert not out.exists() and list(tmp_path.iterdir()) == []


def test_train_with_a_missing_resume_checkpoint_is_bad_input(tmp_path):
    result = stack("train", *TINY, f"train.resume={tmp_path}/nope")
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert "train.resume=" in result.stderr and "nothing is there" in result.stderr


def test_eval_of_a_missing_checkpoint_is_bad_input(tmp_path):
    result = stack("eval", str(tmp_path / "model.pt"))
    assert result.returncode == 2 and "Traceback" not in result.stderr and "model.pt" in result.stderr


def test_profile_writes_a_trace_with_a_range_per_phase(tmp_path):
    pipeline = tiny_pipeline("train.profile_steps=2")
    batches = (synthetic_batch(pipeline, i) for i in itertools.count())
    result = profile_steps(pipeline, tmp_path, TinyMultiTask(pipeline), batches, warmup=1)
    names = {event.get("name") for event in json.loads(result["trace"].read_text())["traceEvents"]}
    expected = {"data", "loss", "backward", "optimizer", "forward/backbone", "forward/depth_head",
                "forward/segmentation_head", "forward/planning_head"}
    assert expected <= names
    assert set(result["phases"]) == expected and 0 < result["data_wait_share"] < 1
    assert "aten::" in result["top_ops"] and result["png"].stat().st_size > 1000


@pytest.mark.slow
def test_evaluate_reports_every_head_and_its_baseline():
    from stack.models import build_model
    from stack.synthetic_batch import random_batch

    pipeline = tiny_pipeline("model.backbone=resnet10t", "model.neck_channels=16", "model.bev_channels=16",
                             "model.bev.cell_size=3.2", "model.depth.bins=8", "model.max_boxes=8",
                             "model.planning_steps=6")
    torch.manual_seed(0)
    metrics = evaluate(build_model(pipeline), pipeline, [random_batch(pipeline, 2, seed=s) for s in (1, 2)],
                       torch.device("cpu"))
    assert metrics["eval/batches"] == 2
    rows = {row.head: row for row in verdicts(metrics)}
    assert set(rows) == {"planning", "depth", "segmentation", "detection", "nuscenes"}
    for row in rows.values():
        assert row.value == row.value and row.baseline == row.baseline, row  # not NaN
    # an untrained planner (residual layer at zero) is its prior, the ego-status rollout: it must fail the bar
    assert rows["planning"].value == pytest.approx(rows["planning"].baseline, rel=1e-4)
    assert not rows["planning"].passed
    assert not any(key.startswith("motion/") for key in metrics)  # one frame: nothing to read motion from


@pytest.mark.slow
def test_evaluate_says_what_a_temporal_network_reads_from_the_previous_key_frame():
    from stack.models import build_model
    from stack.synthetic_batch import random_batch

    pipeline = tiny_pipeline("model.temporal_frames=1", "model.bev_channels=16", "model.depth.bins=8")
    torch.manual_seed(0)
    batches = [random_batch(pipeline, 2, seed=s) for s in (1, 2)]
    metrics = evaluate(build_model(pipeline), pipeline, batches, torch.device("cpu"))
    moving = sum(int(((b.box_labels >= 0) & (b.boxes[..., 7:9].norm(dim=-1) > 1.0)).sum()) for b in batches)
    assert metrics["motion/moving_boxes"] == moving > 0
    # an untrained network's previous frame changes its outputs, so the two passes differ
    assert metrics["motion/velocity_error"] != metrics["motion/velocity_error_alone"]
