// Fused BEV pooling (Lift-Splat "splat" without the frustum tensor): shared declarations.
//
// Layout (BEVPoolv2, batch folded in): every kept frustum point p has
//   ranks_depth[p]  index into depth.flatten(), depth (B, N, D, H, W)
//   ranks_feat[p]   index into the B*N*H*W pixels of feat (B, N, C, H, W)
//   ranks_bev[p]    index into the B*X*Y cells, sorted ascending,
// and interval_starts/lengths (K) cut the points into runs of one cell each.
// The backward also relies on: each ranks_depth value occurs once, and ranks_feat[p] is
// the pixel of ranks_depth[p] (stack.ops.bev_geometry guarantees both).
#pragma once

#include <ATen/ATen.h>
#include <c10/macros/Macros.h>

namespace stack {

struct BevPoolSizes {
  int64_t batch, cameras, bins, height, width, channels;
  int64_t grid_x, grid_y, points, intervals;
  C10_HOST_DEVICE int64_t pixels() const { return batch * cameras * height * width; }
  C10_HOST_DEVICE int64_t cells() const { return batch * grid_x * grid_y; }
  C10_HOST_DEVICE int64_t depth_numel() const { return pixels() * bins; }
};

// Checks dims, dtypes, devices and shapes of the forward arguments; names what is wrong.
BevPoolSizes check_forward_args(const at::Tensor& depth, const at::Tensor& feat, const at::Tensor& ranks_depth,
                                const at::Tensor& ranks_feat, const at::Tensor& ranks_bev,
                                const at::Tensor& interval_starts, const at::Tensor& interval_lengths,
                                int64_t batch, int64_t grid_x, int64_t grid_y);

// The same for the backward (grid size read from grad_out, which must be (B, C, X, Y)).
BevPoolSizes check_backward_args(const at::Tensor& grad_out, const at::Tensor& depth, const at::Tensor& feat,
                                 const at::Tensor& ranks_depth, const at::Tensor& ranks_feat,
                                 const at::Tensor& ranks_bev);

// Bits of the "bad geometry" flag the kernels raise; the message explains each.
enum BadGeometry : int {
  kBadRankDepth = 1,
  kBadRankFeat = 2,
  kBadRankBev = 4,
  kBadInterval = 8,
  kFeatNotPixelOfDepth = 16,
  kUnsortedRanks = 32,
};
void check_geometry_flag(int flag, const BevPoolSizes& sizes);

}  // namespace stack
