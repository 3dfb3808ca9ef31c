"""`stack dagger CHECKPOINT`: the trained network drives, the privileged expert labels the states it visits,
and the network is fine-tuned on them, for dagger.iterations rounds (DAgger; `stack.train.dagger`).

    stack dagger runs/tiny/train/model.pt -c configs/pipeline.yaml -c configs/presets/tiny.yaml
    stack dagger runs/tiny/train/model.pt ... dagger.iterations=5 dagger.episodes=56 dagger.overwrite=true

The student drives training episodes only (worlds never used by `stack drive`'s evaluation). Outputs under
dagger.out_dir: iteration-i/data (the labelled frames of iteration i, a dataset), iteration-i/train (its
fine-tuning run and model.pt), model.pt (the last), dagger.json, dagger.png. Judge the result on the held-out
episodes with `stack drive dagger.out_dir/model.pt`. dagger.overwrite=true deletes only those outputs of an
earlier run, never other files there. Exit 2, before the first episode is driven, for bad input (a checkpoint
without a planner, one for another network or inside the run overwrite would delete, a data.root without a
train split of frames shards of data.rig's cameras, an out_dir holding something else or under a file).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from stack.errors import StackError


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.usage = "stack dagger CHECKPOINT [-c FILE ...] [key=value ...]"


def run(args: argparse.Namespace) -> int:
    from stack.checkpoint.model_file import check_has_planner, load_model_checkpoint, pipeline_for_checkpoint
    from stack.deploy.network_policies import CheckpointPolicy
    from stack.train.dagger import run_dagger

    sources = [word for word in args.overrides if "=" not in word]
    args.overrides = [word for word in args.overrides if "=" in word]
    if len(sources) != 1:
        raise StackError(f"stack dagger needs one CHECKPOINT (stack train's model.pt), found {len(sources)}: "
                         f"{' '.join(sources) or 'none'}")
    source = sources[0]
    if not Path(source).is_file():
        raise StackError(f"{source}: no such checkpoint file; give the model.pt that `stack train` wrote")
    stored, state_dict, _ = load_model_checkpoint(source)
    check_has_planner(state_dict, source)
    pipeline = pipeline_for_checkpoint(stored, source, args.config, args.overrides)
    summary = run_dagger(pipeline, source, CheckpointPolicy)
    print(_table(summary))
    print(f"weights: {summary['model']}\nsummary: {Path(pipeline.dagger.out_dir) / 'dagger.json'} | plot: "
          f"{Path(pipeline.dagger.out_dir) / 'dagger.png'}\njudge it on held-out episodes: stack drive {summary['model']}")
    return 0


def _table(summary: dict) -> str:
    lines = ["| iteration | beta | frames | student DS | student PDMS | expert DS | expert PDMS | collision ended |",
             "|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for row in summary["iterations"]:
        lines.append(f"| {row['iteration']} | {row['beta']:.2f} | {row['frames']} | {row['driving_score']:.3f} | "
                     f"{row['pdms']:.3f} | {row['expert_driving_score']:.3f} | {row['expert_pdms']:.3f} | "
                     f"{row['ended']['collision']:.0%} |")
    return "\n".join(lines)
