"""Nothing of a run is lost: out_dir reuse, logs across a resume, good checkpoints after divergence, bad resumes, Ctrl-C."""

import csv
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from standin import STANDIN_RECIPE, TinyMultiTask, synthetic_loaders, tiny_pipeline  # noqa: E402

from stack.checkpoint.model_file import CheckpointError, load_model_checkpoint
from stack.errors import StackError
from stack.checkpoint.sharded import load_sharded_checkpoint
from stack.train.fit import fit
from stack.train.module import TrainingDiverged, TrainModule

RECIPE = STANDIN_RECIPE  # trained once per session: tests/train/conftest.py
REPO = Path(__file__).resolve().parents[2]


def run(out, *overrides, batches=6):
    pipeline = tiny_pipeline(*RECIPE, f"train.out_dir={out}", *overrides)
    return fit(pipeline, TinyMultiTask, synthetic_loaders(pipeline, batches), progress=False)


def rows(out) -> list[tuple[int, float]]:
    with open(Path(out) / "csv" / "metrics.csv") as handle:
        return [(int(r["step"]), float(r["train/loss_total"])) for r in csv.DictReader(handle) if r.get("train/loss_total")]


@pytest.fixture(scope="module")
def finished(standin_recipe_run):
    """A finished 12-step run of RECIPE (checkpoints at 8 and 12, model.pt, CSV and TensorBoard logs): the
    session's run (tests/train/conftest.py), read or copied, never changed."""
    return standin_recipe_run


def test_a_fresh_run_over_an_earlier_one_is_refused_and_changes_nothing(finished, tmp_path):
    out = tmp_path / "run"
    shutil.copytree(finished, out)
    before = {p: p.read_bytes() for p in out.rglob("*") if p.is_file()}
    with pytest.raises(StackError, match=r"already holds a run \(model.pt and checkpoints\).*train.resume=.*"
                                         r"train.overwrite=true"):
        run(out)
    assert {p: p.read_bytes() for p in out.rglob("*") if p.is_file()} == before


def test_resuming_another_run_into_a_used_out_dir_is_refused_and_changes_nothing(finished, tmp_path):
    out = tmp_path / "other"
    shutil.copytree(finished, out)
    before = {p: p.read_bytes() for p in out.rglob("*") if p.is_file()}
    with pytest.raises(StackError, match="continues another run"):
        run(out, f"train.resume={finished}")
    assert {p: p.read_bytes() for p in out.rglob("*") if p.is_file()} == before


def test_overwrite_starts_fresh_and_leaves_no_rows_of_the_earlier_run(finished, tmp_path):
    out = tmp_path / "run"
    shutil.copytree(finished, out)
    run(out, "train.overwrite=true", "train.max_epochs=1")
    assert [step for step, _ in rows(out)] == list(range(6))
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["latest", "step-0000004.ckpt",
                                                                        "step-0000006.ckpt"]


def test_the_cli_refuses_a_used_out_dir_with_exit_2(finished):
    result = subprocess.run([sys.executable, "-m", "stack", "train", "-c", "configs/pipeline.yaml", "-c",
                             "configs/presets/tiny.yaml", f"train.out_dir={finished}"], cwd=REPO, capture_output=True,
                            text=True, timeout=300, env={**os.environ, "PYTHONWARNINGS": "ignore"})
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
    assert "already holds a run" in result.stderr and "train.overwrite=true" in result.stderr


def test_a_dry_run_into_a_used_out_dir_is_not_refused(finished, tmp_path):
    out = tmp_path / "run"
    shutil.copytree(finished, out)
    result = subprocess.run([sys.executable, "-m", "stack", "train", "-c", "configs/pipeline.yaml", "-c",
                             "configs/presets/tiny.yaml", f"train.out_dir={out}", "train.launcher=slurm", "--dry-run"],
                            cwd=REPO, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0 and "#SBATCH" in result.stdout, result.stderr


def test_a_second_run_into_an_out_dir_being_written_is_refused_and_changes_nothing(finished, tmp_path):
    import fcntl

    out = tmp_path / "run"
    shutil.copytree(finished, out)
    before = {p: p.read_bytes() for p in out.rglob("*") if p.is_file()}
    held = os.open(out, os.O_RDONLY)  # the lock a `stack train` still running there would hold
    try:
        fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)
        with pytest.raises(StackError, match=r"another `stack train` is writing train.out_dir=.*another train.out_dir"):
            run(out, "train.overwrite=true")
        with pytest.raises(StackError, match="another `stack train`"):
            run(tmp_path / "run", f"train.resume={out}")
    finally:
        os.close(held)
    assert {p: p.read_bytes() for p in out.rglob("*") if p.is_file()} == before
    run(out, "train.overwrite=true", "train.max_epochs=1")  # the lock goes with the process that held it
    assert [step for step, _ in rows(out)] == list(range(6))


