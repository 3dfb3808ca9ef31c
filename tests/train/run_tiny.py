"""Train the stand-in network on synthetic batches with `stack.train.fit`, as its own program.

Tests run this in a subprocess so that Lightning can start DDP/FSDP2 ranks the way
`stack train` does (it re-runs the same command line for each extra local rank):

    python tests/train/run_tiny.py [--batches N] [--nan-at STEP] key=value ...

Exit codes are those of the CLI: 0 done, 3 training diverged (message on stderr).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from standin import TinyMultiTask, synthetic_loaders, tiny_pipeline  # noqa: E402

from stack.cli import exit_without_final_gc  # noqa: E402
from stack.errors import StackError  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--batches", type=int, default=6)
    parser.add_argument("--nan-at", type=int, default=-1)
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    pipeline = tiny_pipeline(*args.overrides)
    from stack.train.fit import fit

    make, requested = synthetic_loaders(pipeline, args.batches, args.nan_at), []

    def loaders(split: str, rank: int, world: int):
        requested.append([split, rank, world])
        return make(split, rank, world)
    try:
        module, trainer, stats = fit(pipeline, TinyMultiTask, loaders, progress=False)
    except StackError as exc:
        print(f"{exc.label}: {exc}", file=sys.stderr)
        return exc.exit_code
    summary = {"rank": trainer.global_rank, "world_size": trainer.world_size, "global_step": trainer.global_step,
               "sharded_units": module.sharded_units, "checkpointed_units": module.checkpointed_units,
               "stats": stats.history, "loaders": requested}
    out = Path(pipeline.train.out_dir) / f"summary-rank{trainer.global_rank}.json"
    out.write_text(json.dumps(summary, indent=1))
    return 0


if __name__ == "__main__":
    exit_without_final_gc(main())  # as the `stack` command exits
