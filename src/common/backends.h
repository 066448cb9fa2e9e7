// The backend entry points behind the public API. The public functions
// (src/*.cc) validate every argument, then call the backend of the tensors'
// device with the same Params. Backends assume validated params.
//
// cpu:: is the reference: the executable form of docs/numerics.md.
// cuda:: reproduces it byte for byte (portable) or replays PyTorch (torch).
// Without a CUDA build, cuda:: entry points return a RuntimeError.
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "detdit/adaln.h"
#include "detdit/gate_residual.h"
#include "detdit/linear.h"
#include "detdit/numerics.h"
#include "detdit/rmsnorm.h"
#include "detdit/status.h"
#include "detdit/timestep.h"

namespace detdit {

#define DETDIT_BACKEND_OPS(ns)                                                                   \
  namespace ns {                                                                                 \
  Status timestep_sinusoid_forward(const TimestepSinusoidParams& p, Stream stream);              \
  Status timestep_sinusoid_backward(const TimestepSinusoidBackwardParams& p, Stream stream);     \
  Status linear_forward(const LinearParams& p, Stream stream);                                   \
  Status linear_backward_input_partials(const LinearBackwardInputParams& p, Stream stream);      \
  Status linear_fold_partials(const LinearBackwardInputParams& p, Stream stream);               \
  Status linear_backward_weight(const LinearBackwardWeightParams& p, Stream stream);            \
  Status silu_backward(const SiluBackwardParams& p, Stream stream);                             \
  /* act = R_T(silu(temb)), T = act's dtype: the cast before every projection */                \
  Status silu_cast(const TensorView& temb, const TensorView& act, Numerics numerics, Stream stream); \
  Status adaln_row_gather_forward(const AdalnRowGatherParams& p, Stream stream);                 \
  Status adaln_row_gather_backward(const AdalnRowGatherBackwardParams& p, Stream stream);        \
  Status rmsnorm_forward(const RmsnormParams& p, Stream stream);                                 \
  Status rmsnorm_backward(const RmsnormBackwardParams& p, Stream stream);                        \
  Status gate_residual_forward(const GateResidualParams& p, Stream stream);                      \
  Status gate_residual_backward(const GateResidualBackwardParams& p, Stream stream);             \
  }

DETDIT_BACKEND_OPS(cpu)
DETDIT_BACKEND_OPS(cuda)

namespace cuda {
// Copy bytes from device memory to the host, synchronising `stream` (plan
// building reads a CUDA index once on the host).
Status copy_to_host(const void* device_src, void* host_dst, std::size_t bytes, const Device& device,
                    Stream stream);
// Copy the int32 host arrays into one device allocation on `device`;
// (*device_ptrs)[i] is array i's copy; *owner frees the allocation.
Status upload_tables(const Device& device, const std::vector<const std::vector<int32_t>*>& arrays,
                     std::vector<const int32_t*>* device_ptrs, std::shared_ptr<void>* owner, Stream stream);
}  // namespace cuda

#undef DETDIT_BACKEND_OPS

}  // namespace detdit