def test_resuming_in_the_same_out_dir_keeps_every_earlier_log_row(finished, tmp_path):
    out = tmp_path / "run"
    shutil.copytree(finished, out)
    run(out, f"train.resume={out / 'checkpoints' / 'step-0000008.ckpt'}")
    steps = [step for step, _ in rows(out)]
    assert steps == list(range(12))  # 0-7 from the first run, 8-11 once, from the resumed one
    assert [loss for _, loss in rows(out)] == pytest.approx([loss for _, loss in rows(finished)], rel=1e-5)
    assert len(list((out / "tensorboard").glob("events.out.tfevents.*"))) == 2


def test_a_run_stopped_before_model_pt_is_finished_by_resuming_its_last_checkpoint(finished, tmp_path):
    """Training killed (a time limit) after its step-8 checkpoint, then resumed with train.max_steps=8 to keep what
    it has: Lightning restores the weights, then skips the fit loop, and with it the hook that wrote model.pt, while
    the CLI printed `weights: model.pt`. model.pt now holds the checkpoint's weights, and no step trains twice."""
    out = tmp_path / "run"
    shutil.copytree(finished, out)
    (out / "model.pt").unlink()
    checkpoint = out / "checkpoints" / "step-0000008.ckpt"
    run(out, f"train.resume={checkpoint}", "train.max_steps=8")
    _, weights, meta = load_model_checkpoint(out / "model.pt")
    _, stored, _ = load_model_checkpoint(checkpoint)
    assert meta["extra"]["global_step"] == 8
    assert weights.keys() == stored.keys() and all(torch.equal(weights[k], stored[k]) for k in stored)
    assert [step for step, _ in rows(out)] == list(range(8))


def test_a_checkpoint_folder_is_read_as_the_network_it_holds(finished, tmp_path):
    """`stack eval`, `export`, `deploy` and `drive` read a checkpoints/step-*.ckpt folder as they read model.pt; a
    damaged one, or a folder that is no checkpoint, is one clear refusal."""
    pipeline, final, _ = load_model_checkpoint(finished / "model.pt")
    stored_pipeline, stored, meta = load_model_checkpoint(finished / "checkpoints" / "step-0000012.ckpt")
    assert meta["format"] == "lightning" and meta["extra"]["global_step"] == 12
    assert stored_pipeline == pipeline
    assert stored.keys() == final.keys() and all(torch.equal(stored[k], final[k]) for k in final)
    damaged = tmp_path / "step-0000012.ckpt"
    shutil.copytree(finished / "checkpoints" / "step-0000012.ckpt", damaged)
    shard = damaged / "__0_0.distcp"
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    with pytest.raises(CheckpointError, match=r"step-0000012\.ckpt' cannot be read .*truncated, corrupt or not "
                                              r"written by `stack train`"):
        load_model_checkpoint(damaged)
    with pytest.raises(CheckpointError, match=r"'.*checkpoints' is a folder .*a checkpoints/step-\*\.ckpt folder"):
        load_model_checkpoint(finished / "checkpoints")


def _poison_weights_after_update(monkeypatch, update: int):
    """Make the optimizer's `update`-th step (counting from 1) leave a NaN weight, as an overflowing update would."""
    original, count = TrainModule.configure_optimizers, [0]

    def configure(self):
        config = original(self)

        def hook(optimizer, args, kwargs):
            count[0] += 1
            if count[0] == update:
                with torch.no_grad():
                    next(self.model.parameters()).view(-1)[0] = float("nan")
        config["optimizer"].register_step_post_hook(hook)
        return config
    monkeypatch.setattr(TrainModule, "configure_optimizers", configure)


def test_weights_made_non_finite_by_an_update_are_never_called_good(tmp_path, monkeypatch):
    _poison_weights_after_update(monkeypatch, update=6)  # the update that ends step 6, a checkpoint step
    with pytest.raises(TrainingDiverged, match=r"step 6: weight .* is not finite after the optimizer step.*"
                                               r"Last good checkpoint \(finite weights\): .*step-0000004\.ckpt"):
        run(tmp_path, "train.checkpoint_every_n_steps=2")
    assert (tmp_path / "checkpoints" / "latest").read_text().strip() == "step-0000004.ckpt"
    assert not (tmp_path / "checkpoints" / "step-0000006.ckpt").exists()
    state = load_sharded_checkpoint(tmp_path / "checkpoints" / "step-0000004.ckpt")
    assert all(torch.isfinite(v).all() for v in state["state_dict"].values() if v.is_floating_point())
    monkeypatch.undo()
    run(tmp_path, f"train.resume={tmp_path}", "train.lr=0.001", "train.checkpoint_every_n_steps=2")
    assert load_sharded_checkpoint(tmp_path / "checkpoints" / "step-0000012.ckpt")["global_step"] == 12
    assert all(torch.isfinite(torch.tensor(loss)) for _, loss in rows(tmp_path))


