"""Experiment tracking: every `stack train` run logged to MLflow, findable and comparable later.

MLflow through Lightning's `MLFlowLogger`, beside the TensorBoard and CSV loggers, on rank 0
only (every other rank's metrics reach it through Lightning's reductions). What a run records:

- params: the resolved pipeline, flattened to dotted keys (`train.lr`, `model.bev.cell_size`);
- tags: `stack.pipeline_hash`, `stack.data_hash` and `stack.data_root` (the dataset fingerprint of
  `stack.lineage`), the git commit of the stack source (`mlflow.source.git.commit`; "unknown" outside a
  checkout, with `stack.git_dirty`), host, devices and precision, out_dir, and at the end the step count;
- metrics: every series the trainer logs (losses, gradient norm, samples/s, MFU, memory);
- artifacts: the pipeline YAML (model.pt's); `stack eval` and `stack deploy` add their reports to the
  same run later, found through the run record model.pt carries (`stack.lineage.TRACKING_KEY`).

The store (`train.tracking_uri`, `tracking_store_uri`): by default the SQLite file `mlruns.db` beside
`train.out_dir`, with artifacts in `mlartifacts/` beside it — nothing to start, and `mlflow ui
--backend-store-uri sqlite:///runs/tiny/mlruns.db` shows it. A server URI logs there instead.

Tracking never stops training: an unreachable server is found by one short probe before the run
starts, and any later failure (server gone, disk full) prints one warning and turns tracking off for
the rest of the run (`SafeMLFlowLogger`). A resumed run (`train.resume`) continues the MLflow run its
checkpoint names, when that run is in the same store.
"""

from __future__ import annotations

import dataclasses
import logging
import socket
import sys
from pathlib import Path

import lightning.pytorch as pl
from lightning.pytorch.loggers import MLFlowLogger

from stack.lineage import (DATASET_KEY, TRACKING_KEY, active_run, dataset_fingerprint, git_commit, quiet_mlflow,
                           reachable, set_active_run)
from stack.pipeline import TRACKING_OFF, Pipeline

LOCAL_STORE = "mlruns.db"
"""File name of the default SQLite store, beside train.out_dir."""
ARTIFACTS = "mlartifacts"
"""Folder of a local store's artifacts, beside its database."""

log = logging.getLogger("stack.train")


def tracking_store_uri(train) -> str | None:
    """The MLflow store URI train.tracking_uri names (None: tracking off)."""
    value = train.tracking_uri.strip()
    if value.lower() in TRACKING_OFF:
        return None
    if not value:
        return f"sqlite:///{Path(train.out_dir).resolve().parent / LOCAL_STORE}"
    if "://" in value or value == "databricks":
        return value
    return f"sqlite:///{Path(value).resolve()}"


def chosen_store(pipeline, files: list, overrides: list) -> str | None:
    """The tracking store the user chose in this invocation of eval/deploy: the one their -c files or a
    train.tracking_uri override resolve to. With neither, the pipeline is the checkpoint's own, and a store it
    names was chosen by whoever wrote the checkpoint (stack.lineage.attach_to_run does not log to it if remote)."""
    named = any(str(word).split("=", 1)[0].strip() == "train.tracking_uri" for word in overrides or [])
    if pipeline is None or not (files or named):
        return None
    return tracking_store_uri(pipeline.train)


def check_store(pipeline: Pipeline) -> None:
    """Before anything is written: train.tracking_uri names a local store that does not exist yet (it is made) or
    is an MLflow store this MLflow writes as it is. MLflow would add its tables to any other SQLite file (a
    database of the user's, an empty file) or migrate an older store."""
    from stack.errors import StackError
    from stack.lineage import store_problem

    uri = tracking_store_uri(pipeline.train)
    path = local_store_path(uri) if uri else None
    if path is None or not (path.exists() or path.is_symlink()):
        return
    problem = store_problem(path)
    if problem:
        raise StackError(f"train.tracking_uri: {problem}; `stack train` logs only into an MLflow store or a new "
                         f"file. Name another file (train.tracking_uri=runs/mlruns.db), or train.tracking_uri=off")


