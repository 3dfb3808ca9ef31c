"""Data and model lineage: which dataset a checkpoint or bundle came from, and which tracked run.

Every checkpoint `stack train` writes (model.pt and the resumable `.ckpt`) and every bundle
`stack deploy` writes (gate.json) records

- `dataset`: the fingerprint of the dataset it was trained (or calibrated) on —
  `dataset_fingerprint(root)`: the folder, a sha256 over the manifest and every shard's
  member checksums (the `.sums` files, xxh3_64 of each member), and the facts people compare
  (seed, layout, cameras, image size, shards and samples per split). Two datasets with the
  same hash hold the same bytes; the same config and seed render byte-identical shards, so a
  re-rendered dataset keeps its hash;
- `tracking`: the MLflow run it was logged in (store URI, run id, experiment), so `stack
  eval` and `stack deploy` attach their reports to the run that trained the model.

Training runs and `stack bench --record` records also carry the code they ran: `git_commit()`, the
commit of the checkout and whether it had uncommitted changes.

`stack eval` and `stack deploy` compare the fingerprint of the data they are given with the
one the model saw and warn, naming both folders and hashes and what differs. The comparison
is a warning, not a refusal: scoring a model on another dataset can be the point (a held-out
town, a real recording); scoring it on other data by mistake is what the warning catches.

A store is opened only when it is an MLflow store this MLflow reads as it is, or (for `stack train`) does
not exist yet (`store_problem`): MLflow creates its ~30 tables in any SQLite file it is pointed at and
migrates an older store, so a database of the user's named by mistake, or by a crafted checkpoint, would
be changed. A run record in a checkpoint is data from whoever wrote the file: its store is written to
only when the user named it, or when it is the local store beside the checkpoint, where `stack train`
puts it (`attach_to_run`).

This module imports no stage (train, deploy, models): all three use it. MLflow is imported
only when a run is attached to.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import subprocess
from pathlib import Path

from stack.user_json import read_json_or_none

TRACKING_KEY = "tracking"
"""Checkpoint / gate.json key of the MLflow run record {uri, run_id, experiment}."""
DATASET_KEY = "dataset"
"""Checkpoint / gate.json key of the dataset fingerprint."""
MANIFEST = "manifest.json"
SUMS = ".sums"

_active_run: dict | None = None


# ------------------------------------------------------------------ code


def git_commit() -> tuple[str, str]:
    """(commit, "true"/"false" uncommitted changes) of the checkout the stack runs from; ("unknown", "unknown")
    when it is not one (an installed wheel, no git)."""
    source = Path(__file__).resolve().parent
    try:
        commit = subprocess.run(["git", "-C", str(source), "rev-parse", "HEAD"], capture_output=True, text=True,
                                timeout=10)
        if commit.returncode != 0:
            return "unknown", "unknown"
        dirty = subprocess.run(["git", "-C", str(source), "diff", "--quiet", "HEAD", "--"], capture_output=True,
                               timeout=30)
        return commit.stdout.strip(), "true" if dirty.returncode == 1 else "false"
    except (OSError, subprocess.SubprocessError):
        return "unknown", "unknown"


# ------------------------------------------------------------------ datasets


def dataset_fingerprint(root: str | Path) -> dict | None:
    """The fingerprint of the dataset at `root`, or None when it has no readable manifest."""
    root = Path(root)
    try:
        manifest = read_json_or_none(root / MANIFEST)
        splits = manifest["splits"]
        assert isinstance(splits, dict)
    except (OSError, ValueError, KeyError, TypeError, AssertionError):
        return None
    if not all(isinstance(entries, list) and all(_shard_entry(e) for e in entries) for entries in splits.values()):
        return None  # not a manifest `stack data make` writes: the loader says what is wrong with it
    whole = hashlib.sha256(json.dumps(_as_rendered(manifest), sort_keys=True).encode())
    summary = {}
    for split in sorted(splits):
        digest = hashlib.sha256()
        for entry in splits[split]:
            digest.update(_rendered_name(entry["path"]).encode() + b"\0" + _sums_bytes(root, entry["path"]) + b"\0")
        summary[split] = {"shards": len(splits[split]), "samples": sum(e["samples"] for e in splits[split]),
                          "hash": digest.hexdigest()[:16]}
        whole.update(f"{split}:{summary[split]['hash']}".encode())
    return {"root": str(root.resolve()), "hash": whole.hexdigest(), "seed": manifest.get("seed"),
            "layout": manifest.get("layout", "frames"), "cameras": list(manifest.get("cameras", [])),
            "image_size": list(manifest.get("image_size", [])), "splits": summary}


def _as_rendered(manifest: dict) -> dict:
    """`manifest` with each shard under the name it was rendered as. Where the previous dataset held that name, the
    in-place swap (`stack.data.staging`) stores `train/frames-000000.tar` as `train/frames-000000.1.tar`: the
    data is the same whichever way it was swapped in, and so is its fingerprint."""
    return {**manifest, "splits": {split: [{**entry, "path": _rendered_name(entry["path"])} for entry in entries]
                                   for split, entries in manifest["splits"].items()}}


def _rendered_name(path: str) -> str:
    return _SWAP_SUFFIX.sub("", path)


_SWAP_SUFFIX = re.compile(r"\.[1-9][0-9]?(?=\.tar$)")
"""The `.1` ... `.99` an in-place swap puts before `.tar` (`stack.data.staging._renamed`)."""


def _shard_entry(entry) -> bool:
    """A manifest's shard entry as `stack data make` writes it: {"path": str, "samples": int, ...}."""
    return isinstance(entry, dict) and isinstance(entry.get("path"), str) and type(entry.get("samples")) is int


