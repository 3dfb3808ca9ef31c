"""`fit(pipeline)`: everything `stack train` does on each rank, in one place.

The Trainer is assembled from the pipeline alone: strategy (`stack.train.parallel`),
precision, loggers (TensorBoard + CSV under `train.out_dir`, MLflow per `train.tracking_uri`:
`stack.train.tracking`), the rich progress bar,
step statistics, atomic rolling checkpoints, and the resumable loaders. Lightning
starts the other local ranks itself (re-running the same command) or, under SLURM
and torchrun, picks up the ranks their launchers created.

Before Lightning starts, the out_dir and the resume checkpoint are checked
(`stack.train.checkpoints`): a fresh run never overwrites an earlier one unasked, and
a checkpoint that is unreadable or shaped for another network is refused. A resumed
run appends to the earlier CSV and TensorBoard logs (rows from the resumed step on are
replaced, since those steps run again). Ctrl-C stops with `TrainingInterrupted`
(exit 130) naming the last checkpoint; Lightning alone would exit 1 without a word.
"""

from __future__ import annotations

import csv
import logging
import os
import sys
import warnings
from pathlib import Path
from typing import Callable

import lightning.pytorch as pl
from lightning.pytorch.loggers import CSVLogger
from lightning.pytorch.loggers.csv_logs import ExperimentWriter
from lightning.pytorch.loggers.logger import rank_zero_experiment
from torch import nn

from stack.errors import StackError
from stack.pipeline import Pipeline
from stack.train.callbacks import LoaderPosition, StepStats
from stack.train.checkpoints import (LATEST, RollingCheckpoints, ShardedCheckpointIO, check_resume, out_dir_lock,
                                  prepare_out_dir, resolve_resume)
from stack.data.camera_records import check_rig
from stack.train.datamodule import LoaderFactory, PipelineData
from stack.train.module import TrainModule
from stack.train.parallel import accelerator_name, build_strategy
from stack.train.precision import for_this_hardware
from stack.train.preemption import RequeueOnSignal, resume_after_requeue, slurm_environment
from stack.train.tracking import LineageCallback, check_store, start_tracking


class TrainingInterrupted(StackError):
    """Ctrl-C (SIGINT) stopped training; the newest complete checkpoint is kept."""

    exit_code = 130


class _AppendingWriter(ExperimentWriter):
    """Lightning's CSV writer deletes an existing metrics.csv; this one appends to it, keeping its columns."""

    def _check_log_dir_exists(self) -> None:
        pass

    def __init__(self, log_dir: str):
        super().__init__(log_dir)
        if os.path.isfile(self.metrics_file_path):
            with open(self.metrics_file_path, newline="") as handle:
                self.metrics_keys = sorted(next(csv.reader(handle), []))


class AppendingCSVLogger(CSVLogger):
    """CSVLogger whose metrics.csv survives a resumed run (see `keep_rows_before`)."""

    @property
    @rank_zero_experiment
    def experiment(self) -> _AppendingWriter:
        if self._experiment is None:
            self._fs.makedirs(self.root_dir, exist_ok=True)
            self._experiment = _AppendingWriter(log_dir=self.log_dir)
        return self._experiment


