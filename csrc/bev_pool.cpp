// Fused BEV pooling: the op schema, argument checks and the CPU kernels.
//
// Forward: one task per non-empty cell (interval) sums depth * feature over its points
// into a channel accumulator, then writes the cell once; no atomics, no frustum tensor.
// Backward: a dense map depth entry -> point turns both gradients into gathers, one task
// per feature pixel (its D depth bins), so no two tasks write the same memory.
#include <Python.h>

#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <atomic>
#include <vector>

#include "bev_pool.h"

extern "C" {
// `import stack._C` loads this library, which runs the TORCH_LIBRARY registrations below.
PyObject* PyInit__C(void) {
  static struct PyModuleDef module_def = {PyModuleDef_HEAD_INIT, "_C", nullptr, -1, nullptr};
  return PyModule_Create(&module_def);
}
}

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
              "ranks_depth[p] and ranks_depth must not repeat (as bev_geometry builds them)");
}

namespace {

template <typename scalar_t>
void forward_cpu(const BevPoolSizes& s, const scalar_t* depth, const scalar_t* feat, const int* rd, const int* rf,
                 const int* rb, const int* starts, const int* lengths, scalar_t* out, std::atomic<int>& bad) {
  using acc_t = at::opmath_type<scalar_t>;
  const int64_t C = s.channels, plane = s.grid_x * s.grid_y;
  at::parallel_for(0, s.intervals, 16, [&](int64_t begin, int64_t end) {
    std::vector<acc_t> acc(C);
    for (int64_t k = begin; k < end; ++k) {
      const int64_t first = starts[k], last = first + lengths[k];
      if (first < 0 || lengths[k] <= 0 || last > s.points) { bad |= kBadInterval; continue; }
      const int64_t cell = rb[first];
      if (cell < 0 || cell >= s.cells()) { bad |= kBadRankBev; continue; }
      std::fill(acc.begin(), acc.end(), acc_t(0));
      for (int64_t p = first; p < last; ++p) {
        const int64_t id = rd[p], pixel = rf[p];
        if (id < 0 || id >= s.depth_numel()) { bad |= kBadRankDepth; break; }
        if (pixel < 0 || pixel >= s.pixels()) { bad |= kBadRankFeat; break; }
        const acc_t weight = depth[id];
        const scalar_t* f = feat + pixel * C;
        for (int64_t c = 0; c < C; ++c) acc[c] += weight * static_cast<acc_t>(f[c]);
      }
      scalar_t* o = out + (cell / plane) * C * plane + cell % plane;
      for (int64_t c = 0; c < C; ++c) o[c * plane] = static_cast<scalar_t>(acc[c]);
    }
  });
}

at::Tensor bev_pool_cpu(const at::Tensor& depth, const at::Tensor& feat, const at::Tensor& ranks_depth,
                        const at::Tensor& ranks_feat, const at::Tensor& ranks_bev, const at::Tensor& interval_starts,
                        const at::Tensor& interval_lengths, int64_t batch, int64_t grid_x, int64_t grid_y) {
  const BevPoolSizes s = check_forward_args(depth, feat, ranks_depth, ranks_feat, ranks_bev, interval_starts,
                                            interval_lengths, batch, grid_x, grid_y);
  const at::Tensor depth_c = depth.contiguous();
  const at::Tensor feat_cl = feat.permute({0, 1, 3, 4, 2}).contiguous();  // (B, N, H, W, C): a point reads C in a row
  const at::Tensor rd = ranks_depth.contiguous(), rf = ranks_feat.contiguous(), rb = ranks_bev.contiguous();
  const at::Tensor starts = interval_starts.contiguous(), lengths = interval_lengths.contiguous();
  at::Tensor out = at::zeros({batch, s.channels, grid_x, grid_y}, depth.options());
  std::atomic<int> bad{0};
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, depth.scalar_type(), "bev_pool_cpu", [&] {
    forward_cpu<scalar_t>(s, depth_c.const_data_ptr<scalar_t>(), feat_cl.const_data_ptr<scalar_t>(),
                          rd.const_data_ptr<int>(), rf.const_data_ptr<int>(), rb.const_data_ptr<int>(),
                          starts.const_data_ptr<int>(), lengths.const_data_ptr<int>(), out.mutable_data_ptr<scalar_t>(),
                          bad);
  });
  check_geometry_flag(bad.load(), s);
  return out;
}

