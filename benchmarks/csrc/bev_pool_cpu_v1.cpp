// The previous fused BEV pooling CPU kernels, kept only so that `stack bench ops` can time them
// side by side with csrc/bev_pool_cpu.cpp in one run. Not part of stack._C: benchmarks/bev_pool_v1.py
// compiles this file (with csrc/bev_pool_checks.cpp) into a library of its own on first use, registering
// stack_bench::bev_pool_v1 / stack_bench::bev_pool_backward_v1 (the arguments and results of stack::bev_pool
// and stack::bev_pool_backward). Nothing a user runs calls them.
//
// Forward: tiles of 64 cells, intervals summed point by point into a (cells x C) accumulator in
// memory, written out with scalar strided stores. Backward: a dense map depth entry -> point, one
// task per feature pixel gathering rows of a channels-last copy of the incoming gradient.
#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <vector>

#include "bev_pool.h"

#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__) && defined(__linux__)
#define STACK_CPU_CLONES __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#else
#define STACK_CPU_CLONES
#endif

namespace stack {
namespace {

template <typename scalar_t>
struct Tables {
  BevPoolSizes s;
  const scalar_t* depth;  // (B, N, D, H, W)
  const scalar_t* feat;   // (B, N, H, W, C): one point reads C values in a row
  const scalar_t* grad;   // backward: (B, X, Y, C)
  const int* rd;
  const int* rf;
  const int* rb;
  const int* starts;
  const int* lengths;
  const int* point_of;  // backward: depth entry -> point, -1 where dropped
};

constexpr int64_t kTileCells = 64;  // cells of one output row segment accumulated together

template <typename scalar_t>
C10_ALWAYS_INLINE int64_t interval_cell(const Tables<scalar_t>& t, int64_t k) {
  const int64_t first = t.starts[k];
  return first < 0 || first >= t.s.points ? -1 : t.rb[first];
}

// Tiles [tile_begin, tile_end) of the output, each kTileCells consecutive cells of one sample:
// the tile's intervals accumulate into `tile` (cells x C, in cache), which is then written out
// as C contiguous runs -- every output element once, empty cells as zeros.
template <typename scalar_t, typename acc_t>
C10_ALWAYS_INLINE int forward_tiles(const Tables<scalar_t>& t, scalar_t* out, int64_t tile_begin, int64_t tile_end,
                                    acc_t* tile) {
  const BevPoolSizes& s = t.s;
  const int64_t C = s.channels, plane = s.grid_x * s.grid_y, per_plane = (plane + kTileCells - 1) / kTileCells;
  const auto first_cell_of = [&](int64_t tile_id) { return tile_id / per_plane * plane + tile_id % per_plane * kTileCells; };
  int64_t k = 0, high = s.intervals;  // first interval at or after this range's first cell
  for (const int64_t target = first_cell_of(tile_begin); k < high;) {
    const int64_t mid = (k + high) / 2;
    (interval_cell(t, mid) < target ? k = mid + 1 : high = mid);
  }
  for (int64_t tile_id = tile_begin; tile_id < tile_end; ++tile_id) {
    const int64_t first_cell = first_cell_of(tile_id);
    const int64_t count = std::min(kTileCells, plane - tile_id % per_plane * kTileCells);
    std::fill(tile, tile + count * C, acc_t(0));
    for (; k < s.intervals; ++k) {
      const int64_t cell = interval_cell(t, k), first = t.starts[k], last = first + t.lengths[k];
      if (cell >= first_cell + count) break;
      if (cell < first_cell || last <= first || last > s.points) return kBadInterval;  // outside, empty or unsorted
      acc_t* __restrict__ acc = tile + (cell - first_cell) * C;
      for (int64_t p = first; p < last; ++p) {
        const int64_t id = t.rd[p], pixel = t.rf[p];
        if (id < 0 || id >= s.depth_numel()) return kBadRankDepth;
        if (pixel < 0 || pixel >= s.pixels()) return kBadRankFeat;
        const acc_t weight = t.depth[id];
        const scalar_t* __restrict__ f = t.feat + pixel * C;
        for (int64_t c = 0; c < C; ++c) acc[c] += weight * static_cast<acc_t>(f[c]);
      }
    }
    const int64_t b = tile_id / per_plane;
    for (int64_t c = 0; c < C; ++c) {
      scalar_t* __restrict__ o = out + (b * C + c) * plane + (first_cell - b * plane);
      for (int64_t j = 0; j < count; ++j) o[j] = static_cast<scalar_t>(tile[j * C + c]);
    }
  }
  return tile_end == s.batch * per_plane && k < s.intervals ? kBadRankBev : 0;  // cells past the grid
}

int64_t output_tiles(const BevPoolSizes& s) {
  return s.batch * ((s.grid_x * s.grid_y + kTileCells - 1) / kTileCells);
}

STACK_CPU_CLONES int forward_tiles_float(const Tables<float>& t, float* out, int64_t begin, int64_t end, float* tile) {
  return forward_tiles<float, float>(t, out, begin, end, tile);
}

// The dispatcher's entry: float takes the vectorised clones, other dtypes the generic loop.
template <typename scalar_t, typename acc_t>
int run_forward(const Tables<scalar_t>& t, scalar_t* out, int64_t begin, int64_t end, acc_t* tile) {
  return forward_tiles<scalar_t, acc_t>(t, out, begin, end, tile);
}
int run_forward(const Tables<float>& t, float* out, int64_t begin, int64_t end, float* tile) {
  return forward_tiles_float(t, out, begin, end, tile);
}

// sum(f * g) in kLanes independent partial sums (a fixed order, so still deterministic), which
// the compiler keeps in one vector register instead of a serial chain of scalar adds.
template <typename scalar_t, typename acc_t>
C10_ALWAYS_INLINE acc_t dot_product(const scalar_t* __restrict__ f, const scalar_t* __restrict__ g, int64_t n) {
  constexpr int64_t kLanes = 16;
  acc_t lanes[kLanes] = {};
  int64_t c = 0;
  for (; c + kLanes <= n; c += kLanes) {
    for (int64_t j = 0; j < kLanes; ++j) lanes[j] += static_cast<acc_t>(f[c + j]) * static_cast<acc_t>(g[c + j]);
  }
  acc_t dot = 0;
  for (int64_t j = 0; j < kLanes; ++j) dot += lanes[j];
  for (; c < n; ++c) dot += static_cast<acc_t>(f[c]) * static_cast<acc_t>(g[c]);
  return dot;
}

template <typename scalar_t, typename acc_t>
C10_ALWAYS_INLINE int backward_range(const Tables<scalar_t>& t, scalar_t* grad_depth, scalar_t* grad_feat,
                                     int64_t begin, int64_t end, acc_t* acc) {
  const BevPoolSizes& s = t.s;
  const int64_t C = s.channels, plane = s.height * s.width;
  int bad = 0;
  for (int64_t q = begin; q < end; ++q) {
    const int64_t camera = q / plane, pixel = q % plane;
    const scalar_t* __restrict__ f = t.feat + q * C;
    std::fill(acc, acc + C, acc_t(0));
    for (int64_t d = 0; d < s.bins; ++d) {
      const int64_t id = (camera * s.bins + d) * plane + pixel;
      const int64_t p = t.point_of[id];
      const int64_t cell = p < 0 ? -1 : t.rb[p];
      if (p >= 0 && (cell < 0 || cell >= s.cells())) bad |= kBadRankBev;
      if (cell < 0 || cell >= s.cells()) {
        grad_depth[id] = scalar_t(0);
        continue;
      }
      const scalar_t* __restrict__ g = t.grad + cell * C;
      const acc_t weight = t.depth[id];
      for (int64_t c = 0; c < C; ++c) acc[c] += weight * static_cast<acc_t>(g[c]);
      grad_depth[id] = static_cast<scalar_t>(dot_product<scalar_t, acc_t>(f, g, C));
    }
    for (int64_t c = 0; c < C; ++c) grad_feat[q * C + c] = static_cast<scalar_t>(acc[c]);
  }
  return bad;
}

STACK_CPU_CLONES int backward_range_float(const Tables<float>& t, float* grad_depth, float* grad_feat, int64_t begin,
                                          int64_t end, float* acc) {
  return backward_range<float, float>(t, grad_depth, grad_feat, begin, end, acc);
}

template <typename scalar_t, typename acc_t>
int run_backward(const Tables<scalar_t>& t, scalar_t* grad_depth, scalar_t* grad_feat, int64_t begin, int64_t end,
                 acc_t* acc) {
  return backward_range<scalar_t, acc_t>(t, grad_depth, grad_feat, begin, end, acc);
}
int run_backward(const Tables<float>& t, float* grad_depth, float* grad_feat, int64_t begin, int64_t end, float* acc) {
  return backward_range_float(t, grad_depth, grad_feat, begin, end, acc);
}

template <typename scalar_t>
Tables<scalar_t> tables(const BevPoolSizes& s, const at::Tensor& depth, const at::Tensor& feat, const at::Tensor& rd,
                        const at::Tensor& rf, const at::Tensor& rb) {
  Tables<scalar_t> t{};
  t.s = s;
  t.depth = depth.const_data_ptr<scalar_t>(), t.feat = feat.const_data_ptr<scalar_t>();
  t.rd = rd.const_data_ptr<int>(), t.rf = rf.const_data_ptr<int>(), t.rb = rb.const_data_ptr<int>();
  return t;
}

at::Tensor bev_pool_cpu(const at::Tensor& depth, const at::Tensor& feat, const at::Tensor& ranks_depth,
                        const at::Tensor& ranks_feat, const at::Tensor& ranks_bev, const at::Tensor& interval_starts,
                        const at::Tensor& interval_lengths, int64_t batch, int64_t grid_x, int64_t grid_y) {
  const BevPoolSizes s = check_forward_args(depth, feat, ranks_depth, ranks_feat, ranks_bev, interval_starts,
                                            interval_lengths, batch, grid_x, grid_y);
  if (s.intervals == 0) return at::zeros({batch, s.channels, grid_x, grid_y}, depth.options());
  const at::Tensor depth_c = depth.contiguous(), feat_cl = feat.permute({0, 1, 3, 4, 2}).contiguous();
  const at::Tensor rd = ranks_depth.contiguous(), rf = ranks_feat.contiguous(), rb = ranks_bev.contiguous();
  const at::Tensor starts = interval_starts.contiguous(), lengths = interval_lengths.contiguous();
  at::Tensor out = at::empty({batch, s.channels, grid_x, grid_y}, depth.options());  // every element written once
  std::atomic<int> bad{0};
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, depth.scalar_type(), "bev_pool_cpu", [&] {
    using acc_t = at::opmath_type<scalar_t>;
    Tables<scalar_t> t = tables<scalar_t>(s, depth_c, feat_cl, rd, rf, rb);
    t.starts = starts.const_data_ptr<int>(), t.lengths = lengths.const_data_ptr<int>();
    scalar_t* o = out.mutable_data_ptr<scalar_t>();
    at::parallel_for(0, output_tiles(s), 4, [&](int64_t begin, int64_t end) {
      std::vector<acc_t> tile(kTileCells * s.channels);
      bad |= run_forward(t, o, begin, end, tile.data());
    });
  });
  check_geometry_flag(bad.load(), s);
  return out;
}

// point_of[depth entry] = the point that reads it, or -1 (dropped).
at::Tensor point_of_depth_entry(const BevPoolSizes& s, const at::Tensor& rd, const at::Tensor& rf) {
  at::Tensor point_of = at::full({s.depth_numel()}, -1, rd.options());
  int* map = point_of.mutable_data_ptr<int>();
  const int* d = rd.const_data_ptr<int>();
  const int* f = rf.const_data_ptr<int>();
  const int64_t plane = s.height * s.width;
  std::atomic<int> bad{0};
  at::parallel_for(0, s.points, 4096, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; ++p) {
      const int64_t id = d[p];
      if (id < 0 || id >= s.depth_numel()) { bad |= kBadRankDepth; return; }
      if (f[p] != id / (s.bins * plane) * plane + id % plane) { bad |= kFeatNotPixelOfDepth; return; }
      map[id] = static_cast<int>(p);
    }
  });
  check_geometry_flag(bad.load(), s);
  return point_of;
}

