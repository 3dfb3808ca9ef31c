// Fused BEV pooling: CUDA kernels (the schema and the checks live in bev_pool.cpp).
//
// Forward: a warp per interval (one output cell). The lanes fetch 32 of its points' pixels and
// depth weights at once and broadcast them by shuffles. Where the channels fill whole 16-byte
// vectors (64 fp32 or bf16 channels: 16 or 8 lanes per point), a group of lanes takes one point,
// each lane one 128-bit load of its row, and 8 points' rows are in flight per warp before the
// weights are needed (forward_vec_kernel); other widths take forward_kernel, where each lane sums
// 32-bit channels of one point at a time. Coalesced channels-last rows, no atomics. Backward: a
// dense map depth entry -> cell, then one fused kernel, a warp per pixel, that reads each in-grid
// bin's gradient row once and uses it for both gradients (grad_feat += weight * row, grad_depth =
// feat . row, reduced across the warp). Pixel-major tensors move through shared-memory tiles of 8
// pixels, so neither gradient needs a layout copy; the incoming gradient is made channels-last by
// a tiled transpose. Gathers only, no atomics, deterministic.
//
// On an H100 (ncu, default preset; docs/log/2026-11-27_bev-pool-cuda-128bit-forward.md) every kernel of one forward +
// backward, fills and layout copies included, takes 185 us in fp32 and in bf16; the vector forward
// 72 / 67 us where forward_kernel takes 102 / 84 us (fp32 / bf16), the backward kernel 65 / 72 us.
//
// Out-of-range geometry indices are skipped, never dereferenced. Unlike the CPU kernel the
// CUDA path does not report them: that would need a device-to-host sync per call (and
// breaks CUDA-graph capture); stack.ops.bev_pool checks the geometry's shapes instead.
#include <ATen/OpMathType.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <cstdint>
#include <type_traits>

#include "bev_pool.h"

