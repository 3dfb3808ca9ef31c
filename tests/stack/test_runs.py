"""`stack runs` and `stack runs compare A B` on a local MLflow store (built here the way training, eval and deploy
fill it), and their bad input: a missing store, unknown or ambiguous runs, stray words (exit 2)."""

import time

import pytest

from stack.cli import main


def log_run(client, experiment, name, lr, data_hash, loss, steps, deploy=None, eval_l2=None):
    from mlflow.entities import Metric, Param, RunTag

    run = client.create_run(experiment, run_name=name)
    now = int(time.time() * 1000)
    params = {"train.lr": str(lr), "train.seed": "0", "model.backbone": "resnet18", "train.out_dir": f"runs/{name}"}
    tags = {"stack.pipeline_hash": f"{hash((name, lr)) & 0xffffffffffff:012x}", "stack.data_hash": data_hash,
            "stack.data_root": f"/data/{data_hash}", "stack.git_commit": "abc123", "stack.steps": str(steps),
            "stack.host": "node1"}
    if deploy:
        tags[f"stack.deploy.{deploy[0]}"] = deploy[1]
    metrics = [Metric("loss", value, now, step) for step, value in enumerate(loss)]
    metrics += [Metric("val/loss_total", loss[-1] * 1.1, now, steps)]
    if eval_l2 is not None:
        metrics.append(Metric("eval/planning/L2_at_3s", eval_l2, now, 0))
        tags["stack.eval.verdict"] = "PASS"
    client.log_batch(run.info.run_id, metrics=metrics, params=[Param(k, v) for k, v in params.items()],
                     tags=[RunTag(k, v) for k, v in tags.items()])
    client.set_terminated(run.info.run_id)
    return run.info.run_id


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    from mlflow.tracking import MlflowClient

    folder = tmp_path_factory.mktemp("store")
    client = MlflowClient(f"sqlite:///{folder / 'mlruns.db'}")
    experiment = client.create_experiment("tiny", (folder / "mlartifacts").as_uri())
    first = log_run(client, experiment, "baseline", 0.002, "d" * 64, [3.0, 2.0, 1.5], 684, ("ci-cpu", "PASS"), 0.61)
    second = log_run(client, experiment, "higher-lr", 0.004, "e" * 64, [3.0, 1.8, 1.2], 684, ("orin", "FAIL"))
    return folder / "mlruns.db", first, second


def runs(capsys, *words):
    code = main(["runs", *words])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_lists_runs_with_hashes_steps_losses_eval_and_deploy_verdicts(store, capsys):
    path, first, second = store
    code, out, _ = runs(capsys, f"train.tracking_uri={path}")
    assert code == 0
    rows = {line.split(" | ")[0].strip("| "): line for line in out.splitlines() if line.startswith("| ")}
    assert set(rows) >= {first[:8], second[:8]}
    assert "| dddddddd | 684 | 1.5 | 1.65 | 0.61 |" in rows[first[:8]] and "ci-cpu:PASS" in rows[first[:8]]
    assert "| eeeeeeee | 684 | 1.2 |" in rows[second[:8]] and "orin:FAIL" in rows[second[:8]]
    assert out.index(second[:8]) < out.index(first[:8])  # newest first
    assert f"mlflow ui --backend-store-uri sqlite:///{path}" in out


def test_compare_shows_the_keys_data_and_metrics_that_differ(store, capsys):
    path, first, second = store
    code, out, _ = runs(capsys, "compare", first[:6], "higher-lr", f"train.tracking_uri={path}")
    assert code == 0
    assert "| train.lr | 0.002 | 0.004 |" in out and "| train.out_dir | runs/baseline | runs/higher-lr |" in out
    assert "train.seed" not in out and "model.backbone" not in out  # equal keys are left out
    assert "(DIFFERENT data)" in out and f"| data hash | {'d' * 64} | {'e' * 64} |" in out
    assert "| loss | 1.5 | 1.2 | -0.3 (0.8x) |" in out
    assert "| eval/planning/L2_at_3s | 0.61 |  | only in A |" in out
    assert "| ci-cpu | PASS | - |" in out and "| orin | - | FAIL |" in out


