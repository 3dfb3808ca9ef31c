// Fused BEV pooling: the CPU kernels.
//
// Forward: the output is cut into tiles of 64 consecutive cells; a task sums depth * feature
// over the points of each of its tiles' cells (the intervals), a cell's C channels held in
// registers (blocks of kBlock) while the next points' depth values and context rows are
// prefetched, into a cache-resident (cells x C) tile that is then transposed into the
// (B, C, X, Y) output in 16 x 16 register blocks -- every output element exactly once, no
// atomics, no frustum tensor. The profile of the previous kernel (bev_pool_cpu_v1.cpp) put
// a quarter of its time in waiting for the gathered depth value and context row, a quarter in
// its scalar strided write-out, and most of the rest in a load-add-store of the accumulator
// per point; those are the three things this one does differently.
//
// Backward: cell-major, one task per sample (a sample's points touch only its own pixels,
// so no two tasks write the same memory): the incoming gradient is read in place, a tile of
// 64 cells at a time transposed into cache, and each point of the tile writes its depth
// gradient (each depth entry has one point) and adds its context gradient into a
// channels-last accumulator, in ascending point order -- deterministic whatever the thread
// count. The previous backward gathered gradient rows at random from a channels-last copy of
// the whole 16 MiB gradient, a copy that alone took a third of its time.
//
// The per-channel loops are the hot path. For float they are compiled three times
// (x86-64-v4 = AVX-512, v3 = AVX2 + FMA, baseline) and the loader picks the best the CPU
// runs (GCC target_clones), so one build is both portable and vectorised.
#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <type_traits>
#include <vector>

#include "bev_pool.h"

#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__) && defined(__linux__)
#define STACK_CPU_CLONES __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#define STACK_AVX512_TRANSPOSE 1
#include <immintrin.h>
#else
#define STACK_CPU_CLONES
#define STACK_AVX512_TRANSPOSE 0
#endif

