// Fused BEV pooling: CUDA kernels (the schema and the checks live in bev_pool.cpp).
//
// Forward (as BEVPoolv2): one thread per (cell, channel), channel fastest, so a warp reads
// a point's channels-last feature row in one coalesced load and sums its interval without
// atomics. Backward: a dense map depth entry -> cell, then kGroup lanes per depth entry
// (grad_depth: a dot product over C, reduced by shuffles) and one warp per pixel (grad_feat:
// a sum over the D depth bins, whose cells and weights the lanes fetch 32 at a time and
// broadcast by shuffles) -- gathers only, no atomics, deterministic. On an H100 (ncu, default
// preset, fp32; BENCHMARKS "bev_pool on an H100") this backward runs in 136 us of kernel time
// where one thread per depth entry and one per (pixel, channel), each walking a dependent
// entry -> point -> cell chain with uncoalesced row reads, took 401 us.
//
// Out-of-range geometry indices are skipped, never dereferenced. Unlike the CPU kernel the
// CUDA path does not report them: that would need a device-to-host sync per call (and
// breaks CUDA-graph capture); stack.ops.bev_pool checks the geometry's shapes instead.
#include <ATen/OpMathType.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include "bev_pool.h"

namespace stack {
namespace {

constexpr int kThreads = 256;
constexpr int kWarp = 32;
constexpr unsigned kFullMask = 0xffffffffu;
constexpr int kGroup = 8;

int64_t blocks_for(int64_t work) {
  const int64_t most = int64_t(at::cuda::getCurrentDeviceProperties()->multiProcessorCount) * 32;
  return std::max<int64_t>(1, std::min<int64_t>((work + kThreads - 1) / kThreads, most));
}

template <typename scalar_t>
__global__ void forward_kernel(BevPoolSizes s, const scalar_t* __restrict__ depth, const scalar_t* __restrict__ feat,
                               const int* __restrict__ rd, const int* __restrict__ rf, const int* __restrict__ rb,
                               const int* __restrict__ starts, const int* __restrict__ lengths,
                               scalar_t* __restrict__ out) {
  using acc_t = at::opmath_type<scalar_t>;
  const int64_t C = s.channels, plane = s.grid_x * s.grid_y, work = s.intervals * C;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < work; i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t k = i / C, c = i % C;
    const int64_t first = starts[k], last = first + lengths[k];
    if (first < 0 || last > s.points || last <= first) continue;
    const int64_t cell = rb[first];
    if (cell < 0 || cell >= s.cells()) continue;
    acc_t acc = 0;
    for (int64_t p = first; p < last; ++p) {
      const int64_t id = rd[p], pixel = rf[p];
      if (id < 0 || id >= s.depth_numel() || pixel < 0 || pixel >= s.pixels()) continue;
      acc += static_cast<acc_t>(depth[id]) * static_cast<acc_t>(feat[pixel * C + c]);
    }
    out[(cell / plane) * C * plane + c * plane + cell % plane] = static_cast<scalar_t>(acc);
  }
}

__global__ void cell_map_kernel(BevPoolSizes s, const int* __restrict__ rd, const int* __restrict__ rb,
                                int* __restrict__ cell_of) {
  for (int64_t p = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; p < s.points; p += int64_t(gridDim.x) * blockDim.x) {
    const int64_t id = rd[p], cell = rb[p];
    if (id >= 0 && id < s.depth_numel() && cell >= 0 && cell < s.cells()) cell_of[id] = static_cast<int>(cell);
  }
}

template <typename scalar_t>
__global__ void grad_depth_kernel(BevPoolSizes s, const scalar_t* __restrict__ grad, const scalar_t* __restrict__ feat,
                                  const int* __restrict__ cell_of, scalar_t* __restrict__ grad_depth) {
  // kGroup lanes per depth entry, kWarp / kGroup entries per warp: each group reads the pixel's feature row and
  // the cell's gradient row (kGroup consecutive channels per load), then reduces by shuffles within the group.
  // The loop runs warp by warp, so every lane of a warp reaches the shuffles.
  using acc_t = at::opmath_type<scalar_t>;
  constexpr int kPerWarp = kWarp / kGroup;
  const int64_t C = s.channels, plane = s.height * s.width, total = s.depth_numel();
  const int lane = threadIdx.x % kWarp, sub = lane % kGroup;
  const int64_t warp = (blockIdx.x * int64_t(blockDim.x) + threadIdx.x) / kWarp;
  const int64_t warps = int64_t(gridDim.x) * blockDim.x / kWarp;
  for (int64_t first = warp * kPerWarp; first < total; first += warps * kPerWarp) {
    const int64_t id = first + lane / kGroup;
    const int64_t cell = id < total ? cell_of[id] : -1;
    acc_t dot = 0;
    if (cell >= 0) {
      const scalar_t* f = feat + (id / (s.bins * plane) * plane + id % plane) * C;
      const scalar_t* g = grad + cell * C;
      for (int64_t c = sub; c < C; c += kGroup) dot += static_cast<acc_t>(f[c]) * static_cast<acc_t>(g[c]);
    }
    for (int offset = kGroup / 2; offset > 0; offset /= 2) dot += __shfl_down_sync(kFullMask, dot, offset, kGroup);
    if (sub == 0 && id < total) grad_depth[id] = static_cast<scalar_t>(dot);
  }
}

template <typename scalar_t>
__global__ void grad_feat_kernel(BevPoolSizes s, const scalar_t* __restrict__ grad, const scalar_t* __restrict__ depth,
                                 const int* __restrict__ cell_of, scalar_t* __restrict__ grad_feat) {
  // One warp per pixel: the lanes fetch up to 32 depth bins' cells and weights at once, then each lane sums its
  // channel of the cells' gradient rows (coalesced), the cell and weight broadcast by shuffles.
  using acc_t = at::opmath_type<scalar_t>;
  const int64_t C = s.channels, plane = s.height * s.width;
  const int lane = threadIdx.x % kWarp;
  const int64_t warps = int64_t(gridDim.x) * blockDim.x / kWarp;
  for (int64_t q = (blockIdx.x * int64_t(blockDim.x) + threadIdx.x) / kWarp; q < s.pixels(); q += warps) {
    const int64_t camera = q / plane, pixel = q - camera * plane;
    for (int64_t c0 = 0; c0 < C; c0 += kWarp) {
      const int64_t c = c0 + lane;
      acc_t acc = 0;
      for (int64_t d0 = 0; d0 < s.bins; d0 += kWarp) {
        long long cell = -1;
        acc_t weight = 0;
        if (d0 + lane < s.bins) {
          const int64_t id = (camera * s.bins + d0 + lane) * plane + pixel;
          cell = cell_of[id];
          if (cell >= 0) weight = static_cast<acc_t>(depth[id]);
        }
        const int n = static_cast<int>(s.bins - d0 < kWarp ? s.bins - d0 : kWarp);
        for (int j = 0; j < n; ++j) {
          const long long cj = __shfl_sync(kFullMask, cell, j);
          const acc_t w = __shfl_sync(kFullMask, weight, j);
          if (cj >= 0 && c < C) acc += w * static_cast<acc_t>(grad[cj * C + c]);
        }
      }
      if (c < C) grad_feat[q * C + c] = static_cast<scalar_t>(acc);
    }
  }
}

at::Tensor bev_pool_cuda(const at::Tensor& depth, const at::Tensor& feat, const at::Tensor& ranks_depth,
                         const at::Tensor& ranks_feat, const at::Tensor& ranks_bev, const at::Tensor& interval_starts,
                         const at::Tensor& interval_lengths, int64_t batch, int64_t grid_x, int64_t grid_y) {
  const BevPoolSizes s = check_forward_args(depth, feat, ranks_depth, ranks_feat, ranks_bev, interval_starts,
                                            interval_lengths, batch, grid_x, grid_y);
  const c10::cuda::CUDAGuard guard(depth.device());
  const at::Tensor depth_c = depth.contiguous();
  const at::Tensor feat_cl = feat.permute({0, 1, 3, 4, 2}).contiguous();
  const at::Tensor rd = ranks_depth.contiguous(), rf = ranks_feat.contiguous(), rb = ranks_bev.contiguous();
  const at::Tensor starts = interval_starts.contiguous(), lengths = interval_lengths.contiguous();
  at::Tensor out = at::zeros({batch, s.channels, grid_x, grid_y}, depth.options());
  const int64_t work = s.intervals * s.channels;
  if (work == 0) return out;
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, depth.scalar_type(), "bev_pool_cuda", [&] {
    forward_kernel<scalar_t><<<blocks_for(work), kThreads, 0, stream>>>(
        s, depth_c.const_data_ptr<scalar_t>(), feat_cl.const_data_ptr<scalar_t>(), rd.const_data_ptr<int>(),
        rf.const_data_ptr<int>(), rb.const_data_ptr<int>(), starts.const_data_ptr<int>(), lengths.const_data_ptr<int>(),
        out.mutable_data_ptr<scalar_t>());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  return out;
}

std::tuple<at::Tensor, at::Tensor> bev_pool_backward_cuda(const at::Tensor& grad_out, const at::Tensor& depth,
                                                          const at::Tensor& feat, const at::Tensor& ranks_depth,
                                                          const at::Tensor& ranks_feat, const at::Tensor& ranks_bev) {
  const BevPoolSizes s = check_backward_args(grad_out, depth, feat, ranks_depth, ranks_feat, ranks_bev);
  const c10::cuda::CUDAGuard guard(depth.device());
  const at::Tensor depth_c = depth.contiguous();
  const at::Tensor feat_cl = feat.permute({0, 1, 3, 4, 2}).contiguous();
  const at::Tensor grad_cl = grad_out.permute({0, 2, 3, 1}).contiguous();
  const at::Tensor rd = ranks_depth.contiguous(), rb = ranks_bev.contiguous();
  at::Tensor cell_of = at::full({s.depth_numel()}, -1, rd.options());
  at::Tensor grad_depth = at::empty_like(depth_c);
  at::Tensor grad_feat_cl = at::empty_like(feat_cl);
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  if (s.points > 0) {
    cell_map_kernel<<<blocks_for(s.points), kThreads, 0, stream>>>(s, rd.const_data_ptr<int>(), rb.const_data_ptr<int>(),
                                                                    cell_of.mutable_data_ptr<int>());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, depth.scalar_type(), "bev_pool_backward_cuda", [&] {
    if (s.depth_numel() > 0) {
      grad_depth_kernel<scalar_t><<<blocks_for(s.depth_numel() * kGroup), kThreads, 0, stream>>>(
          s, grad_cl.const_data_ptr<scalar_t>(), feat_cl.const_data_ptr<scalar_t>(), cell_of.const_data_ptr<int>(),
          grad_depth.mutable_data_ptr<scalar_t>());
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    }
    if (s.pixels() * s.channels > 0) {
      grad_feat_kernel<scalar_t><<<blocks_for(s.pixels() * kWarp), kThreads, 0, stream>>>(
          s, grad_cl.const_data_ptr<scalar_t>(), depth_c.const_data_ptr<scalar_t>(), cell_of.const_data_ptr<int>(),
          grad_feat_cl.mutable_data_ptr<scalar_t>());
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    }
  });
  return {grad_depth, grad_feat_cl.permute({0, 1, 4, 2, 3}).contiguous()};
}

}  // namespace

TORCH_LIBRARY_IMPL(stack, CUDA, m) {
  m.impl("bev_pool", &bev_pool_cuda);
  m.impl("bev_pool_backward", &bev_pool_backward_cuda);
}

}  // namespace stack