@pytest.mark.parametrize("words, message", [
    (["compare", "ffffffff", "baseline"], "no run 'ffffffff'"),
    (["compare", "baseline"], "expected nothing (list the runs) or `compare A B`"),
    (["show", "x", "y"], "expected nothing"),
])
def test_bad_run_words_are_bad_input(store, capsys, words, message):
    path, _, _ = store
    code, out, err = runs(capsys, *words, f"train.tracking_uri={path}")
    assert code == 2 and message in err and "Traceback" not in err


def test_an_ambiguous_name_lists_the_runs_it_names(store, capsys):
    from mlflow.tracking import MlflowClient

    path, _, _ = store
    client = MlflowClient(f"sqlite:///{path}")
    twin = log_run(client, client.get_experiment_by_name("tiny").experiment_id, "baseline", 0.002, "d" * 64,
                   [1.0], 1)
    code, _, err = runs(capsys, "compare", "baseline", "higher-lr", f"train.tracking_uri={path}")
    assert code == 2 and "names 2 runs" in err and twin[:12] in err
    client.delete_run(twin)


def test_a_missing_store_or_tracking_off_is_bad_input(tmp_path, capsys):
    code, _, err = runs(capsys, f"train.tracking_uri={tmp_path / 'nothing.db'}")
    assert code == 2 and "no MLflow store at" in err and not (tmp_path / "nothing.db").exists()
    code, _, err = runs(capsys, "train.tracking_uri=off")
    assert code == 2 and "tracking_uri is off" in err
    garbage = tmp_path / "notes.db"
    garbage.write_text("not a database\n")
    code, _, err = runs(capsys, f"train.tracking_uri={garbage}")
    assert code == 2 and "is not an MLflow store" in err and "Traceback" not in err


def test_an_unreachable_server_is_bad_input(capsys):
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    code, _, err = runs(capsys, f"train.tracking_uri=http://127.0.0.1:{port}")
    assert code == 2 and "unreachable" in err


def user_database(path):
    """An SQLite database of the user's (not MLflow's), and its bytes."""
    import sqlite3
    from contextlib import closing

    with closing(sqlite3.connect(path)) as db:
        db.execute("CREATE TABLE thesis (chapter TEXT)")
        db.execute("INSERT INTO thesis VALUES ('one')")
        db.commit()
    return path.read_bytes()


@pytest.mark.parametrize("kind", ["user database", "empty file"])
def test_listing_never_creates_tables_in_a_file_that_is_not_an_mlflow_store(tmp_path, capsys, kind):
    path = tmp_path / "app.db"
    before = user_database(path) if kind == "user database" else path.write_bytes(b"") or b""
    code, _, err = runs(capsys, f"train.tracking_uri={path}")
    assert code == 2 and "is not an MLflow store" in err and "only reads stores" in err, err
    assert path.read_bytes() == before and sorted(p.name for p in tmp_path.iterdir()) == ["app.db"]


def test_listing_never_migrates_a_store_of_another_mlflow_version(tmp_path, capsys):
    """A store an older MLflow wrote (an earlier schema revision) would be migrated by opening it with this MLflow's
    client; `stack runs` says so and how to upgrade it, and leaves it byte for byte as it was."""
    import sqlite3
    from contextlib import closing

    from mlflow.tracking import MlflowClient

    path = tmp_path / "mlruns.db"
    MlflowClient(f"sqlite:///{path}").create_experiment("tiny", (tmp_path / "mlartifacts").as_uri())
    with closing(sqlite3.connect(path)) as db:
        db.execute("UPDATE alembic_version SET version_num = '0a8213491aaa'")  # MLflow 1.x's first revision
        db.commit()
    before = path.read_bytes()
    code, _, err = runs(capsys, f"train.tracking_uri={path}")
    assert code == 2 and "another MLflow version (schema 0a8213491aaa" in err and "mlflow db upgrade" in err, err
    assert path.read_bytes() == before


