"""Training targets from a Batch: CenterPoint heatmaps/regression and BEVDepth depth bins.

Heatmap targets follow CenterNet/CenterPoint (arXiv:1904.07850, 2006.11275): each
box draws a Gaussian at its centre cell in its class channel, with a radius from
CornerNet's `gaussian_radius` on the box footprint in cells (min overlap 0.1, at
least 2 cells), and channels keep the maximum over overlapping boxes. The centre
cell gets exactly 1; the regression target lives only there.

Depth targets follow BEVDepth (arXiv:2206.10092): the metric depth map is reduced
to the feature grid by the nearest valid depth in each stride x stride patch, then
binned; pixels with no depth or outside [min_m, max_m) are ignored.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from stack.batch import IGNORE_INDEX
from stack.pipeline import BevGridConfig, DepthBinsConfig

MIN_OVERLAP = 0.1
MIN_RADIUS = 2


@dataclass
class DetectionTargets:
    """Heatmap (B, C, X, Y) and, per GT box, its centre cell, regression target and validity."""

    heatmap: torch.Tensor
    cell_index: torch.Tensor
    """(B, M) int64 flat index x * Y + y of the centre cell (0 for invalid boxes)."""
    regression: torch.Tensor
    """(B, M, 10) target in REGRESSION_FIELDS order."""
    valid: torch.Tensor
    """(B, M) bool: a real box whose centre lies on the grid."""


def gaussian_radius(length_cells: torch.Tensor, width_cells: torch.Tensor, min_overlap: float = MIN_OVERLAP):
    """CornerNet's radius (in cells) within which a shifted box keeps IoU >= min_overlap."""
    h, w = length_cells, width_cells
    b1 = h + w
    r1 = (b1 + torch.sqrt(b1**2 - 4 * h * w * (1 - min_overlap) / (1 + min_overlap))) / 2
    b2 = 2 * (h + w)
    r2 = (b2 + torch.sqrt(b2**2 - 16 * (1 - min_overlap) * h * w)) / 2
    a3, b3 = 4 * min_overlap, -2 * min_overlap * (h + w)
    r3 = (b3 + torch.sqrt(b3**2 - 4 * a3 * (min_overlap - 1) * w * h)) / 2  # as in CenterPoint's code
    return torch.minimum(torch.minimum(r1, r2), r3)


def encode_detections(boxes: torch.Tensor, labels: torch.Tensor, classes: int, bev: BevGridConfig,
                      grid: tuple[int, int]) -> DetectionTargets:
    """CenterPoint targets for boxes (B, M, 9) in BOX_FIELDS order with labels (B, M) (-1 = padding)."""
    grid_x, grid_y = grid
    u = (boxes[..., 0] - bev.x_range[0]) / bev.cell_size
    v = (boxes[..., 1] - bev.y_range[0]) / bev.cell_size
    cx, cy = torch.floor(u), torch.floor(v)
    valid = (labels >= 0) & (cx >= 0) & (cx < grid_x) & (cy >= 0) & (cy < grid_y)
    radius = gaussian_radius(boxes[..., 3] / bev.cell_size, boxes[..., 4] / bev.cell_size)
    radius = torch.clamp(torch.floor(radius), min=MIN_RADIUS)
    sigma = (2 * radius + 1) / 6
    xs = torch.arange(grid_x, device=boxes.device, dtype=boxes.dtype).view(1, 1, -1, 1)
    ys = torch.arange(grid_y, device=boxes.device, dtype=boxes.dtype).view(1, 1, 1, -1)
    dx, dy = xs - cx[..., None, None], ys - cy[..., None, None]
    r = radius[..., None, None]
    blob = torch.exp(-(dx**2 + dy**2) / (2 * sigma[..., None, None] ** 2))
    blob = blob * ((dx.abs() <= r) & (dy.abs() <= r) & valid[..., None, None])
    one_hot = torch.nn.functional.one_hot(labels.clamp(min=0), classes).to(blob.dtype) * valid[..., None]
    heatmap = (one_hot[..., None, None] * blob[:, :, None]).amax(dim=1) if boxes.shape[1] else \
        boxes.new_zeros(boxes.shape[0], classes, grid_x, grid_y)
    regression = torch.stack([
        u - cx, v - cy, boxes[..., 2],
        torch.log(boxes[..., 3].clamp(min=1e-3)), torch.log(boxes[..., 4].clamp(min=1e-3)),
        torch.log(boxes[..., 5].clamp(min=1e-3)),
        torch.sin(boxes[..., 6]), torch.cos(boxes[..., 6]), boxes[..., 7], boxes[..., 8],
    ], dim=-1)
    cell_index = torch.where(valid, cx * grid_y + cy, torch.zeros_like(cx)).long()
    return DetectionTargets(heatmap, cell_index, regression, valid)