def keep_rows_before(path: Path, step: int) -> None:
    """Drop the rows of `path` (metrics.csv) logged at `step` or later: a run resumed at `step` logs them again."""
    if not path.is_file():
        return
    with open(path, newline="") as handle:
        reader = csv.DictReader(handle)
        header, rows = reader.fieldnames or [], [row for row in reader if row.get("step", "") and int(row["step"]) < step]
    temp = path.with_name(f".{path.name}.partial")
    with open(temp, "w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=header)
        writer.writeheader()
        writer.writerows(rows)
    os.replace(temp, path)

def build_trainer(pipeline: Pipeline, progress: bool = True, validate: bool = True,
                  resume_step: int | None = None, tracker=None) -> tuple[pl.Trainer, StepStats]:
    """The Lightning Trainer for `pipeline.train`, and its step-statistics callback.

    `resume_step`: the global step a resumed run starts at; TensorBoard hides the earlier
    run's events from that step on (`purge_step`), which this run writes again. `tracker`: the MLflow
    logger (`stack.train.tracking.start_tracking`; rank 0 only, None elsewhere or when tracking is off)."""
    from lightning.pytorch.callbacks import RichProgressBar
    from lightning.pytorch.loggers import TensorBoardLogger

    train = pipeline.train
    out = Path(train.out_dir)
    # Without a terminal (SLURM logs, files) the progress bar is replaced by one log line per window.
    stats = StepStats(train.log_every_n_steps, train.peak_tflops, train.precision,
                      print_lines=progress and not sys.stdout.isatty(), count_comm=train.count_comm_bytes)
    callbacks = [LoaderPosition(), stats,
                 RollingCheckpoints(out, train.checkpoint_every_n_steps, train.keep_checkpoints),
                 LineageCallback(pipeline, tracker)]
    environment = slurm_environment(pipeline)  # explicit: Lightning's default would checkpoint mid-step on SIGUSR1
    if environment is not None and train.slurm_requeue:  # stop, checkpoint and requeue on SLURM's signal
        callbacks.append(RequeueOnSignal(next(c for c in callbacks if isinstance(c, RollingCheckpoints))))
    progress_bar = progress and sys.stdout.isatty()
    if progress_bar:
        callbacks.append(RichProgressBar(leave=True))
    trainer = pl.Trainer(
        accelerator=accelerator_name(train), devices=train.devices, num_nodes=train.num_nodes,
        strategy=build_strategy(train), precision=train.precision,
        max_epochs=train.max_epochs, max_steps=train.max_steps,
        logger=[TensorBoardLogger(out, name="tensorboard", version="", purge_step=resume_step),
                AppendingCSVLogger(out, name="csv", version="", flush_logs_every_n_steps=train.log_every_n_steps)]
        + ([tracker] if tracker is not None else []),
        callbacks=callbacks, enable_checkpointing=False, enable_progress_bar=progress_bar,
        log_every_n_steps=train.log_every_n_steps, use_distributed_sampler=False,
        num_sanity_val_steps=0, limit_val_batches=1.0 if validate else 0, deterministic=False,
        enable_model_summary=False, plugins=[ShardedCheckpointIO(), *([environment] if environment is not None else [])],  # resume reads checkpoint folders through DCP
    )
    return trainer, stats


def fit(pipeline: Pipeline, model: Callable[[Pipeline], nn.Module] | None = None,
        loaders: LoaderFactory | None = None, progress: bool = True) -> tuple[TrainModule, pl.Trainer, StepStats]:
    """Train the network `model(pipeline)` builds (default: `stack.models.build_model`) on `loaders`
    (default: `stack.data`). The network is built after seeding, so its initial weights follow train.seed."""
    pipeline = for_this_hardware(pipeline)
    pipeline = resume_after_requeue(pipeline)  # a requeued SLURM job continues from its own latest checkpoint
    first_rank = _launching_rank_zero()
    resume = resolve_resume(pipeline.train.resume) if pipeline.train.resume else None  # a missing one is named first
    if loaders is None:  # the dataset's cameras must be the ones the network is built for, before anything starts
        check_rig(pipeline.data.rig, pipeline.data.root, "train", "it would train on")
    if first_rank:
        check_store(pipeline)
    with out_dir_lock(pipeline, first_rank):
        prepare_out_dir(pipeline, first_rank)
        return _fit_in_out_dir(pipeline, model, loaders, progress, first_rank, resume)


def _fit_in_out_dir(pipeline: Pipeline, model, loaders, progress: bool, first_rank: bool, resume):
    """`fit` once train.out_dir is this run's (locked and prepared)."""
    _quiet_known_warnings()
    pl.seed_everything(pipeline.train.seed, workers=True, verbose=False)
    module = TrainModule(pipeline, model(pipeline) if model is not None else None)
    resume_state = check_resume(resume, pipeline, module.model) if resume else None
    resume_step = int(resume_state["global_step"]) if resume_state else None
    if resume_step is not None and first_rank:
        keep_rows_before(Path(pipeline.train.out_dir) / "csv" / "metrics.csv", resume_step)
    tracker = start_tracking(pipeline, resume_state) if first_rank else None  # MLflow: the launching rank only
    trainer, stats = build_trainer(pipeline, progress=progress, validate=True, resume_step=resume_step,
                                   tracker=tracker)
    _write_pipeline(pipeline, trainer)
    try:
        trainer.fit(module, datamodule=PipelineData(pipeline, loaders), ckpt_path=str(resume) if resume else None,
                    weights_only=True)  # never unpickle code from a checkpoint (check_resume read it the same way)
    except SystemExit as exc:
        if trainer.interrupted:  # Lightning turns KeyboardInterrupt into exit(1) after its teardown
            raise TrainingInterrupted(_interrupted_message(pipeline, module)) from exc
        raise
    if trainer.interrupted:
        raise TrainingInterrupted(_interrupted_message(pipeline, module))
    if resume_step is not None and trainer.global_step == resume_step:
        _write_weights_of_a_finished_checkpoint(trainer, module)
    return module, trainer, stats


def _write_weights_of_a_finished_checkpoint(trainer: pl.Trainer, module: TrainModule) -> None:
    """model.pt from a resumed checkpoint that had already reached train.max_steps (or max_epochs): Lightning restores
    its weights, then skips the fit loop and with it `on_train_end`, which writes model.pt. A run stopped after its
    last checkpoint but before model.pt (a time limit, a crash) is finished this way, as the CLI says it is."""
    rolling = next(c for c in trainer.callbacks if isinstance(c, RollingCheckpoints))
    rolling.write_model_weights(trainer, module)


def _launching_rank_zero() -> bool:
    """True in the process a user started (not in the ranks Lightning, SLURM or torchrun start beside it)."""
    return all(os.environ.get(name, "0") == "0" for name in ("RANK", "LOCAL_RANK", "SLURM_PROCID", "NODE_RANK"))


def _interrupted_message(pipeline: Pipeline, module: TrainModule) -> str:
    out = Path(pipeline.train.out_dir)
    last = module.last_good_checkpoint
    if last is None and (out / "checkpoints" / LATEST).is_file():
        last = str(out / "checkpoints" / (out / "checkpoints" / LATEST).read_text().strip())
    if last is None:
        return "interrupted before the first checkpoint; nothing to resume from (start again)"
    return f"interrupted; last checkpoint {last}. Continue with train.resume={out}"


def _write_pipeline(pipeline: Pipeline, trainer: pl.Trainer) -> None:
    from stack.config import pipeline_to_yaml

    if trainer.is_global_zero:
        out = Path(pipeline.train.out_dir)
        out.mkdir(parents=True, exist_ok=True)
        (out / "pipeline.yaml").write_text(pipeline_to_yaml(pipeline))


def _quiet_known_warnings() -> None:
    """Silence Lightning notes that do not apply (our loaders shard by rank themselves)."""
    for pattern in (".*does not have many workers.*", ".*`IterableDataset` has `__len__`.*",
                    ".*ModelParallelStrategy.*experimental.*", ".*sync_dist=True.*", ".*LeafSpec.*",
                    ".*`srun` command is available.*", ".*overridden `transfer_batch_to_device`.*"):
        warnings.filterwarnings("ignore", message=pattern)
    logging.getLogger("lightning.pytorch.utilities.rank_zero").setLevel(logging.WARNING)