namespace stack {
namespace {

template <typename scalar_t>
struct Tables {
  BevPoolSizes s;
  const scalar_t* depth;  // (B, N, D, H, W)
  const scalar_t* feat;   // (B, N, H, W, C): one point reads C values in a row
  const int* rd;
  const int* rf;
  const int* rb;
  const int* starts;
  const int* lengths;
};

constexpr int64_t kTileCells = 64;  // cells of one output row segment accumulated together
constexpr int64_t kBlock = 64;      // channels of one cell summed in registers at a time
constexpr int64_t kAhead = 24;      // points prefetched ahead (12, 24, 32, 48 tried: 24 and 32 best, 48 worse)

// ------------------------------------------------------------------------------ transposes

#if STACK_AVX512_TRANSPOSE
// dst[j * ds + i] = src[i * ss + j], i, j < 16: unpack 32-bit and 64-bit pairs within 128-bit
// lanes, then two rounds of lane shuffles (the usual 4 x 4-of-4 x 4 decomposition).
template <bool stream>
__attribute__((target("avx512f"))) void transpose16x16(const float* src, int64_t ss, float* dst, int64_t ds) {
  __m512 r[16], t[16];
  for (int i = 0; i < 16; ++i) r[i] = _mm512_loadu_ps(src + i * ss);
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_ps(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_ps(r[i], r[i + 1]);
  }
  for (int g = 0; g < 16; g += 4) {  // u[g + i], lane L: column 4L + i of rows g..g+3
    const __m512d a = _mm512_castps_pd(t[g]), b = _mm512_castps_pd(t[g + 1]);
    const __m512d c = _mm512_castps_pd(t[g + 2]), d = _mm512_castps_pd(t[g + 3]);
    r[g] = _mm512_castpd_ps(_mm512_unpacklo_pd(a, c));
    r[g + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(a, c));
    r[g + 2] = _mm512_castpd_ps(_mm512_unpacklo_pd(b, d));
    r[g + 3] = _mm512_castpd_ps(_mm512_unpackhi_pd(b, d));
  }
  for (int i = 0; i < 4; ++i) {
    const __m512 x0 = _mm512_shuffle_f32x4(r[i], r[4 + i], 0x88), x1 = _mm512_shuffle_f32x4(r[i], r[4 + i], 0xDD);
    const __m512 y0 = _mm512_shuffle_f32x4(r[8 + i], r[12 + i], 0x88);
    const __m512 y1 = _mm512_shuffle_f32x4(r[8 + i], r[12 + i], 0xDD);
    const __m512 out[4] = {_mm512_shuffle_f32x4(x0, y0, 0x88), _mm512_shuffle_f32x4(x1, y1, 0x88),
                           _mm512_shuffle_f32x4(x0, y0, 0xDD), _mm512_shuffle_f32x4(x1, y1, 0xDD)};
    for (int q = 0; q < 4; ++q) {  // streaming stores skip reading the output's lines before writing them
      if constexpr (stream) {
        _mm512_stream_ps(dst + (4 * q + i) * ds, out[q]);
      } else {
        _mm512_storeu_ps(dst + (4 * q + i) * ds, out[q]);
      }
    }
  }
}

__attribute__((target("avx512f"))) void stream_fence() { _mm_sfence(); }

bool cpu_has_avx512() {
  static const bool found = __builtin_cpu_supports("avx512f");
  return found;
}
#endif

// dst[j * ds + i] = src[i * ss + j] for i < rows, j < cols: 16 x 16 register blocks where the
// CPU has AVX-512 and the type is float, element by element for the rest. `stream`: write the
// blocks with non-temporal stores where dst is 64-byte aligned (an output nobody reads back
// here: it saves reading every destination line first; callers end with stream_fence()).
template <typename src_t, typename dst_t>
void transpose(const src_t* src, int64_t ss, dst_t* dst, int64_t ds, int64_t rows, int64_t cols, bool stream = false) {
  int64_t rows16 = 0, cols16 = 0;
#if STACK_AVX512_TRANSPOSE
  if constexpr (std::is_same_v<src_t, float> && std::is_same_v<dst_t, float>) {
    if (cpu_has_avx512()) {
      rows16 = rows / 16 * 16, cols16 = cols / 16 * 16;
      for (int64_t i = 0; i < rows16; i += 16) {
        for (int64_t j = 0; j < cols16; j += 16) {
          const bool aligned = stream && (reinterpret_cast<uintptr_t>(dst + j * ds + i) | ds * 4) % 64 == 0;
          (aligned ? transpose16x16<true> : transpose16x16<false>)(src + i * ss + j, ss, dst + j * ds + i, ds);
        }
      }
    }
  }
#endif
  for (int64_t i = 0; i < rows; ++i) {
    for (int64_t j = i < rows16 ? cols16 : 0; j < cols; ++j) dst[j * ds + i] = static_cast<dst_t>(src[i * ss + j]);
  }
}

// (B, N, C, H, W) -> (B, N, H, W, C), the layout in which one point reads its C values in a row.
at::Tensor channels_last_context(const at::Tensor& feat) {
  const at::Tensor permuted = feat.permute({0, 1, 3, 4, 2});
  if (permuted.is_contiguous()) return permuted;  // e.g. a channels_last conv output: no copy
  if (feat.scalar_type() != at::kFloat || !feat.is_contiguous()) return permuted.contiguous();
  at::Tensor out = at::empty(permuted.sizes(), feat.options());
  const int64_t C = feat.size(2), plane = feat.size(3) * feat.size(4);
  const float* src = feat.const_data_ptr<float>();
  float* dst = out.mutable_data_ptr<float>();
  at::parallel_for(0, feat.size(0) * feat.size(1), 1, [&](int64_t begin, int64_t end) {
    for (int64_t cam = begin; cam < end; ++cam) transpose(src + cam * C * plane, plane, dst + cam * plane * C, C, C, plane);
  });
  return out;
}

// ------------------------------------------------------------------------------ forward

template <typename scalar_t>
C10_ALWAYS_INLINE int64_t interval_cell(const Tables<scalar_t>& t, int64_t k) {
  const int64_t first = t.starts[k];
  return first < 0 || first >= t.s.points ? -1 : t.rb[first];
}

template <typename scalar_t>
C10_ALWAYS_INLINE void prefetch_point(const Tables<scalar_t>& t, int64_t p) {
  if (p >= t.s.points) return;
  __builtin_prefetch(t.depth + t.rd[p]);
  const char* row = reinterpret_cast<const char*>(t.feat + int64_t(t.rf[p]) * t.s.channels);
  for (int64_t byte = 0; byte < t.s.channels * int64_t(sizeof(scalar_t)); byte += 64) __builtin_prefetch(row + byte);
}

// Channels [c0, c0 + n) of one cell: sum over points [first, last) in registers, then store.
template <typename scalar_t, typename acc_t, int64_t n>
C10_ALWAYS_INLINE void sum_block(const Tables<scalar_t>& t, int64_t first, int64_t last, int64_t c0, acc_t* row) {
  acc_t sum[n] = {};
  for (int64_t p = first; p < last; ++p) {
    if (c0 == 0) prefetch_point(t, p + kAhead);
    const acc_t weight = t.depth[t.rd[p]];
    const scalar_t* __restrict__ f = t.feat + int64_t(t.rf[p]) * t.s.channels + c0;
    for (int64_t j = 0; j < n; ++j) sum[j] += weight * static_cast<acc_t>(f[j]);
  }
  for (int64_t j = 0; j < n; ++j) row[c0 + j] = sum[j];
}

// One cell's C sums over its interval [first, last) into row; the ranks are checked first.
template <typename scalar_t, typename acc_t>
C10_ALWAYS_INLINE int sum_interval(const Tables<scalar_t>& t, int64_t first, int64_t last, acc_t* row) {
  const BevPoolSizes& s = t.s;
  for (int64_t p = first; p < last; ++p) {
    if (t.rd[p] < 0 || t.rd[p] >= s.depth_numel()) return kBadRankDepth;
    if (t.rf[p] < 0 || t.rf[p] >= s.pixels()) return kBadRankFeat;
  }
  int64_t c0 = 0;
  for (; c0 + kBlock <= s.channels; c0 += kBlock) sum_block<scalar_t, acc_t, kBlock>(t, first, last, c0, row);
  for (; c0 + 16 <= s.channels; c0 += 16) sum_block<scalar_t, acc_t, 16>(t, first, last, c0, row);
  for (; c0 < s.channels; ++c0) sum_block<scalar_t, acc_t, 1>(t, first, last, c0, row);
  return 0;
}

// Tiles [tile_begin, tile_end) of the output, each kTileCells consecutive cells of one sample:
// each interval's sums go to its row of `tile` (cells x C, in cache), rows of empty cells are
// zeroed, and the tile is transposed into the output -- every output element once.
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
    const int64_t first_cell = first_cell_of(tile_id), b = tile_id / per_plane;
    const int64_t count = std::min(kTileCells, plane - tile_id % per_plane * kTileCells);
    int64_t zeroed = 0;  // rows below this one are written
    for (; k < s.intervals; ++k) {
      const int64_t cell = interval_cell(t, k), first = t.starts[k], last = first + t.lengths[k];
      if (cell >= first_cell + count) break;
      if (cell < first_cell + zeroed || last <= first || last > s.points) return kBadInterval;  // outside, empty, unsorted
      std::fill(tile + zeroed * C, tile + (cell - first_cell) * C, acc_t(0));
      if (const int bad = sum_interval(t, first, last, tile + (cell - first_cell) * C)) return bad;
      zeroed = cell - first_cell + 1;
    }
    std::fill(tile + zeroed * C, tile + count * C, acc_t(0));
    transpose(tile, C, out + b * C * plane + (first_cell - b * plane), plane, count, C, true);
  }
#if STACK_AVX512_TRANSPOSE
  if (cpu_has_avx512()) stream_fence();
#endif
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

// ------------------------------------------------------------------------------ backward

// sum(f * g) in kLanes independent partial sums, which the compiler keeps in one vector register,
// added up as a tree: a fixed order, so still deterministic.
template <typename scalar_t, typename acc_t>
C10_ALWAYS_INLINE acc_t dot_product(const scalar_t* __restrict__ f, const acc_t* __restrict__ g, int64_t n) {
  constexpr int64_t kLanes = 16;
  acc_t lanes[kLanes] = {};
  int64_t c = 0;
  for (; c + kLanes <= n; c += kLanes) {
    for (int64_t j = 0; j < kLanes; ++j) lanes[j] += static_cast<acc_t>(f[c + j]) * g[c + j];
  }
  // A tree, not a serial chain of 16 adds; constant trip counts, so the compiler keeps it in registers.
  for (int64_t j = 0; j < 8; ++j) lanes[j] += lanes[j + 8];
  for (int64_t j = 0; j < 4; ++j) lanes[j] += lanes[j + 4];
  for (int64_t j = 0; j < 2; ++j) lanes[j] += lanes[j + 2];
  acc_t dot = lanes[0] + lanes[1];
  for (; c < n; ++c) dot += static_cast<acc_t>(f[c]) * g[c];
  return dot;
}

template <typename scalar_t, typename acc_t>
struct Gradients {
  const scalar_t* grad;  // incoming, (B, C, X, Y), read in place
  scalar_t* depth;       // (B, N, D, H, W), zeroed: dropped entries stay 0
  acc_t* feat;           // (B, N, H, W, C), zeroed accumulator
};

// The points of sample b, [lo, hi), in ascending order: a tile of the incoming gradient is
// transposed into `tile` (cells x C) when the walk enters it, then each point writes
// grad_depth[its entry] = context row . gradient row and adds depth * gradient row to the
// context gradient of its pixel. ranks_bev is sorted (checked by the caller).
template <typename scalar_t, typename acc_t>
C10_ALWAYS_INLINE int backward_sample(const Tables<scalar_t>& t, const Gradients<scalar_t, acc_t>& out, int64_t b,
                                      int64_t lo, int64_t hi, acc_t* tile) {
  const BevPoolSizes& s = t.s;
  const int64_t C = s.channels, plane = s.grid_x * s.grid_y, pixels = s.height * s.width;
  const scalar_t* grad = out.grad + b * C * plane;
  int64_t loaded = -1;  // first cell (within the sample) of the tile in `tile`
  for (int64_t p = lo; p < hi; ++p) {
    const int64_t local = t.rb[p] - b * plane, tile_first = local / kTileCells * kTileCells;
    if (tile_first != loaded) {
      transpose(grad + tile_first, plane, tile, C, C, std::min(kTileCells, plane - tile_first));
      loaded = tile_first;
    }
    const int64_t id = t.rd[p];
    if (id < 0 || id >= s.depth_numel()) return kBadRankDepth;
    const int64_t pixel = id / (s.bins * pixels) * pixels + id % pixels;
    if (t.rf[p] != pixel) return kFeatNotPixelOfDepth;
    if (p + kAhead < hi) {
      const int64_t ahead = t.rf[p + kAhead];
      __builtin_prefetch(t.depth + t.rd[p + kAhead]);
      for (int64_t c = 0; c < C; c += 64 / int64_t(sizeof(acc_t))) {
        __builtin_prefetch(t.feat + ahead * C + c);
        __builtin_prefetch(out.feat + ahead * C + c, 1);
      }
    }
    const acc_t* __restrict__ g = tile + (local - tile_first) * C;
    const scalar_t* __restrict__ f = t.feat + pixel * C;
    acc_t* __restrict__ gf = out.feat + pixel * C;
    const acc_t weight = t.depth[id];
    out.depth[id] = static_cast<scalar_t>(dot_product<scalar_t, acc_t>(f, g, C));
    for (int64_t c = 0; c < C; ++c) gf[c] += weight * g[c];
  }
  return 0;
}

STACK_CPU_CLONES int backward_sample_float(const Tables<float>& t, const Gradients<float, float>& out, int64_t b,
                                           int64_t lo, int64_t hi, float* tile) {
  return backward_sample<float, float>(t, out, b, lo, hi, tile);
}

template <typename scalar_t, typename acc_t>
int run_backward(const Tables<scalar_t>& t, const Gradients<scalar_t, acc_t>& out, int64_t b, int64_t lo, int64_t hi,
                 acc_t* tile) {
  return backward_sample<scalar_t, acc_t>(t, out, b, lo, hi, tile);
}
int run_backward(const Tables<float>& t, const Gradients<float, float>& out, int64_t b, int64_t lo, int64_t hi,
                 float* tile) {
  return backward_sample_float(t, out, b, lo, hi, tile);
}

// kBadRankBev / kUnsortedRanks when ranks_bev leaves [0, cells) or is not ascending.
int check_sorted_cells(const int* rb, int64_t points, int64_t cells) {
  std::atomic<int> bad{0};
  at::parallel_for(0, points, 1 << 16, [&](int64_t begin, int64_t end) {
    int found = 0;
    for (int64_t p = begin; p < end; ++p) {
      found |= rb[p] < 0 || rb[p] >= cells ? kBadRankBev : 0;
      found |= p > 0 && rb[p] < rb[p - 1] ? kUnsortedRanks : 0;
    }
    bad |= found;
  });
  return bad.load();
}

// ------------------------------------------------------------------------------ entry points

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
  const at::Tensor depth_c = depth.contiguous(), feat_cl = channels_last_context(feat);
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

std::tuple<at::Tensor, at::Tensor> bev_pool_backward_cpu(const at::Tensor& grad_out, const at::Tensor& depth,
                                                         const at::Tensor& feat, const at::Tensor& ranks_depth,
                                                         const at::Tensor& ranks_feat, const at::Tensor& ranks_bev) {
  BevPoolSizes s = check_backward_args(grad_out, depth, feat, ranks_depth, ranks_feat, ranks_bev);
  const at::Tensor depth_c = depth.contiguous(), feat_cl = channels_last_context(feat), grad_c = grad_out.contiguous();
  const at::Tensor rd = ranks_depth.contiguous(), rf = ranks_feat.contiguous(), rb = ranks_bev.contiguous();
  const int* cells = rb.const_data_ptr<int>();
  check_geometry_flag(check_sorted_cells(cells, s.points, s.cells()), s);
  const int64_t plane = s.grid_x * s.grid_y;
  std::vector<int64_t> first_point(s.batch + 1);  // sample b's points: [first_point[b], first_point[b + 1])
  for (int64_t b = 0; b <= s.batch; ++b) first_point[b] = std::lower_bound(cells, cells + s.points, b * plane) - cells;
  at::Tensor grad_depth = at::zeros_like(depth_c);
  at::Tensor grad_feat = at::empty(feat.sizes(), feat.options());  // contiguous, whatever feat's strides
  std::atomic<int> bad{0};
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, depth.scalar_type(), "bev_pool_backward_cpu", [&] {
    using acc_t = at::opmath_type<scalar_t>;
    const at::Tensor feat_acc = at::zeros(feat_cl.sizes(), feat.options().dtype(c10::CppTypeToScalarType<acc_t>::value));
    const Tables<scalar_t> t = tables<scalar_t>(s, depth_c, feat_cl, rd, rf, rb);
    const Gradients<scalar_t, acc_t> g{grad_c.const_data_ptr<scalar_t>(), grad_depth.mutable_data_ptr<scalar_t>(),
                                       feat_acc.mutable_data_ptr<acc_t>()};
    at::parallel_for(0, s.batch, 1, [&](int64_t begin, int64_t end) {
      std::vector<acc_t> tile(kTileCells * s.channels);
      for (int64_t b = begin; b < end; ++b) bad |= run_backward(t, g, b, first_point[b], first_point[b + 1], tile.data());
    });
    // (B, N, H, W, C) accumulator -> (B, N, C, H, W) gradient, one camera per task.
    const int64_t C = s.channels, pixels = s.height * s.width;
    scalar_t* gf = grad_feat.mutable_data_ptr<scalar_t>();
    at::parallel_for(0, s.batch * s.cameras, 1, [&](int64_t begin, int64_t end) {
      for (int64_t cam = begin; cam < end; ++cam) {
        transpose(g.feat + cam * pixels * C, C, gf + cam * C * pixels, pixels, pixels, C, true);
      }
#if STACK_AVX512_TRANSPOSE
      if (cpu_has_avx512()) stream_fence();
#endif
    });
  });
  check_geometry_flag(bad.load(), s);
  return {grad_depth, grad_feat};
}

}  // namespace

TORCH_LIBRARY_IMPL(stack, CPU, m) {
  m.impl("bev_pool", &bev_pool_cpu);
  m.impl("bev_pool_backward", &bev_pool_backward_cpu);
}

}  // namespace stack
