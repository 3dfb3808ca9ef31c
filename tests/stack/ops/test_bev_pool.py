"""BEV pooling: the geometry against an independent projection, the op against the reference."""

import importlib
import warnings

import pytest
import torch
from bev_cases import bev_pool_naive, make_geometry, random_inputs, rig_tensors
from helpers import device_params

from stack.ops import BevPoolError, bev_geometry, bev_pool, bev_pool_ref, extension_loaded
from stack.ops import _extension
from stack.pipeline import BevGridConfig

needs_extension = pytest.mark.skipif(not extension_loaded(), reason="stack._C is not built (no C++ compiler at install)")
# fp32 sums of hundreds of points in another order (CUDA intervals vs index_add) differ by a few
# ulps times the count: rtol 1e-4 covers 1000-point cells.
TOL = {torch.float32: dict(atol=1e-5, rtol=1e-4), torch.float64: dict(atol=1e-12, rtol=1e-12),
       torch.bfloat16: dict(atol=3e-2, rtol=3e-2), torch.float16: dict(atol=3e-3, rtol=3e-3)}

GRIDS = {
    "random": None,
    "one_cell_holds_every_point": BevGridConfig(x_range=[-80.0, 80.0], y_range=[-80.0, 80.0],
                                                z_range=[-10.0, 40.0], cell_size=160.0),
    "mostly_out_of_range": BevGridConfig(x_range=[0.0, 6.0], y_range=[-3.0, 3.0], z_range=[-1.0, 2.0], cell_size=0.5),
    "nothing_in_range": BevGridConfig(x_range=[1000.0, 1010.0], y_range=[0.0, 10.0], cell_size=1.0),
}


def test_geometry_matches_an_independent_projection():
    geometry, rigs, depth_cfg, bev = make_geometry(batch=2, cameras=2, bins=6, stride=16)
    depth, context = random_inputs(geometry, channels=3, dtype=torch.float64)
    expected = bev_pool_naive(depth, context, rigs, depth_cfg, bev, stride=16)
    assert expected.abs().sum() > 0
    torch.testing.assert_close(bev_pool_ref(depth, context, geometry), expected, atol=1e-12, rtol=1e-12)


