// gate_residual_layernorm's forward on CUDA (docs/numerics.md 9.7): one
// kernel, bitwise equal to the two ops composed (gate_residual into h, then
// layernorm of h), so to the CPU in the portable profile and to the composed
// kernels in the torch profile. Row source, then launcher, then the backend
// entry point; the kernel is layernorm's forward (src/cuda/layernorm_rows.cuh)
// with x computed here: h = gate_residual's out (numerics 5.7, 5.12: the
// gate absent, indexed or grouped, k, both recipes) from its own scalar
// functions (rowwise_math.h) over the recipe of y's dtype and the gate's
// (modulation_math.h), rounded to h's dtype and stored to h; the norm's
// statistics and output read exactly that rounded h: the statistics pass
// the value just stored, the output pass registers (a thread's first batch
// of vectors) or the h the thread stored (L2). So the norm sees the bytes
// of h the composition's second kernel reads.
//
// Bytes per row of H elements from and to DRAM (e = residual's and y's
// dtype size, e_h = h's, e_o = out's, e_m = the modulation's): residual and
// y read once (2 H e), h written once (H e_h), out written once (H e_o),
// mean and rstd (8 B when asked for); the gate, shift and scale rows and
// weight and bias are shared by many rows and stay in L2, except per token,
// where each present one adds H e_m. bf16 everywhere, not per token:
// 8 H + 8 bytes, 43016 B at H = 5376, 24584 B at H = 3072 (the two-kernel
// composition moves 10 H + 8: h written by one and read back by the other).
// h read again in the output pass past a thread's first batch (H > 4096)
// is the h this thread has just written: L2, not DRAM.
#include <cuda_runtime.h>

#include <cstdint>

#include "common/backends.h"
#include "common/modulation_math.h"
#include "common/rowwise_math.h"
#include "common/scalar_math.h"
#include "common/storage.h"
#include "cuda/cuda_util.cuh"
#include "cuda/layernorm_rows.cuh"
#include "detdit/gate_residual_layernorm.h"
#include "detdit/layernorm.h"
#include "rowwise/checks.h"

