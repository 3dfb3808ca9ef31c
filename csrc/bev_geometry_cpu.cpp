// BEV pooling geometry on the CPU: which frustum point lands in which cell, sorted by cell.
//
// stack.ops.bev_geometry computes, per camera and feature pixel, the ray in grid units
// (slopes) and the camera origin in grid units (offsets); a point at depth-bin centre z is
// offset + slope * z. This kernel does the rest in two passes over the B*N*D*H*W points --
// cell and in-grid test with a per-cell count, then a counting sort that places the kept
// points by cell, in ascending depth-entry order within a cell (a stable sort, so the
// result equals the PyTorch path's). That is O(points) instead of the elementwise chain,
// nonzero, gather and comparison sort the PyTorch path runs, which dominates a CPU
// training step's lift-splat when augmentation changes the rig every batch.
#include <ATen/ATen.h>
#include <torch/library.h>

#include <cmath>
#include <vector>

namespace stack {
namespace {

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> bev_geometry_ranks_cpu(
    const at::Tensor& slopes, const at::Tensor& offsets, const at::Tensor& bins, int64_t grid_x, int64_t grid_y) {
  TORCH_CHECK(slopes.dim() == 5 && slopes.size(2) == 3 && slopes.scalar_type() == at::kDouble,
              "stack::bev_geometry_ranks: slopes must be float64 (B, N, 3, H, W), got ", slopes.scalar_type(), " ",
              slopes.sizes());
  const int64_t B = slopes.size(0), N = slopes.size(1), H = slopes.size(3), W = slopes.size(4);
  TORCH_CHECK(offsets.scalar_type() == at::kDouble && offsets.dim() == 3 && offsets.size(0) == B &&
                  offsets.size(1) == N && offsets.size(2) == 3,
              "stack::bev_geometry_ranks: offsets must be float64 (B, N, 3) = (", B, ", ", N, ", 3), got ",
              offsets.scalar_type(), " ", offsets.sizes());
  TORCH_CHECK(bins.scalar_type() == at::kDouble && bins.dim() == 1 && bins.numel() > 0,
              "stack::bev_geometry_ranks: bins must be a non-empty float64 (D,) tensor, got ", bins.scalar_type(), " ",
              bins.sizes());
  TORCH_CHECK(grid_x > 0 && grid_y > 0, "stack::bev_geometry_ranks: grid must be positive, got ", grid_x, "x", grid_y);
  const int64_t D = bins.numel(), plane = H * W, total = B * N * D * plane, cells = B * grid_x * grid_y;
  TORCH_CHECK(total < (int64_t(1) << 31) && cells < (int64_t(1) << 31), "stack::bev_geometry_ranks: ", total,
              " frustum points / ", cells, " cells do not fit int32 ranks; split the batch");
  const at::Tensor slopes_c = slopes.contiguous(), offsets_c = offsets.contiguous(), bins_c = bins.contiguous();
  const double* slope = slopes_c.const_data_ptr<double>();
  const double* offset = offsets_c.const_data_ptr<double>();
  const double* bin = bins_c.const_data_ptr<double>();

  std::vector<int32_t> cell_of(total), count(cells, 0);
  for (int64_t camera = 0; camera < B * N; ++camera) {
    const int64_t sample = camera / N;
    const double* s = slope + camera * 3 * plane;
    const double* o = offset + camera * 3;
    for (int64_t d = 0; d < D; ++d) {
      int32_t* out = cell_of.data() + (camera * D + d) * plane;
      for (int64_t i = 0; i < plane; ++i) {
        const double x = std::floor(o[0] + s[i] * bin[d]), y = std::floor(o[1] + s[plane + i] * bin[d]);
        const double z = o[2] + s[2 * plane + i] * bin[d];
        const bool keep = x >= 0 && x < grid_x && y >= 0 && y < grid_y && z >= 0 && z < 1;
        out[i] = keep ? static_cast<int32_t>((sample * grid_x + int64_t(x)) * grid_y + int64_t(y)) : -1;
        if (keep) ++count[out[i]];
      }
    }
  }
  std::vector<int32_t> next(cells);
  int64_t points = 0, intervals = 0;
  for (int64_t c = 0; c < cells; ++c) {
    next[c] = static_cast<int32_t>(points);
    points += count[c];
    intervals += count[c] > 0;
  }
  const auto i32 = at::TensorOptions().dtype(at::kInt);
  at::Tensor ranks_depth = at::empty({points}, i32), ranks_feat = at::empty({points}, i32);
  at::Tensor ranks_bev = at::empty({points}, i32);
  at::Tensor starts = at::empty({intervals}, i32), lengths = at::empty({intervals}, i32);
  int32_t *rd = ranks_depth.mutable_data_ptr<int32_t>(), *rf = ranks_feat.mutable_data_ptr<int32_t>();
  int32_t *rb = ranks_bev.mutable_data_ptr<int32_t>();
  int32_t *st = starts.mutable_data_ptr<int32_t>(), *len = lengths.mutable_data_ptr<int32_t>();
  for (int64_t c = 0, k = 0; c < cells; ++c) {
    if (count[c] > 0) st[k] = next[c], len[k++] = count[c];
  }
  for (int64_t id = 0; id < total; ++id) {
    const int32_t cell = cell_of[id];
    if (cell < 0) continue;
    const int32_t p = next[cell]++;
    rd[p] = static_cast<int32_t>(id), rb[p] = cell;
    rf[p] = static_cast<int32_t>(id / (D * plane) * plane + id % plane);
  }
  return {ranks_depth, ranks_feat, ranks_bev, starts, lengths};
}

}  // namespace

TORCH_LIBRARY_IMPL(stack, CPU, m) {
  m.impl("bev_geometry_ranks", &bev_geometry_ranks_cpu);
}

}  // namespace stack