def test_geometry_layout_holds_the_invariants_the_kernels_rely_on():
    g, *_ = make_geometry(batch=3)
    for name in ("ranks_depth", "ranks_feat", "ranks_bev", "interval_starts", "interval_lengths"):
        assert getattr(g, name).dtype == torch.int32, name
    bev = g.ranks_bev.long()
    assert torch.all(bev[1:] >= bev[:-1])
    assert g.ranks_depth.unique().numel() == g.num_points
    pixels = g.feat_h * g.feat_w
    depth = g.ranks_depth.long()
    assert torch.equal(g.ranks_feat.long(), depth // (g.depth_bins * pixels) * pixels + depth % pixels)
    assert int(g.interval_lengths.sum()) == g.num_points
    assert torch.equal(g.interval_starts[1:], (g.interval_starts + g.interval_lengths)[:-1])
    starts = g.interval_starts.long()
    assert torch.unique(bev).numel() == g.num_cells
    assert torch.equal(bev[starts], torch.unique(bev))
    assert 0 < g.num_points < g.batch * g.cameras * g.depth_bins * pixels  # some dropped, some kept


@pytest.mark.parametrize("device", device_params())
def test_geometry_is_built_on_the_device_of_its_inputs(device):
    cpu, *_ = make_geometry()
    there, *_ = make_geometry(device=device)
    assert there.device.type == device
    assert torch.equal(there.ranks_depth.cpu(), cpu.ranks_depth) and torch.equal(there.ranks_bev.cpu(), cpu.ranks_bev)
    assert cpu.to(device).ranks_feat.device.type == device


def gradients(pool, depth, context, geometry, grad):
    """(d depth, d context) of sum(pool(depth, context) * grad)."""
    d, c = (t.detach().clone().requires_grad_() for t in (depth, context))
    return torch.autograd.grad(pool(d, c, geometry), (d, c), grad)


@pytest.mark.parametrize("device", device_params())
@pytest.mark.parametrize("case", sorted(GRIDS))
@pytest.mark.parametrize("batch", [1, 3])
def test_bev_pool_matches_the_reference(device, case, batch):
    geometry, *_ = make_geometry(batch=batch, bev=GRIDS[case], device=device)
    depth, context = random_inputs(geometry, channels=7, device=device)
    out = bev_pool(depth, context, geometry)
    assert out.shape == (batch, 7, geometry.grid_x, geometry.grid_y) and out.is_contiguous()
    torch.testing.assert_close(out, bev_pool_ref(depth, context, geometry), **TOL[torch.float32])
    grad = torch.randn_like(out)
    for ours, ref in zip(gradients(bev_pool, depth, context, geometry, grad),
                         gradients(bev_pool_ref, depth, context, geometry, grad)):
        torch.testing.assert_close(ours, ref, **TOL[torch.float32])
    if case == "one_cell_holds_every_point":
        assert geometry.num_cells == batch and geometry.interval_lengths.min() > 100
    if case == "nothing_in_range":
        assert geometry.num_points == 0 and not out.any()


@pytest.mark.parametrize("device", device_params())
def test_the_tiny_preset_rig_matches_the_reference(device):
    from stack.config import CONFIG_DIR, load_pipeline
    from stack.rig import rig_matrices

    pipeline = load_pipeline([CONFIG_DIR / "pipeline.yaml", CONFIG_DIR / "presets" / "tiny.yaml"])
    rig, model = pipeline.data.rig, pipeline.model
    ks, poses = (torch.tensor(m, dtype=torch.float32)[None].expand(2, -1, -1, -1) for m in rig_matrices(rig))
    geometry = bev_geometry(ks.to(device), poses.to(device), (rig.image_height, rig.image_width),
                            model.feature_stride, model.depth, model.bev)
    assert (geometry.grid_x, geometry.grid_y, geometry.cameras) == (64, 64, len(rig.cameras))
    depth, context = random_inputs(geometry, channels=model.neck_channels, device=device)
    torch.testing.assert_close(bev_pool(depth, context, geometry), bev_pool_ref(depth, context, geometry),
                               **TOL[torch.float32])


@pytest.mark.parametrize("device", device_params())
def test_empty_cells_are_zero_and_full_cells_are_not(device):
    geometry, *_ = make_geometry(batch=2, cameras=1, device=device)
    depth, context = random_inputs(geometry, device=device)
    out = bev_pool(depth, context, geometry).permute(0, 2, 3, 1).reshape(-1, context.shape[2])
    filled = torch.zeros(out.shape[0], dtype=torch.bool, device=device)
    filled[geometry.ranks_bev.long()] = True
    assert 0 < int(filled.sum()) < filled.numel() // 2
    assert not out[~filled].any()
    assert out[filled].abs().sum(1).min() > 0


@pytest.mark.parametrize("device", device_params())
def test_non_contiguous_inputs(device):
    geometry, *_ = make_geometry(device=device)
    depth, context = random_inputs(geometry, channels=6, device=device)
    depth_t = depth.transpose(3, 4).contiguous().transpose(3, 4)  # same values, other strides
    context_s = torch.cat([context, context], dim=2)[:, :, ::2]  # strided channel axis
    assert not depth_t.is_contiguous() and not context_s.is_contiguous()
    expected = bev_pool_ref(depth, context_s.contiguous(), geometry)
    torch.testing.assert_close(bev_pool(depth_t, context_s, geometry), expected, **TOL[torch.float32])


@pytest.mark.parametrize("device", device_params())
def test_a_context_that_starts_off_a_vector_boundary(device):
    # A channels-last view one element into its storage: its rows are not 16-byte aligned, so the CUDA forward
    # must take its scalar path, not the 128-bit loads.
    geometry, *_ = make_geometry(device=device)
    g = geometry
    depth, context = random_inputs(geometry, channels=64, device=device)
    storage = torch.zeros(context.numel() + 1, device=device)
    shifted = storage[1:].view(g.batch, g.cameras, g.feat_h, g.feat_w, 64).permute(0, 1, 4, 2, 3)
    shifted.copy_(context)
    assert shifted.permute(0, 1, 3, 4, 2).is_contiguous() and shifted.data_ptr() % 16 != 0
    torch.testing.assert_close(bev_pool(depth, shifted, geometry), bev_pool_ref(depth, context, geometry),
                               **TOL[torch.float32])


@pytest.mark.parametrize("device", device_params())
def test_channels_last_context(device):
    geometry, *_ = make_geometry(device=device)
    depth, context = random_inputs(geometry, channels=6, device=device)
    g = geometry
    as_conv_output = context.reshape(-1, 6, g.feat_h, g.feat_w).to(memory_format=torch.channels_last)
    context_cl = as_conv_output.view(context.shape)
    assert context_cl.permute(0, 1, 3, 4, 2).is_contiguous() and not context_cl.is_contiguous()
    torch.testing.assert_close(bev_pool(depth, context_cl, geometry), bev_pool_ref(depth, context, geometry),
                               **TOL[torch.float32])


@pytest.mark.parametrize("device", device_params())
@pytest.mark.parametrize("channels", [7, 8, 16, 32, 64, 80, 130, 300])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("image", [(128, 64), (104, 40)])
def test_every_channel_width_and_depth_batch_matches_the_reference(device, channels, dtype, image):
    # The CUDA forward gives each point 1-32 lanes of one 16-byte vector when the channels fill whole vectors (8 to
    # 80 here, in fp32 and bf16), else a warp. The other kernels hold 32, 64, 128 or 256 channels per pass (300: two
    # passes, the second partial) and fetch
    # 32 depth bins at a time (40 bins: a full batch and a partial one); the backward takes 8 pixels a block
    # (104 x 40 at stride 8: 2 x 65 pixels, the last tile partial). The reference runs in float64.
    geometry, *_ = make_geometry(batch=1 if image[0] == 104 else 2, cameras=2, bins=40, width=image[0],
                                 height=image[1], device=device)
    assert image[0] == 128 or geometry.batch * geometry.cameras * geometry.feat_h * geometry.feat_w % 8 != 0
    depth, context = random_inputs(geometry, channels=channels, dtype=torch.float64, device=device)
    grad = torch.randn(geometry.batch, channels, geometry.grid_x, geometry.grid_y, dtype=torch.float64,
                       device=device, generator=torch.Generator(device).manual_seed(4))
    low = [t.to(dtype) for t in (depth, context, grad)]
    ours = (bev_pool(low[0], low[1], geometry), *gradients(bev_pool, *low[:2], geometry, low[2]))
    exact = [t.double() for t in low]
    expected = (bev_pool_ref(exact[0], exact[1], geometry), *gradients(bev_pool_ref, *exact[:2], geometry, exact[2]))
    for mine, ref in zip(ours, expected):
        assert mine.dtype == dtype
        torch.testing.assert_close(mine.double(), ref, **TOL[dtype])


@pytest.mark.parametrize("device", device_params())
@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16, torch.float16])
def test_other_float_dtypes(device, dtype):
    geometry, *_ = make_geometry(device=device)
    depth, context = random_inputs(geometry, dtype=torch.float64, device=device)
    out = bev_pool(depth.to(dtype), context.to(dtype), geometry)
    assert out.dtype == dtype
    expected = bev_pool_ref(depth.to(dtype).double(), context.to(dtype).double(), geometry)
    torch.testing.assert_close(out.double(), expected, **TOL[dtype])