def test_control_characters_in_names_and_tags_are_escaped_not_printed(tmp_path, capsys):
    """Run names, tags and params come from the store: an escape sequence printed raw can clear the screen or
    retitle the terminal."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(f"sqlite:///{tmp_path / 'mlruns.db'}")
    experiment = client.create_experiment("tiny", (tmp_path / "mlartifacts").as_uri())
    first = log_run(client, experiment, "clear\x1b[2J\x1b]0;owned\x07", 0.002, "d\x1bc" * 3, [3.0, 2.0], 4)
    second = log_run(client, experiment, "plain", 0.004, "e" * 64, [3.0, 1.0], 4)
    code, out, _ = runs(capsys, f"train.tracking_uri={tmp_path / 'mlruns.db'}")
    assert code == 0 and "\x1b" not in out and "\x07" not in out
    assert "clear\\x1b[2J\\x1b]0;owned\\x07" in out
    code, out, _ = runs(capsys, "compare", first, second, f"train.tracking_uri={tmp_path / 'mlruns.db'}")
    assert code == 0 and "\x1b" not in out and "\\x1b" in out


def hostile_store(folder):
    """A store made as training makes one, then edited in its SQLite file the way SQLite allows (a column's type is
    not enforced): metric values that are text, bytes or not a date, params and tags with control characters, a tag
    without a value. (first run, second run)."""
    import sqlite3
    from contextlib import closing

    from mlflow.tracking import MlflowClient

    path = folder / "mlruns.db"
    client = MlflowClient(f"sqlite:///{path}")
    experiment = client.create_experiment("tiny", (folder / "mlartifacts").as_uri())
    first = log_run(client, experiment, "baseline", 0.002, "d" * 64, [3.0, 2.0, 1.5], 684, ("ci-cpu", "PASS"), 0.61)
    second = log_run(client, experiment, "higher-lr", 0.004, "e" * 64, [3.0, 1.8, 1.2], 684)
    with closing(sqlite3.connect(path)) as db:
        for table in ("metrics", "latest_metrics"):
            db.execute(f"UPDATE {table} SET value = 'fast\x1b[2J' WHERE key = 'loss' AND run_uuid = ?", (first,))
            db.execute(f"UPDATE {table} SET value = x'00ff' WHERE key = 'val/loss_total' AND run_uuid = ?", (second,))
        db.execute("UPDATE params SET value = '0.1\x1b]0;owned\x07' WHERE key = 'train.lr' AND run_uuid = ?", (first,))
        db.execute("UPDATE tags SET value = '6\x1b[2J' WHERE key = 'stack.steps' AND run_uuid = ?", (first,))
        db.execute("UPDATE tags SET value = NULL WHERE key = 'stack.pipeline_hash' AND run_uuid = ?", (second,))
        db.execute("UPDATE runs SET start_time = 'yesterday' WHERE run_uuid = ?", (second,))
        db.commit()
    return path, first, second


def test_values_of_the_wrong_type_in_the_store_are_shown_as_such_not_a_traceback(tmp_path, capsys):
    path, first, second = hostile_store(tmp_path)
    code, out, err = runs(capsys, f"train.tracking_uri={path}")
    assert code == 0 and "Traceback" not in err, err
    assert "\x1b" not in out and "\x07" not in out and "6\\x1b[2J" in out, out
    rows = {line.split(" | ")[0].strip("| "): line for line in out.splitlines() if line.startswith("| ")}
    assert "| not a number | 1.65 |" in rows[first[:8]] and "| 1.2 | not a number |" in rows[second[:8]], out
    assert "not a date" in rows[second[:8]]
    assert f"run {first[:8]}, metric 'loss': the store holds text 'fast\\x1b[2J', not a number" in out, out
    assert f"run {second[:8]}, metric 'val/loss_total': the store holds bytes" in out, out
    code, out, err = runs(capsys, "compare", first, second, f"train.tracking_uri={path}")
    assert code == 0 and "Traceback" not in err, err
    assert "\x1b" not in out and "\x07" not in out and "| train.lr | 0.1\\x1b]0;owned\\x07 | 0.004 |" in out, out
    assert "| loss | not a number | 1.2 | not comparable |" in out, out
    assert "| val/loss_total | 1.65 | not a number | not comparable |" in out, out
    assert f"run {first[:8]}, metric 'loss': the store holds text" in out
