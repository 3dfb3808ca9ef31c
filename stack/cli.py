"""The `stack` command line: `stack COMMAND [-c FILE ...] [key=value ...]`.

Every command takes the same configuration arguments (config files, `key=value`
overrides, `--print-config`) and nothing per field: the pipeline schema is the
interface. Command modules are imported only when their command runs, so
`stack config` stays instant and never loads a deep-learning framework.

Each command lives in `stack/commands/<name>.py` and provides
`add_arguments(parser)` (command-specific arguments only) and `run(args) -> int`.
"""

from __future__ import annotations

import argparse
import gc
import importlib
import sys

from stack.errors import StackError

COMMANDS = {
    "config": "validate the pipeline and print it resolved",
    "bench": "side-by-side speed measurements (ops, data, model, infer); --record them, compare records (compare)",
    "data": "render the driving world into shards (make), draw a sample (inspect), convert a dataset (convert)",
    "train": "train the network (Lightning: DDP/FSDP2, bf16, resumable checkpoints; local, SLURM or torchrun)",
    "profile": "profile a few training steps: Chrome trace with NVTX ranges, top ops, data-wait share",
    "eval": "evaluate a trained checkpoint: every head against its trivial baseline on the validation split",
    "export": "export a checkpoint to ONNX (standard ops, metadata) and check it against PyTorch",
    "deploy": "quantize, gate (accuracy per head, FPS measured or predicted) and bundle for a target",
    "dagger": "closed-loop fine-tuning: the network drives training episodes, the expert labels them (DAgger)",
    "drive": "closed loop: a checkpoint or deployed bundle drives held-out scenarios beside the baselines",
    "reference": "the pinned reference network: replay it on its frames, pin a network with its card, reproduce it",
    "runs": "tracked runs (MLflow) side by side: metrics, hashes, eval and deploy verdicts; `compare A B`",
}
"""Command name -> one-line help. Add a command here only when it works end to end."""


def add_config_arguments(parser: argparse.ArgumentParser) -> None:
    """The configuration arguments shared by every command."""
    parser.add_argument(
        "-c", "--config", action="append", default=[], metavar="FILE",
        help="pipeline YAML, merged in order onto the schema (repeatable; default: configs/pipeline.yaml)",
    )
    parser.add_argument("overrides", nargs="*", metavar="key=value", help="override any config key, e.g. train.max_epochs=5")
    parser.add_argument("--print-config", action="store_true", help="print the resolved pipeline before running")


def load_pipeline_from_args(args: argparse.Namespace):
    """The validated pipeline for this invocation (printed first with --print-config)."""
    from stack.config import load_pipeline, pipeline_to_yaml

    pipeline = load_pipeline(args.config, args.overrides)
    if args.print_config:
        print(pipeline_to_yaml(pipeline), end="", flush=True)
    return pipeline


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="stack",
        description="End-to-end autonomy stack: rendered data -> multi-task BEV model -> quantized real-time engines.",
    )
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name, help_text in COMMANDS.items():
        sub = subparsers.add_parser(name, help=help_text, description=help_text)
        # The command's own arguments first: a positional of its own (`stack bench NAME`) then comes before the
        # shared `key=value` words, so `stack bench ops data.batch_size=2` and `stack bench compare A B` parse.
        _command_module(name).add_arguments(sub)
        add_config_arguments(sub)
    return parser


def _command_module(name: str):
    return importlib.import_module(f"stack.commands.{name}")


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    # parse_known_args + re-appending keeps `key=value` words that follow options
    # (`stack data make -c FILE key=value`): argparse alone fills the overrides positional once.
    args, extra = parser.parse_known_args(argv)
    flags = [word for word in extra if word.startswith("-")]
    if flags:
        parser.error(f"unrecognized arguments: {' '.join(flags)}")
    args.overrides = list(args.overrides) + extra
    try:
        return int(_command_module(args.command).run(args) or 0)
    except StackError as exc:
        print(f"stack {args.command}: {exc.label}: {exc}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        print(f"stack {args.command}: interrupted", file=sys.stderr)
        return 130


def entry() -> None:
    """The `stack` command (and `python -m stack`)."""
    exit_without_final_gc(main())


def exit_without_final_gc(code: int) -> None:
    """Exit with `code` without the interpreter's final garbage collections walking every object that torch and
    the command made, ~1 s of each exit on our 2-core CPUs (`stack data make` of 3 tiny scenes: 0.85x the wall
    time, AVX2 EPYC). `gc.freeze` moves those objects where the collector does not look
    (docs.python.org/3/library/gc.html#gc.freeze); reference counting still frees them and atexit handlers still
    run. For a process's last step only: `main` called in a process that goes on (tests) is left as it was."""
    gc.freeze()
    sys.exit(code)


if __name__ == "__main__":
    entry()
