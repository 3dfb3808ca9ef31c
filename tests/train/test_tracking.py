"""MLflow tracking of `stack train` on a local store: what a run records, that only one process logs, and that a
tracking failure never stops training."""

import json
import socket
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from standin import TinyMultiTask, synthetic_loaders, tiny_pipeline  # noqa: E402

from stack.checkpoint.model_file import load_model_checkpoint
from stack.lineage import dataset_fingerprint
from stack.train.checkpoints import read_resume_checkpoint
from stack.train.fit import fit

RECIPE = ["train.max_epochs=1", "train.log_every_n_steps=1", "train.checkpoint_every_n_steps=3", "train.seed=7",
          "train.tracking_uri="]  # tracked: the default store beside out_dir (standin's TEST_OVERRIDES turn it off)


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
    assert run.info.artifact_uri.startswith((tmp_path / "run" / "mlartifacts").as_uri())  # beside the store
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


@pytest.mark.parametrize("written", ["off", "false", "no", "False", "'off'", "None"])
def test_tracking_turned_off_in_yaml_reads_off_and_writes_nothing_in_the_working_folder(tmp_path, monkeypatch,
                                                                                         written):
    """YAML reads an unquoted `off` as a boolean: the string key got 'False', which once became a SQLite file
    named False (and mlartifacts/) in the working folder."""
    from stack.config import load_pipeline
    from stack.train.tracking import start_tracking, tracking_store_uri

    monkeypatch.chdir(tmp_path)
    config = tmp_path / "off.yaml"
    config.write_text(f"train:\n  tracking_uri: {written}\n")
    pipeline = load_pipeline([config])
    assert pipeline.train.tracking_uri == "off" and tracking_store_uri(pipeline.train) is None
    assert start_tracking(pipeline) is None
    assert sorted(p.name for p in tmp_path.iterdir()) == ["off.yaml"]


def test_tracking_uri_refuses_the_retired_file_store_unknown_schemes_and_bare_words():
    from stack.errors import ConfigError

    for value in ("file:///tmp/mlruns", "ftp://host/x", "true", "mlruns", "sqlite://mlruns.db"):
        with pytest.raises(ConfigError, match="tracking_uri"):
            tiny_pipeline(f"train.tracking_uri={value}")


# ------------------------------------------------------------------ lineage: stack eval on the data the model saw

SMALL = ["data.rig.image_width=64", "data.rig.image_height=32", "data.world.scenes=2", "data.world.frames_per_scene=2",
         "data.world.agents_per_scene=4", "data.samples_per_shard=2", "data.world.val_fraction=0.5",
         "data.batch_size=1", "data.num_workers=0", "data.world.workers=1", "model.backbone=resnet10t",
         "model.neck_channels=16", "model.bev_channels=16", "model.bev.cell_size=3.2", "model.depth.bins=8",
         "model.max_boxes=8", "train.accelerator=cpu"]


def small(root, *extra):
    from stack.config import load_pipeline

    return load_pipeline(overrides=[*SMALL, f"data.root={root}", *extra])


@pytest.fixture(scope="module")
def two_datasets(tmp_path_factory):
    """Two rendered datasets of the same size from different world seeds, and a byte copy of the first."""
    import shutil

    from stack.data.make import make_dataset

    roots = [tmp_path_factory.mktemp("world_seed0"), tmp_path_factory.mktemp("world_seed1")]
    for seed, root in enumerate(roots):
        make_dataset(small(root, f"data.world.seed={seed}"), log=lambda *_: None)
    copy = tmp_path_factory.mktemp("copy") / "world"
    shutil.copytree(roots[0], copy)
    return roots[0], roots[1], copy


