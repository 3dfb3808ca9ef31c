"""End-to-end training on one CPU process: loss curve vs golden file, resume, divergence, checkpoint safety."""

import csv
import json
import os
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from standin import STANDIN_RECIPE, TinyMultiTask, synthetic_loaders, tiny_pipeline  # noqa: E402

from stack.checkpoint.model_file import load_model_checkpoint
from stack.errors import StackError
from stack.train.checkpoints import resolve_resume
from stack.checkpoint.sharded import load_sharded_checkpoint
from stack.train.fit import fit
from stack.train.module import TrainingDiverged

GOLDEN = Path(__file__).resolve().parents[1] / "assets" / "losses" / "train_tiny_standin.json"
RECIPE = STANDIN_RECIPE  # trained once per session: tests/train/conftest.py


def run(out, *overrides, batches=6, nan_at=-1):
    pipeline = tiny_pipeline(*RECIPE, f"train.out_dir={out}", *overrides)
    return fit(pipeline, TinyMultiTask, synthetic_loaders(pipeline, batches, nan_at), progress=False)


def losses(out) -> dict[int, float]:
    with open(Path(out) / "csv" / "metrics.csv") as handle:
        return {int(row["step"]): float(row["train/loss_total"]) for row in csv.DictReader(handle)
                if row.get("train/loss_total")}


@pytest.fixture(scope="module")
def reference(standin_recipe_run):
    """RECIPE trained uninterrupted (the session's run, tests/train/conftest.py)."""
    return standin_recipe_run


def test_loss_curve_matches_golden_file(reference):
    curve = losses(reference)
    assert sorted(curve) == list(range(12))
    if os.environ.get("STACK_UPDATE_GOLDEN"):
        GOLDEN.parent.mkdir(parents=True, exist_ok=True)
        GOLDEN.write_text(json.dumps({"recipe": RECIPE, "losses": [curve[s] for s in range(12)]}, indent=1) + "\n")
    golden = json.loads(GOLDEN.read_text())["losses"]
    assert [curve[s] for s in range(12)] == pytest.approx(golden, rel=2e-3)
    assert sum(golden[-3:]) < 0.5 * sum(golden[:3])  # the recipe learns


def test_run_leaves_checkpoints_weights_and_logs(reference):
    names = sorted(p.name for p in (reference / "checkpoints").iterdir())
    assert names == ["latest", "step-0000008.ckpt", "step-0000012.ckpt"]  # keep_checkpoints=2
    assert resolve_resume(reference) == reference / "checkpoints" / "step-0000012.ckpt"
    ckpt = load_sharded_checkpoint(reference / "checkpoints" / "step-0000012.ckpt")
    assert ckpt["global_step"] == 12 and "pipeline_yaml" in ckpt and ckpt["optimizer_states"]
    pipeline, state, meta = load_model_checkpoint(reference / "model.pt")
    assert pipeline.train.seed == 7 and set(state) == set(TinyMultiTask(pipeline).state_dict())
    assert list((reference / "tensorboard").glob("events.out.tfevents.*"))
    rows = list(csv.DictReader(open(reference / "csv" / "metrics.csv")))
    assert any(row.get("perf/mfu") for row in rows) and any(row.get("val/loss_total") for row in rows)


def test_resume_mid_epoch_reproduces_the_uninterrupted_run(reference, tmp_path):
    middle = reference / "checkpoints" / "step-0000008.ckpt"  # epoch 1, batch 2 of 6
    run(tmp_path, f"train.resume={middle}")
    resumed, full = losses(tmp_path), losses(reference)
    assert sorted(resumed) == list(range(8, 12))
    assert [resumed[s] for s in range(8, 12)] == pytest.approx([full[s] for s in range(8, 12)], rel=1e-5)


def test_non_finite_loss_stops_naming_step_and_term_and_keeps_last_good_checkpoint(tmp_path):
    with pytest.raises(TrainingDiverged, match=r"step 5: loss term depth=nan, total=nan is not finite.*step-0000004\.ckpt"):
        run(tmp_path, nan_at=5)
    assert (tmp_path / "checkpoints" / "latest").read_text().strip() == "step-0000004.ckpt"
    assert load_sharded_checkpoint(tmp_path / "checkpoints" / "step-0000004.ckpt")["global_step"] == 4
    assert not (tmp_path / "model.pt").exists()


