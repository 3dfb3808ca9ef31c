"""`stack data make|inspect|convert`: render the world into shards, look at a shard, convert a dataset.

    stack data make    -c configs/pipeline.yaml -c configs/presets/tiny.yaml
    stack data inspect runs/tiny/data/train/frames-000000.tar --out sample.png [--sample 3]
    stack data convert --from nuscenes --source /data/nuscenes [--version v1.0-mini]
"""

from __future__ import annotations

import argparse

ACTIONS = ("make", "inspect", "convert")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    # The action and the shard are the leading words without "=" (the shared `key=value`
    # positional would otherwise swallow them); `run` takes them off the overrides.
    parser.usage = "stack data {make,inspect SHARD,convert} [-c FILE ...] [key=value ...] [options]"
    parser.epilog = "make: render shards; inspect SHARD: PNG mosaic of a sample; convert: another dataset to shards"
    parser.add_argument("--out", metavar="PNG", help="inspect: where to write the mosaic (default: next to the shard)")
    parser.add_argument("--sample", type=int, default=0, metavar="I", help="inspect: index of the sample in the shard")
    parser.add_argument("--from", dest="source_format", choices=("nuscenes",), help="convert: the source format")
    parser.add_argument("--source", metavar="DIR", help="convert: the source dataset folder")
    parser.add_argument("--version", default="v1.0-mini", help="convert: nuScenes version folder (default v1.0-mini)")


def _words(args: argparse.Namespace) -> list:
    """Take the leading words without '=' (action, shard) off `args.overrides`."""
    words = []
    while args.overrides and "=" not in args.overrides[0]:
        words.append(args.overrides.pop(0))
    return words


def run(args: argparse.Namespace) -> int:
    from stack.cli import load_pipeline_from_args
    from stack.errors import StackError

    words = _words(args)
    if not words or words[0] not in ACTIONS:
        found = words[0] if words else "nothing"
        raise StackError(f"expected an action ({', '.join(ACTIONS)}) after `stack data`, found {found!r}; "
                         "e.g. `stack data make -c configs/presets/tiny.yaml`")
    action, operands = words[0], words[1:]
    if len(operands) != (1 if action == "inspect" else 0):
        need = "one SHARD path" if action == "inspect" else "no further words"
        raise StackError(f"`stack data {action}` takes {need}, found {operands!r}")
    pipeline = load_pipeline_from_args(args)
    if action == "make":
        from stack.data.make import make_dataset

        manifest = make_dataset(pipeline)
        for split, shards in manifest["splits"].items():
            print(f"{split}: {sum(s['samples'] for s in shards)} samples in {len(shards)} shards")
        return 0
    if action == "inspect":
        from stack.data.inspect import inspect_shard

        print(inspect_shard(operands[0], args.sample, args.out))
        return 0
    from stack.data.convert import convert

    convert(pipeline, args.source_format, args.source, args.version)
    return 0
