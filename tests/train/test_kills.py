"""SIGKILL at named points of `stack train` (stack.failpoints): the previous checkpoint stays intact and a
resume from it reproduces the uninterrupted run's losses, with every log row kept once. The checkpoint points
fire in the background writer while training has gone on (checkpoints are written asynchronously); a kill in a
training step waits for the writer's commit of the checkpoint it expects (`&`: stack.failpoints)."""

import csv
import os
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from standin import STANDIN_RECIPE  # noqa: E402

from stack.checkpoint.sharded import load_sharded_checkpoint

SCRIPT = Path(__file__).resolve().parent / "run_tiny.py"
REPO = Path(__file__).resolve().parents[2]
RECIPE = STANDIN_RECIPE  # trained once per session: tests/train/conftest.py


def train(out: Path, *overrides: str, fail_at: str | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    env.pop("STACK_FAIL_POINT", None)
    if fail_at:
        env["STACK_FAIL_POINT"] = fail_at
    return subprocess.run([sys.executable, str(SCRIPT), "--batches", "6", f"train.out_dir={out}", *RECIPE, *overrides],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=300)


def losses(out: Path) -> list[tuple[int, float]]:
    with open(out / "csv" / "metrics.csv") as handle:
        return [(int(r["step"]), float(r["train/loss_total"])) for r in csv.DictReader(handle) if r.get("train/loss_total")]


@pytest.fixture(scope="module")
def uninterrupted(standin_recipe_run):
    """The losses of RECIPE trained without a kill: the session's run (tests/train/conftest.py; in this process,
    as run_tiny.py trains it in its own)."""
    return losses(standin_recipe_run)


@pytest.mark.slow  # two Lightning processes per kill point (~40 s on 2 busy cores)
@pytest.mark.parametrize("point, kept", [
    # a training step, once the writer has committed the checkpoint before it: without `&`, a busy machine's
    # writer may not have finished step 4 by step 7, and `latest` would not exist yet
    ("train-step:7&checkpoint-committed:1", "step-0000004.ckpt"),   # epoch 1, first batch: one checkpoint behind
    ("train-step:11&checkpoint-committed:2", "step-0000008.ckpt"),  # epoch 1, mid-epoch
    ("checkpoint-write:2", "step-0000004.ckpt"),   # step 8's shards written, DCP's .metadata not yet
    ("checkpoint-commit:2", "step-0000004.ckpt"),  # step 8 complete and durable, not yet renamed into place
])
def test_sigkill_keeps_the_last_checkpoint_and_resume_reproduces_the_run(uninterrupted, tmp_path, point, kept):
    killed = train(tmp_path, fail_at=point)
    assert killed.returncode == -9, killed.stderr[-3000:]
    checkpoints = tmp_path / "checkpoints"
    assert (checkpoints / "latest").read_text().strip() == kept
    assert load_sharded_checkpoint(checkpoints / kept)["global_step"] == int(kept[5:12])
    assert not (tmp_path / "model.pt").exists()
    resumed = train(tmp_path, f"train.resume={tmp_path}")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert [s for s, _ in losses(tmp_path)] == list(range(12))  # every step logged once
    assert [v for _, v in losses(tmp_path)] == pytest.approx([v for _, v in uninterrupted], rel=1e-5)
    assert not list(checkpoints.glob(".*.partial"))