def test_failed_checkpoint_write_keeps_the_previous_one(tmp_path, monkeypatch):
    from stack.checkpoint import sharded as dcp_io

    original, calls = dcp_io._FencedWriter.write_data, []

    def failing(self, plan, planner):  # runs in the background writer, while training goes on
        calls.append(self.path)
        if len(calls) == 2:  # the disk fills up while the second checkpoint (step 4) is written
            raise OSError("No space left on device")
        return original(self, plan, planner)

    monkeypatch.setattr(dcp_io._FencedWriter, "write_data", failing)
    with pytest.raises(StackError, match=r"step-0000004\.ckpt could not be written .*No space left on device.*"
                                         r"still names the previous complete one"):
        run(tmp_path, "train.checkpoint_every_n_steps=2")
    assert resolve_resume(tmp_path).name == "step-0000002.ckpt"
    assert load_sharded_checkpoint(resolve_resume(tmp_path))["global_step"] == 2


def test_resume_from_nothing_is_a_clear_error(tmp_path):
    with pytest.raises(StackError, match="train.resume=.*nothing is there"):
        resolve_resume(tmp_path / "missing")


@pytest.mark.gpu
def test_trains_on_a_gpu_in_bf16(tmp_path):
    module, trainer, stats = run(tmp_path, "train.accelerator=gpu", "train.precision=bf16-mixed")
    curve = losses(tmp_path)
    assert len(curve) == 12 and torch.isfinite(torch.tensor(list(curve.values()))).all()
    last = stats.history[-1]
    assert 0 < last["perf/mfu"] < 1 and last["perf/peak_memory_mb"] > 0
    assert trainer.strategy.root_device.type == "cuda"  # fit's teardown moves the weights back to the CPU


@pytest.mark.gpu
def test_fsdp2_cpu_offload_trains_as_without_it(tmp_path):
    """train.fsdp_cpu_offload keeps parameter shards, gradients and AdamW state in host memory and steps the
    optimizer there: the same seed and data give the same loss curve as FSDP2 on the GPU alone (to fp32 rounding:
    the CPU's AdamW kernels are not the GPU's), with less GPU memory at the peak (no weights, gradients or moments
    kept on it)."""
    runs = {}
    for offload in (False, True):
        out = tmp_path / f"offload-{offload}"
        runs[offload] = run(out, "train.accelerator=gpu", "train.devices=1", "train.strategy=fsdp",
                            f"train.fsdp_cpu_offload={str(offload).lower()}")
        strategy = type(runs[offload][1].strategy).__name__
        assert strategy == ("OffloadingModelParallelStrategy" if offload else "ModelParallelStrategy"), strategy
    plain, offloaded = losses(tmp_path / "offload-False"), losses(tmp_path / "offload-True")
    assert len(plain) == 12 and offloaded == pytest.approx(plain, rel=1e-4)
    peak = {offload: stats.history[-1]["perf/peak_memory_mb"] for offload, (_, _, stats) in runs.items()}
    assert peak[True] < peak[False], peak


def test_a_checkpoint_carries_the_pipeline_serialised_once_per_run(monkeypatch):
    """Every checkpoint carries the resolved pipeline's YAML and hash; serialising them took ~0.4 s of each
    checkpoint's pause, so the module makes them once and again only for another pipeline."""
    from stack import config
    from stack.train.module import TrainModule

    calls = []
    real = config.pipeline_to_yaml
    monkeypatch.setattr(config, "pipeline_to_yaml", lambda pipeline: calls.append(1) or real(pipeline))
    pipeline = tiny_pipeline(*RECIPE)
    module = TrainModule(pipeline, TinyMultiTask(pipeline))
    first, second = {}, {}
    module.on_save_checkpoint(first)
    module.on_save_checkpoint(second)
    assert first["pipeline_yaml"] == second["pipeline_yaml"] == real(pipeline) and len(calls) == 1
    assert first["pipeline_hash"] == config.pipeline_hash(pipeline)
    module.pipeline = tiny_pipeline(*RECIPE, "train.lr=0.5")
    third = {}
    module.on_save_checkpoint(third)
    assert "lr: 0.5" in third["pipeline_yaml"] and third["pipeline_hash"] != first["pipeline_hash"]
