"""Custom operators below the models: fused BEV pooling (Lift-Splat) and its export form.

`bev_pool` runs the compiled `torch.ops.stack.bev_pool` kernels (csrc/, CPU and CUDA)
when the extension `stack._C` is built, and the pure-PyTorch reference otherwise.
Importing this package loads torch but never initialises CUDA.
"""

from stack.ops.bev_pool import (
    BevPoolError,
    BevPoolGeometry,
    bev_geometry,
    bev_pool,
    bev_pool_ref,
    extension_loaded,
)
from stack.ops.bev_pool_onnx import BevPoolTables, FixedBevPool, bev_pool_onnx_friendly, bev_pool_tables

__all__ = [
    "BevPoolError",
    "BevPoolGeometry",
    "BevPoolTables",
    "FixedBevPool",
    "bev_geometry",
    "bev_pool",
    "bev_pool_onnx_friendly",
    "bev_pool_ref",
    "bev_pool_tables",
    "extension_loaded",
]
