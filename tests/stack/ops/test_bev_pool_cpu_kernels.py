"""The CPU kernels' own paths: channel blocks held in registers, tile transposes, the cell-major
backward, its sortedness check, and agreement with the previous kernels kept for the bench."""

import pytest
import torch
from bev_cases import make_geometry, random_inputs

from stack.ops import bev_pool, bev_pool_ref, extension_loaded
from stack.pipeline import BevGridConfig

pytestmark = pytest.mark.skipif(not extension_loaded(), reason="the extension stack._C is not built")

# 36 x 28 cells: tiles of 64 cells end mid-row and the last tile of each sample is partial.
ODD_GRID = BevGridConfig(x_range=[-36.0, 36.0], y_range=[-28.0, 28.0], z_range=[-2.0, 4.0], cell_size=2.0)


def _grads(pool, depth, context, geometry, grad):
    d, c = (t.detach().clone().requires_grad_() for t in (depth, context))
    out = pool(d, c, geometry)
    return (out, *torch.autograd.grad(out, (d, c), grad))


@pytest.mark.parametrize("channels", [16, 64, 80, 130])
def test_every_channel_blocking_matches_the_reference(channels):
    # 64: one register block; 80: a block of 64 and one of 16; 130: two of 64 and two single channels.
    geometry, *_ = make_geometry(batch=2, cameras=3, bins=12, bev=ODD_GRID)
    depth, context = random_inputs(geometry, channels=channels)
    grad = torch.randn(2, channels, geometry.grid_x, geometry.grid_y, generator=torch.Generator().manual_seed(2))
    for ours, ref in zip(_grads(bev_pool, depth, context, geometry, grad),
                         _grads(bev_pool_ref, depth, context, geometry, grad)):
        torch.testing.assert_close(ours, ref, atol=1e-5, rtol=1e-5)


def test_full_register_blocks_are_bitwise_equal_across_thread_counts():
    geometry, *_ = make_geometry(batch=3, cameras=4, bins=16, bev=ODD_GRID)
    depth, context = random_inputs(geometry, channels=64)
    grad = torch.randn(3, 64, geometry.grid_x, geometry.grid_y, generator=torch.Generator().manual_seed(3))
    previous = torch.get_num_threads()
    try:
        results = []
        for threads in (1, 2, 3):
            torch.set_num_threads(threads)
            results.append(_grads(bev_pool, depth, context, geometry, grad))
    finally:
        torch.set_num_threads(previous)
    for other in results[1:]:
        assert all(torch.equal(a, b) for a, b in zip(results[0], other))


def test_the_backward_rejects_unsorted_cell_ranks():
    # The cell-major backward walks each sample's points in cell order: tables in another order would
    # silently drop gradient, so the op says what it needs instead.
    geometry, *_ = make_geometry()
    depth, context = random_inputs(geometry)
    g = geometry
    order = torch.randperm(g.num_points, generator=torch.Generator().manual_seed(0))
    grad = torch.randn(g.batch, 5, g.grid_x, g.grid_y)
    with pytest.raises(RuntimeError, match="ranks_bev must be sorted ascending"):
        torch.ops.stack.bev_pool_backward(grad, depth, context, g.ranks_depth[order], g.ranks_feat[order],
                                          g.ranks_bev[order])
    with pytest.raises(RuntimeError, match="ranks_feat\\[p\\] must be the pixel of ranks_depth\\[p\\]"):
        torch.ops.stack.bev_pool_backward(grad, depth, context, g.ranks_depth, g.ranks_feat.roll(1), g.ranks_bev)


def test_the_previous_kernels_kept_for_the_bench_compute_the_same():
    """`stack bench ops` times the bench-only previous kernels (benchmarks/, compiled here on first use) beside
    the current ones: they must compute the same grid and gradients, or the comparison means nothing."""
    from stack import bench_only

    v1 = bench_only.load("bev_pool_v1")
    if v1.buildable():
        pytest.skip(v1.buildable())
    previous = v1.ops()
    assert not hasattr(torch.ops.stack, "bev_pool_v1"), "the previous kernels must not ship in stack._C"
    geometry, *_ = make_geometry(batch=2, bins=12, bev=ODD_GRID)
    depth, context = random_inputs(geometry, channels=64)
    g = geometry
    tables = (g.ranks_depth, g.ranks_feat, g.ranks_bev, g.interval_starts, g.interval_lengths, g.batch, g.grid_x,
              g.grid_y)
    torch.testing.assert_close(previous.bev_pool_v1(depth, context, *tables),
                               torch.ops.stack.bev_pool(depth, context, *tables), atol=1e-5, rtol=1e-5)
    grad = torch.randn(2, 64, g.grid_x, g.grid_y)
    ranks = (g.ranks_depth, g.ranks_feat, g.ranks_bev)
    for old, new in zip(previous.bev_pool_backward_v1(grad, depth, context, *ranks),
                        torch.ops.stack.bev_pool_backward(grad, depth, context, *ranks)):
        torch.testing.assert_close(old, new, atol=1e-5, rtol=1e-5)
