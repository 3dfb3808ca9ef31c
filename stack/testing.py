"""Test helpers shared by the test suite: device parameters and skip reasons.

Tests that need hardware this machine may lack carry a marker (`gpu`, `trt`);
`tests/conftest.py` turns each marker into a skip that says why, using the
reasons below. Importing this module is as cheap as importing `stack`.
"""

from __future__ import annotations

import importlib.util
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
    """Why `trt` tests cannot run here, or None when TensorRT can be imported."""
    if importlib.util.find_spec("tensorrt") is None:
        return "needs TensorRT (pip extra `stack[trt]` on a GPU host or a Jetson); not importable here"
    return gpu_skip_reason()


MARKER_SKIP_REASONS = {"gpu": gpu_skip_reason, "trt": trt_skip_reason}
"""Marker name -> function giving the reason to skip (None: run)."""


def device_params() -> list:
    """`["cpu", "cuda"]` for `pytest.mark.parametrize`, the CUDA case marked `gpu`."""
    import pytest

    return ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]
