"""`stack config`: validate the pipeline and print it resolved, or describe its keys."""

from __future__ import annotations

import argparse

from stack.pipeline import SCHEMA_VERSION


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--describe", nargs="?", const="", default=None, metavar="KEY",
        help="list the schema's keys (under KEY) with type, default and meaning, instead of the resolved pipeline",
    )


def run(args: argparse.Namespace) -> int:
    from stack.cli import load_pipeline_from_args
    from stack.config import describe, pipeline_to_yaml, yaml_hash

    if args.describe is not None:
        print(describe(args.describe))
        return 0
    pipeline = load_pipeline_from_args(args)
    if not args.print_config:
        text = pipeline_to_yaml(pipeline)
        print(f"# pipeline {pipeline.name} (schema {SCHEMA_VERSION}, sha256 {yaml_hash(text)})")
        print(text, end="")
    return 0
