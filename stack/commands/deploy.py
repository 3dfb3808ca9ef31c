"""`stack deploy --target T CHECKPOINT`: a gated bundle for one deploy target.

Exports the network, quantizes it in the target's QDQ flavour on validation samples,
runs the per-head accuracy gate and the FPS gate (measured with ONNX Runtime on CPU
targets or TensorRT where importable, otherwise predicted by the latency model), and
writes `{export.out_dir}/{T}/` with the models, the resolved pipeline, report.md,
latency.png, gate.json and (TensorRT targets) build_engine.sh.
Exit 0: every gate passed; 1: a gate failed (report.md says which); 2: bad input.
"""

from __future__ import annotations

import argparse


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from stack.commands.export import CHECKPOINT_HELP

    parser.add_argument("--target", required=True, metavar="NAME",
                        help="deploy target: a file stem in configs/targets/ (e.g. orin, cpu, ci-cpu)")
    parser.usage = "stack deploy --target NAME [options] CHECKPOINT [key=value ...]"
    parser.epilog = CHECKPOINT_HELP


def run(args: argparse.Namespace) -> int:
    from stack.checkpoint import load_for_deploy
    from stack.commands.export import take_checkpoint
    from stack.config import load_target

    args.checkpoint = take_checkpoint(args)
    pipeline, state_dict, _ = load_for_deploy(args.checkpoint, args.config, args.overrides)
    load_target(args.target, pipeline)  # an unknown target is bad input before any work starts
    if args.print_config:
        from stack.config import pipeline_to_yaml

        print(pipeline_to_yaml(pipeline), end="")
    from stack.deploy.entrypoints import deploy_checkpoint

    result = deploy_checkpoint(pipeline, state_dict, args.checkpoint, args.target)
    return 0 if result["passed"] else 1
