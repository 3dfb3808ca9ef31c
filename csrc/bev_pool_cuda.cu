// Fused BEV pooling: CUDA kernels (the schema and the checks live in bev_pool.cpp).
//
// Forward (as BEVPoolv2): one thread per (cell, channel), channel fastest, so a warp reads
// a point's channels-last feature row in one coalesced load and sums its interval without
// atomics. Backward: a dense map depth entry -> point, then one thread per depth entry
// (grad_depth: a dot product over C) and one per (pixel, channel) (grad_feat: a sum over
// the D depth bins) -- gathers only, no atomics, deterministic.
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

__global__ void point_map_kernel(BevPoolSizes s, const int* __restrict__ rd, int* __restrict__ point_of) {
  for (int64_t p = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; p < s.points; p += int64_t(gridDim.x) * blockDim.x) {
    const int64_t id = rd[p];
    if (id >= 0 && id < s.depth_numel()) point_of[id] = static_cast<int>(p);
  }
}

template <typename scalar_t>
__global__ void grad_depth_kernel(BevPoolSizes s, const scalar_t* __restrict__ grad, const scalar_t* __restrict__ feat,
                                  const int* __restrict__ point_of, const int* __restrict__ rb,
                                  scalar_t* __restrict__ grad_depth) {
  using acc_t = at::opmath_type<scalar_t>;
  const int64_t C = s.channels, plane = s.height * s.width, total = s.depth_numel();
  for (int64_t id = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; id < total; id += int64_t(gridDim.x) * blockDim.x) {
    const int64_t p = point_of[id];
    const int64_t cell = p < 0 ? -1 : rb[p];
    acc_t dot = 0;
    if (cell >= 0 && cell < s.cells()) {
      const scalar_t* f = feat + (id / (s.bins * plane) * plane + id % plane) * C;
      const scalar_t* g = grad + cell * C;
      for (int64_t c = 0; c < C; ++c) dot += static_cast<acc_t>(f[c]) * static_cast<acc_t>(g[c]);
    }
    grad_depth[id] = static_cast<scalar_t>(dot);
  }
}

template <typename scalar_t>
__global__ void grad_feat_kernel(BevPoolSizes s, const scalar_t* __restrict__ grad, const scalar_t* __restrict__ depth,
                                 const int* __restrict__ point_of, const int* __restrict__ rb,
                                 scalar_t* __restrict__ grad_feat) {
  using acc_t = at::opmath_type<scalar_t>;
  const int64_t C = s.channels, plane = s.height * s.width, work = s.pixels() * C;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < work; i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t q = i / C, c = i % C, camera = q / plane, pixel = q % plane;
    acc_t acc = 0;
    for (int64_t d = 0; d < s.bins; ++d) {
      const int64_t id = (camera * s.bins + d) * plane + pixel;
      const int64_t p = point_of[id];
      const int64_t cell = p < 0 ? -1 : rb[p];
      if (cell >= 0 && cell < s.cells()) acc += static_cast<acc_t>(depth[id]) * static_cast<acc_t>(grad[cell * C + c]);
    }
    grad_feat[i] = static_cast<scalar_t>(acc);
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
  at::Tensor point_of = at::full({s.depth_numel()}, -1, rd.options());
  at::Tensor grad_depth = at::empty_like(depth_c);
  at::Tensor grad_feat_cl = at::empty_like(feat_cl);
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  if (s.points > 0) {
    point_map_kernel<<<blocks_for(s.points), kThreads, 0, stream>>>(s, rd.const_data_ptr<int>(),
                                                                     point_of.mutable_data_ptr<int>());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, depth.scalar_type(), "bev_pool_backward_cuda", [&] {
    if (s.depth_numel() > 0) {
      grad_depth_kernel<scalar_t><<<blocks_for(s.depth_numel()), kThreads, 0, stream>>>(
          s, grad_cl.const_data_ptr<scalar_t>(), feat_cl.const_data_ptr<scalar_t>(), point_of.const_data_ptr<int>(),
          rb.const_data_ptr<int>(), grad_depth.mutable_data_ptr<scalar_t>());
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    }
    if (s.pixels() * s.channels > 0) {
      grad_feat_kernel<scalar_t><<<blocks_for(s.pixels() * s.channels), kThreads, 0, stream>>>(
          s, grad_cl.const_data_ptr<scalar_t>(), depth_c.const_data_ptr<scalar_t>(), point_of.const_data_ptr<int>(),
          rb.const_data_ptr<int>(), grad_feat_cl.mutable_data_ptr<scalar_t>());
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