@pytest.fixture
def tracked_model(two_datasets, tmp_path):
    """An (untrained) model.pt of the small network, saved as training on the first dataset in a tracked run."""
    from mlflow.tracking import MlflowClient

    from stack.checkpoint.model_file import save_model_checkpoint
    from stack.lineage import set_active_run
    from stack.models import build_model

    uri = f"sqlite:///{tmp_path / 'mlruns.db'}"
    client = MlflowClient(uri)
    run = client.create_run(client.create_experiment("stack", (tmp_path / "mlartifacts").as_uri()))
    pipeline = small(two_datasets[0])
    set_active_run({"uri": uri, "run_id": run.info.run_id, "experiment": "stack"})
    try:
        path = save_model_checkpoint(tmp_path / "train" / "model.pt", pipeline, build_model(pipeline).state_dict())
    finally:
        set_active_run(None)
    return path, client, run.info.run_id


def test_eval_on_other_data_warns_naming_both_datasets_and_what_differs(two_datasets, tracked_model, capsys):
    from stack.train.evaluate import evaluate_checkpoint

    seen, other, _ = two_datasets
    path, client, run_id = tracked_model
    evaluate_checkpoint(path, small(other), progress=False)
    err = capsys.readouterr().err
    assert "warning:" in err and str(seen) in err and str(other) in err and "seed 0 vs 1" in err
    # the eval landed in the run that trained the model
    run = client.get_run(run_id)
    assert "eval/planning/L2_at_3s" in run.data.metrics and run.data.tags["stack.eval.verdict"] in ("PASS", "FAIL")
    assert {"eval/detection/NDS", "eval/detection/mAAE", "eval/detection/mAP"} <= set(run.data.metrics)
    assert run.data.tags["stack.eval.data_hash"] != dataset_fingerprint(seen)["hash"]
    assert {a.path for a in client.list_artifacts(run_id, "eval")} == {"eval/metrics.json", "eval/heads.png"}


def test_eval_on_the_same_data_is_silent_wherever_it_lies(two_datasets, tracked_model, capsys):
    from stack.train.evaluate import evaluate_checkpoint

    seen, _, copy = two_datasets
    path, _, _ = tracked_model
    for root in (seen, copy):  # the same bytes in another folder are the same data
        evaluate_checkpoint(path, small(root), progress=False)
        assert "warning" not in capsys.readouterr().err


def test_fingerprint_tells_what_differs():
    from stack.lineage import dataset_differences

    base = {"hash": "a", "seed": 0, "layout": "frames", "cameras": ["front"], "image_size": [32, 64],
            "splits": {"train": {"shards": 1, "samples": 8, "hash": "t"}, "val": {"shards": 1, "samples": 4, "hash": "v"}}}
    fewer = {**base, "hash": "b", "splits": {**base["splits"], "val": {"shards": 1, "samples": 2, "hash": "w"}}}
    edited = {**base, "hash": "c", "splits": {**base["splits"], "val": {"shards": 1, "samples": 4, "hash": "x"}}}
    assert dataset_differences(base, dict(base, root="/elsewhere")) == []
    assert dataset_differences(base, fewer) == ["val split: 4 samples in 1 shards vs 2 in 1 shards"]
    assert dataset_differences(base, edited) == ["val split: same 4 samples, other content (shard checksums differ)"]
    assert dataset_differences(base, {**base, "hash": "d", "cameras": ["front", "back"]})[0].startswith("cameras")


def test_a_shard_edited_in_place_changes_the_fingerprint(tmp_path):
    root = fake_dataset(tmp_path / "data")
    before = dataset_fingerprint(root)
    (root / "val" / "frames-000000.sums").write_text("val edited\n")
    after = dataset_fingerprint(root)
    assert before["hash"] != after["hash"] and before["splits"]["train"] == after["splits"]["train"]


# ------------------------------------------------------------------ ranks, resume, the CLI's view of a real run