namespace stack {
namespace {

constexpr int kThreads = 256;
constexpr int kWarp = 32;
constexpr unsigned kFullMask = 0xffffffffu;
constexpr int kTilePixels = kThreads / kWarp;  // backward: one warp per pixel, a block per tile

int64_t blocks_for(int64_t work) {
  const int64_t most = int64_t(at::cuda::getCurrentDeviceProperties()->multiProcessorCount) * 32;
  return std::max<int64_t>(1, std::min<int64_t>((work + kThreads - 1) / kThreads, most));
}

__global__ void cell_map_kernel(BevPoolSizes s, const int* __restrict__ rd, const int* __restrict__ rb,
                                int* __restrict__ cell_of) {
  for (int64_t p = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; p < s.points; p += int64_t(gridDim.x) * blockDim.x) {
    const int64_t id = rd[p], cell = rb[p];
    if (id >= 0 && id < s.depth_numel() && cell >= 0 && cell < s.cells()) cell_of[id] = static_cast<int>(cell);
  }
}

// Channels handled per pass: kWarp * kChunks, one register per chunk and lane.
int chunks_for(int64_t channels) {
  const int64_t needed = (channels + kWarp - 1) / kWarp;
  return needed <= 1 ? 1 : needed <= 2 ? 2 : needed <= 4 ? 4 : 8;
}

template <typename scalar_t, int kChunks>
__global__ void forward_kernel(BevPoolSizes s, const scalar_t* __restrict__ depth, const scalar_t* __restrict__ feat,
                               const int* __restrict__ rd, const int* __restrict__ rf, const int* __restrict__ rb,
                               const int* __restrict__ starts, const int* __restrict__ lengths,
                               scalar_t* __restrict__ out) {
  using acc_t = at::opmath_type<scalar_t>;
  constexpr int kSlice = kWarp * kChunks;
  const int64_t C = s.channels, plane = s.grid_x * s.grid_y;
  const int lane = threadIdx.x % kWarp;
  const int64_t warps = int64_t(gridDim.x) * blockDim.x / kWarp;
  for (int64_t k = (blockIdx.x * int64_t(blockDim.x) + threadIdx.x) / kWarp; k < s.intervals; k += warps) {
    const int64_t first = starts[k], last = first + lengths[k];
    if (first < 0 || last > s.points || last <= first) continue;
    const int64_t cell = rb[first];
    if (cell < 0 || cell >= s.cells()) continue;
    for (int64_t c0 = 0; c0 < C; c0 += kSlice) {
      acc_t acc[kChunks];
#pragma unroll
      for (int i = 0; i < kChunks; ++i) acc[i] = 0;
      for (int64_t p0 = first; p0 < last; p0 += kWarp) {
        // Each lane fetches one point's pixel and depth weight; the loop below broadcasts them.
        int pixel = 0, valid = 0;
        acc_t weight = 0;
        if (p0 + lane < last) {
          const int64_t id = rd[p0 + lane], px = rf[p0 + lane];
          if (id >= 0 && id < s.depth_numel() && px >= 0 && px < s.pixels()) {
            valid = 1;
            pixel = static_cast<int>(px);
            weight = static_cast<acc_t>(depth[id]);
          }
        }
        const int n = static_cast<int>(last - p0 < kWarp ? last - p0 : kWarp);
#pragma unroll 8
        for (int j = 0; j < n; ++j) {
          const int pj = __shfl_sync(kFullMask, pixel, j), vj = __shfl_sync(kFullMask, valid, j);
          const acc_t wj = __shfl_sync(kFullMask, weight, j);
          const scalar_t* row = feat + int64_t(pj) * C + c0 + lane;
#pragma unroll
          for (int i = 0; i < kChunks; ++i) {
            const acc_t f = c0 + lane + i * kWarp < C ? static_cast<acc_t>(row[i * kWarp]) : acc_t(0);
            acc[i] += vj ? wj * f : acc_t(0);
          }
        }
      }
      scalar_t* target = out + (cell / plane) * C * plane + cell % plane;
#pragma unroll
      for (int i = 0; i < kChunks; ++i) {
        const int64_t c = c0 + lane + i * kWarp;
        if (c < C) target[c * plane] = static_cast<scalar_t>(acc[i]);
      }
    }
  }
}

// Forward for contiguous 16-byte rows: kGroup lanes share a point, each lane holding one 16-byte vector of its
// channels (4 fp32, 8 bf16), so a warp takes 32 / kGroup points per step with one 128-bit load per lane, and
// kBatch steps' loads are issued before their weights are read. Against forward_kernel (a lane per channel, one
// point at a time, three shuffles per point) it issues 8% fewer instructions in fp32 but keeps more loads in
// flight: 1.42x faster in fp32, 1.26x in bf16 (H100, default preset). The next interval's bounds are fetched
// while one is summed, and the cell's load no longer waits in front of the sums. The slots' partial sums are
// added by a butterfly at the end; the order is fixed, so results stay deterministic.
template <typename scalar_t>
struct alignas(16) Vec16 {
  scalar_t v[16 / sizeof(scalar_t)];
};

template <typename scalar_t, int kGroup, int kBatch>
__global__ void __launch_bounds__(kThreads)
    forward_vec_kernel(BevPoolSizes s, const scalar_t* __restrict__ depth, const scalar_t* __restrict__ feat,
                       const int* __restrict__ rd, const int* __restrict__ rf, const int* __restrict__ rb,
                       const int* __restrict__ starts, const int* __restrict__ lengths, scalar_t* __restrict__ out) {
  using acc_t = at::opmath_type<scalar_t>;
  using vec_t = Vec16<scalar_t>;
  constexpr int kVec = 16 / sizeof(scalar_t);
  constexpr int kSlots = kWarp / kGroup;  // points per step
  const int64_t C = s.channels, plane = s.grid_x * s.grid_y;
  const int lane = threadIdx.x % kWarp, slot = lane / kGroup, part = lane % kGroup;
  const bool holds_channels = part * kVec < C;  // C is a multiple of kVec: a vector is all in or all out
  const int64_t warps = int64_t(gridDim.x) * blockDim.x / kWarp;
  int64_t k = (blockIdx.x * int64_t(blockDim.x) + threadIdx.x) / kWarp;
  // The next interval's bounds are fetched while this one is summed: one dependent load less per interval.
  int64_t next_first = k < s.intervals ? starts[k] : 0, next_length = k < s.intervals ? lengths[k] : 0;
  for (; k < s.intervals; k += warps) {
    const int64_t first = next_first, last = first + next_length;
    if (k + warps < s.intervals) {
      next_first = starts[k + warps];
      next_length = lengths[k + warps];
    }
    if (first < 0 || last > s.points || last <= first) continue;
    const int64_t cell = rb[first];  // checked at the store: nothing before it waits for this load
    acc_t acc[kVec];
#pragma unroll
    for (int v = 0; v < kVec; ++v) acc[v] = 0;
    for (int64_t p0 = first; p0 < last; p0 += kWarp) {
      int pixel = -1;  // -1: out-of-range indices, skipped
      acc_t weight = 0;
      if (p0 + lane < last) {
        const int64_t id = rd[p0 + lane], px = rf[p0 + lane];
        if (id >= 0 && id < s.depth_numel() && px >= 0 && px < s.pixels()) {
          pixel = static_cast<int>(px);
          weight = static_cast<acc_t>(depth[id]);
        }
      }
      const int n = static_cast<int>(last - p0 < kWarp ? last - p0 : kWarp);
      for (int j0 = 0; j0 < n; j0 += kBatch * kSlots) {
        // kBatch rows in flight per lane: every load is issued (a skipped point reads the first row) before
        // the depth weights, which arrive one load later than the pixels, are needed.
        vec_t x[kBatch];
        bool take[kBatch];
#pragma unroll
        for (int u = 0; u < kBatch; ++u) {
          const int j = j0 + u * kSlots + slot;
          const int pj = __shfl_sync(kFullMask, pixel, j % kWarp);
          take[u] = j < n && pj >= 0 && holds_channels;
          x[u] = *reinterpret_cast<const vec_t*>(feat + (take[u] ? int64_t(pj) * C + part * kVec : 0));
        }
#pragma unroll
        for (int u = 0; u < kBatch; ++u) {
          const acc_t wj = __shfl_sync(kFullMask, weight, (j0 + u * kSlots + slot) % kWarp);
#pragma unroll
          for (int v = 0; v < kVec; ++v) acc[v] += take[u] ? wj * static_cast<acc_t>(x[u].v[v]) : acc_t(0);
        }
      }
    }
#pragma unroll
    for (int offset = kGroup; offset < kWarp; offset *= 2) {
#pragma unroll
      for (int v = 0; v < kVec; ++v) acc[v] += __shfl_xor_sync(kFullMask, acc[v], offset);
    }
    if (cell < 0 || cell >= s.cells() || !holds_channels) continue;
    scalar_t* target = out + (cell / plane) * C * plane + cell % plane + part * kVec * plane;
#pragma unroll
    for (int v = 0; v < kVec; ++v) {
      if (v % kSlots == slot) target[v * plane] = static_cast<scalar_t>(acc[v]);  // the slots share the stores
    }
  }
}

// Lanes per point for forward_vec_kernel, or 0 where it does not apply: the channels must fill whole 16-byte
// vectors (at most one per lane) and the rows must start 16-byte aligned.
int vec_group_for(int64_t channels, size_t element_size, const void* feat) {
  const int64_t per_vec = 16 / static_cast<int64_t>(element_size);
  if (channels % per_vec != 0 || channels > kWarp * per_vec || reinterpret_cast<uintptr_t>(feat) % 16 != 0) return 0;
  int group = 1;
  while (group * per_vec < channels) group *= 2;
  return group;
}

template <typename F>
void with_group(int group, F&& f) {
  switch (group) {
    case 1: f(std::integral_constant<int, 1>{}); break;
    case 2: f(std::integral_constant<int, 2>{}); break;
    case 4: f(std::integral_constant<int, 4>{}); break;
    case 8: f(std::integral_constant<int, 8>{}); break;
    case 16: f(std::integral_constant<int, 16>{}); break;
    default: f(std::integral_constant<int, 32>{}); break;
  }
}

template <typename F>
void with_chunks(int chunks, F&& f) {
  switch (chunks) {
    case 1: f(std::integral_constant<int, 1>{}); break;
    case 2: f(std::integral_constant<int, 2>{}); break;
    case 4: f(std::integral_constant<int, 4>{}); break;
    default: f(std::integral_constant<int, 8>{}); break;
  }
}

// (rows, C, P) -> (rows, P, C) through 32 x 33 shared tiles: both the read and the write are coalesced, where
// at::Tensor::contiguous() on the permuted view reads or writes one element per 32-byte sector.
template <typename scalar_t>
__global__ void channels_last_kernel(const scalar_t* __restrict__ in, scalar_t* __restrict__ out, int64_t rows,
                                     int64_t C, int64_t P) {
  __shared__ scalar_t tile[kWarp][kWarp + 1];
  const int64_t c_tiles = (C + kWarp - 1) / kWarp, p_tiles = (P + kWarp - 1) / kWarp;
  const int64_t tiles = rows * c_tiles * p_tiles;
  for (int64_t t = blockIdx.x; t < tiles; t += gridDim.x) {
    const int64_t row = t / (c_tiles * p_tiles), rest = t % (c_tiles * p_tiles);
    const int64_t c0 = rest / p_tiles * kWarp, p0 = rest % p_tiles * kWarp;
    __syncthreads();
    for (int y = threadIdx.y; y < kWarp; y += blockDim.y) {
      const int64_t c = c0 + y, p = p0 + threadIdx.x;
      if (c < C && p < P) tile[y][threadIdx.x] = in[(row * C + c) * P + p];
    }
    __syncthreads();
    for (int y = threadIdx.y; y < kWarp; y += blockDim.y) {
      const int64_t p = p0 + y, c = c0 + threadIdx.x;
      if (c < C && p < P) out[(row * P + p) * C + c] = tile[threadIdx.x][y];
    }
  }
}

at::Tensor channels_last(const at::Tensor& t, int64_t rows, int64_t C, int64_t P) {
  // t holds rows x C x P elements in that order (contiguous); the result rows x P x C, same dtype.
  const at::Tensor src = t.contiguous();
  at::Tensor out = at::empty({rows, P, C}, src.options());
  const int64_t tiles = rows * ((C + kWarp - 1) / kWarp) * ((P + kWarp - 1) / kWarp);
  if (tiles == 0) return out;
  const int64_t most = int64_t(at::cuda::getCurrentDeviceProperties()->multiProcessorCount) * 16;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, src.scalar_type(), "bev_pool_channels_last", [&] {
    channels_last_kernel<scalar_t><<<std::min(tiles, most), dim3(kWarp, 8), 0, at::cuda::getCurrentCUDAStream()>>>(
        src.const_data_ptr<scalar_t>(), out.mutable_data_ptr<scalar_t>(), rows, C, P);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  return out;
}

template <typename acc_t>
__device__ __forceinline__ acc_t warp_sum(acc_t v) {
#pragma unroll
  for (int offset = kWarp / 2; offset > 0; offset /= 2) v += __shfl_xor_sync(kFullMask, v, offset);
  return v;
}

template <typename scalar_t, int kChunks>
__global__ void __launch_bounds__(kThreads)
    backward_kernel(BevPoolSizes s, const scalar_t* __restrict__ grad, const scalar_t* __restrict__ depth,
                    const scalar_t* __restrict__ feat, const int* __restrict__ cell_of, scalar_t* __restrict__ grad_depth,
                    at::opmath_type<scalar_t>* __restrict__ partial, scalar_t* __restrict__ grad_feat) {
  // A block takes kTile consecutive pixels, one warp each. A warp visits only the bins of its pixel that fall in
  // a cell (a ballot, then the set bits in turn), reads each bin's gradient row once (channels-last, coalesced)
  // for both gradients, reduces the dot product across the warp at once, and fetches the next bin's row before
  // reducing the current one. Depth weights, the cell map, feat and both outputs are pixel-major: they move
  // through shared tiles so that every global access covers kTile consecutive pixels. `partial` carries
  // grad_depth between channel passes when C > kSlice. (An earlier version that ran all 32 bins of a batch
  // unrolled and reduced them together by a halving exchange held 90 registers: 25% occupancy, 114 us.)
  using acc_t = at::opmath_type<scalar_t>;
  constexpr int kSlice = kWarp * kChunks;
  constexpr int kTile = kTilePixels;
  __shared__ acc_t feat_tile[kSlice][kTile + 1];
  __shared__ acc_t bins_tile[kWarp][kTile + 1];
  __shared__ int cells_tile[kWarp][kTile + 1];
  const int C = static_cast<int>(s.channels), bins = static_cast<int>(s.bins);
  const int64_t plane = s.height * s.width, pixels = s.pixels();
  const int lane = threadIdx.x % kWarp, warp = threadIdx.x / kWarp;
  const int64_t tiles = (pixels + kTile - 1) / kTile;
  for (int64_t tile = blockIdx.x; tile < tiles; tile += gridDim.x) {
    for (int c0 = 0; c0 < C; c0 += kSlice) {
      const bool first_pass = c0 == 0, last_pass = c0 + kSlice >= C;
      __syncthreads();
      for (int t = threadIdx.x; t < kSlice * kTile; t += blockDim.x) {
        const int c = t / kTile, w = t % kTile;
        const int64_t q = tile * kTile + w;
        feat_tile[c][w] = q < pixels && c0 + c < C
                              ? static_cast<acc_t>(feat[((q / plane) * C + c0 + c) * plane + q % plane])
                              : acc_t(0);
      }
      __syncthreads();
      acc_t f[kChunks], acc[kChunks];
      bool in[kChunks];
#pragma unroll
      for (int i = 0; i < kChunks; ++i) {
        f[i] = feat_tile[lane + i * kWarp][warp];
        acc[i] = 0;
        in[i] = c0 + lane + i * kWarp < C;
      }
      for (int d0 = 0; d0 < bins; d0 += kWarp) {
        __syncthreads();
        for (int t = threadIdx.x; t < kWarp * kTile; t += blockDim.x) {
          const int d = t / kTile, w = t % kTile;
          const int64_t q = tile * kTile + w;
          int cell = -1;
          acc_t weight = 0;
          if (q < pixels && d0 + d < bins) {
            const int64_t id = ((q / plane) * bins + d0 + d) * plane + q % plane;
            cell = cell_of[id];
            if (cell >= 0) weight = static_cast<acc_t>(depth[id]);
          }
          cells_tile[d][w] = cell;
          bins_tile[d][w] = weight;
        }
        __syncthreads();
        const int cell = cells_tile[lane][warp];
        const acc_t weight = bins_tile[lane][warp];
        acc_t mine = 0;
        unsigned todo = __ballot_sync(kFullMask, cell >= 0);
        if (todo != 0) {
          int j = __ffs(todo) - 1;
          acc_t next[kChunks];
          {
            const scalar_t* row = grad + int64_t(__shfl_sync(kFullMask, cell, j)) * C + (c0 + lane);
#pragma unroll
            for (int i = 0; i < kChunks; ++i) next[i] = in[i] ? static_cast<acc_t>(row[i * kWarp]) : acc_t(0);
          }
          while (true) {
            acc_t g[kChunks];
#pragma unroll
            for (int i = 0; i < kChunks; ++i) g[i] = next[i];
            const acc_t wj = __shfl_sync(kFullMask, weight, j);
            const int current = j;
            todo &= todo - 1;
            if (todo != 0) {
              j = __ffs(todo) - 1;
              const scalar_t* row = grad + int64_t(__shfl_sync(kFullMask, cell, j)) * C + (c0 + lane);
#pragma unroll
              for (int i = 0; i < kChunks; ++i) next[i] = in[i] ? static_cast<acc_t>(row[i * kWarp]) : acc_t(0);
            }
            acc_t dot = 0;
#pragma unroll
            for (int i = 0; i < kChunks; ++i) {
              dot += f[i] * g[i];
              acc[i] += wj * g[i];
            }
            dot = warp_sum(dot);
            if (lane == current) mine = dot;
            if (todo == 0) break;
          }
        }
        bins_tile[lane][warp] = mine;  // this lane's own element, read above
        __syncthreads();
        for (int t = threadIdx.x; t < kWarp * kTile; t += blockDim.x) {
          const int d = t / kTile, w = t % kTile;
          const int64_t q = tile * kTile + w;
          if (q < pixels && d0 + d < bins) {
            const int64_t id = ((q / plane) * bins + d0 + d) * plane + q % plane;
            const acc_t sum = bins_tile[d][w] + (first_pass ? acc_t(0) : partial[id]);
            if (last_pass)
              grad_depth[id] = static_cast<scalar_t>(sum);
            else
              partial[id] = sum;
          }
        }
      }
      __syncthreads();
#pragma unroll
      for (int i = 0; i < kChunks; ++i) feat_tile[lane + i * kWarp][warp] = acc[i];
      __syncthreads();
      for (int t = threadIdx.x; t < kSlice * kTile; t += blockDim.x) {
        const int c = t / kTile, w = t % kTile;
        const int64_t q = tile * kTile + w;
        if (q < pixels && c0 + c < C)
          grad_feat[((q / plane) * C + c0 + c) * plane + q % plane] = static_cast<scalar_t>(feat_tile[c][w]);
      }
    }
  }
}


at::Tensor bev_pool_cuda(const at::Tensor& depth, const at::Tensor& feat, const at::Tensor& ranks_depth,
                         const at::Tensor& ranks_feat, const at::Tensor& ranks_bev, const at::Tensor& interval_starts,
                         const at::Tensor& interval_lengths, int64_t batch, int64_t grid_x, int64_t grid_y) {
  const BevPoolSizes s = check_forward_args(depth, feat, ranks_depth, ranks_feat, ranks_bev, interval_starts,
                                            interval_lengths, batch, grid_x, grid_y);
  const c10::cuda::CUDAGuard guard(depth.device());
  at::Tensor out = at::zeros({batch, s.channels, grid_x, grid_y}, depth.options());
  if (s.intervals == 0 || s.channels == 0) return out;
  const at::Tensor depth_c = depth.contiguous();
  const at::Tensor feat_permuted = feat.permute({0, 1, 3, 4, 2});  // a channels-last context needs no copy
  const at::Tensor feat_cl = feat_permuted.is_contiguous()
                                 ? feat_permuted
                                 : channels_last(feat, s.batch * s.cameras, s.channels, s.height * s.width);
  const at::Tensor rd = ranks_depth.contiguous(), rf = ranks_feat.contiguous(), rb = ranks_bev.contiguous();
  const at::Tensor starts = interval_starts.contiguous(), lengths = interval_lengths.contiguous();
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, depth.scalar_type(), "bev_pool_cuda", [&] {
    const int group = vec_group_for(s.channels, sizeof(scalar_t), feat_cl.const_data_ptr());
    if (group > 0 && s.pixels() > 0) {  // a skipped slot reads the first row: there must be one
      with_group(group, [&](auto g) {
        constexpr int kGroup = decltype(g)::value, kSlots = kWarp / kGroup;
        constexpr int kBatch = kSlots >= 8 ? 1 : 8 / kSlots;  // 8 points in flight per warp and batch
        forward_vec_kernel<scalar_t, kGroup, kBatch><<<blocks_for(s.intervals * kWarp), kThreads, 0, stream>>>(
            s, depth_c.const_data_ptr<scalar_t>(), feat_cl.const_data_ptr<scalar_t>(), rd.const_data_ptr<int>(),
            rf.const_data_ptr<int>(), rb.const_data_ptr<int>(), starts.const_data_ptr<int>(),
            lengths.const_data_ptr<int>(), out.mutable_data_ptr<scalar_t>());
        C10_CUDA_KERNEL_LAUNCH_CHECK();
      });
      return;
    }
    with_chunks(chunks_for(s.channels), [&](auto chunks) {
      forward_kernel<scalar_t, decltype(chunks)::value><<<blocks_for(s.intervals * kWarp), kThreads, 0, stream>>>(
          s, depth_c.const_data_ptr<scalar_t>(), feat_cl.const_data_ptr<scalar_t>(), rd.const_data_ptr<int>(),
          rf.const_data_ptr<int>(), rb.const_data_ptr<int>(), starts.const_data_ptr<int>(),
          lengths.const_data_ptr<int>(), out.mutable_data_ptr<scalar_t>());
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    });
  });
  return out;
}

std::tuple<at::Tensor, at::Tensor> bev_pool_backward_cuda(const at::Tensor& grad_out, const at::Tensor& depth,
                                                          const at::Tensor& feat, const at::Tensor& ranks_depth,
                                                          const at::Tensor& ranks_feat, const at::Tensor& ranks_bev) {
  const BevPoolSizes s = check_backward_args(grad_out, depth, feat, ranks_depth, ranks_feat, ranks_bev);
  const c10::cuda::CUDAGuard guard(depth.device());
  const at::Tensor depth_c = depth.contiguous(), feat_c = feat.contiguous();
  at::Tensor grad_depth = at::empty_like(depth_c), grad_feat = at::empty_like(feat_c);
  if (s.cells() == 0 || s.channels == 0 || s.pixels() == 0) {  // no gradient row to read: nothing reaches the inputs
    grad_depth.zero_();
    grad_feat.zero_();
    return {grad_depth, grad_feat};
  }
  const at::Tensor grad_cl = channels_last(grad_out, s.batch, s.channels, s.grid_x * s.grid_y);
  const at::Tensor rd = ranks_depth.contiguous(), rb = ranks_bev.contiguous();
  at::Tensor cell_of = at::full({s.depth_numel()}, -1, rd.options());
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  if (s.points > 0) {
    cell_map_kernel<<<blocks_for(s.points), kThreads, 0, stream>>>(s, rd.const_data_ptr<int>(), rb.const_data_ptr<int>(),
                                                                    cell_of.mutable_data_ptr<int>());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
  const int chunks = chunks_for(s.channels);
  // Over kWarp * chunks channels the kernel makes several passes; grad_depth's running sum then stays in opmath.
  const at::Tensor partial =
      s.channels > kWarp * chunks
          ? at::empty({s.depth_numel()}, depth_c.options().dtype(at::toOpMathType(depth_c.scalar_type())))
          : at::Tensor();
  const int64_t tiles = (s.pixels() + kTilePixels - 1) / kTilePixels;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, depth.scalar_type(), "bev_pool_backward_cuda", [&] {
    using acc_t = at::opmath_type<scalar_t>;
    with_chunks(chunks, [&](auto chunks_c) {
      backward_kernel<scalar_t, decltype(chunks_c)::value><<<blocks_for(tiles * kThreads), kThreads, 0, stream>>>(
          s, grad_cl.const_data_ptr<scalar_t>(), depth_c.const_data_ptr<scalar_t>(), feat_c.const_data_ptr<scalar_t>(),
          cell_of.const_data_ptr<int>(), grad_depth.mutable_data_ptr<scalar_t>(),
          partial.defined() ? partial.mutable_data_ptr<acc_t>() : nullptr, grad_feat.mutable_data_ptr<scalar_t>());
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    });
  });
  return {grad_depth, grad_feat};
}

}  // namespace

TORCH_LIBRARY_IMPL(stack, CUDA, m) {
  m.impl("bev_pool", &bev_pool_cuda);
  m.impl("bev_pool_backward", &bev_pool_backward_cuda);
}

}  // namespace stack
