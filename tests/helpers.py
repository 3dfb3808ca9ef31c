"""Helpers only the tests use: hardware markers' skip reasons, device parameters, the two forward paths.

Kept out of the installed packages (issue 58); `tests/conftest.py` puts this folder on `sys.path`
(`--import-mode=importlib` does not), so a test imports it as `helpers`.
"""

from __future__ import annotations

from functools import lru_cache


@lru_cache(maxsize=1)
def gpu_skip_reason() -> str | None:
    """Why `gpu` tests cannot run here, or None when a CUDA device is usable."""
    import torch

    if not torch.cuda.is_available():
        return "needs a CUDA GPU; torch.cuda.is_available() is False on this machine"
    return None


@lru_cache(maxsize=1)
def trt_skip_reason() -> str | None:
    """Why `trt` tests cannot run here (`stack.deploy.tensorrt.unavailable_reason`), or None."""
    from stack.deploy.tensorrt import unavailable_reason

    return unavailable_reason()


MARKER_SKIP_REASONS = {"gpu": gpu_skip_reason, "trt": trt_skip_reason}
"""Marker name -> function giving the reason to skip (None: run)."""


def device_params() -> list:
    """`["cpu", "cuda"]` for `pytest.mark.parametrize`, the CUDA case marked `gpu`."""
    import pytest

    return ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


def fixed_and_per_batch_outputs(model, batch) -> tuple[dict, dict]:
    """(outputs with the rig baked by `fix_geometry`, outputs with geometry from the batch's cameras) of `model` in
    eval mode: export's graph and training's path, which must agree for the pipeline's own rig."""
    import torch

    model.eval()
    with torch.no_grad():
        per_batch = model.forward_batch(batch)
        model.fix_geometry(model.rig_geometry(batch=batch.images.shape[0]))
        try:
            fixed = model(batch.images, batch.ego_status, batch.command)
        finally:
            model.fix_geometry(None)
    return fixed, per_batch