def _sums_bytes(root: Path, shard: str) -> bytes:
    """The shard's member checksums (`x.sums` beside `x.tar`); b"" when absent (the hash then covers the manifest)."""
    if not shard or Path(shard).is_absolute() or ".." in Path(shard).parts:
        return b""
    try:
        return (root / shard).with_suffix(SUMS).read_bytes()
    except OSError:
        return b""


def dataset_differences(seen: dict, given: dict) -> list[str]:
    """What differs between the dataset a model saw and the one it is given ([] when the bytes are the same)."""
    if seen.get("hash") == given.get("hash"):
        return []
    found = [f"{name} {seen.get(key)!r} vs {given.get(key)!r}"
             for key, name in (("seed", "seed"), ("layout", "layout"), ("cameras", "cameras"),
                               ("image_size", "image size"))
             if seen.get(key) != given.get(key)]
    left, right = seen.get("splits", {}), given.get("splits", {})
    for split in sorted(set(left) | set(right)):
        a, b = left.get(split), right.get(split)
        if a is None or b is None:
            found.append(f"split {split} only in the {'model' if b is None else 'given'}'s data")
        elif (a["samples"], a["shards"]) != (b["samples"], b["shards"]):
            found.append(f"{split} split: {a['samples']} samples in {a['shards']} shards vs "
                         f"{b['samples']} in {b['shards']} shards")
        elif a["hash"] != b["hash"]:
            found.append(f"{split} split: same {a['samples']} samples, other content (shard checksums differ)")
    return found or ["the manifests differ (same splits and shard checksums)"]


def well_formed(fingerprint) -> bool:
    """True for a fingerprint of `dataset_fingerprint`'s shape (a checkpoint's record may be edited or foreign)."""
    if not isinstance(fingerprint, dict) or not isinstance(fingerprint.get("hash"), str):
        return False
    splits = fingerprint.get("splits")
    return isinstance(splits, dict) and all(
        isinstance(v, dict) and isinstance(v.get("samples"), int) and isinstance(v.get("shards"), int)
        and isinstance(v.get("hash"), str) for v in splits.values())


def data_warning(seen: dict | None, given: dict | None, model: str, given_root: str, what: str) -> str | None:
    """The warning `stack eval` / `stack deploy` print when `model` did not see the data it is now `what` on."""
    if given is None:
        return None
    if seen is not None and not well_formed(seen):
        return (f"note: {model} records a dataset fingerprint that is not one `stack train` writes (edited?); cannot "
                f"check that {given_root} is the data it saw.")
    if seen is None:
        return (f"note: {model} records no training dataset (written before lineage was recorded); cannot check that "
                f"{given_root} is the data it saw.")
    differences = dataset_differences(seen, given)
    if not differences:
        return None
    return (f"warning: {model} was trained on {seen.get('root')} (data hash {seen.get('hash', '')[:12]}), but is "
            f"{what} {given.get('root')} (data hash {given.get('hash', '')[:12]}): " + "; ".join(differences)
            + ". Its figures describe another dataset than the one it was trained on; set data.root to that dataset "
              "to compare like with like, or ignore this if another dataset is the point.")