@pytest.mark.slow
def test_two_ddp_ranks_make_one_run_logged_by_rank_zero(tmp_path):
    import os
    import subprocess

    data = fake_dataset(tmp_path / "data")
    env = {**os.environ, "PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "1"}
    result = subprocess.run([sys.executable, str(Path(__file__).resolve().parent / "run_tiny.py"),
                             f"train.out_dir={tmp_path / 'run' / 'train'}", f"data.root={data}", "train.devices=2",
                             "train.strategy=ddp", "train.max_steps=3", "train.log_every_n_steps=1", "train.seed=3",
                             "train.tracking_uri="],
                            cwd=Path(__file__).resolve().parents[2], env=env, capture_output=True, text=True,
                            timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    client = client_for(tmp_path / "run" / "mlruns.db")
    runs = client.search_runs([e.experiment_id for e in client.search_experiments()])
    assert len(runs) == 1 and runs[0].data.tags["stack.devices"].startswith("1x2")
    assert [m.step for m in client.get_metric_history(runs[0].info.run_id, "train/loss_total")] == [0, 1, 2]


def test_a_resumed_run_continues_its_mlflow_run_and_stack_runs_lists_it(tmp_path, capsys):
    from stack.cli import main

    train(tmp_path)
    middle = tmp_path / "run" / "train" / "checkpoints" / "step-0000003.ckpt"
    first = load_model_checkpoint(tmp_path / "run" / "train" / "model.pt")[2]["tracking"]["run_id"]
    train(tmp_path, f"train.resume={middle}", "train.overwrite=true")
    client = client_for(tmp_path / "run" / "mlruns.db")
    runs = client.search_runs([e.experiment_id for e in client.search_experiments()])
    assert [r.info.run_id for r in runs] == [first]  # the same out_dir: the same run, not a second one
    assert load_model_checkpoint(tmp_path / "run" / "train" / "model.pt")[2]["tracking"]["run_id"] == first
    capsys.readouterr()
    assert main(["runs", f"train.out_dir={tmp_path / 'run' / 'train'}"]) == 0
    out = capsys.readouterr().out
    assert f"| {first[:8]} | train |" in out and "| 6 |" in out


def test_deploy_on_other_data_warns_records_lineage_in_gate_json_and_logs_into_the_run(tmp_path):
    import dataclasses

    import torch
    from mlflow.tracking import MlflowClient

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "deploy"))
    from deploy_fixture_net import example_inputs, make_net, make_samples, segmentation_error

    from stack.checkpoint.model_file import save_model_checkpoint
    from stack.config import load_pipeline, load_target
    from stack.deploy.gates.accuracy import HeadBudget
    from stack.deploy.bundle import verify_bundle
    from stack.deploy.orchestrate import DeploySpec, run_deploy
    from stack.lineage import set_active_run

    seen, other = fake_dataset(tmp_path / "seen", seed=0), fake_dataset(tmp_path / "other", seed=1, val_samples=2)
    uri = f"sqlite:///{tmp_path / 'mlruns.db'}"
    client = MlflowClient(uri)
    run_id = client.create_run(client.create_experiment("stack", (tmp_path / "art").as_uri())).info.run_id
    set_active_run({"uri": uri, "run_id": run_id, "experiment": "stack"})
    try:
        checkpoint = save_model_checkpoint(tmp_path / "model.pt", tiny_pipeline(f"data.root={seen}"),
                                           {"w": torch.zeros(1)})
    finally:
        set_active_run(None)
    net, feeds = make_net(seed=0), make_samples(12, seed=3)
    pipeline = load_pipeline(["configs/pipeline.yaml"], ["export.calibration_samples=8", "export.timing_runs=20",
                                                         "export.timing_warmup=1", "export.keep_fp32=[bev_pool]"])
    target = dataclasses.replace(load_target("cpu", pipeline), min_fps=0.1, max_p99_latency_ms=1e6)
    spec = DeploySpec(net, example_inputs(), ["segmentation", "speed"], {"pipeline_hash": "test"}, feeds[:8],
                      feeds[8:], segmentation_error(net, feeds[8:]), [HeadBudget("segmentation", "seg_rel_error", 0.05,
                                                                                 False)],
                      "fixture samples", data_root=str(other), checkpoint=str(checkpoint))
    lines = []
    result = run_deploy(spec, "cpu", target, pipeline.export, tmp_path / "bundle", log=lines.append)
    warning = next(line for line in lines if line.startswith("warning:"))
    assert str(seen) in warning and str(other) in warning and "seed 0 vs 1" in warning and "val split" in warning
    gate = verify_bundle(tmp_path / "bundle")  # the lineage fields are part of a gate.json that still verifies
    assert gate["dataset"]["hash"] == dataset_fingerprint(other)["hash"]
    assert gate["trained_on"] == {"root": str(seen.resolve()), "hash": dataset_fingerprint(seen)["hash"]}
    assert gate["tracking"]["run_id"] == run_id
    run = client.get_run(run_id)
    expected = "FAIL" if not result["passed"] else "PASS" if result["for_deployment"] else "PASS-NOT-FOR-DEPLOYMENT"
    assert run.data.tags["stack.deploy.cpu"] == expected
    assert run.data.metrics["deploy/cpu/passed"] == float(result["passed"]) and "deploy/cpu/median_ms" in run.data.metrics
    assert {a.path for a in client.list_artifacts(run_id, "deploy/cpu")} == {"deploy/cpu/gate.json",
                                                                            "deploy/cpu/report.md"}