def test_mixed_dtypes_are_promoted():
    geometry, *_ = make_geometry()
    depth, context = random_inputs(geometry)
    out = bev_pool(depth, context.to(torch.bfloat16), geometry)
    assert out.dtype == torch.float32


@pytest.mark.parametrize("device", device_params())
def test_gradients_match_the_reference(device):
    geometry, *_ = make_geometry(batch=2, device=device)
    depth, context = random_inputs(geometry, channels=4, device=device)
    grad = torch.randn(2, 4, geometry.grid_x, geometry.grid_y, device=device)
    ours = gradients(bev_pool, depth, context, geometry, grad)
    for mine, ref in zip(ours, gradients(bev_pool_ref, depth, context, geometry, grad)):
        torch.testing.assert_close(mine, ref, **TOL[torch.float32])
    assert ours[0].abs().sum() > 0 and ours[1].abs().sum() > 0


@pytest.mark.parametrize("device", device_params())
def test_gradcheck_float64(device):
    geometry, *_ = make_geometry(batch=2, cameras=2, bins=4, stride=16, device=device)
    depth, context = random_inputs(geometry, channels=3, dtype=torch.float64, device=device)
    depth.requires_grad_()
    context.requires_grad_()
    assert torch.autograd.gradcheck(lambda d, c: bev_pool(d, c, geometry), (depth, context))


