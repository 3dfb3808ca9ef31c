"""`fit(pipeline)`: everything `stack train` does on each rank, in one place.

The Trainer is assembled from the pipeline alone: strategy (`stack.train.parallel`),
precision, loggers (TensorBoard + CSV under `train.out_dir`), the rich progress bar,
step statistics, atomic rolling checkpoints, and the resumable loaders. Lightning
starts the other local ranks itself (re-running the same command) or, under SLURM
and torchrun, picks up the ranks their launchers created.
"""

from __future__ import annotations

import logging
import sys
import warnings
from pathlib import Path
from typing import Callable

import lightning.pytorch as pl
from torch import nn

from stack.pipeline import Pipeline
from stack.train.callbacks import LoaderPosition, StepStats
from stack.train.checkpoints import RollingCheckpoints, resolve_resume
from stack.train.data import LoaderFactory, PipelineData
from stack.train.module import TrainModule
from stack.train.parallel import accelerator_name, build_strategy
from stack.train.precision import for_this_hardware

def build_trainer(pipeline: Pipeline, progress: bool = True, validate: bool = True) -> tuple[pl.Trainer, StepStats]:
    """The Lightning Trainer for `pipeline.train`, and its step-statistics callback."""
    from lightning.pytorch.callbacks import RichProgressBar
    from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger

    train = pipeline.train
    out = Path(train.out_dir)
    # Without a terminal (SLURM logs, files) the progress bar is replaced by one log line per window.
    stats = StepStats(train.log_every_n_steps, train.peak_tflops, train.precision,
                      print_lines=progress and not sys.stdout.isatty())
    callbacks = [LoaderPosition(), stats,
                 RollingCheckpoints(out, train.checkpoint_every_n_steps, train.keep_checkpoints)]
    progress_bar = progress and sys.stdout.isatty()
    if progress_bar:
        callbacks.append(RichProgressBar(leave=True))
    trainer = pl.Trainer(
        accelerator=accelerator_name(train), devices=train.devices, num_nodes=train.num_nodes,
        strategy=build_strategy(train), precision=train.precision,
        max_epochs=train.max_epochs, max_steps=train.max_steps,
        logger=[TensorBoardLogger(out, name="tensorboard", version=""), CSVLogger(out, name="csv", version="",
                                                                             flush_logs_every_n_steps=train.log_every_n_steps)],
        callbacks=callbacks, enable_checkpointing=False, enable_progress_bar=progress_bar,
        log_every_n_steps=train.log_every_n_steps, use_distributed_sampler=False,
        num_sanity_val_steps=0, limit_val_batches=1.0 if validate else 0, deterministic=False,
        enable_model_summary=False,
    )
    return trainer, stats


def fit(pipeline: Pipeline, model: Callable[[Pipeline], nn.Module] | None = None,
        loaders: LoaderFactory | None = None, progress: bool = True) -> tuple[TrainModule, pl.Trainer, StepStats]:
    """Train the network `model(pipeline)` builds (default: `stack.models.build_model`) on `loaders`
    (default: `stack.data`). The network is built after seeding, so its initial weights follow train.seed."""
    pipeline = for_this_hardware(pipeline)
    resume = str(resolve_resume(pipeline.train.resume)) if pipeline.train.resume else None
    _quiet_known_warnings()
    pl.seed_everything(pipeline.train.seed, workers=True, verbose=False)
    module = TrainModule(pipeline, model(pipeline) if model is not None else None)
    trainer, stats = build_trainer(pipeline, progress=progress, validate=True)
    _write_pipeline(pipeline, trainer)
    trainer.fit(module, datamodule=PipelineData(pipeline, loaders), ckpt_path=resume)
    return module, trainer, stats


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
