"""DDP and FSDP2 on 2 CPU processes (gloo), launched by Lightning exactly as `stack train` does."""

import csv
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parent / "run_tiny.py"
REPO = Path(__file__).resolve().parents[2]
COMMON = ["train.devices=2", "train.max_steps=4", "train.log_every_n_steps=1", "train.checkpoint_every_n_steps=2",
          "train.seed=3"]


def train(out: Path, *overrides: str, batches: int = 6, nan_at: int = -1) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, str(SCRIPT), "--batches", str(batches), "--nan-at", str(nan_at),
                           f"train.out_dir={out}", *COMMON, *overrides],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=300)


def curve(out: Path) -> list[float]:
    with open(out / "csv" / "metrics.csv") as handle:
        return [float(r["train/loss_total"]) for r in csv.DictReader(handle) if r.get("train/loss_total")]


def summaries(out: Path) -> list[dict]:
    return [json.loads((out / f"summary-rank{rank}.json").read_text()) for rank in (0, 1)]


@pytest.fixture(scope="module")
def ddp_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("ddp")
    result = train(out, "train.strategy=ddp")
    assert result.returncode == 0, result.stderr[-3000:]
    return out


@pytest.fixture(scope="module")
def fsdp_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("fsdp")
    result = train(out, "train.strategy=fsdp", "train.fsdp_units=[backbone.*.*,planning_head]",
                   "train.activation_checkpointing=[backbone.*]")
    assert result.returncode == 0, result.stderr[-3000:]
    return out


@pytest.mark.slow
def test_ddp_runs_two_ranks_in_step(ddp_run):
    ranks = summaries(ddp_run)
    assert [s["world_size"] for s in ranks] == [2, 2] and [s["global_step"] for s in ranks] == [4, 4]
    assert [s["loaders"] for s in ranks] == [[["train", 0, 2], ["val", 0, 2]], [["train", 1, 2], ["val", 1, 2]]]
    assert (ddp_run / "checkpoints" / "step-0000004.ckpt" / ".metadata").is_file() and (ddp_run / "model.pt").is_file()


@pytest.mark.slow
def test_fsdp2_matches_ddp_with_sharded_state(ddp_run, fsdp_run):
    ranks = summaries(fsdp_run)
    assert ranks[0]["sharded_units"] == ["backbone.0.0", "backbone.0.1", "backbone.1.0", "backbone.1.1",
                                         "planning_head"]
    assert ranks[0]["checkpointed_units"] == ["backbone.0", "backbone.1"]
    # Same data, same seed: data parallelism sharded or replicated gives the same training.
    assert curve(fsdp_run) == pytest.approx(curve(ddp_run), rel=1e-4)
    # Each rank holds about half of parameters + gradients + AdamW state.
    fsdp_mb = max(s["stats"][-1]["perf/train_state_mb"] for s in ranks)
    ddp_mb = max(s["stats"][-1]["perf/train_state_mb"] for s in summaries(ddp_run))
    assert fsdp_mb <= 0.6 * ddp_mb
    shards = sorted(p.name for p in (fsdp_run / "checkpoints" / "step-0000004.ckpt").iterdir())
    assert shards == [".metadata", "__0_0.distcp", "__1_0.distcp", "meta.pt"]


@pytest.mark.slow
def test_fsdp2_resumes_from_its_sharded_checkpoint(fsdp_run, tmp_path):
    result = train(tmp_path, "train.strategy=fsdp", "train.fsdp_units=[backbone.*.*,planning_head]",
                   "train.activation_checkpointing=[backbone.*]", f"train.resume={fsdp_run}/checkpoints/step-0000002.ckpt")
    assert result.returncode == 0, result.stderr[-3000:]
    assert curve(tmp_path) == pytest.approx(curve(fsdp_run)[2:], rel=1e-5)


@pytest.mark.slow
def test_divergence_on_one_rank_stops_both_with_the_step(tmp_path):
    # Rank 0's third batch carries a NaN label: both ranks stop together (no hang) at step 2.
    result = train(tmp_path, "train.strategy=ddp", nan_at=2)
    assert result.returncode == 3, result.stderr[-3000:]
    assert "training diverged at step 2: loss term depth=nan" in result.stderr
    assert "Last good checkpoint: " in result.stderr and "step-0000002.ckpt" in result.stderr
    assert (tmp_path / "checkpoints" / "latest").read_text().strip() == "step-0000002.ckpt"
