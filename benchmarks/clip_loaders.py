"""Both loaders on clip shards (data.layout=clips), interleaved: samples/s of one shuffled training epoch.

Clips decode with PyAV in both backends (DALI cannot decode H.264 on the CPU): the torch backend in its
`data.num_workers` processes (each decodes a whole clip, its cameras one after the other), the DALI backend in
its own process, a clip's cameras side by side in `data.num_workers` threads, before its graph. Rows: torch with
0 and N workers, DALI with 1 and N decode threads, each with and without augmentation, interleaved best of
`--rounds` (a warm-up epoch first: page cache, imports, the DALI graph's build).

    stack data make -c configs/pipeline.yaml -c configs/presets/tiny.yaml data.layout=clips data.root=runs/tiny-clips
    python benchmarks/clip_loaders.py -c configs/pipeline.yaml -c configs/presets/tiny.yaml data.root=runs/tiny-clips
"""

from __future__ import annotations

import argparse

from stack.config import load_pipeline
from stack.data.bench import _loader_rate


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-c", dest="config", action="append", default=[])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    rows = {f"{backend}, data.num_workers={workers}": (backend, workers)
            for backend, workers in (("torch", 0), ("torch", args.workers), ("dali", 1), ("dali", args.workers))}
    best = {}
    for _ in range(args.rounds):
        for name, (backend, workers) in rows.items():
            pipeline = load_pipeline(args.config, [*args.overrides, "data.layout=clips", f"data.backend={backend}",
                                                   f"data.num_workers={workers}"])
            for augment in (False, True):
                rate = _loader_rate(pipeline, augment=augment)
                best[name, augment] = max(best.get((name, augment), 0.0), rate)
    print("| loader on clip shards | samples/s | samples/s, augmented |\n|---|---:|---:|")
    for name in rows:
        print(f"| {name} | {best[name, False]:.1f} | {best[name, True]:.1f} |")


if __name__ == "__main__":
    main()
