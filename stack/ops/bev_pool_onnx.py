"""BEV pooling with standard ONNX ops for a fixed rig, for export (no TensorRT plugin).

With the geometry fixed at export time, every non-empty cell gets a constant, padded
list of the points it sums ("slots"). Cells are grouped into a few chunks by how many
points they hold, so padding stays small; per chunk, Gather(depth) and Gather(context)
meet in a batched MatMul (a (1 x L) by (L x C) product per cell); the chunk results and
a zero row are concatenated, and one final Gather places each cell's row into the grid
(empty cells read the zero row).

The exported graph uses only Gather, MatMul, Concat, Reshape, Transpose, Constant and
ConstantOfShape (the tables and the zero row), all native in TensorRT 8.6 and 10.x.
It is exact (no cumsum differences, unlike the LSS cumsum trick) and never uses
ScatterND/ScatterElements with reduction=add, which TensorRT 8.6 silently ignores.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import torch

from stack.ops.bev_pool import BevPoolGeometry

ONNX_OPS = frozenset({"Gather", "MatMul", "Concat", "Reshape", "Transpose", "Constant", "ConstantOfShape"})
"""The ONNX op types an export of `FixedBevPool` may contain."""


@dataclasses.dataclass(frozen=True, eq=False)
class BevPoolTables:
    """Constant gather tables for one geometry (see the module docstring)."""

    depth_index: tuple
    """Per chunk, (cells, slots) int64 into depth.flatten() padded by one zero (padding slots point at it)."""
    feat_index: tuple
    """Per chunk, (cells, slots) int64 into the (B*N*H*W, C) context rows."""
    cell_row: torch.Tensor
    """(B*X*Y,) int64: row of each grid cell in the concatenated chunk results; empty cells -> the zero row."""
    batch: int
    grid_x: int
    grid_y: int

    @property
    def padded_slots(self) -> int:
        return sum(int(t.numel()) for t in self.depth_index)


@torch.no_grad()
def bev_pool_tables(geometry: BevPoolGeometry, chunks: int = 8) -> BevPoolTables:
    """Gather tables for `geometry`, cells split into at most `chunks` groups by points per cell."""
    g = geometry.to("cpu")
    lengths = g.interval_lengths.long()
    order = torch.argsort(lengths, stable=True)
    bounds = _chunk_bounds(lengths[order].numpy(), chunks)
    pad_index = g.batch * g.cameras * g.depth_bins * g.feat_h * g.feat_w
    depth_index, feat_index = [], []
    for lo, hi in zip(bounds[:-1], bounds[1:]):
        cells = order[lo:hi]
        slots = int(lengths[cells].max())
        point = g.interval_starts[cells].long()[:, None] + torch.arange(slots)
        valid = torch.arange(slots) < lengths[cells][:, None]
        point = torch.where(valid, point, 0)
        depth_index.append(torch.where(valid, g.ranks_depth.long()[point], pad_index))
        feat_index.append(torch.where(valid, g.ranks_feat.long()[point], 0))
    cell_row = torch.full((g.batch * g.grid_x * g.grid_y,), g.num_cells, dtype=torch.long)
    cell_row[g.ranks_bev.long()[g.interval_starts.long()[order]]] = torch.arange(g.num_cells)
    return BevPoolTables(tuple(depth_index), tuple(feat_index), cell_row, g.batch, g.grid_x, g.grid_y)


def _chunk_bounds(sorted_lengths: np.ndarray, chunks: int) -> list:
    """Split points (ascending lengths) into <= `chunks` runs minimising sum(cells x max length)."""
    if sorted_lengths.size == 0:
        return [0]
    values, ends = np.unique(sorted_lengths, return_index=False, return_counts=True)
    ends = np.cumsum(ends)  # cells with length <= values[i]
    groups = len(values)
    # best[k][j]: least padded size covering groups 0..j with k+1 chunks; choice[k][j]: where the last starts
    best = ends * values.astype(np.float64)
    choices = [np.zeros(groups, dtype=np.int64)]
    for _ in range(1, min(chunks, groups)):
        new_best, choice = best.copy(), np.zeros(groups, dtype=np.int64)
        for j in range(1, groups):
            starts = np.arange(1, j + 1)
            cost = best[starts - 1] + (ends[j] - ends[starts - 1]) * float(values[j])
            at = int(np.argmin(cost))
            if cost[at] < new_best[j]:
                new_best[j], choice[j] = cost[at], starts[at]
        best = new_best
        choices.append(choice)
    bounds, j = [int(ends[-1])], groups - 1
    for choice in reversed(choices):
        start = int(choice[j])
        if start > 0:
            bounds.append(int(ends[start - 1]))
            j = start - 1
    return [0] + sorted(set(bounds))


def bev_pool_onnx_friendly(depth: torch.Tensor, context: torch.Tensor, tables: BevPoolTables) -> torch.Tensor:
    """`bev_pool` for the fixed geometry of `tables`, in ops that export to standard ONNX (`ONNX_OPS`)."""
    channels = context.shape[2]
    depth_flat = torch.cat([depth.reshape(-1), depth.new_zeros(1)])
    rows = context.permute(0, 1, 3, 4, 2).reshape(-1, channels)
    sums = []
    for depth_index, feat_index in zip(tables.depth_index, tables.feat_index):
        cells, slots = depth_index.shape
        weights = depth_flat.index_select(0, depth_index.reshape(-1)).reshape(cells, 1, slots)
        features = rows.index_select(0, feat_index.reshape(-1)).reshape(cells, slots, channels)
        sums.append(torch.matmul(weights, features).reshape(cells, channels))
    stacked = torch.cat(sums + [depth.new_zeros(1, channels)], dim=0)
    grid = stacked.index_select(0, tables.cell_row)
    return grid.reshape(tables.batch, tables.grid_x, tables.grid_y, channels).permute(0, 3, 1, 2)


class FixedBevPool(torch.nn.Module):
    """BEV pooling for one fixed rig as a module whose tables export as ONNX constants."""

    def __init__(self, geometry: BevPoolGeometry, chunks: int = 8):
        super().__init__()
        tables = bev_pool_tables(geometry, chunks)
        self.chunks = len(tables.depth_index)
        self.batch, self.grid_x, self.grid_y = tables.batch, tables.grid_x, tables.grid_y
        for i, (depth_index, feat_index) in enumerate(zip(tables.depth_index, tables.feat_index)):
            self.register_buffer(f"depth_index_{i}", depth_index, persistent=False)
            self.register_buffer(f"feat_index_{i}", feat_index, persistent=False)
        self.register_buffer("cell_row", tables.cell_row, persistent=False)

    def tables(self) -> BevPoolTables:
        depth_index = tuple(getattr(self, f"depth_index_{i}") for i in range(self.chunks))
        feat_index = tuple(getattr(self, f"feat_index_{i}") for i in range(self.chunks))
        return BevPoolTables(depth_index, feat_index, self.cell_row, self.batch, self.grid_x, self.grid_y)

    def forward(self, depth: torch.Tensor, context: torch.Tensor) -> torch.Tensor:
        return bev_pool_onnx_friendly(depth, context, self.tables())
