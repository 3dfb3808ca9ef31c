"""Fused BEV pooling: the splat step of Lift-Splat-Shoot without the frustum tensor.

Lift-Splat-Shoot (Philion & Fidler, https://arxiv.org/abs/2008.05625) lifts every
camera feature pixel into D depth bins and sums depth-probability x context-feature
products into a bird's-eye-view grid. Done naively that materialises a
(B, N, D, H, W, C) tensor and scatter-adds it. BEVFusion's `bev_pool`
(https://arxiv.org/abs/2205.13542) and BEVDet's BEVPoolv2
(https://arxiv.org/abs/2211.17111) instead precompute, once per rig, which
(camera, depth bin, pixel) lands in which cell, sort the points by cell into
intervals, and sum the products per interval directly into the grid.

`bev_geometry` builds those tables (`BevPoolGeometry`, BEVPoolv2 layout with the
batch folded in); `bev_pool` runs the compiled `torch.ops.stack.bev_pool` (csrc/)
when the extension is built and `bev_pool_ref`, the pure-PyTorch oracle, otherwise.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Sequence

import torch

from stack.errors import StackError
from stack.ops import _extension
from stack.pipeline import BevGridConfig, DepthBinsConfig


class BevPoolError(StackError, ValueError):
    """Inputs of BEV pooling that do not fit together (shape, dtype, device, geometry)."""


@dataclasses.dataclass(frozen=True, eq=False)
class BevPoolGeometry:
    """Which (camera, depth bin, pixel) lands in which BEV cell, for one rig, batch folded in.

    Every kept frustum point p (inside the grid's x, y and z ranges) has three ranks,
    sorted by `ranks_bev`; points outside the grid are absent. Invariants the kernels
    rely on (and `bev_geometry` guarantees): each `ranks_depth` value occurs once, and
    `ranks_feat[p]` is the pixel of `ranks_depth[p]` (its depth-bin index removed).
    """

    ranks_depth: torch.Tensor
    """(P,) int32: index into depth.flatten() of shape (B, N, D, H, W)."""
    ranks_feat: torch.Tensor
    """(P,) int32: index into the (B, N, H, W) pixel positions of the context."""
    ranks_bev: torch.Tensor
    """(P,) int32: index into the (B, X, Y) cells, ascending."""
    interval_starts: torch.Tensor
    """(K,) int32: first point of each run of equal `ranks_bev` (one run per non-empty cell)."""
    interval_lengths: torch.Tensor
    """(K,) int32: points in each run."""
    # The shapes the tables were built for; bev_pool rejects inputs of any other shape.
    batch: int
    cameras: int
    depth_bins: int
    feat_h: int
    feat_w: int
    grid_x: int
    grid_y: int
    # The cameras the tables were built from, for a network that conditions on them (camera-aware depth); the
    # kernels never read them. None where the geometry was made otherwise.
    intrinsics: torch.Tensor | None = None
    """(B, N, 3, 3) pixels."""
    cam_to_ego: torch.Tensor | None = None
    """(B, N, 4, 4)."""

    @property
    def num_points(self) -> int:
        return int(self.ranks_bev.shape[0])

    @property
    def num_cells(self) -> int:
        """Non-empty cells (intervals)."""
        return int(self.interval_starts.shape[0])

    @property
    def device(self) -> torch.device:
        return self.ranks_bev.device

    def to(self, device: torch.device | str) -> "BevPoolGeometry":
        """The same geometry with its tables on `device`."""
        moved = {f.name: getattr(self, f.name).to(device) for f in dataclasses.fields(self)
                 if isinstance(getattr(self, f.name), torch.Tensor)}
        return dataclasses.replace(self, **moved)

    def shape_text(self) -> str:
        return (f"batch={self.batch}, cameras={self.cameras}, depth_bins={self.depth_bins}, "
                f"feature {self.feat_h}x{self.feat_w}, grid {self.grid_x}x{self.grid_y}")


def grid_cells(bev: BevGridConfig) -> tuple[int, int]:
    """(X, Y): cells along ego x and ego y."""
    cells_x = round((bev.x_range[1] - bev.x_range[0]) / bev.cell_size)
    cells_y = round((bev.y_range[1] - bev.y_range[0]) / bev.cell_size)
    return int(cells_x), int(cells_y)


def depth_bin_centres(depth: DepthBinsConfig, device=None, dtype=torch.float64) -> torch.Tensor:
    """(D,) centre of each uniform depth bin, metres."""
    width = (depth.max_m - depth.min_m) / depth.bins
    return depth.min_m + (torch.arange(depth.bins, device=device, dtype=dtype) + 0.5) * width


@torch.no_grad()
def bev_geometry(intrinsics: torch.Tensor, cam_to_ego: torch.Tensor, image_size: Sequence[int],
                 feature_stride: int, depth: DepthBinsConfig, bev: BevGridConfig) -> BevPoolGeometry:
    """Geometry tables for a rig: intrinsics (B, N, 3, 3), cam_to_ego (B, N, 4, 4), image (H, W) px.

    The frustum is sampled at feature-pixel centres ((i + 0.5) * stride px) and depth-bin
    centres (z-depth); conventions are those of `stack.rig`. Runs on the inputs' device.
    """
    _check_rig(intrinsics, cam_to_ego, image_size, feature_stride)
    batch, cameras = intrinsics.shape[:2]
    feat_h, feat_w = image_size[0] // feature_stride, image_size[1] // feature_stride
    grid_x, grid_y = grid_cells(bev)
    shape = (batch, cameras, depth.bins, feat_h, feat_w)
    _check_int32(math.prod(shape), batch * grid_x * grid_y)
    slopes, offsets = _rays_in_cells(intrinsics, cam_to_ego, feat_h, feat_w, feature_stride, bev)
    bins = depth_bin_centres(depth, intrinsics.device)
    if _extension.has_kernel(intrinsics.device.type, "bev_geometry_ranks"):
        tables = torch.ops.stack.bev_geometry_ranks(slopes, offsets, bins, grid_x, grid_y)
    else:
        tables = _ranks_torch(slopes, offsets, bins, grid_x, grid_y)
    ranks_depth, ranks_feat, ranks_bev, starts, lengths = tables
    i32 = torch.int32
    return BevPoolGeometry(
        ranks_depth=ranks_depth.to(i32), ranks_feat=ranks_feat.to(i32), ranks_bev=ranks_bev.to(i32),
        interval_starts=starts.to(i32), interval_lengths=lengths.to(i32),
        batch=batch, cameras=cameras, depth_bins=depth.bins, feat_h=feat_h, feat_w=feat_w,
        grid_x=grid_x, grid_y=grid_y, intrinsics=intrinsics, cam_to_ego=cam_to_ego,
    )


def _rays_in_cells(intrinsics, cam_to_ego, feat_h, feat_w, stride, bev) -> tuple:
    """(slopes (B, N, 3, H, W), offsets (B, N, 3)), float64, in grid units per axis.

    A frustum point is origin + ray(pixel) * z with ray = R K^-1 (u, v, 1) (unit z in the
    camera); in grid units ((coordinate - low) / cell size, height over the z range) it is
    offsets + slopes * z: cell = floor of the first two, inside the grid when the third is in
    [0, 1). float64 so that cell boundaries do not depend on the device.
    """
    device, f64 = intrinsics.device, torch.float64
    u = (torch.arange(feat_w, device=device, dtype=f64) + 0.5) * stride
    v = (torch.arange(feat_h, device=device, dtype=f64) + 0.5) * stride
    pixels = torch.stack([u.expand(feat_h, feat_w), v[:, None].expand(feat_h, feat_w),
                          torch.ones(feat_h, feat_w, device=device, dtype=f64)], dim=-1)
    rays = torch.einsum("bnij,hwj->bnhwi", torch.linalg.inv(intrinsics.to(f64)), pixels)
    rays = rays / rays[..., 2:3]
    pose = cam_to_ego.to(f64)
    rays = torch.einsum("bnij,bnhwj->bnihw", pose[..., :3, :3], rays)
    low = torch.tensor([bev.x_range[0], bev.y_range[0], bev.z_range[0]], device=device, dtype=f64)
    size = torch.tensor([bev.cell_size, bev.cell_size, bev.z_range[1] - bev.z_range[0]], device=device, dtype=f64)
    return (rays / size.view(3, 1, 1)).contiguous(), (pose[..., :3, 3] - low) / size


def _ranks_torch(slopes, offsets, bins, grid_x: int, grid_y: int) -> tuple:
    """The geometry tables with PyTorch ops (any device): per-point cells, nonzero, stable sort."""
    batch, cameras, _, feat_h, feat_w = slopes.shape
    depth_bins = bins.shape[0]

    def in_cells(axis: int) -> torch.Tensor:  # (B, N, D, H, W), one pass
        return torch.addcmul(offsets[:, :, axis].view(batch, cameras, 1, 1, 1),
                             slopes[:, :, axis].unsqueeze(2), bins.view(1, 1, -1, 1, 1))

    cell_x = in_cells(0).floor_().to(torch.int32)
    cell_y = in_cells(1).floor_().to(torch.int32)
    height = in_cells(2)
    keep = (cell_x >= 0) & (cell_x < grid_x) & (cell_y >= 0) & (cell_y < grid_y) & (height >= 0) & (height < 1)
    sample = torch.arange(batch, device=slopes.device, dtype=torch.int32).view(-1, 1, 1, 1, 1)
    cells = (sample * grid_x + cell_x) * grid_y + cell_y
    ranks_depth = keep.reshape(-1).nonzero().squeeze(1)  # flat (B, N, D, H, W) index, ascending
    ranks_bev, order = torch.sort(cells.reshape(-1)[ranks_depth], stable=True)  # int32 keys sort ~2x faster
    ranks_depth = ranks_depth[order]
    pixels = feat_h * feat_w
    ranks_feat = ranks_depth // (depth_bins * pixels) * pixels + ranks_depth % pixels
    _, lengths = torch.unique_consecutive(ranks_bev, return_counts=True)
    return ranks_depth, ranks_feat, ranks_bev, torch.cumsum(lengths, 0) - lengths, lengths


def _check_rig(intrinsics, cam_to_ego, image_size, feature_stride) -> None:
    if intrinsics.dim() != 4 or intrinsics.shape[-2:] != (3, 3):
        raise BevPoolError(f"bev_geometry: intrinsics must be (B, N, 3, 3), got {tuple(intrinsics.shape)}; "
                           "add batch and camera axes (e.g. K[None] for one sample)")
    if cam_to_ego.shape != (*intrinsics.shape[:2], 4, 4):
        raise BevPoolError(f"bev_geometry: cam_to_ego must be (B, N, 4, 4) = {(*intrinsics.shape[:2], 4, 4)} "
                           f"to match intrinsics, got {tuple(cam_to_ego.shape)}")
    height, width = image_size
    if feature_stride <= 0 or height % feature_stride or width % feature_stride:
        raise BevPoolError(f"bev_geometry: image size {height}x{width} px must be a multiple of the feature "
                           f"stride {feature_stride}; pick a stride that divides both")


def _check_int32(depth_elements: int, cells: int) -> None:
    if max(depth_elements, cells) >= 2**31:
        raise BevPoolError(f"bev_geometry: {depth_elements} depth entries / {cells} cells do not fit the int32 "
                           "ranks; split the batch")


# --------------------------------------------------------------------------- pooling


def bev_pool_ref(depth: torch.Tensor, context: torch.Tensor, geometry: BevPoolGeometry) -> torch.Tensor:
    """The oracle: gather the kept points, multiply, `index_add` into (B, C, X, Y)."""
    channels = context.shape[2]
    values = depth.reshape(-1)[geometry.ranks_depth.long()]
    features = context.permute(0, 1, 3, 4, 2).reshape(-1, channels)[geometry.ranks_feat.long()]
    cells = geometry.batch * geometry.grid_x * geometry.grid_y
    out = torch.zeros(cells, channels, dtype=values.dtype, device=values.device)
    out = out.index_add(0, geometry.ranks_bev.long(), features * values[:, None])
    return out.view(geometry.batch, geometry.grid_x, geometry.grid_y, channels).permute(0, 3, 1, 2).contiguous()


def bev_pool(depth: torch.Tensor, context: torch.Tensor, geometry: BevPoolGeometry) -> torch.Tensor:
    """Sum depth (B, N, D, H, W) x context (B, N, C, H, W) into the BEV grid (B, C, X, Y).

    Differentiable w.r.t. depth and context; mixed float dtypes are promoted. Uses the
    compiled kernels for the inputs' device when built, else `bev_pool_ref` (warned once).
    The kernels read context channels-last: a context that already is (e.g. a channels_last
    conv output of shape (B*N, C, H, W) viewed to 5-D) saves them one copy.
    """
    check_bev_pool_inputs(depth, context, geometry)
    dtype = torch.promote_types(depth.dtype, context.dtype)
    depth, context = depth.to(dtype), context.to(dtype)
    if _extension.has_kernel(depth.device.type):
        g = geometry
        return torch.ops.stack.bev_pool(depth, context, g.ranks_depth, g.ranks_feat, g.ranks_bev,
                                        g.interval_starts, g.interval_lengths, g.batch, g.grid_x, g.grid_y)
    if not torch.compiler.is_compiling():
        _extension.warn_reference_once(depth.device.type)
    return bev_pool_ref(depth, context, geometry)


def extension_loaded() -> bool:
    """True when the compiled `stack._C` kernels are registered."""
    return _extension.load()


def check_bev_pool_inputs(depth: torch.Tensor, context: torch.Tensor, geometry: BevPoolGeometry) -> None:
    """Raise BevPoolError naming what was expected and found when the inputs do not fit together."""
    if not isinstance(geometry, BevPoolGeometry):
        raise BevPoolError(f"bev_pool: geometry must be a BevPoolGeometry from bev_geometry(), got {type(geometry).__name__}")
    if depth.dim() != 5 or context.dim() != 5:
        raise BevPoolError(f"bev_pool: depth must be (B, N, D, H, W) and context (B, N, C, H, W); got "
                           f"{tuple(depth.shape)} and {tuple(context.shape)}")
    for name, tensor in (("depth", depth), ("context", context)):
        if not tensor.is_floating_point():
            raise BevPoolError(f"bev_pool: {name} must be a floating-point tensor, got {tensor.dtype}")
    g = geometry
    expected = (g.batch, g.cameras, g.depth_bins, g.feat_h, g.feat_w)
    if tuple(depth.shape) != expected:
        raise BevPoolError(f"bev_pool: depth has shape {tuple(depth.shape)} but the geometry was built for "
                           f"{expected} (B, N, D, H, W; {g.shape_text()}); rebuild it with bev_geometry() for "
                           "this rig, batch and depth bins")
    if (context.shape[:2], context.shape[3:]) != (depth.shape[:2], depth.shape[3:]):
        raise BevPoolError(f"bev_pool: context {tuple(context.shape)} must be (B, N, C, H, W) with the B, N, H, W "
                           f"of depth {tuple(depth.shape)}")
    if not depth.device == context.device == g.device:
        raise BevPoolError(f"bev_pool: depth ({depth.device}), context ({context.device}) and geometry "
                           f"({g.device}) must share a device; move the geometry with geometry.to(device)")
