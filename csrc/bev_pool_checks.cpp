// Argument checks shared by the fused BEV pooling kernels (CPU, CUDA, and the bench-only previous CPU kernel
// in benchmarks/csrc/): each names what is wrong with which tensor and how to fix it. No op registration here,
// so the bench-only extension can link these without redefining the `stack` library.
#include "bev_pool.h"

namespace stack {
namespace {

void check_rank_tensor(const at::Tensor& t, const char* name, const at::Tensor& depth) {
  TORCH_CHECK(t.scalar_type() == at::kInt, "stack::bev_pool: ", name, " must be int32 (as bev_geometry builds it), got ",
              t.scalar_type(), "; convert with .int()");
  TORCH_CHECK(t.dim() == 1, "stack::bev_pool: ", name, " must be 1-D, got shape ", t.sizes());
  TORCH_CHECK(t.device() == depth.device(), "stack::bev_pool: ", name, " is on ", t.device(), " but depth is on ",
              depth.device(), "; move the geometry with geometry.to(device)");
}

BevPoolSizes check_tensors(const at::Tensor& depth, const at::Tensor& feat, const at::Tensor& ranks_depth,
                           const at::Tensor& ranks_feat, const at::Tensor& ranks_bev) {
  TORCH_CHECK(depth.dim() == 5, "stack::bev_pool: depth must be (B, N, D, H, W), got shape ", depth.sizes());
  TORCH_CHECK(feat.dim() == 5, "stack::bev_pool: feat must be (B, N, C, H, W), got shape ", feat.sizes());
  TORCH_CHECK(at::isFloatingType(depth.scalar_type()), "stack::bev_pool: depth must be floating point, got ",
              depth.scalar_type());
  TORCH_CHECK(depth.scalar_type() == feat.scalar_type(), "stack::bev_pool: depth and feat must have the same dtype, got ",
              depth.scalar_type(), " and ", feat.scalar_type(), "; stack.ops.bev_pool promotes them for you");
  TORCH_CHECK(feat.device() == depth.device(), "stack::bev_pool: depth is on ", depth.device(), " but feat on ",
              feat.device());
  TORCH_CHECK(feat.size(0) == depth.size(0) && feat.size(1) == depth.size(1) && feat.size(3) == depth.size(3) &&
                  feat.size(4) == depth.size(4),
              "stack::bev_pool: feat (B, N, C, H, W) ", feat.sizes(), " must share B, N, H, W with depth (B, N, D, H, W) ",
              depth.sizes());
  check_rank_tensor(ranks_depth, "ranks_depth", depth);
  check_rank_tensor(ranks_feat, "ranks_feat", depth);
  check_rank_tensor(ranks_bev, "ranks_bev", depth);
  TORCH_CHECK(ranks_depth.numel() == ranks_bev.numel() && ranks_feat.numel() == ranks_bev.numel(),
              "stack::bev_pool: ranks_depth, ranks_feat and ranks_bev must have one entry per point, got ",
              ranks_depth.numel(), ", ", ranks_feat.numel(), " and ", ranks_bev.numel());
  TORCH_CHECK(depth.numel() < (int64_t(1) << 31), "stack::bev_pool: depth has ", depth.numel(),
              " entries, more than int32 ranks can address; split the batch");
  BevPoolSizes s{};
  s.batch = depth.size(0), s.cameras = depth.size(1), s.bins = depth.size(2);
  s.height = depth.size(3), s.width = depth.size(4), s.channels = feat.size(2);
  s.points = ranks_bev.numel();
  return s;
}

}  // namespace

BevPoolSizes check_forward_args(const at::Tensor& depth, const at::Tensor& feat, const at::Tensor& ranks_depth,
                                const at::Tensor& ranks_feat, const at::Tensor& ranks_bev,
                                const at::Tensor& interval_starts, const at::Tensor& interval_lengths,
                                int64_t batch, int64_t grid_x, int64_t grid_y) {
  BevPoolSizes s = check_tensors(depth, feat, ranks_depth, ranks_feat, ranks_bev);
  check_rank_tensor(interval_starts, "interval_starts", depth);
  check_rank_tensor(interval_lengths, "interval_lengths", depth);
  TORCH_CHECK(interval_starts.numel() == interval_lengths.numel(),
              "stack::bev_pool: interval_starts and interval_lengths must have the same length, got ",
              interval_starts.numel(), " and ", interval_lengths.numel());
  TORCH_CHECK(batch == s.batch, "stack::bev_pool: batch=", batch, " but depth has batch ", s.batch,
              "; the geometry was built for another batch size, rebuild it with stack.ops.bev_geometry");
  TORCH_CHECK(grid_x > 0 && grid_y > 0, "stack::bev_pool: grid_x and grid_y must be positive, got ", grid_x, "x",
              grid_y);
  s.grid_x = grid_x, s.grid_y = grid_y, s.intervals = interval_starts.numel();
  return s;
}

BevPoolSizes check_backward_args(const at::Tensor& grad_out, const at::Tensor& depth, const at::Tensor& feat,
                                 const at::Tensor& ranks_depth, const at::Tensor& ranks_feat,
                                 const at::Tensor& ranks_bev) {
  BevPoolSizes s = check_tensors(depth, feat, ranks_depth, ranks_feat, ranks_bev);
  TORCH_CHECK(grad_out.dim() == 4 && grad_out.size(0) == s.batch && grad_out.size(1) == s.channels,
              "stack::bev_pool_backward: grad_out must be (B, C, X, Y) with B=", s.batch, ", C=", s.channels, ", got ",
              grad_out.sizes());
  TORCH_CHECK(grad_out.scalar_type() == depth.scalar_type() && grad_out.device() == depth.device(),
              "stack::bev_pool_backward: grad_out must match depth's dtype and device, got ", grad_out.scalar_type(),
              " on ", grad_out.device());
  s.grid_x = grad_out.size(2), s.grid_y = grad_out.size(3), s.intervals = 0;
  return s;
}

void check_geometry_flag(int flag, const BevPoolSizes& s) {
  TORCH_CHECK(!(flag & kBadRankBev), "stack::bev_pool: ranks_bev has values out of range for ", s.batch, " x ", s.grid_x,
              " x ", s.grid_y, " cells: the geometry was built for another batch or BEV grid; rebuild it with "
              "stack.ops.bev_geometry for this grid");
  TORCH_CHECK(!(flag & kBadRankDepth), "stack::bev_pool: ranks_depth has values out of range for depth with ",
              s.depth_numel(), " entries: the geometry was built for another shape; rebuild it with stack.ops.bev_geometry");
  TORCH_CHECK(!(flag & kBadRankFeat), "stack::bev_pool: ranks_feat has values out of range for ", s.pixels(),
              " feature pixels: the geometry was built for another shape; rebuild it with stack.ops.bev_geometry");
  TORCH_CHECK(!(flag & kBadInterval), "stack::bev_pool: interval_starts/lengths point outside the ", s.points,
              " points; rebuild the geometry with stack.ops.bev_geometry");
  TORCH_CHECK(!(flag & kFeatNotPixelOfDepth), "stack::bev_pool_backward: ranks_feat[p] must be the pixel of "
              "ranks_depth[p] (as bev_geometry builds them)");
  TORCH_CHECK(!(flag & kUnsortedRanks), "stack::bev_pool_backward: ranks_bev must be sorted ascending (as "
              "bev_geometry builds it); rebuild the geometry with stack.ops.bev_geometry");
}

}  // namespace stack
