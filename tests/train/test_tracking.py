"""MLflow tracking of `stack train` on a local store: what a run records, that only one process logs, and that a
tracking failure never stops training."""

import json
import socket
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from standin import TinyMultiTask, synthetic_loaders, tiny_pipeline  # noqa: E402

from stack.checkpoint import load_model_checkpoint
from stack.lineage import dataset_fingerprint
from stack.train.checkpoints import read_resume_checkpoint
from stack.train.fit import fit

RECIPE = ["train.max_epochs=1", "train.log_every_n_steps=1", "train.checkpoint_every_n_steps=3", "train.seed=7"]


def fake_dataset(root: Path, seed: int = 0, val_samples: int = 4) -> Path:
    """A manifest with shard checksum files: all the lineage fingerprint reads (the stand-in trains on synthetic
    batches)."""
    root.mkdir(parents=True, exist_ok=True)
    splits = {"train": [{"path": "train/frames-000000.tar", "samples": 8}],
              "val": [{"path": "val/frames-000000.tar", "samples": val_samples}]}
    for split, shards in splits.items():
        (root / split).mkdir(exist_ok=True)
        (root / shards[0]["path"]).with_suffix(".sums").write_text(f"{split} {seed}\n")
    (root / "manifest.json").write_text(json.dumps({"schema": 2, "seed": seed, "cameras": ["front"],
                                                    "image_size": [32, 64], "layout": "frames", "splits": splits}))
    return root


def train(tmp_path: Path, *overrides: str):
    data = fake_dataset(tmp_path / "data")
    pipeline = tiny_pipeline(*RECIPE, f"train.out_dir={tmp_path / 'run' / 'train'}", f"data.root={data}", *overrides)
    return fit(pipeline, TinyMultiTask, synthetic_loaders(pipeline, 6), progress=False)


def client_for(store: Path):
    from mlflow.tracking import MlflowClient

    return MlflowClient(f"sqlite:///{store}")


def test_a_run_records_pipeline_data_code_metrics_and_lands_in_its_checkpoints(tmp_path):
    module, trainer, _ = train(tmp_path)
    store = tmp_path / "run" / "mlruns.db"
    assert store.is_file()  # the default store sits beside train.out_dir
    client = client_for(store)
    runs = client.search_runs([e.experiment_id for e in client.search_experiments()])
    assert len(runs) == 1
    run = runs[0]
    _, _, meta = load_model_checkpoint(tmp_path / "run" / "train" / "model.pt")
    data = dataset_fingerprint(tmp_path / "data")
    assert run.data.params["train.lr"] == "0.01" and run.data.params["data.root"] == str(tmp_path / "data")
    assert run.data.tags["stack.pipeline_hash"] == meta["pipeline_hash"]
    assert run.data.tags["stack.data_hash"] == data["hash"] and run.data.tags["stack.steps"] == "6"
    assert len(run.data.tags["mlflow.source.git.commit"]) in (40, 7)  # a commit, or "unknown" outside a checkout
    assert run.data.tags["stack.host"] == socket.gethostname()
    steps = [m.step for m in client.get_metric_history(run.info.run_id, "train/loss_total")]
    assert steps == list(range(6))  # every logged step of every series
    assert "val/loss_total" in run.data.metrics and "perf/samples_per_s" in run.data.metrics
    assert run.info.status == "FINISHED"
    artifact = Path(client.download_artifacts(run.info.run_id, "pipeline.yaml", str(tmp_path)))
    assert "tracking_uri" in artifact.read_text()
    # lineage: model.pt and every resumable checkpoint name the run and the data
    assert meta["tracking"]["run_id"] == run.info.run_id and meta["dataset"]["hash"] == data["hash"]
    ckpt = read_resume_checkpoint(tmp_path / "run" / "train" / "checkpoints" / "step-0000006.ckpt")
    assert ckpt["tracking"]["run_id"] == run.info.run_id and ckpt["dataset"]["hash"] == data["hash"]


def test_an_unreachable_server_warns_and_training_finishes(tmp_path, capsys):
    with socket.socket() as probe:  # a port nothing listens on
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    train(tmp_path, f"train.tracking_uri=http://127.0.0.1:{port}")
    err = capsys.readouterr().err
    assert f"http://127.0.0.1:{port} is unreachable" in err and "training goes on without tracking" in err
    _, _, meta = load_model_checkpoint(tmp_path / "run" / "train" / "model.pt")
    assert meta["tracking"] is None and meta["dataset"] is not None


def test_a_store_that_fails_mid_run_warns_once_and_training_finishes(tmp_path, capsys, monkeypatch):
    from lightning.pytorch.loggers import MLFlowLogger

    calls = []

    def failing(self, metrics, step=None):
        calls.append(step)
        raise ConnectionError("server went away")

    monkeypatch.setattr(MLFlowLogger, "log_metrics", failing)
    module, trainer, _ = train(tmp_path)
    assert trainer.global_step == 6 and (tmp_path / "run" / "train" / "model.pt").is_file()
    err = capsys.readouterr().err
    assert err.count("MLflow tracking at") == 1 and "server went away" in err and len(calls) == 1


def test_tracking_off_writes_no_store(tmp_path):
    train(tmp_path, "train.tracking_uri=off")
    assert not (tmp_path / "run" / "mlruns.db").exists()
    _, _, meta = load_model_checkpoint(tmp_path / "run" / "train" / "model.pt")
    assert meta["tracking"] is None


def test_tracking_uri_refuses_the_retired_file_store_and_unknown_schemes():
    from stack.errors import ConfigError

    for value in ("file:///tmp/mlruns", "ftp://host/x"):
        with pytest.raises(ConfigError, match="tracking_uri"):
            tiny_pipeline(f"train.tracking_uri={value}")
