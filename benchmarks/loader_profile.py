"""Where the torch loader's CPU time per sample goes, beside its floor (decoding the same JPEGs with PIL).

`stack bench data` finds the torch loader at 2.56-2.98x its floor in wall time and 3.44-4.73x in CPU time per sample
(docs/results/data.md, "Loaders against their floors"). This splits the CPU: the same loader read in this process
(`data.num_workers=0`) under cProfile, its functions grouped by what they do (JPEG decoding, npy label decoding,
the member checksums, tar reading, the rows' and the batch's assembly, the rest), and the same epochs read with the
pipeline's worker processes, whose extra CPU per sample is what handing batches from workers to the trainer costs
(pickling into shared memory and back). All in CPU milliseconds per sample of this process and its workers.

    python benchmarks/loader_profile.py -c configs/pipeline.yaml -c configs/presets/tiny.yaml [data.root=runs/tiny/data]
"""

from __future__ import annotations

import argparse
import cProfile
import dataclasses
import pstats
import sys
import time

GROUPS = (
    ("JPEG decode (PIL)", ("PIL/", "ImageFile", "decode")),
    ("npy decode (labels, depth)", ("numpy/lib/_format_impl", "numpy/lib/format", "_npyio", "frombuffer")),
    ("member checksums", ("checksums", "xxhash", "xxh")),
    ("tar / shard reading", ("tarfile", "samples.py", "shard_index", "staging", "read_piece", "_io.", "readinto")),
    ("collate into a Batch", ("collate", "batch.py", "torch/utils/data/_utils")),
)
"""(group, substrings of a function's file or name that put it in the group): the first that matches wins."""


def _group(path: str, name: str) -> str:
    where = f"{path}:{name}"
    for group, needles in GROUPS:
        if any(needle in where for needle in needles):
            return group
    return REST


REST = "the rest (rows, shuffling, Python)"


def profile_in_process(pipeline, epochs: int) -> tuple[int, float, dict]:
    """Samples and CPU seconds of `epochs` epochs read in this process after a warm one, then the CPU seconds per
    group of the same epochs read again under cProfile (its shares; the profiler's own cost is not in the time)."""
    from stack.data.loader import build_loader

    loader = build_loader(dataclasses.replace(pipeline, data=dataclasses.replace(pipeline.data, num_workers=0)),
                          "train", 0, 1, shuffle=True, augment=False)
    for _ in loader:  # page cache and index warm
        pass
    samples, start = 0, time.process_time()
    for _ in range(epochs):
        samples += sum(batch.images.shape[0] for batch in loader)
    spent = time.process_time() - start
    profile = cProfile.Profile(time.process_time)
    profile.enable()
    for _ in range(epochs):
        for _ in loader:
            pass
    profile.disable()
    groups: dict[str, float] = {}
    rest: dict[str, float] = {}
    for (path, line, name), row in pstats.Stats(profile).stats.items():
        group = _group(path, name)
        groups[group] = groups.get(group, 0.0) + row[2]
        if group == REST:
            rest[f"{name} ({path.rsplit('/', 1)[-1]}:{line})" if path != "~" else name] = row[2]
    return samples, spent, groups, rest


def main(argv: list[str]) -> int:
    from stack.config import load_pipeline
    from stack.data.bench import _decode_all, _jpeg_lists, _loader_cpu_ms

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-c", "--config", action="append", default=[])
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_intermixed_args(argv)
    pipeline = load_pipeline(args.config, [*args.overrides, "data.backend=torch"])
    samples, spent, groups, rest = profile_in_process(pipeline, args.epochs)
    profiled = sum(groups.values())
    jpegs = _jpeg_lists(pipeline)
    start = time.process_time()
    for images in jpegs:
        _decode_all(images)
    floor_ms = 1000 * (time.process_time() - start) / len(jpegs)
    workers_ms = _loader_cpu_ms(pipeline, args.epochs)
    in_process_ms = 1000 * spent / samples
    print(f"{samples} samples over {args.epochs} epochs; floor (PIL decoding the same JPEGs, this process): "
          f"{floor_ms:.2f} CPU ms a sample\n")
    print("| where the CPU goes (in process, cProfile) | CPU ms a sample | share |\n|---|---:|---:|")
    for group, seconds in sorted(groups.items(), key=lambda item: -item[1]):
        print(f"| {group} | {in_process_ms * seconds / profiled:.2f} | {100 * seconds / profiled:.0f}% |")
    print(f"| **in process, total (timed without the profiler)** | **{in_process_ms:.2f}** | "
          f"{in_process_ms / floor_ms:.2f}x the floor |")
    print(f"| with data.num_workers={pipeline.data.num_workers} worker processes (this process + workers) | "
          f"{workers_ms:.2f} | {workers_ms / floor_ms:.2f}x the floor; handing batches over: "
          f"{workers_ms - in_process_ms:+.2f} |")
    largest = sorted(rest.items(), key=lambda item: -item[1])[:10]
    print(f"\nlargest in {REST!r}: " + "; ".join(
        f"`{name}` {in_process_ms * seconds / profiled:.2f}" for name, seconds in largest))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
