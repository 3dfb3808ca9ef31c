"""The stand-in recipe trained once for the trainer's tests that compare with an uninterrupted run."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))  # --import-mode=importlib does not put test folders on sys.path

from standin import STANDIN_RECIPE, TinyMultiTask, synthetic_loaders, tiny_pipeline  # noqa: E402


@pytest.fixture(scope="session")
def standin_recipe_run(tmp_path_factory) -> Path:
    """The out_dir of STANDIN_RECIPE trained once, uninterrupted, in this process (`stack.train.fit`, the code
    `stack train` and tests/train/run_tiny.py run): checkpoints, model.pt, CSV and TensorBoard logs. test_fit,
    test_reliability, test_kills and test_checkpoints_async each trained this same run for themselves; they read
    it, and copy it before changing anything."""
    from stack.train.fit import fit

    out = tmp_path_factory.mktemp("standin-recipe")
    pipeline = tiny_pipeline(*STANDIN_RECIPE, f"train.out_dir={out}")
    fit(pipeline, TinyMultiTask, synthetic_loaders(pipeline, 6), progress=False)
    return out
