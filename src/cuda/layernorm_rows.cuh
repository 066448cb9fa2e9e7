// The LayerNorm row kernel and the host helpers the layernorm family of
// src/cuda/ shares: layernorm.cu (layernorm) and gate_residual_layernorm.cu
// (the fused region's forward) run one forward kernel template, which takes
// its row source as a template parameter: x loaded from memory (StoredRows,
// below) or h computed from residual, y and the gate and stored on the way
// (gate_residual_layernorm.cu). Private to those two files: each includes it
// once (anonymous namespace, so each compiles the kernels it launches).
//
// The forward (docs/numerics.md 9.1, 9.2, 9.5): one 128-thread block per row
// (thread t = lane + 32*warp, PyTorch's (32, 4) block flattened). Thread t
// owns the 4-element vectors t, t+128, ... in element order and folds them
// into a Welford state; the warps reduce with shuffle-down trees and the 4
// warp results meet in shared memory, every thread computing the same final
// combine (src/common/layernorm_math.h holds each step). The output pass
// normalises and modulates the same vectors. Only where a value comes from
// depends on the source; every step on it is the same code, so the fused
// region's bits are the plain norm's of the h it stores.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <type_traits>

#include "common/backends.h"
#include "common/layernorm_math.h"
#include "common/modulation_math.h"
#include "common/row_tree.h"
#include "common/rowwise_math.h"
#include "common/scalar_math.h"
#include "common/storage.h"
#include "cuda/cuda_util.cuh"
#include "cuda/profile_math.cuh"
#include "detdit/layernorm.h"
#include "detdit/plan.h"
#include "rowwise/checks.h"

