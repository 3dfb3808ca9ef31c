"""`stack deploy --target T CHECKPOINT`: a gated bundle for one deploy target.

Exports the network, quantizes it in the target's QDQ flavour on validation samples,
runs the per-head accuracy gate and the FPS gate (measured with ONNX Runtime on CPU
targets or TensorRT where importable, otherwise predicted by the latency model), and
writes `{export.out_dir}/{T}/` with the models, the resolved pipeline, report.md,
latency.png, gate.json, calibration.yaml and (TensorRT targets) build_engine.sh.
`--calibration FILE` builds the bundle for that camera calibration (one bundle per vehicle;
default the pipeline's nominal data.rig); validation samples recorded with another are refused.
Every bundle is first judged for quality (`stack.deploy.gates.quality`): the fp32 network must clear
`stack eval`'s head bars and beat the blind policies in closed loop; `--allow-below-bar` builds a bundle
below that bar for experiments, marked NOT FOR DEPLOYMENT.
Exit 0: every gate passed (with --allow-below-bar: every gate but quality); 1: a gate failed (report.md
says which); 2: bad input.
"""

from __future__ import annotations

import argparse


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from stack.commands.export import CHECKPOINT_HELP, add_calibration_argument

    add_calibration_argument(parser)
    parser.add_argument("--target", metavar="NAME",
                        help="deploy target: a file stem in configs/targets/ (e.g. orin, cpu, ci-cpu)")
    parser.add_argument("--allow-below-bar", action="store_true",
                        help="build the bundle even when the network is below the quality bar (stack eval's head bars, "
                             "beating the blind policies in closed loop): for experiments; the bundle is marked NOT "
                             "FOR DEPLOYMENT and the runtime refuses it unless asked (exit 0 when the other gates pass)")
    parser.add_argument("--verify", metavar="BUNDLE",
                        help="check an existing bundle instead of building one: every file must be the one its "
                             "gate.json vouches for (exit 0: intact and passed; 1: changed files or a failed gate)")
    parser.usage = "stack deploy --target NAME [options] CHECKPOINT [key=value ...]  |  stack deploy --verify BUNDLE"
    parser.epilog = CHECKPOINT_HELP


def run(args: argparse.Namespace) -> int:
    if args.verify:
        return verify(args.verify)
    if not args.target:
        from stack.errors import StackError

        raise StackError("stack deploy needs --target NAME (a file stem in configs/targets/, e.g. orin) and a "
                         "checkpoint, or --verify BUNDLE to check a bundle that exists.")
    from stack.checkpoint.model_file import load_for_deploy
    from stack.commands.export import take_checkpoint
    from stack.config import check_target_name, load_target

    check_target_name(args.target, "--target")  # it names a folder: refused before any file is read
    args.checkpoint = take_checkpoint(args)
    pipeline, state_dict, _ = load_for_deploy(args.checkpoint, args.config, args.overrides)
    load_target(args.target, pipeline)  # an unknown target is bad input before any work starts
    if args.print_config:
        from stack.config import pipeline_to_yaml

        print(pipeline_to_yaml(pipeline), end="")
    from stack.deploy.entrypoints import deploy_checkpoint
    from stack.train.tracking import chosen_store

    result = deploy_checkpoint(pipeline, state_dict, args.checkpoint, args.target, calibration_file=args.calibration,
                               chosen_store=chosen_store(pipeline, args.config, args.overrides),
                               allow_below_bar=args.allow_below_bar)
    return 0 if result["passed"] else 1


def verify(bundle: str) -> int:
    """`stack deploy --verify BUNDLE`: 0 when every file matches gate.json and the bundle is for deployment (every
    gate passed, quality included), else 1."""
    from stack.deploy.bundle import BundleMismatch, verify_bundle
    from stack.safe_values import escaped

    def show(text) -> None:  # gate.json's text and the bundle's file names are the user's: printed escaped
        print("\n".join(escaped(line, limit=2000) for line in str(text).splitlines()))

    try:
        gate = verify_bundle(bundle)
    except BundleMismatch as exc:
        show(f"stack deploy --verify: {exc}")
        return 1
    from stack.deploy.report import verdict_line

    show(f"{bundle}: {len(gate['files'])} files match gate.json; the gate verdict for target "
         f"{gate.get('target', '?')} is {verdict_line(gate)} (checkpoint {gate.get('checkpoint', '?')})")
    for reason in gate.get("failures", []) + gate.get("below_bar", []):
        show(f"  {reason}")
    return 0 if gate["for_deployment"] else 1