def encode_depth(depth: torch.Tensor, stride: int, bins: DepthBinsConfig) -> torch.Tensor:
    """Depth-bin class (B, N, H/stride, W/stride) int64 from metric depth (B, N, H, W); IGNORE_INDEX where unknown."""
    b, n, h, w = depth.shape
    patches = depth.reshape(b, n, h // stride, stride, w // stride, stride)
    patches = torch.where(patches > 0, patches, torch.full_like(patches, float("inf")))
    nearest = patches.amin(dim=(3, 5))
    index = torch.floor((nearest - bins.min_m) / ((bins.max_m - bins.min_m) / bins.bins))
    valid = torch.isfinite(nearest) & (index >= 0) & (index < bins.bins)
    return torch.where(valid, index, torch.full_like(index, IGNORE_INDEX)).long()


def downsample_labels(semantic: torch.Tensor, stride: int) -> torch.Tensor:
    """Semantic labels (B, N, H, W) at the logits' stride: the label at each patch's centre pixel."""
    return semantic[..., stride // 2::stride, stride // 2::stride]


DRIVABLE_CLASSES = ("road", "lane_marking")
"""Semantic classes whose surface the ego may drive on."""
GROUND_CLASSES = ("sidewalk", "building", "vegetation")
"""Classes whose cells are not drivable; road users' pixels say nothing of the ground under them."""
DRIVABLE_STRIDE = 4
"""Every fourth pixel of each axis is lifted (a 256x128 camera gives 2048 points): enough to vote on every
ground cell within ~20 m, at ~5% of a tiny training step."""


def encode_drivable(depth: torch.Tensor, semantic: torch.Tensor, intrinsics: torch.Tensor, cam_to_ego: torch.Tensor,
                    classes: list, bev: BevGridConfig, grid: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """The BEV drivable-area target lifted from the cameras' own exact labels: (B, X, Y) float 0/1 and (B, X, Y)
    bool known.

    Every labelled pixel with a depth is unprojected (z-depth along the ray through its centre, `stack.rig`
    conventions) into the ego frame and votes for its cell: drivable (DRIVABLE_CLASSES) or not (GROUND_CLASSES);
    a cell is drivable where most votes say so, and unknown where no camera sees its ground. The rendered world
    has no map raster in the shards, and needs none: depth and semantics are exact per pixel (BEVDepth's
    insight that lidar-free BEV nets profit from dense geometric labels, arXiv:2206.10092, applied to the map)."""
    s = DRIVABLE_STRIDE
    d = depth[..., s // 2::s, s // 2::s].float()
    labels = semantic[..., s // 2::s, s // 2::s].long()
    b, n, h, w = d.shape
    v, u = torch.meshgrid(torch.arange(h, device=d.device, dtype=torch.float32) * s + s // 2 + 0.5,
                          torch.arange(w, device=d.device, dtype=torch.float32) * s + s // 2 + 0.5, indexing="ij")
    fx, fy = intrinsics[..., 0, 0, None, None], intrinsics[..., 1, 1, None, None]
    cx, cy = intrinsics[..., 0, 2, None, None], intrinsics[..., 1, 2, None, None]
    camera = torch.stack([(u - cx) / fx * d, (v - cy) / fy * d, d], dim=-1)  # (B, N, h, w, 3)
    ego = torch.einsum("bnij,bnhwj->bnhwi", cam_to_ego[..., :3, :3].float(), camera) + \
        cam_to_ego[..., None, None, :3, 3].float()
    drivable = torch.zeros_like(labels, dtype=torch.bool)
    ground = torch.zeros_like(drivable)
    for name in DRIVABLE_CLASSES:
        drivable |= labels == classes.index(name)
    for name in GROUND_CLASSES:
        ground |= labels == classes.index(name)
    cell_x = torch.floor((ego[..., 0] - bev.x_range[0]) / bev.cell_size).long()
    cell_y = torch.floor((ego[..., 1] - bev.y_range[0]) / bev.cell_size).long()
    vote = (drivable | ground) & (d > 0) & (cell_x >= 0) & (cell_x < grid[0]) & (cell_y >= 0) & (cell_y < grid[1])
    flat = torch.arange(b, device=d.device).view(b, 1, 1, 1) * grid[0] * grid[1] + cell_x * grid[1] + cell_y
    flat = torch.where(vote, flat, torch.zeros_like(flat)).flatten()
    cells = b * grid[0] * grid[1]
    total = torch.zeros(cells, device=d.device).index_add_(0, flat, vote.flatten().float())
    positive = torch.zeros(cells, device=d.device).index_add_(0, flat, (vote & drivable).flatten().float())
    known = total > 0
    target = (positive > total / 2).float()
    return target.view(b, *grid), known.view(b, *grid)