# ------------------------------------------------------------------ tracked runs


def set_active_run(record: dict | None) -> None:
    """The MLflow run this process trains in (set by `stack.train.tracking` on rank 0); checkpoints record it."""
    global _active_run
    _active_run = dict(record) if record else None


def active_run() -> dict | None:
    return dict(_active_run) if _active_run else None


def checkpoint_lineage(pipeline) -> dict:
    """The lineage keys a checkpoint of a model training on `pipeline` carries (dataset; tracking when tracked)."""
    found = {DATASET_KEY: dataset_fingerprint(pipeline.data.root)}
    if _active_run:
        found[TRACKING_KEY] = dict(_active_run)
    return found


def quiet_mlflow() -> None:
    """Keep MLflow's INFO lines (database migrations, run links) out of our output, and bound its HTTP retries:
    its default (7 retries with doubling back-off, 120 s timeouts) would stall a step for minutes when a server
    goes away. Values the user set in the environment win."""
    import logging

    os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "2")
    os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", "15")
    import mlflow  # noqa: F401 - its import sets its loggers to INFO: lower them after it

    for name in ("mlflow", "alembic"):
        logging.getLogger(name).setLevel(logging.WARNING)
    logging.getLogger("lightning.pytorch.loggers.mlflow").setLevel(logging.ERROR)  # "Experiment ... not found. Creating it."


def reachable(uri: str, timeout: float = 3.0) -> str | None:
    """None when the tracking store at `uri` answers; otherwise why not. Only HTTP servers are probed
    (their `/health` endpoint); local stores are files."""
    if not uri.startswith(("http://", "https://")):
        return None
    import urllib.error
    import urllib.request

    try:
        with urllib.request.urlopen(uri.rstrip("/") + "/health", timeout=timeout):
            return None
    except (urllib.error.URLError, OSError, ValueError) as exc:
        return str(getattr(exc, "reason", exc))


def attach_to_run(record: dict | None, metrics: dict, files: list, tags: dict, log=print,
                  chosen: str | None = None, checkpoint_folder: Path | None = None) -> bool:
    """Log `metrics`, `tags` and `files` ([(path, artifact folder)]) into the run `record` names; a warning, never
    an error, when the store or run cannot be reached (an eval or deploy must not fail for its bookkeeping).

    `record` comes from a checkpoint, i.e. from whoever wrote the file: a store is written to only when the
    user chose it in this invocation (`chosen`, the store their config/overrides resolve to, or
    MLFLOW_TRACKING_URI), or when it is a local store beside the checkpoint (`checkpoint_folder` or the one above, where
    `stack train` puts `mlruns.db`) and an MLflow store already. So a crafted or foreign model.pt can make eval or
    deploy neither send metrics to a server of its choosing (not even the reachability probe is sent) nor add
    tables to a database of the user's."""
    if not (isinstance(record, dict) and isinstance(record.get("run_id"), str) and isinstance(record.get("uri"), str)):
        return False
    uri = record["uri"]
    why = _unchosen_remote(uri, chosen) or _missing_store(uri) or _unchosen_local(uri, chosen, checkpoint_folder)
    if why is None and uri.startswith(SQLITE):
        why = store_problem(Path(uri[len(SQLITE):]))
    if why is None:
        why = reachable(uri)
    if why is None:
        try:
            _log_to_run(record, metrics, files, tags)
            return True
        except Exception as exc:  # noqa: BLE001 - any tracking failure is a warning here
            why = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}"
    log(f"warning: could not attach to MLflow run {record.get('run_id')} at {record.get('uri')} ({why}); "
        f"the results are on disk only.")
    return False


SQLITE = "sqlite:///"


def _unchosen_remote(uri: str, chosen: str | None) -> str | None:
    """Why a store other than a local SQLite file is not written to: nobody in this invocation chose it."""
    if uri.startswith(SQLITE):
        return None
    named = {_same_store(os.environ.get("MLFLOW_TRACKING_URI", "")), _same_store(chosen or "")} - {""}
    if _same_store(uri) in named:
        return None
    return (f"a remote store recorded in the checkpoint is only used when you choose it: give "
            f"train.tracking_uri={uri} (or set MLFLOW_TRACKING_URI) to log there")


