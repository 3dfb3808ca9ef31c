"""`stack bench NAME`: side-by-side speed measurements, written for BENCHMARKS.md.

Each benchmark is a function `run(pipeline, args) -> int` in the stage that owns
the code it measures; BENCHMARKS below maps its name to "module:function" so that
only the chosen benchmark's stage is imported. Timings live here, never in tests.
"""

from __future__ import annotations

import argparse
import importlib

BENCHMARKS: dict[str, str] = {
    "model": "stack.models.bench:run",
    "ops": "stack.ops.bench:run",
    "data": "stack.data.bench:run",
    "train-step": "stack.train.bench:run_step",
    "train-memory": "stack.train.bench:run_memory",
    "infer": "stack.deploy.bench:infer",
    "latency": "stack.deploy.bench:latency",
    "drive": "stack.deploy.bench:drive",
    "checkpoint": "stack.train.checkpoint_bench:run",
}
"""Benchmark name -> "module:function". Add an entry when the benchmark works."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("name", choices=sorted(BENCHMARKS), help="which benchmark to run")


def run(args: argparse.Namespace) -> int:
    from stack.cli import load_pipeline_from_args

    pipeline = load_pipeline_from_args(args)
    module_name, function_name = BENCHMARKS[args.name].split(":")
    return int(getattr(importlib.import_module(module_name), function_name)(pipeline, args) or 0)
