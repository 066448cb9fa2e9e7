// LayerNorm on CUDA (docs/numerics.md 9), bitwise equal to src/cpu/layernorm.cc
// in the portable profile; in the torch profile rsqrt is the hardware rsqrtf,
// which with PyTorch's tree makes the forward and dx PyTorch eager's.
//
// Forward and dx: one 128-thread block per row (thread t = lane + 32*warp,
// PyTorch's (32, 4) block flattened). Thread t owns the 4-element vectors t,
// t+128, ... in element order: a Welford state (forward) or the (s1, s2) dx
// sums; the warps reduce with shuffle-down trees and the 4 warp results meet
// in shared memory, every thread computing the same final combine
// (src/common/layernorm_math.h holds each step).
// d_weight / d_bias (canonical reduction 6.5): one thread per (chunk, column)
// walks the chunk's positions ascending; src/layernorm.cc folds the partials
// with fold.cu.
#include <cuda_runtime.h>

#include <cstdint>

#include "common/backends.h"
#include "common/layernorm_math.h"
#include "common/row_tree.h"
#include "common/scalar_math.h"
#include "common/storage.h"
#include "cuda/cuda_util.cuh"
#include "cuda/profile_math.cuh"
#include "detdit/plan.h"

namespace detdit {
namespace cuda {
namespace {

constexpr int kVec = kRowTreeVector;  // 4 elements per tree vector

struct LayernormArgs {
  const void* x;       // (M, H)
  const void* weight;  // (H,) or nullptr
  const void* bias;    // (H,) or nullptr
  int64_t hidden, positions;
  float eps;
  bool torch;
  void* out;           // forward (M, H)
  float* mean;         // forward output or backward input (M,); may be nullptr in the forward
  float* rstd;
  const void* grad;    // backward (M, H)
  void* dx;            // backward (M, H)
  float* weight_partials;  // (chunks, H) or nullptr
  float* bias_partials;    // (chunks, H) or nullptr
};

__device__ __forceinline__ layernorm::Welford shfl_down(const layernorm::Welford& s, int offset) {
  return layernorm::Welford{__shfl_down_sync(kFullMask, s.mean, offset), __shfl_down_sync(kFullMask, s.m2, offset),
                            __shfl_down_sync(kFullMask, s.count, offset)};
}

// Weight (or bias) vector j, or `fill` when absent.
template <typename T>
__device__ __forceinline__ void parameter_vec(const void* p, int64_t j, float fill, float (&out)[kVec]) {
  if (p) {
    load_elems<T, kVec, true>(static_cast<const T*>(p) + j * kVec, out);
  } else {
#pragma unroll
    for (int e = 0; e < kVec; ++e) out[e] = fill;
  }
}

// x, weight, bias and out are validated aligned to a 4-element vector.
template <typename T>
__global__ void __launch_bounds__(kRowTreeThreads) layernorm_forward_kernel(LayernormArgs a) {
  __shared__ layernorm::Welford warp_states[kRowTreeWarps];
  const int64_t m = blockIdx.x;
  const int64_t vectors = a.hidden / kVec;
  const T* x = static_cast<const T*>(a.x) + m * a.hidden;  // (H,) row m
  layernorm::Welford s{0.0f, 0.0f, 0.0f};
  for (int64_t j = threadIdx.x; j < vectors; j += kRowTreeThreads) {
    float v[kVec];
    load_elems<T, kVec, true>(x + j * kVec, v);
#pragma unroll
    for (int e = 0; e < kVec; ++e) s = layernorm::welford_step(s, v[e]);
  }
  for (int offset = 16; offset >= 1; offset /= 2) s = layernorm::welford_combine(s, shfl_down(s, offset));
  if (threadIdx.x % kWarpSize == 0) warp_states[threadIdx.x / kWarpSize] = s;
  __syncthreads();
  const layernorm::Welford w[kRowTreeWarps] = {warp_states[0], warp_states[1], warp_states[2], warp_states[3]};
  const layernorm::RowMoments moments = layernorm::moments_of(layernorm::combine_warps(w), a.hidden);
  const float rstd = rsqrt_p(num::add32(moments.var, a.eps), a.torch);
  if (threadIdx.x == 0) {
    if (a.mean) a.mean[m] = moments.mean;
    if (a.rstd) a.rstd[m] = rstd;
  }
  T* out = static_cast<T*>(a.out) + m * a.hidden;
  const bool has_weight = a.weight != nullptr, has_bias = a.bias != nullptr;
  for (int64_t j = threadIdx.x; j < vectors; j += kRowTreeThreads) {
    float v[kVec], wv[kVec], bv[kVec], o[kVec];
    load_elems<T, kVec, true>(x + j * kVec, v);
    parameter_vec<T>(a.weight, j, 1.0f, wv);
    parameter_vec<T>(a.bias, j, 0.0f, bv);
#pragma unroll
    for (int e = 0; e < kVec; ++e)
      o[e] = layernorm::normalised(v[e], moments.mean, rstd, has_weight, wv[e], has_bias, bv[e]);
    store_elems<T, kVec, true>(out + j * kVec, o);
  }
}

// kVector: grad and dx rows aligned to a 4-element vector (x and weight always are).
template <typename T, bool kVector>
__global__ void __launch_bounds__(kRowTreeThreads) layernorm_backward_rows_kernel(LayernormArgs a) {
  __shared__ float warp_sums[2][kRowTreeWarps];
  const int64_t m = blockIdx.x;
  const int64_t vectors = a.hidden / kVec;
  const T* x = static_cast<const T*>(a.x) + m * a.hidden;  // (H,) row m
  const T* g = static_cast<const T*>(a.grad) + m * a.hidden;
  const float mean = a.mean[m], rstd = a.rstd[m];
  layernorm::DxSums s{0.0f, 0.0f};
  for (int64_t j = threadIdx.x; j < vectors; j += kRowTreeThreads) {
    float xv[kVec], gv[kVec], wv[kVec];
    load_elems<T, kVec, true>(x + j * kVec, xv);
    load_elems<T, kVec, kVector>(g + j * kVec, gv);
    parameter_vec<T>(a.weight, j, 1.0f, wv);
#pragma unroll
    for (int e = 0; e < kVec; ++e) s = layernorm::dx_sums_step(s, gv[e], wv[e], xv[e], mean, rstd);
  }
  float s1 = s.s1, s2 = s.s2;
  for (int offset = 16; offset >= 1; offset /= 2) {
    s1 = num::add32(s1, __shfl_down_sync(kFullMask, s1, offset));
    s2 = num::add32(s2, __shfl_down_sync(kFullMask, s2, offset));
  }
  if (threadIdx.x % kWarpSize == 0) {
    warp_sums[0][threadIdx.x / kWarpSize] = s1;
    warp_sums[1][threadIdx.x / kWarpSize] = s2;
  }
  __syncthreads();
  const float sum1 = layernorm::block_sum_of_warps(warp_sums[0]);
  const float sum2 = layernorm::block_sum_of_warps(warp_sums[1]);
  const float term1 = layernorm::dx_term1(rstd, a.hidden);
  T* dx = static_cast<T*>(a.dx) + m * a.hidden;
  for (int64_t j = threadIdx.x; j < vectors; j += kRowTreeThreads) {
    float xv[kVec], gv[kVec], wv[kVec], o[kVec];
    load_elems<T, kVec, true>(x + j * kVec, xv);
    load_elems<T, kVec, kVector>(g + j * kVec, gv);
    parameter_vec<T>(a.weight, j, 1.0f, wv);
#pragma unroll
    for (int e = 0; e < kVec; ++e) o[e] = layernorm::dx_value(gv[e], wv[e], xv[e], mean, rstd, sum1, sum2, term1, a.hidden);
    store_elems<T, kVec, kVector>(dx + j * kVec, o);
  }
}

constexpr int kPartialThreads = 128;

// Block b: chunk b / column_blocks, columns of block b % column_blocks; one
// thread per column, the chunk's positions ascending.
template <typename T>
__global__ void layernorm_backward_partials_kernel(LayernormArgs a, int64_t column_blocks) {
  const int64_t chunk = blockIdx.x / column_blocks;
  const int64_t i = (blockIdx.x % column_blocks) * kPartialThreads + threadIdx.x;
  if (i >= a.hidden) return;
  const T* x = static_cast<const T*>(a.x);
  const T* g = static_cast<const T*>(a.grad);
  const int64_t begin = chunk * kReductionChunk;
  const int64_t end = begin + kReductionChunk < a.positions ? begin + kReductionChunk : a.positions;
  float wacc = 0.0f, bacc = 0.0f;
  for (int64_t p = begin; p < end; ++p) {
    const float gv = to_float(g[p * a.hidden + i]);
    if (a.weight_partials) wacc = layernorm::weight_grad_step(gv, to_float(x[p * a.hidden + i]), a.mean[p], a.rstd[p], wacc);
    if (a.bias_partials) bacc = num::add32(bacc, gv);
  }
  if (a.weight_partials) a.weight_partials[chunk * a.hidden + i] = wacc;
  if (a.bias_partials) a.bias_partials[chunk * a.hidden + i] = bacc;
}

LayernormArgs args_of(const LayernormInputs& in) {
  LayernormArgs a{};
  a.x = in.x.data;
  a.weight = in.weight.present() ? in.weight.data : nullptr;
  a.bias = in.bias.present() ? in.bias.data : nullptr;
  a.hidden = in.x.shape[in.x.rank - 1];
  a.positions = in.x.numel() / a.hidden;
  a.eps = in.eps;
  a.torch = in.numerics == Numerics::kTorch;
  return a;
}

}  // namespace

Status layernorm_forward(const LayernormParams& p, Stream stream) {
  if (p.in.shift.present())
    return Status::value_error("shift and scale: the modulated layernorm runs on the CPU only in this build");
  DeviceGuard guard;
  DETDIT_RETURN_IF_ERROR(guard.enter(p.in.x.device));
  LayernormArgs a = args_of(p.in);
  a.out = p.out.data;
  a.mean = p.mean.present() ? p.mean.ptr<float>() : nullptr;
  a.rstd = p.rstd.present() ? p.rstd.ptr<float>() : nullptr;
  if (a.positions == 0) return Status();
  return dispatch_float_dtype(p.in.x.dtype, [&](auto tag) {
    layernorm_forward_kernel<decltype(tag)>
        <<<static_cast<unsigned>(a.positions), kRowTreeThreads, 0, as_cuda_stream(stream)>>>(a);
    return launch_status("layernorm_forward_kernel");
  });
}

Status layernorm_backward_rows(const LayernormBackwardParams& p, Stream stream) {
  if (p.in.shift.present())
    return Status::value_error("shift and scale: the modulated layernorm runs on the CPU only in this build");
  if (!p.dx.present()) return Status();
  DeviceGuard guard;
  DETDIT_RETURN_IF_ERROR(guard.enter(p.in.x.device));
  LayernormArgs a = args_of(p.in);
  a.mean = const_cast<float*>(p.mean.ptr<const float>());
  a.rstd = const_cast<float*>(p.rstd.ptr<const float>());
  a.grad = p.grad.data;
  a.dx = p.dx.data;
  if (a.positions == 0) return Status();
  return dispatch_float_dtype(p.in.x.dtype, [&](auto tag) {
    using T = decltype(tag);
    const unsigned blocks = static_cast<unsigned>(a.positions);
    // H % 4 == 0, so every row of an aligned grad / dx is aligned too.
    if (address_aligned(a.grad, kVec * sizeof(T)) && address_aligned(a.dx, kVec * sizeof(T)))
      layernorm_backward_rows_kernel<T, true><<<blocks, kRowTreeThreads, 0, as_cuda_stream(stream)>>>(a);
    else
      layernorm_backward_rows_kernel<T, false><<<blocks, kRowTreeThreads, 0, as_cuda_stream(stream)>>>(a);
    return launch_status("layernorm_backward_rows_kernel");
  });
}

Status layernorm_backward_partials(const LayernormBackwardParams& p, const LayernormPartials& partials,
                                   Stream stream) {
  const TensorView &weight_partials = partials.weight, &bias_partials = partials.bias;
  if (!weight_partials.present() && !bias_partials.present()) return Status();
  DeviceGuard guard;
  DETDIT_RETURN_IF_ERROR(guard.enter(p.in.x.device));
  LayernormArgs a = args_of(p.in);
  a.mean = const_cast<float*>(p.mean.ptr<const float>());
  a.rstd = const_cast<float*>(p.rstd.ptr<const float>());
  a.grad = p.grad.data;
  a.weight_partials = weight_partials.present() ? weight_partials.ptr<float>() : nullptr;
  a.bias_partials = bias_partials.present() ? bias_partials.ptr<float>() : nullptr;
  const int64_t chunks = (a.positions + kReductionChunk - 1) / kReductionChunk;
  const int64_t column_blocks = blocks_for(a.hidden, kPartialThreads);
  if (chunks == 0) return Status();
  return dispatch_float_dtype(p.in.x.dtype, [&](auto tag) {
    layernorm_backward_partials_kernel<decltype(tag)>
        <<<static_cast<unsigned>(chunks * column_blocks), kPartialThreads, 0, as_cuda_stream(stream)>>>(
            a, column_blocks);
    return launch_status("layernorm_backward_partials_kernel");
  });
}

}  // namespace cuda
}  // namespace detdit