def _unchosen_local(uri: str, chosen: str | None, checkpoint_folder: Path | None) -> str | None:
    """Why a local store the checkpoint records is not written to: the user did not name it, and it is not where
    `stack train` puts the store of this checkpoint (its folder or the one above)."""
    if not uri.startswith(SQLITE):
        return None
    store = Path(uri[len(SQLITE):]).resolve()
    if chosen and chosen.startswith(SQLITE) and Path(chosen[len(SQLITE):]).resolve() == store:
        return None
    if checkpoint_folder is not None:
        folder = Path(checkpoint_folder).resolve()
        if store.parent in (folder, folder.parent):
            return None
    return (f"a local store recorded in the checkpoint is only used beside the checkpoint or when you name it: give "
            f"train.tracking_uri={store} to log there")


def _same_store(uri: str) -> str:
    return uri.strip().rstrip("/")


def _missing_store(uri: str) -> str | None:
    """Why a local store a checkpoint names cannot be used: MLflow would create a database at any path a
    (moved, copied or crafted) checkpoint records, so only an existing store file is written to."""
    if uri.startswith(SQLITE) and not Path(uri[len(SQLITE):]).is_file():
        return f"its store file {uri[len(SQLITE):]} does not exist (moved or deleted?); no new store is made"
    return None


def store_problem(path: Path) -> str | None:
    """None when the SQLite file at `path` is an MLflow store that this MLflow opens without changing it (every
    table it expects there, the schema revision it writes); otherwise what it is. Read-only: nothing is created."""
    import sqlite3
    from contextlib import closing
    from urllib.request import pathname2url

    if not Path(path).is_file():
        return f"{path} is not an MLflow store (not a file)"
    try:
        with closing(sqlite3.connect(f"file:{pathname2url(str(Path(path).resolve()))}?mode=ro", uri=True)) as db:
            tables = {row[0] for row in db.execute("SELECT name FROM sqlite_master WHERE type='table'")}
            revision = db.execute("SELECT version_num FROM alembic_version").fetchone() \
                if "alembic_version" in tables else None
    except sqlite3.Error as exc:
        return f"{path} is not an MLflow store (not an SQLite database: {exc})"
    if not {"experiments", "runs"} <= tables or revision is None:
        return f"{path} is not an MLflow store (no MLflow tables in it)"
    expected, head = _mlflow_schema()
    if not expected <= tables or revision[0] != head:
        return (f"{path} is an MLflow store of another MLflow version (schema {revision[0]}, this MLflow writes "
                f"{head}); upgrade it with `mlflow db upgrade sqlite:///{path}` after a backup")
    return None


def _mlflow_schema() -> tuple[set, str]:
    """(the tables this MLflow expects in a store, the schema revision it writes)."""
    quiet_mlflow()
    from mlflow.store.db import utils

    return set(utils.Base.metadata.tables), utils._get_latest_schema_revision()


def metric_name(key: str) -> str:
    """`key` in the characters MLflow allows in a metric name ("AP_car@0.5m" -> "AP_car_at_0.5m")."""
    import re

    return re.sub(r"[^A-Za-z0-9_\-. :/]", "_", key.replace("@", "_at_"))


def _log_to_run(record: dict, metrics: dict, files: list, tags: dict) -> None:
    import math
    import time

    quiet_mlflow()
    from mlflow.entities import Metric, RunTag
    from mlflow.tracking import MlflowClient

    client = MlflowClient(record["uri"])
    client.get_run(record["run_id"])  # a deleted or unknown run fails here, before anything is logged
    now = int(time.time() * 1000)
    values = [Metric(metric_name(key), float(value), now, 0) for key, value in sorted(metrics.items())
              if isinstance(value, (int, float)) and math.isfinite(float(value))]
    for start in range(0, max(len(values), 1), 500):
        client.log_batch(record["run_id"], metrics=values[start:start + 500],
                         tags=[RunTag(k, str(v)) for k, v in tags.items()] if start == 0 else [])
    for path, folder in files:
        if Path(path).is_file():
            client.log_artifact(record["run_id"], str(path), folder)
