"""`run_tiny.py` whose training steps each take at least `STACK_TEST_STEP_SECONDS` (default 0.15 s).

The SLURM preemption test signals a job mid-run; the pause in every training forward gives
it the time to, without changing a single number the network computes.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import run_tiny  # noqa: E402
from stack.cli import exit_without_final_gc  # noqa: E402
from standin import TinyMultiTask  # noqa: E402


class SlowTinyMultiTask(TinyMultiTask):
    def forward(self, batch):
        if self.training:
            time.sleep(float(os.environ.get("STACK_TEST_STEP_SECONDS", "0.15")))
        return super().forward(batch)


if __name__ == "__main__":
    run_tiny.TinyMultiTask = SlowTinyMultiTask
    exit_without_final_gc(run_tiny.main())  # as the `stack` command exits
