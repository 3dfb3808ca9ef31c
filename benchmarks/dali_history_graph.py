"""What the previous key frame costs the DALI loader's graph alone, with and without assembling the Batch.

`stack bench data` finds the DALI loader at 0.42x its one-frame rate once each sample carries its previous key frame
(model.temporal_frames = 1), more than twice the JPEGs alone explain
(docs/log/2026-11-28_loaders-previous-key-frame.md). This separates the graph from the loader's Python: the training
split's samples are read into memory first, each given the sample stored before it as its history, and the loader's
own graph (`stack.data.dali_loader.build_pipeline`) is fed one batch at a time for 0 and 1 history frames, with and
without turning its outputs into Batch tensors (`_images`, `_zero_copy`). Interleaved, best of `--repeats`,
milliseconds of wall time per sample.

    python benchmarks/dali_history_graph.py -c configs/pipeline.yaml -c configs/presets/tiny.yaml
"""

from __future__ import annotations

import argparse
import sys
import time


def main(argv: list[str]) -> int:
    from stack.config import load_pipeline
    from stack.data.dali_loader import _images, _zero_copy, build_pipeline, feed
    from stack.data.loader import read_manifest, split_shards
    from stack.data.samples import ClassMaps
    from stack.data.shard_index import SampleReader

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-c", "--config", action="append", default=[])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_intermixed_args(argv)
    pipeline = load_pipeline(args.config, args.overrides)
    manifest, size = read_manifest(pipeline.data.root), pipeline.data.batch_size
    cameras, reader = manifest["cameras"], SampleReader()
    samples = [reader.read(path, i) for path, count in split_shards(manifest, pipeline.data.root, "train")
               for i in range(count)]
    for index, sample in enumerate(samples):  # the shape `key_frame_history` gives: ((stored, shard), pose)
        sample["history"] = [((samples[index - 1], None), None)]
    batches = [samples[i:i + size] for i in range(0, len(samples) - size + 1, size)]
    threads = max(pipeline.data.num_workers, 1)
    graphs = {back: build_pipeline(cameras, ClassMaps.build(manifest, pipeline), size, threads, history=back)
              for back in (0, 1)}

    def epoch(back: int, assemble: bool) -> float:
        start = time.perf_counter()
        for batch in batches:
            feed(graphs[back], cameras, batch, back)
            outputs = graphs[back].run()
            if assemble:
                n = len(cameras)
                [_images(outputs[j * n:(j + 1) * n]) for j in range(back + 1)]
                _zero_copy(outputs[(back + 1) * n]), _zero_copy(outputs[(back + 1) * n + 1])
        return (time.perf_counter() - start) / (len(batches) * size)

    for back in (0, 1):  # warm-up
        epoch(back, True)
    best: dict = {}
    for _ in range(args.repeats):
        for key in ((0, False), (0, True), (1, False), (1, True)):
            best[key] = min(best.get(key, float("inf")), epoch(*key))
    print(f"| previous key frames | graph alone (ms a sample) | graph + Batch assembly | {threads} DALI threads, "
          f"batch {size}, {len(batches) * size} samples |\n|---|---:|---:|---|")
    for back in (0, 1):
        print(f"| {back} | {1e3 * best[(back, False)]:.3f} | {1e3 * best[(back, True)]:.3f} | |")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