@pytest.mark.parametrize("record", [{"hash": 3}, {"hash": "a", "splits": {"val": {"samples": "many"}}},
                                    {"hash": "a", "splits": ["val"]}])
def test_a_malformed_fingerprint_in_a_checkpoint_is_a_note_not_a_traceback(tmp_path, record):
    from stack.lineage import data_warning

    given = dataset_fingerprint(fake_dataset(tmp_path / "data"))
    message = data_warning(record, given, "model.pt", str(tmp_path / "data"), "evaluated on")
    assert message.startswith("note: model.pt records a dataset fingerprint that is not one")


def test_a_checkpoint_naming_a_store_that_is_not_there_makes_no_store(tmp_path):
    """model.pt's run record is data from whoever wrote the checkpoint: eval and deploy log into an existing
    local store only, never create a database at the path it names."""
    from stack.lineage import attach_to_run

    elsewhere = tmp_path / "mlruns.db"  # MLflow would create it, tables and all
    lines = []
    record = {"uri": f"sqlite:///{elsewhere}", "run_id": "0123456789abcdef", "experiment": "tiny"}
    assert not attach_to_run(record, {"eval/x": 1.0}, [], {}, log=lines.append)
    assert not elsewhere.exists()
    assert len(lines) == 1 and "does not exist" in lines[0] and "results are on disk only" in lines[0]
    assert not attach_to_run({"uri": 5, "run_id": ["x"]}, {}, [], {}, log=lines.append) and len(lines) == 1


@pytest.mark.parametrize("entry", [{"path": "train/a.tar", "samples": "many"}, {"path": ["a"], "samples": 1}, "a.tar"])
def test_a_malformed_manifest_has_no_fingerprint_rather_than_a_traceback(tmp_path, entry):
    """stack eval fingerprints the data before its loader reads the manifest: the loader must be the one to say
    what is wrong (exit 2), not int('many') here."""
    (tmp_path / "manifest.json").write_text(json.dumps({"splits": {"train": [entry]}}))
    assert dataset_fingerprint(tmp_path) is None


@pytest.fixture
def recording_server():
    """A tiny HTTP server on 127.0.0.1 that answers 200 to everything and records each request's path."""
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    seen = []

    class Recorder(BaseHTTPRequestHandler):
        def _answer(self):
            seen.append(self.path)
            self.send_response(200)
            self.send_header("Content-Length", "2")
            self.end_headers()
            self.wfile.write(b"{}")

        do_GET = do_POST = do_PUT = _answer

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Recorder)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}", seen
    server.shutdown()


