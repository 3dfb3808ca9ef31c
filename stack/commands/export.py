"""`stack export CHECKPOINT`: the trained network as one ONNX file, checked against PyTorch.

Writes `{export.out_dir}/model.onnx` (standard ONNX ops only, named outputs, metadata:
pipeline hash, classes, output layout, rig, input normalisation) and the resolved
pipeline beside it; prints the operators with TensorRT's verdict and the ONNX Runtime vs
PyTorch error per output. `--calibration FILE` bakes a vehicle's camera calibration into the
BEV pooling instead of the pipeline's nominal rig (see `stack.deploy.calibration`); it is written
beside the model as calibration.yaml. export.out_dir must be new, empty, or stack's own (a previous
export, deploy bundles): a folder of other files is refused before anything is written there. Exit 0
when parity holds, 1 when an output differs beyond its tolerance, 2 on bad input (including validation
samples recorded with another calibration).
"""

from __future__ import annotations

import argparse


CHECKPOINT_HELP = ("CHECKPOINT: the model.pt or a checkpoints/step-*.ckpt folder `stack train` wrote, given before or "
                   "among the key=value overrides (the first word without '=').")
CALIBRATION_HELP = ("camera calibration (YAML/JSON, as `stack data calibration` writes) to bake into the network; "
                    "default: the pipeline's nominal data.rig. The validation samples must have been recorded with it.")


def add_calibration_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--calibration", metavar="FILE", help=CALIBRATION_HELP)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    # CHECKPOINT arrives through the shared `overrides` positional (a second positional
    # would be swallowed by it); `take_checkpoint` takes it off.
    add_calibration_argument(parser)
    parser.usage = f"stack {parser.prog.split()[-1]} [options] CHECKPOINT [key=value ...]"
    parser.epilog = CHECKPOINT_HELP


def take_checkpoint(args: argparse.Namespace) -> str:
    """The one word without '=' in the overrides: the checkpoint path."""
    from stack.errors import StackError

    words = [word for word in args.overrides if "=" not in word]
    if len(words) != 1:
        found = f"{len(words)} ({', '.join(map(repr, words))})" if words else "none"
        raise StackError(f"expected exactly one CHECKPOINT (a path without '='), found {found}. "
                         f"Example: stack export runs/tiny/train/last.ckpt -c configs/pipeline.yaml ...")
    args.overrides = [word for word in args.overrides if "=" in word]
    return words[0]


def run(args: argparse.Namespace) -> int:
    from stack.checkpoint.model_file import load_for_deploy
    from stack.deploy.entrypoints import export_checkpoint

    args.checkpoint = take_checkpoint(args)
    pipeline, state_dict, _ = load_for_deploy(args.checkpoint, args.config, args.overrides)
    if args.print_config:
        from stack.config import pipeline_to_yaml

        print(pipeline_to_yaml(pipeline), end="")
    summary = export_checkpoint(pipeline, state_dict, args.checkpoint, calibration_file=args.calibration)
    print("operators: " + ", ".join(f"{op} x{n}" for op, n in summary["ops"].items()))
    problems = summary["tensorrt_problems"]
    print("TensorRT 8.6/10.3 import: " + ("every operator native" if not problems else "; ".join(problems)))
    print(f"parity on {summary['samples']}:")
    for row in summary["parity"]:
        verdict = "ok" if row.passed else "FAIL"
        print(f"  {row.output:<18} max |ORT - torch| {row.max_abs_error:.2e}  tolerance {row.tolerance:.2e}  {verdict}")
    print(f"wrote {summary['path']}")
    return 0 if all(row.passed for row in summary["parity"]) else 1