@needs_extension
@pytest.mark.parametrize("device", device_params())
def test_opcheck(device):
    geometry, *_ = make_geometry(batch=2, device=device)
    depth, context = random_inputs(geometry, channels=4, device=device)
    g = geometry
    args = (depth.requires_grad_(), context.requires_grad_(), g.ranks_depth, g.ranks_feat, g.ranks_bev,
            g.interval_starts, g.interval_lengths, g.batch, g.grid_x, g.grid_y)
    torch.library.opcheck(torch.ops.stack.bev_pool.default, args)
    grad = torch.randn(g.batch, 4, g.grid_x, g.grid_y, device=device)
    torch.library.opcheck(torch.ops.stack.bev_pool_backward.default,
                          (grad, depth.detach(), context.detach(), g.ranks_depth, g.ranks_feat, g.ranks_bev))


class Splat(torch.nn.Module):
    def __init__(self, geometry):
        super().__init__()
        self.geometry = geometry
        self.mix = torch.nn.Conv2d(4, 4, 1)

    def forward(self, depth_logits, context):
        return self.mix(bev_pool(depth_logits.softmax(2), context, self.geometry))


@pytest.mark.parametrize("device", device_params())
def test_torch_compile_fullgraph(device):
    geometry, *_ = make_geometry(device=device)
    depth, context = random_inputs(geometry, channels=4, device=device)
    module = Splat(geometry).to(device)
    compiled = torch.compile(module, fullgraph=True, backend="aot_eager")
    d = depth.clone().requires_grad_()
    out = compiled(d, context)
    torch.testing.assert_close(out, module(depth, context), **TOL[torch.float32])
    out.sum().backward()
    assert d.grad is not None and d.grad.abs().sum() > 0


@pytest.mark.slow
def test_torch_compile_inductor_fullgraph():
    geometry, *_ = make_geometry()
    depth, context = random_inputs(geometry, channels=4)
    module = Splat(geometry)
    compiled = torch.compile(module, fullgraph=True)
    torch.testing.assert_close(compiled(depth, context), module(depth, context), **TOL[torch.float32])


def test_bad_inputs_raise_clear_errors():
    geometry, *_ = make_geometry()
    depth, context = random_inputs(geometry)
    with pytest.raises(BevPoolError, match="floating-point"):
        bev_pool(depth.to(torch.int64), context, geometry)
    with pytest.raises(BevPoolError, match=r"context .* must be \(B, N, C, H, W\) with the B, N, H, W"):
        bev_pool(depth, context[..., :-1], geometry)
    other, *_ = make_geometry(bins=6)
    with pytest.raises(BevPoolError, match="geometry was built for .* rebuild it with bev_geometry"):
        bev_pool(depth, context, other)
    with pytest.raises(BevPoolError, match=r"\(B, N, D, H, W\)"):
        bev_pool(depth[0], context, geometry)
    with pytest.raises(BevPoolError, match="BevPoolGeometry"):
        bev_pool(depth, context, geometry.ranks_bev)


