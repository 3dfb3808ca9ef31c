"""Step statistics: an epoch boundary's validation and checkpointing are not reported as data wait."""

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from standin import TinyMultiTask, synthetic_loaders, tiny_pipeline  # noqa: E402

from stack.train.data import ResumableLoader
from stack.train.fit import fit

VALIDATION_BATCH_S = 0.5


def slow_validation(pipeline):
    """The stand-in loaders, with every validation batch taking VALIDATION_BATCH_S to arrive."""
    make = synthetic_loaders(pipeline, 4)

    def loaders(split: str, rank: int, world: int):
        loader = make(split, rank, world)
        if split == "train":
            return loader

        def epoch_batches(epoch: int):
            for batch in loader.make_epoch(epoch):
                time.sleep(VALIDATION_BATCH_S)
                yield batch
        return ResumableLoader(epoch_batches, len(loader))
    return loaders


def test_validation_between_epochs_is_not_data_wait(tmp_path):
    pipeline = tiny_pipeline("train.max_epochs=3", "train.log_every_n_steps=1", "train.seed=7",
                             f"train.out_dir={tmp_path}")
    _, _, stats = fit(pipeline, TinyMultiTask, slow_validation(pipeline), progress=False)
    first_steps = [row for row in stats.history if row["step"] in (5, 9)]  # the first step of epochs 1 and 2
    assert len(first_steps) == 2
    for row in first_steps:  # each came right after a validation of >= 1 s
        wait_s = row["perf/data_wait_share"] * row["perf/step_ms"] / 1000
        assert wait_s < VALIDATION_BATCH_S, f"step {row['step']}: {wait_s:.2f} s of data wait"
    assert all(row["perf/data_wait_share"] < 1 for row in stats.history)
