"""`stack eval CHECKPOINT`: each head of a trained network against its trivial baseline (validation split).

    stack eval runs/tiny/train/model.pt -c configs/pipeline.yaml -c configs/presets/tiny.yaml

CHECKPOINT is the `model.pt` that `stack train` writes (or a Lightning `.ckpt`); the
network is rebuilt from the pipeline it carries, and the data comes from the -c files and
overrides given (or, with none, from that pipeline with the overrides): a pipeline of another
network (model or rig) is refused up front, as export and deploy refuse it. Exit code 0 when every head clears its
bar, 1 when one does not. Detection is barred by mAP and by nuScenes' NDS; below the table, its five TP errors as
information (no bar; `stack.metrics.detection.summary` says which the network does not predict), and for a temporal
network what it reads from the previous key frame (`stack.metrics.motion`). Writes eval/metrics.json and eval/heads.png
beside it (eval-train/ for `--split train`: the same table on frames the network trained on, so a gap between the
two splits shows memorisation rather than learning).
"""

from __future__ import annotations

import argparse


def add_arguments(parser: argparse.ArgumentParser) -> None:
    # CHECKPOINT arrives through the shared `overrides` positional, as for `stack export`.
    parser.usage = "stack eval [options] CHECKPOINT [key=value ...]"
    parser.epilog = ("CHECKPOINT: the model.pt that `stack train` wrote, or one of its checkpoints/step-*.ckpt folders "
                     "(a run stopped before it ended).")
    parser.add_argument("--split", choices=("val", "train"), default="val",
                        help="eval: the split to score (default val; train, unaugmented, shows overfitting)")


def run(args: argparse.Namespace) -> int:
    from pathlib import Path

    from stack.commands.export import take_checkpoint
    from stack.metrics.bars import all_judged_pass, verdicts
    from stack.metrics.depth import summary as depth_summary
    from stack.metrics.detection import summary
    from stack.metrics.motion import summary as motion_summary
    from stack.train.evaluate import evaluate_checkpoint

    checkpoint = take_checkpoint(args)
    pipeline = _checked_pipeline(checkpoint, args)
    from stack.train.tracking import chosen_store

    metrics, out = evaluate_checkpoint(Path(checkpoint), pipeline, split=args.split,
                                       chosen_store=chosen_store(pipeline, args.config, args.overrides))
    rows = verdicts(metrics)
    print("| head | metric | model | baseline | bar | verdict |\n|---|---|---|---|---|---|")
    for row in rows:
        print(f"| {row.head} | {row.metric} | {row.value:.3f} | {row.baseline:.3f} | {row.bar} | {row.verdict} |")
    print(f"detection, nuScenes (mAP and NDS barred above; the TP errors as information): {summary(metrics)}")
    print(f"depth (information, no bar): {depth_summary(metrics)}")
    if "motion/moving_boxes" in metrics:
        print(f"temporal fusion (information, no bar): {motion_summary(metrics)}")
    for row in rows:
        if row.note:
            print(f"{row.head}: {row.value / row.baseline if row.baseline else float('nan'):.2f}x the baseline; "
                  f"{row.note}")
    print(f"{int(metrics['eval/batches'])} {args.split} batches in {metrics['eval/seconds']:.1f} s; "
          f"all metrics: {out / 'metrics.json'}; plot: {out / 'heads.png'}")
    return 0 if all_judged_pass(rows) else 1


def _checked_pipeline(checkpoint: str, args: argparse.Namespace):
    """The -c files + overrides, or the checkpoint's own pipeline + overrides when no file is given (as export
    and deploy do; None with neither); refused before any data is read when its model or rig differs from the
    checkpoint's (the data would not fit the network), or when the weights do not fit the network."""
    from stack.checkpoint.model_file import check_weights_fit, load_model_checkpoint, pipeline_for_checkpoint
    from stack.config import pipeline_to_yaml

    stored, state_dict, _ = load_model_checkpoint(checkpoint)
    pipeline = None
    if args.config or args.overrides:
        pipeline = pipeline_for_checkpoint(stored, checkpoint, args.config, args.overrides)
        if args.print_config:
            print(pipeline_to_yaml(pipeline), end="", flush=True)
    check_weights_fit(stored, state_dict, checkpoint)
    return pipeline
