"""`stack train`: fit the pipeline's network on its data (Lightning; DDP / FSDP2; local, SLURM or torchrun).

    stack train -c configs/pipeline.yaml -c configs/presets/tiny.yaml
    stack train ... train.devices=2 train.strategy=fsdp train.precision=bf16-mixed
    stack train ... train.resume=runs/tiny/train            # continue from its latest checkpoint
    stack train ... train.overwrite=true                    # start over in an out_dir that holds a run
    stack train ... train.launcher=slurm train.num_nodes=4 train.devices=8 --dry-run

Outputs under train.out_dir: checkpoints/ (resumable, atomic), model.pt (weights +
pipeline, for export), tensorboard/ and csv/ logs, pipeline.yaml; the MLflow run goes to
train.tracking_uri (default `mlruns.db` beside out_dir; `stack runs` lists the runs there). An out_dir that holds
a run is refused without train.resume or train.overwrite; Ctrl-C exits 130 naming the
last checkpoint.
"""

from __future__ import annotations

import argparse


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--dry-run", action="store_true",
                        help="print what would run (the sbatch script, the torchrun command, or the local training "
                             "command and what it would train), and do not run it")


def run(args: argparse.Namespace) -> int:
    from stack.cli import load_pipeline_from_args

    pipeline = load_pipeline_from_args(args)
    launcher = pipeline.train.launcher
    if launcher != "local" or args.dry_run:
        from stack.train.launch import local_dry_run, rank_command, run_torchrun, submit_slurm

        program = rank_command(args.config, args.overrides)
        if launcher == "slurm":
            return submit_slurm(pipeline, program, args.dry_run)
        if launcher == "torchrun":
            return run_torchrun(pipeline, program, args.dry_run)
        return local_dry_run(pipeline, program)
    from stack.train.fit import fit

    module, trainer, stats = fit(pipeline)
    if trainer.is_global_zero:
        _summary(pipeline, trainer, stats)
    return 0


def _summary(pipeline, trainer, stats) -> None:
    from pathlib import Path

    out = Path(pipeline.train.out_dir)
    last = stats.history[-1] if stats.history else {}
    speed = (f"{last['perf/samples_per_s']:.1f} samples/s, data wait {100 * last['perf/data_wait_share']:.0f}%"
             + (f", MFU {last.get('mfu_text') or format(last['perf/mfu'], '.1%')}" if "perf/mfu" in last else "")) if last else "no stats"
    print(f"trained {trainer.global_step} steps (epoch {trainer.current_epoch}); last window: {speed}")
    print(f"weights: {out / 'model.pt'}\ncheckpoints: {out / 'checkpoints'}\n"
          f"logs: tensorboard --logdir {out / 'tensorboard'}  |  {out / 'csv' / 'metrics.csv'}")
    from stack.train.tracking import SafeMLFlowLogger

    for logger in trainer.loggers:
        if isinstance(logger, SafeMLFlowLogger) and logger.failed is None:
            print(f"tracked: MLflow run {logger.run_id} in {logger._tracking_uri} (`stack runs` lists it; "
                  f"mlflow ui --backend-store-uri {logger._tracking_uri})")