// point_of[depth entry] = the point that reads it, or -1 (dropped).
at::Tensor point_of_depth_entry(const BevPoolSizes& s, const at::Tensor& rd, const at::Tensor& rf, std::atomic<int>& bad) {
  at::Tensor point_of = at::full({s.depth_numel()}, -1, rd.options());
  int* map = point_of.mutable_data_ptr<int>();
  const int* d = rd.const_data_ptr<int>();
  const int* f = rf.const_data_ptr<int>();
  const int64_t plane = s.height * s.width;
  at::parallel_for(0, s.points, 4096, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; ++p) {
      const int64_t id = d[p];
      if (id < 0 || id >= s.depth_numel()) { bad |= kBadRankDepth; continue; }
      if (f[p] != id / (s.bins * plane) * plane + id % plane) { bad |= kFeatNotPixelOfDepth; continue; }
      map[id] = static_cast<int>(p);
    }
  });
  return point_of;
}

template <typename scalar_t>
void backward_cpu(const BevPoolSizes& s, const scalar_t* grad, const scalar_t* depth, const scalar_t* feat,
                  const int* point_of, const int* rb, scalar_t* grad_depth, scalar_t* grad_feat, std::atomic<int>& bad) {
  using acc_t = at::opmath_type<scalar_t>;
  const int64_t C = s.channels, plane = s.height * s.width;
  at::parallel_for(0, s.pixels(), 64, [&](int64_t begin, int64_t end) {
    std::vector<acc_t> acc(C);
    for (int64_t q = begin; q < end; ++q) {
      const int64_t camera = q / plane, pixel = q % plane;
      const scalar_t* f = feat + q * C;
      std::fill(acc.begin(), acc.end(), acc_t(0));
      for (int64_t d = 0; d < s.bins; ++d) {
        const int64_t id = (camera * s.bins + d) * plane + pixel;
        const int64_t p = point_of[id];
        const int64_t cell = p < 0 ? -1 : rb[p];
        if (p >= 0 && (cell < 0 || cell >= s.cells())) bad |= kBadRankBev;
        if (cell < 0 || cell >= s.cells()) { grad_depth[id] = scalar_t(0); continue; }
        const scalar_t* g = grad + cell * C;
        const acc_t weight = depth[id];
        acc_t dot = 0;
        for (int64_t c = 0; c < C; ++c) {
          dot += static_cast<acc_t>(f[c]) * static_cast<acc_t>(g[c]);
          acc[c] += weight * static_cast<acc_t>(g[c]);
        }
        grad_depth[id] = static_cast<scalar_t>(dot);
      }
      for (int64_t c = 0; c < C; ++c) grad_feat[q * C + c] = static_cast<scalar_t>(acc[c]);
    }
  });
}

std::tuple<at::Tensor, at::Tensor> bev_pool_backward_cpu(const at::Tensor& grad_out, const at::Tensor& depth,
                                                         const at::Tensor& feat, const at::Tensor& ranks_depth,
                                                         const at::Tensor& ranks_feat, const at::Tensor& ranks_bev) {
  const BevPoolSizes s = check_backward_args(grad_out, depth, feat, ranks_depth, ranks_feat, ranks_bev);
  const at::Tensor depth_c = depth.contiguous();
  const at::Tensor feat_cl = feat.permute({0, 1, 3, 4, 2}).contiguous();
  const at::Tensor grad_cl = grad_out.permute({0, 2, 3, 1}).contiguous();  // (B, X, Y, C): a cell's C in a row
  const at::Tensor rb = ranks_bev.contiguous();
  std::atomic<int> bad{0};
  const at::Tensor point_of = point_of_depth_entry(s, ranks_depth.contiguous(), ranks_feat.contiguous(), bad);
  check_geometry_flag(bad.load(), s);
  at::Tensor grad_depth = at::empty_like(depth_c);
  at::Tensor grad_feat_cl = at::empty_like(feat_cl);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, depth.scalar_type(), "bev_pool_backward_cpu", [&] {
    backward_cpu<scalar_t>(s, grad_cl.const_data_ptr<scalar_t>(), depth_c.const_data_ptr<scalar_t>(),
                           feat_cl.const_data_ptr<scalar_t>(), point_of.const_data_ptr<int>(), rb.const_data_ptr<int>(),
                           grad_depth.mutable_data_ptr<scalar_t>(), grad_feat_cl.mutable_data_ptr<scalar_t>(), bad);
  });
  check_geometry_flag(bad.load(), s);
  return {grad_depth, grad_feat_cl.permute({0, 1, 4, 2, 3}).contiguous()};
}

}  // namespace

TORCH_LIBRARY(stack, m) {
  m.def("bev_pool(Tensor depth, Tensor feat, Tensor ranks_depth, Tensor ranks_feat, Tensor ranks_bev, "
        "Tensor interval_starts, Tensor interval_lengths, int batch, int grid_x, int grid_y) -> Tensor");
  m.def("bev_pool_backward(Tensor grad_out, Tensor depth, Tensor feat, Tensor ranks_depth, Tensor ranks_feat, "
        "Tensor ranks_bev) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(stack, CPU, m) {
  m.impl("bev_pool", &bev_pool_cpu);
  m.impl("bev_pool_backward", &bev_pool_backward_cpu);
}

}  // namespace stack
