"""The previous CPU kernels of `stack::bev_pool`, compiled on first use for `stack bench ops` and their test.

They are not in `stack._C` (users do not build or load them): `ops()` compiles `csrc/bev_pool_cpu_v1.cpp` here
with the shared argument checks of the product's `csrc/bev_pool_checks.cpp` into a library of its own
(torch's JIT extension builder, cached under `TORCH_EXTENSIONS_DIR` or ~/.cache/torch_extensions, ~1 min on
2 cores the first time), and returns `torch.ops.stack_bench`: `bev_pool_v1` and `bev_pool_backward_v1`, with
the arguments and results of `stack::bev_pool` / `stack::bev_pool_backward`.
"""

from __future__ import annotations

import functools
import shutil
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
PRODUCT_CSRC = HERE.parent / "csrc"


def buildable() -> str | None:
    """None when the kernels can be compiled here, else why not."""
    if not (shutil.which("c++") or shutil.which("g++")):
        return "no C++ compiler found"
    if not (PRODUCT_CSRC / "bev_pool.h").is_file():
        return f"{PRODUCT_CSRC} has no bev_pool.h (not a source checkout)"
    return None


@functools.lru_cache(maxsize=1)
def ops():
    """`torch.ops.stack_bench` with the previous kernels registered (compiled once per process, cached on disk)."""
    import torch
    from torch.utils import cpp_extension

    openmp = ["-fopenmp"] if sys.platform == "linux" and torch.backends.openmp.is_available() else []
    cpp_extension.load("stack_bench_bev_pool_v1",
                       [str(HERE / "csrc" / "bev_pool_cpu_v1.cpp"), str(PRODUCT_CSRC / "bev_pool_checks.cpp")],
                       extra_include_paths=[str(PRODUCT_CSRC)], extra_cflags=["-O3", *openmp],
                       extra_ldflags=openmp, is_python_module=False, verbose=False)
    return torch.ops.stack_bench
