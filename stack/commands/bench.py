"""`stack bench NAME`: side-by-side speed measurements (for a dated docs/log entry, then docs/results); `stack bench compare`.

`BENCHMARKS` below is the one list of benches: the CLI reads it and nothing else lists them. Each entry names
a function `(pipeline, args) -> int` beside the code it times, in that stage's `bench` or `*_bench` module (as
torchtitan and timm keep theirs), imported only when chosen; a bench that times stages composed (`drive`: sim's loop with
deploy's network policies) is wired by the command module that composes them for the real command, since a
stage cannot import the one above it. `benchmarks/` holds bench-only baselines and one-off lab scripts, not
benches, so none is listed here. Timings live in benches, never in tests.

A benchmark adds every figure it prints, with its samples, to `args.figures` (a
`stack.benchrecord.FigureLog`); `--record [PATH]` writes them into a JSON record
(default: a new file in runs/bench-history/). `stack bench compare` sets two records,
or a record and the history, side by side (`stack.benchrecord.comparison`).
"""

from __future__ import annotations

import argparse
import importlib
from pathlib import Path

from stack.benchrecord.records import DEFAULT_HISTORY

BENCHMARKS: dict[str, str] = {
    "model": "stack.models.bench:run",
    "ops": "stack.ops.bench:run",
    "ops-cuda": "stack.ops.bev_pool_cuda_bench:run",
    "data": "stack.data.bench:run",
    "train-step": "stack.train.bench:run_step",
    "train-step-cuda": "stack.train.step_cuda_bench:run_step_cuda",
    "train-memory": "stack.train.bench:run_memory",
    "infer": "stack.deploy.bench:infer",
    "latency": "stack.deploy.bench:latency",
    "fps-bar": "stack.deploy.bench:fps_bar",
    "drive": "stack.commands.drive:bench",
    "checkpoint": "stack.train.checkpoint_bench:run",
    "instructions": "stack.instructions.bench:run",
}
"""Benchmark name -> "module:function" (the registry). Add an entry when the benchmark works."""
COMPARE = "compare"
INSTRUCTIONS = "instructions"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.usage = ("stack bench NAME [-c FILE ...] [key=value ...] [--record [PATH]]  |  "
                    "stack bench drive [BUNDLE ...] [-c FILE ...] [key=value ...]  |  "
                    "stack bench instructions [--check | --update-baseline]  |  "
                    "stack bench compare BASELINE.json CANDIDATE.json  |  stack bench compare [RECORD.json] --history [DIR]")
    parser.add_argument("name", choices=sorted(BENCHMARKS) + [COMPARE],
                        help="which benchmark to run, or `compare` to set records side by side")
    parser.add_argument("--record", nargs="?", const=str(DEFAULT_HISTORY), metavar="PATH",
                        help=f"write the figures with their samples as a JSON record: into a new file in the folder "
                             f"PATH (default {DEFAULT_HISTORY}), or to PATH when it ends in .json")
    parser.add_argument("--history", nargs="?", const=str(DEFAULT_HISTORY), metavar="DIR",
                        help=f"compare: judge a record (default: the newest in DIR) against the records before it in "
                             f"DIR (default {DEFAULT_HISTORY}), name the commits where figures changed, plot trends")
    parser.add_argument("--check", action="store_true",
                        help="instructions: exit 1 when a count grew past its baseline's limit or this ISA level has "
                             "no baseline (make perf)")
    parser.add_argument("--update-baseline", action="store_true",
                        help="instructions: write the counts as this ISA level's baseline in benchmarks/instructions/")


def run(args: argparse.Namespace) -> int:
    from stack.errors import StackError

    if (args.check or args.update_baseline) and args.name != INSTRUCTIONS:
        raise StackError(f"--check and --update-baseline belong to `stack bench {INSTRUCTIONS}` (instruction counts "
                         f"against a stored baseline); `stack bench {args.name}` measures times: compare its "
                         f"--record with `stack bench compare`")
    if args.check and args.update_baseline:
        raise StackError("--check judges against the stored baseline and --update-baseline replaces it: give one")
    if args.name == COMPARE:
        return _compare(args)
    if args.history is not None:
        raise StackError("--history belongs to `stack bench compare`; to record this run use --record [PATH]")
    return _bench(args)


def _bench(args: argparse.Namespace) -> int:
    from stack.benchrecord import FigureLog
    from stack.benchrecord.load import LoadMeter
    from stack.benchrecord.records import build_record, check_destination, write_record
    from stack.cli import load_pipeline_from_args

    destination = None if args.record is None else Path(args.record)
    if destination is not None:
        check_destination(destination)  # before minutes of measuring, not after
    _take_bundles(args)
    pipeline = load_pipeline_from_args(args)
    args.figures = FigureLog()
    meter = LoadMeter()
    module_name, function_name = BENCHMARKS[args.name].split(":")
    code = int(getattr(importlib.import_module(module_name), function_name)(pipeline, args) or 0)
    if destination is not None:
        path = write_record(build_record(args.name, args, pipeline, args.figures, code, meter.finish()), destination)
        print(f"recorded {len(args.figures.figures)} figures with their samples: {path}")
    return code


def _take_bundles(args: argparse.Namespace) -> None:
    """`stack bench drive BUNDLE ...`: the words that are not key=value are deploy bundle folders to drive beside the
    checkpoint (`args.bundles`); no other benchmark takes such words."""
    from stack.errors import StackError

    words = [word for word in args.overrides if "=" not in word]
    if words and args.name != "drive":
        raise StackError(f"`stack bench {args.name}` takes key=value overrides; {words[0]!r} is not one (deploy bundle "
                         f"folders are for `stack bench drive BUNDLE ...`)")
    args.bundles, args.overrides = words, [word for word in args.overrides if "=" in word]


def _compare(args: argparse.Namespace) -> int:
    from stack.benchrecord.comparison import USAGE, run_compare
    from stack.errors import StackError

    settings = [word for word in args.overrides if "=" in word]
    if args.config or settings or args.record is not None:
        given = " ".join([*(f"-c {path}" for path in args.config), *settings,
                          *([f"--record {args.record}"] if args.record is not None else [])])
        raise StackError(f"stack bench compare reads records and runs nothing, so it takes no {given!r}; {USAGE}")
    return run_compare(list(args.overrides), args.history)