namespace detdit {
namespace cuda {
namespace {

// The row source that computes h (layernorm_rows.cuh's contract): T is
// residual's and y's storage type, G the gate's, h's storage type the
// recipe's Out. kVector: residual, y and the gate rows aligned to a vector
// (else scalar loads, the same values); h is validated aligned. Both passes
// in whole batches, as gate_residual_rmsnorm's forward (its comment: 79-82 %
// of the copy bandwidth batched against 77-81 % one vector at a time, bf16,
// H = 5376, S >= 32768, one H200).
template <typename T, typename G, bool kUpcast, bool kVector>
struct GatedRows {
  using R = Recipe<T, G, kUpcast>;
  using Stored = typename R::Out;
  static constexpr int kStatisticsBatch = kForwardBatch;
  static constexpr int kOutputBatch = kForwardBatch;
  struct Loads {
    ElemVec<T, kVec> residual, y;
    ElemVec<G, kVec> gate;
  };
  struct Row {
    const T *residual, *y;  // (H,) row m
    const G* gate;          // (H,) position m's gate row, or nullptr (absent)
    Stored* h;              // (H,) row m
    bool has_k;
    float k;
    __device__ __forceinline__ void load(int64_t j, Loads& in) const {
      load_stored<T, kVec, kVector>(residual + j * kVec, in.residual);
      load_stored<T, kVec, kVector>(y + j * kVec, in.y);
      if (gate) load_stored<G, kVec, kVector>(gate + j * kVec, in.gate);
    }
    // gate_residual's h (its forward kernels' functions), stored, returned
    // as stored.
    __device__ __forceinline__ ElemVec<Stored, kVec> finish(int64_t j, const Loads& in) const {
      float r[kVec], yv[kVec], h_vec[kVec];
      widen(in.residual, r);
      widen(in.y, yv);
      if (gate) {
        float g[kVec];
        widen(in.gate, g);
#pragma unroll
        for (int e = 0; e < kVec; ++e) {
          const float term = has_k ? rowwise::gate_with_constant<typename R::Factor>(k, g[e]) : g[e];
          h_vec[e] = rowwise::gated_sum<typename R::Mid>(r[e], term, yv[e]);
        }
      } else {
#pragma unroll
        for (int e = 0; e < kVec; ++e) h_vec[e] = num::add32(r[e], yv[e]);
      }
      ElemVec<Stored, kVec> out;
#pragma unroll
      for (int e = 0; e < kVec; ++e) out.elems[e] = from_float<Stored>(h_vec[e]);
      store_elems<Stored, kVec, true>(h + j * kVec, h_vec);
      return out;
    }
    // A plain load, not the read-only path: this thread wrote h in this kernel.
    __device__ __forceinline__ void reload(int64_t j, ElemVec<Stored, kVec>& out) const {
      load_stored<Stored, kVec, true>(h + j * kVec, out);
    }
  };
  const T *residual, *y;  // (M, H)
  ModulationOperand gate;  // data null: absent
  ModulationForm form;
  const int32_t* row_of_seq;  // indexed form (device)
  int64_t seq_len, frame_len;
  bool has_k;
  float k;
  Stored* h;  // (M, H)
  __device__ __forceinline__ Row row(int64_t m, int64_t hidden) const {
    const G* gate_row =
        gate.data ? static_cast<const G*>(gate.data) + modulation_offset(gate, form, seq_len, frame_len, row_of_seq, m)
                  : nullptr;
    return Row{residual + m * hidden, y + m * hidden, gate_row, h + m * hidden, has_k, k};
  }
};

// The norm's modulation type N (shift's storage type: fp32 or h's) given h's.
template <typename H, typename Fn>
Status dispatch_norm_modulation(DType dtype, Fn&& fn) {
  return dtype == DType::kF32 ? fn(float{}) : fn(H{});
}

// The recipe over <y's type, the gate's, upcast>, the norm's modulation type
// over h's, and the alignment: one instantiation of the kernel per case.
Status launch_gate_residual_layernorm_forward(const GateResidualLayernormParams& p, const LayernormArgs& norm,
                                              DType norm_modulation, cudaStream_t stream) {
  const GateResidualLayernormInputs& in = p.in;
  const GateResidualInputs gate_in{in.residual, in.y, in.gate, in.plan, in.has_k, in.k, in.upcast};
  const ResolvedModulation mod = rowwise::gate_modulation(gate_in);
  return dispatch_recipe(in.y.dtype, mod.dtype, in.upcast, [&](auto t, auto g, auto up) {
    using T = decltype(t);
    using G = decltype(g);
    constexpr bool kUp = decltype(up)::value;
    using Stored = typename Recipe<T, G, kUp>::Out;
    const ModulationOperand gate = modulation_operand(in.gate, mod);
    const bool rows_vector = address_aligned(in.residual.data, kVec * sizeof(T)) &&
                             address_aligned(in.y.data, kVec * sizeof(T)) && operand_vectorizable(gate, sizeof(G));
    return dispatch_norm_modulation<Stored>(norm_modulation, [&](auto n) {
      using N = decltype(n);
      return dispatch_bool(rows_vector && modulation_vectorizable<N>(norm), [&](auto vector) {
        constexpr bool kVector = decltype(vector)::value;
        using Source = GatedRows<T, G, kUp, kVector>;
        Source source{};
        source.residual = in.residual.ptr<const T>();
        source.y = in.y.ptr<const T>();
        source.gate = gate;
        source.form = mod.form;
        source.row_of_seq = mod.form == ModulationForm::kIndexed ? in.plan.device_tables().row_of_seq : nullptr;
        source.seq_len = mod.seq_len;
        source.frame_len = mod.frame_len;
        source.has_k = in.has_k;
        source.k = in.k;
        source.h = static_cast<Stored*>(p.h.data);
        return launch_layernorm_forward<Source, N, kUp, kVector>(norm, source, stream);
      });
    });
  });
}

}  // namespace

Status gate_residual_layernorm_forward(const GateResidualLayernormParams& p, Stream stream) {
  DeviceGuard guard;
  DETDIT_RETURN_IF_ERROR(guard.enter(p.h.device));
  const GateResidualLayernormInputs& in = p.in;
  // The norm half's arguments, x = h (the composition's second op).
  const LayernormParams norm{
      LayernormInputs{p.h, in.weight, in.bias, in.shift, in.scale, in.plan, in.eps, in.numerics, in.upcast}, p.out,
      p.mean, p.rstd};
  LayernormArgs a = args_of(norm.in);
  set_forward_outputs(norm, &a);
  return launch_gate_residual_layernorm_forward(p, a, modulation_dtype(norm.in), as_cuda_stream(stream));
}

}  // namespace cuda
}  // namespace detdit
