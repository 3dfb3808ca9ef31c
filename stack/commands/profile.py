"""`stack profile`: a few training steps under torch.profiler → Chrome trace (NVTX ranges), top ops, data-wait share.

    stack profile -c configs/pipeline.yaml -c configs/presets/tiny.yaml train.profile_steps=6

Writes train.out_dir/profile/trace.json (open in ui.perfetto.dev or chrome://tracing;
under Nsight Systems the same ranges appear as NVTX) and phases.png; then times one more step operator by
operator against the measured matmul peak and memory bandwidth (`stack.train.operator_costs`): the table per part,
roofline.json and roofline.png.
"""

from __future__ import annotations

import argparse


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """No options beyond the pipeline: train.profile_steps sets the number of recorded steps."""


def run(args: argparse.Namespace) -> int:
    from pathlib import Path

    from stack.cli import load_pipeline_from_args
    from stack.train.profile import profile_steps

    pipeline = load_pipeline_from_args(args)
    result = profile_steps(pipeline, Path(pipeline.train.out_dir) / "profile")
    print(result["top_ops"])
    wall = result["wall_s"]
    print(f"{result['steps']} steps in {wall:.2f} s ({1000 * wall / result['steps']:.0f} ms/step); time per phase:")
    for name, seconds in result["phases"].items():
        print(f"  {name:<32} {1000 * seconds / result['steps']:8.1f} ms/step  {100 * seconds / wall:5.1f}%")
    print(f"data-wait share: {100 * result['data_wait_share']:.1f}% of wall time")
    print(f"\none more step, every operator timed and charged to its part (dispatch overhead not included):\n"
          f"{result['roofline']}")
    print(f"trace: {result['trace']} (ui.perfetto.dev or chrome://tracing)\nplots: {result['png']}, "
          f"{result['roofline_png']}")
    return 0