namespace detdit {
namespace cuda {
namespace {

constexpr int kVec = kRowTreeVector;  // 4 elements per tree vector

// The forward's statistics pass takes a thread's vectors in batches of this
// many (j = first + 128*i, ascending i), every load of a batch before its
// first store, and keeps the first batch in registers for the output pass
// (H <= 4096 whole); later vectors are read again (x, or the h this thread
// wrote: L2). A store may alias a later vector's input as far as the
// compiler knows, so a source that stores (h) would otherwise make each
// vector's loads wait for the previous store: one memory latency per vector
// (gate_residual_rmsnorm's forward batches for this reason). Past the cached
// batch, and in the output pass, the source sets the batch (below).
constexpr int kForwardBatch = 8;

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
  // modulation (shift.data null: the plain norm)
  ModulationOperand shift, scale;
  ModulationForm form;
  const int32_t* row_of_seq;  // indexed form (device)
  int64_t seq_len, frame_len, per_group;
  PlanTables tables;      // indexed form (device)
  float* table_partials;  // [d_shift | d_scale] (rows, 2H) or nullptr
};

__device__ __forceinline__ int64_t offset_of(const LayernormArgs& a, const ModulationOperand& m, int64_t p) {
  return modulation_offset(m, a.form, a.seq_len, a.frame_len, a.row_of_seq, p);
}

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

// A row source of the forward kernel: Stored, x's storage type (the norm's
// T); Loads, what vector j's loads bring; kStatisticsBatch and kOutputBatch,
// the vectors per batch past the cached batch in the statistics pass and in
// the output pass (divisors of kForwardBatch); row(m, H), the source
// of row m, whose load(j, loads) issues vector j's loads, finish(j, loads)
// makes x vector j from them (storing whatever the source writes) and
// reload(j, x) reads x vector j again in the output pass.
//
// StoredRows: the plain layernorm, x read from memory (validated aligned to a
// vector). It stores nothing in its statistics pass, so the compiler issues
// the cached batch's loads together anyway; past it and in the output pass
// it goes one vector at a time, as rmsnorm's plain forward does: batching
// both passes raised rmsnorm's registers from 40 to 90 and cut it from
// 74-82 % to 51-53 % of the copy bandwidth, the first alone made it 0-11 %
// slower (one H200, dev/README.md).
template <typename T>
struct StoredRows {
  using Stored = T;
  static constexpr int kStatisticsBatch = 1;
  static constexpr int kOutputBatch = 1;
  struct Loads {
    ElemVec<T, kVec> x;
  };
  struct Row {
    const T* x;  // (H,) row m
    __device__ __forceinline__ void load(int64_t j, Loads& in) const { load_stored<T, kVec, true>(x + j * kVec, in.x); }
    __device__ __forceinline__ ElemVec<T, kVec> finish(int64_t, const Loads& in) const { return in.x; }
    __device__ __forceinline__ void reload(int64_t j, ElemVec<T, kVec>& out) const {
      load_stored<T, kVec, true>(x + j * kVec, out);
    }
  };
  const T* x;  // (M, H)
  __device__ __forceinline__ Row row(int64_t m, int64_t hidden) const { return Row{x + m * hidden}; }
};

// The forward of one row per block, x from `source`: statistics (mean, rstd
// stored where asked for), then out = the normalised x, modulated by the
// shift and scale rows of position m when present. x, weight, bias and out
// are validated aligned to a vector; kVector: the shift and scale rows are
// too (else scalar loads of them, the same values).
template <typename Source, typename M, bool kUpcast, bool kVector>
__global__ void __launch_bounds__(kRowTreeThreads) layernorm_forward_kernel(LayernormArgs a, Source source) {
  using T = typename Source::Stored;
  using R = Recipe<T, M, kUpcast>;
  using Out = typename R::Out;
  __shared__ layernorm::Welford warp_states[kRowTreeWarps];
  const int64_t m = blockIdx.x;
  const int64_t vectors = a.hidden / kVec;
  constexpr int64_t kBatchStride = static_cast<int64_t>(kForwardBatch) * kRowTreeThreads;
  const typename Source::Row row = source.row(m, a.hidden);
  // The first batch of x, in its storage type.
  ElemVec<T, kVec> cached[kForwardBatch];
  layernorm::Welford s{0.0f, 0.0f, 0.0f};
  // Vectors j = first + 128*i, i < width; kept: they also go into cached.
  auto statistics_batch = [&](auto width, int64_t first, bool kept) {
    constexpr int kWidth = decltype(width)::value;
    typename Source::Loads in[kWidth];
#pragma unroll
    for (int i = 0; i < kWidth; ++i) {
      const int64_t j = first + static_cast<int64_t>(i) * kRowTreeThreads;
      if (j < vectors) row.load(j, in[i]);
    }
#pragma unroll
    for (int i = 0; i < kWidth; ++i) {
      const int64_t j = first + static_cast<int64_t>(i) * kRowTreeThreads;
      if (j < vectors) {
        const ElemVec<T, kVec> xv = row.finish(j, in[i]);
        if (kept) cached[i] = xv;
        float v[kVec];
        widen(xv, v);
#pragma unroll
        for (int e = 0; e < kVec; ++e) s = layernorm::welford_step(s, v[e]);
      }
    }
  };
  statistics_batch(std::integral_constant<int, kForwardBatch>{}, threadIdx.x, true);
  constexpr int kLater = Source::kStatisticsBatch;
  for (int64_t first = threadIdx.x + kBatchStride; first < vectors;
       first += static_cast<int64_t>(kLater) * kRowTreeThreads)
    statistics_batch(std::integral_constant<int, kLater>{}, first, false);
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
  Out* out = static_cast<Out*>(a.out) + m * a.hidden;
  const T* weight = static_cast<const T*>(a.weight);
  const T* bias = static_cast<const T*>(a.bias);
  const bool modulated = a.shift.data != nullptr;
  const M* shift = modulated ? static_cast<const M*>(a.shift.data) + offset_of(a, a.shift, m) : nullptr;
  const M* scale = modulated ? static_cast<const M*>(a.scale.data) + offset_of(a, a.scale, m) : nullptr;
  // Vectors j = first + 128*i, i < kOut; x from cached[c + i] when c >= 0
  // (the first batch, c a constant once unrolled), else read again.
  constexpr int kOut = Source::kOutputBatch;
  static_assert(kForwardBatch % kOut == 0, "the output batches tile the cached batch");
  auto output_batch = [&](int64_t first, int c) {
    ElemVec<T, kVec> xs[kOut], ws[kOut], bs[kOut];
    ElemVec<M, kVec> shs[kOut], scs[kOut];
#pragma unroll
    for (int i = 0; i < kOut; ++i) {
      const int64_t j = first + static_cast<int64_t>(i) * kRowTreeThreads;
      if (j < vectors) {
        if (c >= 0)
          xs[i] = cached[c + i];
        else
          row.reload(j, xs[i]);
        if (weight) load_stored<T, kVec, true>(weight + j * kVec, ws[i]);
        if (bias) load_stored<T, kVec, true>(bias + j * kVec, bs[i]);
        if (modulated) {
          load_stored<M, kVec, kVector>(shift + j * kVec, shs[i]);
          load_stored<M, kVec, kVector>(scale + j * kVec, scs[i]);
        }
      }
    }
#pragma unroll
    for (int i = 0; i < kOut; ++i) {
      const int64_t j = first + static_cast<int64_t>(i) * kRowTreeThreads;
      if (j < vectors) {
        float xv[kVec], wv[kVec], bv[kVec], o[kVec];
        widen(xs[i], xv);
        if (weight) widen(ws[i], wv);
        if (bias) widen(bs[i], bv);
#pragma unroll
        for (int e = 0; e < kVec; ++e)
          o[e] = layernorm::normalised(xv[e], moments.mean, rstd, weight != nullptr, weight ? wv[e] : 1.0f,
                                       bias != nullptr, bias ? bv[e] : 0.0f);
        if (modulated) {
          float sh[kVec], sc[kVec];
          widen(shs[i], sh);
          widen(scs[i], sc);
#pragma unroll
          for (int e = 0; e < kVec; ++e)
            o[e] = layernorm::modulated<typename R::Norm, typename R::Mid, typename R::Factor>(o[e], sc[e], sh[e]);
        }
        store_elems<Out, kVec, true>(out + j * kVec, o);
      }
    }
  };
#pragma unroll
  for (int c = 0; c < kForwardBatch; c += kOut)
    output_batch(threadIdx.x + static_cast<int64_t>(c) * kRowTreeThreads, c);
  for (int64_t first = threadIdx.x + kBatchStride; first < vectors;
       first += static_cast<int64_t>(kOut) * kRowTreeThreads)
    output_batch(first, -1);
}

// Whether a modulation operand's rows allow vector loads: absent, or its base
// and row strides a multiple of a vector of its elements.
inline bool operand_vectorizable(const ModulationOperand& m, std::size_t element_bytes) {
  return m.data == nullptr ||
         (address_aligned(m.data, kVec * element_bytes) && m.stride_b % kVec == 0 && m.stride_f % kVec == 0);
}

// One 128-thread block per row.
template <typename Source, typename M, bool kUpcast, bool kVector>
Status launch_layernorm_forward(const LayernormArgs& a, const Source& source, cudaStream_t stream) {
  if (a.positions == 0) return Status();
  layernorm_forward_kernel<Source, M, kUpcast, kVector>
      <<<static_cast<unsigned>(a.positions), kRowTreeThreads, 0, stream>>>(a, source);
  return launch_status("layernorm_forward_kernel");
}

// The arguments every layernorm kernel reads, from validated inputs.
LayernormArgs args_of(const LayernormInputs& in) {
  LayernormArgs a{};
  a.x = in.x.data;
  a.weight = in.weight.present() ? in.weight.data : nullptr;
  a.bias = in.bias.present() ? in.bias.data : nullptr;
  a.hidden = in.x.shape[in.x.rank - 1];
  a.positions = in.x.numel() / a.hidden;
  a.eps = in.eps;
  a.torch = in.numerics == Numerics::kTorch;
  const ResolvedModulation mod = rowwise::layernorm_modulation(in);
  a.shift = modulation_operand(in.shift, mod);
  a.scale = modulation_operand(in.scale, mod);
  a.form = mod.form;
  a.row_of_seq = mod.form == ModulationForm::kIndexed ? in.plan.device_tables().row_of_seq : nullptr;
  if (mod.form == ModulationForm::kIndexed) a.tables = in.plan.device_tables();
  a.seq_len = mod.seq_len;
  a.frame_len = mod.frame_len;
  a.per_group = mod.grouped() ? (mod.frame_len + kReductionChunk - 1) / kReductionChunk : 0;
  return a;
}

// The forward's output pointers into `a`.
void set_forward_outputs(const LayernormParams& p, LayernormArgs* a) {
  a->out = p.out.data;
  a->mean = p.mean.present() ? p.mean.ptr<float>() : nullptr;
  a->rstd = p.rstd.present() ? p.rstd.ptr<float>() : nullptr;
}

// Whether the shift and scale rows allow vector loads (M: their storage type).
template <typename M>
bool modulation_vectorizable(const LayernormArgs& a) {
  return operand_vectorizable(a.shift, sizeof(M)) && operand_vectorizable(a.scale, sizeof(M));
}

// fn(std::bool_constant<value>{}): a runtime choice of a kernel's bool
// template parameter.
template <typename Fn>
auto dispatch_bool(bool value, Fn&& fn) {
  return value ? fn(std::true_type{}) : fn(std::false_type{});
}

}  // namespace
}  // namespace cuda
}  // namespace detdit