@pytest.mark.parametrize("damage", ["truncated shard", "garbage metadata", "garbage meta.pt", "missing latest target"])
def test_an_unreadable_resume_checkpoint_is_refused_before_training(finished, tmp_path, damage):
    out = tmp_path / "run"
    shutil.copytree(finished, out)
    ckpt = out / "checkpoints" / "step-0000012.ckpt"
    expected = r"step-0000012\.ckpt is not a readable training checkpoint"
    if damage == "truncated shard":
        shard = ckpt / "__0_0.distcp"
        shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    elif damage == "garbage metadata":
        (ckpt / ".metadata").write_bytes(os.urandom(4096))
    elif damage == "garbage meta.pt":
        (ckpt / "meta.pt").write_bytes(os.urandom(4096))
    else:
        shutil.rmtree(ckpt)
        expected = r"latest names step-0000012\.ckpt, which does not exist \(checkpoints there: step-0000008\.ckpt\)"
    with pytest.raises(StackError, match=expected):
        run(tmp_path / "new", f"train.resume={out}")
    assert not (tmp_path / "new" / "csv").exists()  # refused before Lightning started


@pytest.mark.parametrize("damage", ["garbage metadata", "truncated metadata", "truncated shard", "garbage shard",
                                    "missing shard"])
def test_an_unreadable_resume_checkpoint_logs_no_traceback(finished, tmp_path, damage, caplog):
    """The one-line refusal is all a user sees: DCP logged a failed metadata read with its traceback on the root
    logger (twice: it retries with the rank's own metadata) before the refusal."""
    out = tmp_path / "run"
    shutil.copytree(finished, out)
    ckpt = out / "checkpoints" / "step-0000012.ckpt"
    metadata, shard = ckpt / ".metadata", ckpt / "__0_0.distcp"
    if damage == "garbage metadata":
        metadata.write_bytes(os.urandom(4096))
    elif damage == "truncated metadata":
        metadata.write_bytes(metadata.read_bytes()[:100])
    elif damage == "truncated shard":
        shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    elif damage == "garbage shard":
        shard.write_bytes(os.urandom(shard.stat().st_size))
    else:
        shard.unlink()
    caplog.set_level("DEBUG")
    with pytest.raises(StackError, match=r"step-0000012\.ckpt is not a readable training checkpoint"):
        run(tmp_path / "new", f"train.resume={out}")
    logged = [f"{r.name}: {r.getMessage()}" for r in caplog.records if r.exc_info or r.levelno >= 30]
    assert logged == [], logged


def test_a_checkpoint_of_another_network_shape_is_refused_naming_the_key(finished, tmp_path):
    with pytest.raises(StackError, match=r"model.segmentation_classes: \['road', 'car', 'sky'\] vs "
                                         r"\['road', 'car', 'sky', 'building'\].*segmentation_head.weight"):
        run(tmp_path, f"train.resume={finished}", "model.segmentation_classes=[road,car,sky,building]")


def default_sigint() -> None:
    """The child gets Ctrl-C's default action even when this run was started in the background (where a shell
    ignores SIGINT, and Python then installs no KeyboardInterrupt handler), as a user's terminal gives it."""
    import signal

    signal.signal(signal.SIGINT, signal.SIG_DFL)


def test_ctrl_c_exits_130_naming_the_last_checkpoint(tmp_path):
    process = subprocess.Popen([sys.executable, str(REPO / "tests" / "train" / "run_tiny.py"), "--batches", "6",
                                f"train.out_dir={tmp_path}", "train.max_epochs=1000", "train.checkpoint_every_n_steps=3"],
                               cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               env={**os.environ, "PYTHONWARNINGS": "ignore"}, preexec_fn=default_sigint)
    # Wait for the first checkpoint (seconds); the ceiling only ends a run that hangs, generous for a loaded machine.
    latest, deadline = tmp_path / "checkpoints" / "latest", time.monotonic() + 600
    while not latest.exists() and time.monotonic() < deadline and process.poll() is None:
        time.sleep(0.05)
    if not latest.exists():
        process.kill()
        _, err = process.communicate()
        raise AssertionError(f"no checkpoint to name before Ctrl-C (exit {process.returncode}): {err[-3000:]}")
    process.send_signal(signal.SIGINT)
    out, err = process.communicate(timeout=120)
    assert process.returncode == 130, err
    named = latest.read_text().strip()
    assert f"interrupted; last checkpoint {tmp_path / 'checkpoints' / named}" in err and "Traceback" not in err
    assert load_sharded_checkpoint(tmp_path / "checkpoints" / named)["global_step"] >= 3


class _Payload:
    """Unpickling this runs a command: what a crafted checkpoint would do."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_a_crafted_resume_checkpoint_is_refused_without_running_its_code(tmp_path):
    marker = tmp_path / "pwned"
    crafted = tmp_path / "step-0000004.ckpt"
    torch.save({"global_step": 4, "state_dict": {}, "payload": _Payload(marker)}, crafted)
    with pytest.raises(StackError, match=r"step-0000004\.ckpt is not a readable training checkpoint"):
        run(tmp_path / "out", f"train.resume={crafted}")
    assert not marker.exists()