def test_a_checkpoint_naming_a_server_the_user_did_not_choose_gets_no_request(tmp_path, recording_server,
                                                                               monkeypatch, capsys):
    """A crafted or foreign model.pt names the server; eval and deploy must not send it metrics and reports (nor
    even probe it) unless the user chose that server in this invocation."""
    import torch

    from stack.checkpoint.model_file import read_lineage, save_model_checkpoint
    from stack.deploy.orchestrate import _attach
    from stack.lineage import TRACKING_KEY, attach_to_run, set_active_run
    from stack.train.evaluate import attach_eval
    from stack.train.tracking import chosen_store

    uri, seen = recording_server
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    stored = tiny_pipeline(f"data.root={tmp_path / 'data'}", f"train.tracking_uri={uri}")
    set_active_run({"uri": uri, "run_id": "0123456789abcdef", "experiment": "stack"})
    try:
        checkpoint = save_model_checkpoint(tmp_path / "model.pt", stored, {"w": torch.zeros(1)})
    finally:
        set_active_run(None)
    record = read_lineage(checkpoint)[TRACKING_KEY]
    assert record["uri"] == uri
    # `stack eval model.pt data.root=...`: the pipeline is the checkpoint's own, so its store was not chosen
    assert chosen_store(stored, [], [f"data.root={tmp_path}"]) is None
    (tmp_path / "eval").mkdir()
    attach_eval(record, {"eval/x": 1.0}, tmp_path / "eval", None, chosen=None)
    lines = []
    spec = type("Spec", (), {"chosen_store": None, "checkpoint": str(checkpoint)})()
    _attach({"passed": True, "tracking": record}, spec, "cpu", tmp_path, lines.append)
    assert seen == []  # no request at all, not even the /health probe
    err = capsys.readouterr().err
    assert "remote store recorded in the checkpoint" in err and err.count("\n") == 1
    assert len(lines) == 1 and "train.tracking_uri=" in lines[0] and "results are on disk only" in lines[0]
    # the check can fail: once the user chooses the server (override or environment) it is contacted
    assert chosen_store(stored, [], [f"train.tracking_uri={uri}"]) == uri
    attach_to_run(record, {"eval/x": 1.0}, [], {}, log=lines.append, chosen=f"{uri}/")
    assert seen and seen[0] == "/health"
    seen.clear()
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    attach_to_run(record, {"eval/x": 1.0}, [], {}, log=lines.append)
    assert seen


def _user_database(path: Path) -> bytes:
    from tests.stack.test_runs import user_database

    return user_database(path)


@pytest.mark.parametrize("where", ["elsewhere", "two folders above", "beside the checkpoint", "the folder above"])
def test_a_checkpoint_naming_a_database_that_is_not_an_mlflow_store_leaves_it_as_it_is(tmp_path, where):
    """A crafted model.pt's run record names a SQLite file of the user's: eval and deploy add no table to it
    (elsewhere: not even opened, the user did not name it; in the checkpoint's folder or the one above, where
    `stack train` puts its store: opened read-only, and refused as not an MLflow store)."""
    from stack.lineage import attach_to_run

    checkpoint_folder = tmp_path / "runs" / "train"
    checkpoint_folder.mkdir(parents=True)
    database = {"elsewhere": tmp_path / "other", "two folders above": tmp_path, "beside the checkpoint":
                checkpoint_folder, "the folder above": checkpoint_folder.parent}[where] / "app.db"
    database.parent.mkdir(exist_ok=True)
    before = _user_database(database)
    lines = []
    record = {"uri": f"sqlite:///{database}", "run_id": "0123456789abcdef", "experiment": "tiny"}
    assert not attach_to_run(record, {"eval/x": 1.0}, [], {}, log=lines.append, checkpoint_folder=checkpoint_folder)
    assert database.read_bytes() == before
    allowed = where in ("beside the checkpoint", "the folder above")
    says = "is not an MLflow store" if allowed else "only used beside the checkpoint or when you name it"
    assert len(lines) == 1 and says in lines[0] and "results are on disk only" in lines[0], lines


@pytest.mark.parametrize("kind", ["user database", "empty file"])
def test_train_refuses_a_tracking_uri_that_is_not_an_mlflow_store_before_writing_anything(tmp_path, kind):
    from stack.errors import StackError

    database = tmp_path / "app.db"
    before = _user_database(database) if kind == "user database" else database.write_bytes(b"") or b""
    with pytest.raises(StackError, match=r"train.tracking_uri: .*is not an MLflow store.*train.tracking_uri=off"):
        train(tmp_path, f"train.tracking_uri={database}")
    assert database.read_bytes() == before and not (tmp_path / "run").exists()