@needs_extension
def test_the_op_itself_rejects_geometry_for_another_grid():
    geometry, *_ = make_geometry()
    depth, context = random_inputs(geometry)
    g = geometry
    with pytest.raises(RuntimeError, match="ranks_bev .* out of range .*another batch or BEV grid.*bev_geometry"):
        torch.ops.stack.bev_pool(depth, context, g.ranks_depth, g.ranks_feat, g.ranks_bev, g.interval_starts,
                                 g.interval_lengths, g.batch, g.grid_x // 2, g.grid_y // 2)
    with pytest.raises(RuntimeError, match="same dtype"):
        torch.ops.stack.bev_pool(depth, context.double(), g.ranks_depth, g.ranks_feat, g.ranks_bev,
                                 g.interval_starts, g.interval_lengths, g.batch, g.grid_x, g.grid_y)
    with pytest.raises(RuntimeError, match="int32"):
        torch.ops.stack.bev_pool(depth, context, g.ranks_depth.long(), g.ranks_feat, g.ranks_bev,
                                 g.interval_starts, g.interval_lengths, g.batch, g.grid_x, g.grid_y)


def test_reference_fallback_warns_once(monkeypatch):
    geometry, *_ = make_geometry()
    depth, context = random_inputs(geometry)
    monkeypatch.setattr(_extension, "has_kernel", lambda device_type, op="bev_pool": False)
    monkeypatch.setattr(_extension, "_WARNED", set())
    with pytest.warns(RuntimeWarning, match="pure-PyTorch reference"):
        out = bev_pool(depth, context, geometry)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        bev_pool(depth, context, geometry)
    torch.testing.assert_close(out, bev_pool_ref(depth, context, geometry))


@needs_extension
def test_bev_pool_dispatches_to_the_compiled_kernel(monkeypatch):
    geometry, *_ = make_geometry()
    depth, context = random_inputs(geometry)
    module = importlib.import_module("stack.ops.bev_pool")  # the package re-exports a function of that name
    monkeypatch.setattr(module, "bev_pool_ref", lambda *a: pytest.fail("took the reference path"))
    assert _extension.has_kernel("cpu")
    assert bev_pool(depth, context, geometry).shape[1] == context.shape[2]


@needs_extension
@pytest.mark.parametrize("case", sorted(GRIDS))
def test_compiled_geometry_equals_the_pytorch_path(case):
    from stack.ops.bev_pool import _ranks_torch, _rays_in_cells, depth_bin_centres, grid_cells

    _, rigs, depth_cfg, bev = make_geometry(batch=3, bev=GRIDS[case])
    bev = GRIDS[case] or bev
    k, pose = rig_tensors(rigs)
    slopes, offsets = _rays_in_cells(k, pose, 8, 16, 8, bev)
    bins = depth_bin_centres(depth_cfg)
    compiled = torch.ops.stack.bev_geometry_ranks(slopes, offsets, bins, *grid_cells(bev))
    for name, ours, ref in zip(("ranks_depth", "ranks_feat", "ranks_bev", "starts", "lengths"), compiled,
                               _ranks_torch(slopes, offsets, bins, *grid_cells(bev))):
        assert ours.dtype == torch.int32 and torch.equal(ours.long(), ref.long()), name


@needs_extension
def test_compiled_geometry_rejects_bad_tables():
    with pytest.raises(RuntimeError, match=r"slopes must be float64 \(B, N, 3, H, W\)"):
        torch.ops.stack.bev_geometry_ranks(torch.zeros(1, 2, 3, 4, 5), torch.zeros(1, 2, 3, dtype=torch.float64),
                                           torch.ones(4, dtype=torch.float64), 8, 8)
    with pytest.raises(RuntimeError, match=r"offsets must be float64 \(B, N, 3\)"):
        torch.ops.stack.bev_geometry_ranks(torch.zeros(1, 2, 3, 4, 5, dtype=torch.float64),
                                           torch.zeros(2, 2, 3, dtype=torch.float64), torch.ones(4, dtype=torch.float64), 8, 8)
