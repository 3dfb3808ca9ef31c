"""Validation samples for calibration, the accuracy gate and timing.

They come from the validation shards that `stack data make` writes (whole scenes never
seen in training). Until a shard loader is importable, the rendered-data path is not
available and the samples are synthetic flat-ground frames from
`stack.models.testing.random_batch`; every report names the source it used.
"""

from __future__ import annotations

from stack.pipeline import Pipeline

SYNTHETIC = "synthetic flat-ground frames (stack.models.testing.random_batch): no validation shard loader available"


def load_validation(pipeline: Pipeline, count: int) -> tuple[list, str]:
    """(list of Batches with `count` samples in all, where they came from)."""
    from stack.models.testing import random_batch

    batches, left, seed = [], count, 1000
    while left > 0:
        size = min(left, 8)
        batches.append(random_batch(pipeline, batch_size=size, seed=seed))
        left, seed = left - size, seed + 1
    return batches, SYNTHETIC
