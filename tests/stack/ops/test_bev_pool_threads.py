"""The CPU kernels use every intra-op thread, and the thread count never changes a result."""

import shutil
import subprocess
from pathlib import Path

import pytest
import torch
from bev_cases import make_geometry, random_inputs

from stack.ops import bev_pool, extension_loaded

pytestmark = pytest.mark.skipif(not extension_loaded(), reason="the extension stack._C is not built")


def _pool_and_grads(depth, context, geometry, grad, threads):
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        d, c = (t.detach().clone().requires_grad_() for t in (depth, context))
        out = bev_pool(d, c, geometry)
        return (out, *torch.autograd.grad(out, (d, c), grad))
    finally:
        torch.set_num_threads(previous)


def test_one_and_two_threads_give_bitwise_equal_outputs_and_gradients():
    # Training is reproducible across machines with different core counts only if this holds.
    geometry, *_ = make_geometry(batch=3, cameras=4, bins=16)
    depth, context = random_inputs(geometry, channels=33)
    grad = torch.randn(3, 33, geometry.grid_x, geometry.grid_y, generator=torch.Generator().manual_seed(1))
    one, two = (_pool_and_grads(depth, context, geometry, grad, n) for n in (1, 2))
    for a, b in zip(one, two):
        assert torch.equal(a, b)


@pytest.mark.skipif(shutil.which("nm") is None, reason="binutils' nm is not installed")
@pytest.mark.skipif(not torch.backends.openmp.is_available(), reason="this torch does not run on OpenMP")
def test_the_kernels_are_compiled_with_openmp():
    # Without -fopenmp, at::parallel_for compiles to its serial branch: the op silently uses one core.
    import stack._C

    symbols = subprocess.run(["nm", "-D", "--undefined-only", str(Path(stack._C.__file__))], capture_output=True,
                             text=True, check=True).stdout
    assert "GOMP_parallel" in symbols, "stack._C was built without -fopenmp; rebuild with `make install`"
