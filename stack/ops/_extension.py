"""Loads the compiled `stack._C` kernels and teaches PyTorch about them.

csrc/ defines the schema (`TORCH_LIBRARY(stack, m)`) and the CPU/CUDA kernels; this
module adds what Python owns: fake (meta) kernels so `torch.compile` and
`torch.export` can trace the op without running it, and the autograd formula that
routes the gradient to `stack::bev_pool_backward`. Without the extension (no
compiler at install time) `bev_pool` falls back to the reference with one warning.
"""

from __future__ import annotations

import functools
import warnings

import torch

_WARNED: set = set()


@functools.lru_cache(maxsize=1)
def load() -> bool:
    """Import `stack._C` once and register the Python parts; False when it is not built."""
    try:
        import stack._C  # noqa: F401  (loading the library runs the TORCH_LIBRARY registrations)
    except ImportError:
        return False
    _register_fake_kernels()
    torch.library.register_autograd("stack::bev_pool", _backward, setup_context=_setup_context)
    return True


def has_kernel(device_type: str, op: str = "bev_pool") -> bool:
    """Whether `stack::<op>` has a compiled kernel for this device type ("cpu", "cuda")."""
    return device_type in KERNEL_DEVICES.get(op, ())


def _kernel_devices() -> dict:
    if not load():
        return {}
    keys = {"cpu": "CPU", "cuda": "CUDA"}
    return {op: frozenset(d for d, key in keys.items() if torch._C._dispatch_has_kernel_for_dispatch_key(f"stack::{op}", key))
            for op in ("bev_pool", "bev_pool_backward", "bev_geometry_ranks") if hasattr(torch.ops.stack, op)}


def warn_reference_once(device_type: str) -> None:
    if device_type in _WARNED:
        return
    _WARNED.add(device_type)
    why = "the extension stack._C is not built" if not load() else f"stack._C has no {device_type} kernel"
    warnings.warn(f"bev_pool: {why}; using the pure-PyTorch reference (slower, more memory). Rebuild with "
                  "`MAX_JOBS=2 pip install --no-build-isolation -e .` where a C++ compiler (and nvcc for CUDA) "
                  "is present.", RuntimeWarning, stacklevel=3)


def _register_fake_kernels() -> None:
    @torch.library.register_fake("stack::bev_pool")
    def _(depth, feat, ranks_depth, ranks_feat, ranks_bev, interval_starts, interval_lengths, batch, grid_x, grid_y):
        return depth.new_empty((batch, feat.shape[2], grid_x, grid_y))

    @torch.library.register_fake("stack::bev_pool_backward")
    def _(grad_out, depth, feat, ranks_depth, ranks_feat, ranks_bev):
        return depth.new_empty(depth.shape), feat.new_empty(feat.shape)

    if not hasattr(torch.ops.stack, "bev_geometry_ranks"):
        return  # a stack._C built before this op existed: bev_geometry keeps its PyTorch path

    @torch.library.register_fake("stack::bev_geometry_ranks")
    def _(slopes, offsets, bins, grid_x, grid_y):
        ctx = torch.library.get_ctx()
        points, cells = ctx.new_dynamic_size(), ctx.new_dynamic_size()
        ranks = [slopes.new_empty(points, dtype=torch.int32) for _ in range(3)]
        return (*ranks, slopes.new_empty(cells, dtype=torch.int32), slopes.new_empty(cells, dtype=torch.int32))


def _setup_context(ctx, inputs, output) -> None:
    depth, feat, ranks_depth, ranks_feat, ranks_bev = inputs[:5]
    ctx.save_for_backward(depth, feat, ranks_depth, ranks_feat, ranks_bev)


def _backward(ctx, grad_out):
    depth, feat, ranks_depth, ranks_feat, ranks_bev = ctx.saved_tensors
    grad_depth, grad_feat = torch.ops.stack.bev_pool_backward(grad_out, depth, feat, ranks_depth, ranks_feat, ranks_bev)
    return grad_depth, grad_feat, None, None, None, None, None, None, None, None


KERNEL_DEVICES = _kernel_devices()
"""Op name -> device types with a compiled kernel; fixed at import so `torch.compile` sees a constant."""
