"""`stack data make|inspect|convert|calibration`: render the world into shards, look at a shard, convert a
dataset, write the camera calibration a dataset was recorded with.

    stack data make    -c configs/pipeline.yaml -c configs/presets/tiny.yaml
    stack data inspect runs/tiny/data/train/frames-000000.tar --out sample.png [--sample 3]
    stack data convert --from nuscenes --source /data/nuscenes [--version v1.0-mini]
    stack data calibration runs/nuscenes/data --out vehicle.yaml [--sample I]

`calibration` without --sample requires every sample to share one calibration (a bundle is
built for one, `stack deploy --calibration vehicle.yaml`); --sample I takes sample I's.
"""

from __future__ import annotations

import argparse

ACTIONS = ("make", "inspect", "convert", "calibration")
TAKES_PATH = ("inspect", "calibration")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    # The action and the shard are the leading words without "=" (the shared `key=value`
    # positional would otherwise swallow them); `run` takes them off the overrides.
    parser.usage = ("stack data {make,inspect SHARD,convert,calibration DATA_ROOT_OR_SHARD} [-c FILE ...] "
                    "[key=value ...] [options]")
    parser.epilog = ("make: render shards; inspect SHARD: PNG mosaic of a sample; convert: another dataset to shards; "
                     "calibration: the camera calibration the data was recorded with, for stack deploy --calibration")
    parser.add_argument("--out", metavar="FILE", help="inspect: where to write the mosaic PNG (default: next to the "
                        "shard); calibration: the YAML/JSON file to write (default: print it)")
    parser.add_argument("--sample", type=int, default=None, metavar="I",
                        help="inspect: index of the sample in the shard (default 0); calibration: take sample I's "
                             "(default: the one calibration all samples share)")
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
    if len(operands) != (1 if action in TAKES_PATH else 0):
        need = "one SHARD path" if action == "inspect" else "one DATA_ROOT or SHARD" if action in TAKES_PATH \
            else "no further words"
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

        print(inspect_shard(operands[0], args.sample or 0, args.out))
        return 0
    if action == "calibration":
        return write_calibration(operands[0], args.sample, args.out)
    from stack.data.convert import convert

    convert(pipeline, args.source_format, args.source, args.version)
    return 0


def write_calibration(path: str, sample: int | None, out: str | None) -> int:
    from stack.deploy.calibration import check_destination, dataset_calibration

    if out is not None:
        check_destination(out)  # before the dataset is read
    calibration = dataset_calibration(path, sample)
    if out is None:
        print(calibration.to_yaml(), end="")
        return 0
    calibration.save(out)
    print(f"wrote {out}: {len(calibration.cameras)} cameras at {calibration.image_width}x{calibration.image_height}, "
          f"{calibration.name}, hash {calibration.hash[:12]}")
    return 0