std::tuple<at::Tensor, at::Tensor> bev_pool_backward_cpu(const at::Tensor& grad_out, const at::Tensor& depth,
                                                         const at::Tensor& feat, const at::Tensor& ranks_depth,
                                                         const at::Tensor& ranks_feat, const at::Tensor& ranks_bev) {
  const BevPoolSizes s = check_backward_args(grad_out, depth, feat, ranks_depth, ranks_feat, ranks_bev);
  const at::Tensor depth_c = depth.contiguous(), feat_cl = feat.permute({0, 1, 3, 4, 2}).contiguous();
  const at::Tensor grad_cl = grad_out.permute({0, 2, 3, 1}).contiguous();  // (B, X, Y, C): a cell's C in a row
  const at::Tensor rd = ranks_depth.contiguous(), rf = ranks_feat.contiguous(), rb = ranks_bev.contiguous();
  const at::Tensor point_of = point_of_depth_entry(s, rd, rf);
  at::Tensor grad_depth = at::empty_like(depth_c);
  at::Tensor grad_feat_cl = at::empty_like(feat_cl);
  std::atomic<int> bad{0};
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, depth.scalar_type(), "bev_pool_backward_cpu", [&] {
    using acc_t = at::opmath_type<scalar_t>;
    Tables<scalar_t> t = tables<scalar_t>(s, depth_c, feat_cl, rd, rf, rb);
    t.grad = grad_cl.const_data_ptr<scalar_t>(), t.point_of = point_of.const_data_ptr<int>();
    scalar_t* gd = grad_depth.mutable_data_ptr<scalar_t>();
    scalar_t* gf = grad_feat_cl.mutable_data_ptr<scalar_t>();
    at::parallel_for(0, s.pixels(), 64, [&](int64_t begin, int64_t end) {
      std::vector<acc_t> acc(s.channels);
      bad |= run_backward(t, gd, gf, begin, end, acc.data());
    });
  });
  check_geometry_flag(bad.load(), s);
  return {grad_depth, grad_feat_cl.permute({0, 1, 4, 2, 3}).contiguous()};
}

}  // namespace

TORCH_LIBRARY(stack_bench, m) {
  m.def("bev_pool_v1(Tensor depth, Tensor feat, Tensor ranks_depth, Tensor ranks_feat, Tensor ranks_bev, "
        "Tensor interval_starts, Tensor interval_lengths, int batch, int grid_x, int grid_y) -> Tensor");
  m.def("bev_pool_backward_v1(Tensor grad_out, Tensor depth, Tensor feat, Tensor ranks_depth, Tensor ranks_feat, "
        "Tensor ranks_bev) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(stack_bench, CPU, m) {
  m.impl("bev_pool_v1", &bev_pool_cpu);
  m.impl("bev_pool_backward_v1", &bev_pool_backward_cpu);
}

}  // namespace stack