def local_store_path(uri: str) -> Path | None:
    """The database file of a `sqlite:///` store, None for other stores."""
    return Path(uri[len("sqlite:///"):]) if uri.startswith("sqlite:///") else None


def flat_params(pipeline: Pipeline) -> dict[str, str]:
    """The resolved pipeline as {dotted key: value}; lists stay one value ("[a, b]"), as config overrides write them."""
    found: dict[str, str] = {}

    def walk(node, prefix: str) -> None:
        if isinstance(node, dict):
            for key, value in node.items():
                walk(value, f"{prefix}.{key}" if prefix else str(key))
        else:
            found[prefix] = str(node)

    walk(dataclasses.asdict(pipeline), "")
    return found


class SafeMLFlowLogger(MLFlowLogger):
    """MLFlowLogger whose failures warn once and stop tracking, never training (MLflow raises on a lost server)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.failed: str | None = None

    def _safely(self, call, *args):
        if self.failed is not None:
            return None
        try:
            return call(*args)
        except Exception as exc:  # noqa: BLE001 - a tracking failure of any kind must not stop training
            self.failed = f"{type(exc).__name__}: {(str(exc).splitlines() or [''])[0][:200]}"
            print(f"warning: MLflow tracking at {self._tracking_uri} failed ({self.failed}); training goes on, "
                  f"the rest of this run is logged to TensorBoard and CSV only.", file=sys.stderr, flush=True)
            return None

    def log_metrics(self, metrics, step=None) -> None:
        self._safely(super().log_metrics, metrics, step)

    def log_hyperparams(self, params) -> None:
        self._safely(super().log_hyperparams, params)

    def finalize(self, status: str = "success") -> None:
        self._safely(super().finalize, status)

    def log_text(self, text: str, name: str) -> None:
        self._safely(lambda: self.experiment.log_text(self.run_id, text, name))

    def set_tags(self, tags: dict) -> None:
        self._safely(lambda: [self.experiment.set_tag(self.run_id, k, str(v)) for k, v in tags.items()])


def start_tracking(pipeline: Pipeline, resume_state: dict | None = None) -> SafeMLFlowLogger | None:
    """The MLflow logger of this run on the process that starts it (None: tracking off, or the store is
    unreachable, said in a warning), with params, tags and the pipeline logged and the run made active
    (`stack.lineage.active_run`) so the checkpoints record it."""
    uri = tracking_store_uri(pipeline.train)
    set_active_run(None)
    if uri is None:
        return None
    why = reachable(uri)
    if why is not None:
        print(f"warning: MLflow tracking server {uri} is unreachable ({why}); training goes on without tracking "
              f"(TensorBoard and CSV logs as usual). Start the server, or set train.tracking_uri=off.",
              file=sys.stderr, flush=True)
        return None
    quiet_mlflow()
    continued = _resumed_run(resume_state, uri, pipeline.train.out_dir)
    earlier = (resume_state or {}).get(TRACKING_KEY)
    branch = {"stack.resumed_from": earlier["run_id"]} if isinstance(earlier, dict) and earlier.get("run_id") else {}
    logger = _open_logger(pipeline, uri, continued, branch)
    if logger is None or logger.failed:
        return None
    set_active_run({"uri": uri, "run_id": logger.run_id, "experiment": pipeline.name})
    if continued is None:
        from stack.config import pipeline_to_yaml

        logger.log_hyperparams(flat_params(pipeline))
        logger.log_text(pipeline_to_yaml(pipeline), "pipeline.yaml")
    return None if logger.failed else logger


def _open_logger(pipeline: Pipeline, uri: str, run_id: str | None, tags: dict) -> SafeMLFlowLogger | None:
    store = local_store_path(uri)
    try:
        if store is not None:
            store.parent.mkdir(parents=True, exist_ok=True)
        logger = SafeMLFlowLogger(
            experiment_name=pipeline.name, run_name=Path(pipeline.train.out_dir).name, tracking_uri=uri,
            tags={**run_tags(pipeline), **tags}, run_id=run_id,
            artifact_location=(store.parent / ARTIFACTS).as_uri() if store is not None else None)
    except Exception as exc:  # noqa: BLE001 - e.g. an unwritable folder, a database of another MLflow version
        print(f"warning: MLflow tracking store {uri} cannot be opened ({type(exc).__name__}: "
              f"{(str(exc).splitlines() or [''])[0][:200]}); training goes on without tracking.",
              file=sys.stderr, flush=True)
        return None
    logger._safely(lambda: logger.experiment)  # creates (or reopens) the run now, so its id goes into checkpoints
    return logger


def _resumed_run(state: dict | None, uri: str, out_dir: str) -> str | None:
    """The run id a resume checkpoint was tracked in, when that run is in this store and wrote this out_dir
    (a run resumed into another out_dir is a branch: it gets a run of its own)."""
    record = (state or {}).get(TRACKING_KEY)
    if not (isinstance(record, dict) and record.get("uri") == uri and isinstance(record.get("run_id"), str)):
        return None
    from mlflow.tracking import MlflowClient

    try:
        run = MlflowClient(uri).get_run(record["run_id"])
    except Exception:  # noqa: BLE001 - deleted or unknown: the resumed run starts a new MLflow run
        return None
    return record["run_id"] if run.data.tags.get("stack.out_dir") == str(Path(out_dir).resolve()) else None


def run_tags(pipeline: Pipeline) -> dict[str, str]:
    """The tags that make a run findable: pipeline and data hashes, code version, where and on what it ran."""
    from stack.config import pipeline_hash

    train = pipeline.train
    data = dataset_fingerprint(pipeline.data.root) or {}
    commit, dirty = git_commit()
    return {"stack.pipeline_hash": pipeline_hash(pipeline), "stack.data_hash": data.get("hash", "none"),
            "stack.data_root": data.get("root", str(Path(pipeline.data.root).resolve())),
            "mlflow.source.git.commit": commit, "stack.git_commit": commit, "stack.git_dirty": dirty,
            "stack.host": socket.gethostname(),
            "stack.devices": f"{train.num_nodes}x{train.devices} {train.accelerator} ({train.strategy})",
            "stack.precision": train.precision, "stack.out_dir": str(Path(train.out_dir).resolve())}


def finish_tracking(logger: SafeMLFlowLogger | None, trainer) -> None:
    """Record the step count the run reached (the `stack runs` table's steps column)."""
    if logger is not None and active_run():
        logger.set_tags({"stack.steps": trainer.global_step, "stack.epochs": trainer.current_epoch})


class LineageCallback(pl.Callback):
    """Puts the dataset fingerprint and the MLflow run record into every resumable checkpoint (model.pt gets
    them from `stack.checkpoint.model_file.save_model_checkpoint`), and tags the run with its step count at the end."""

    def __init__(self, pipeline: Pipeline, logger: SafeMLFlowLogger | None):
        self.dataset = dataset_fingerprint(pipeline.data.root)
        self.logger = logger

    def on_save_checkpoint(self, trainer, pl_module, checkpoint: dict) -> None:
        checkpoint[DATASET_KEY] = self.dataset
        run = active_run()
        if run:
            checkpoint[TRACKING_KEY] = run

    def on_train_end(self, trainer, pl_module) -> None:
        if trainer.is_global_zero:
            finish_tracking(self.logger, trainer)

    def teardown(self, trainer, pl_module, stage: str) -> None:
        set_active_run(None)  # model.pt is written; a later checkpoint in this process belongs to no run of ours
