// Internal scratch memory for the temporaries of composite ops: the d_x chunk
// partials of linear_backward_input, the hidden activations of timestep_mlp,
// and the act / FP32 gradient copies of the projection helper
// (src/common/projection.h). Not part of the public API.
//
// Scratch never changes a bit: it only holds intermediates whose order of
// operations docs/numerics.md fixes. It is released when the last copy of
// *owner goes away; on CUDA that is stream-ordered (cudaFreeAsync on the same
// stream), so the host may drop *owner right after enqueuing the launches.
#pragma once

#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <memory>

#include "detdit/numerics.h"
#include "detdit/status.h"
#include "detdit/tensor.h"

namespace detdit {

namespace cpu {
// `bytes` of host memory, 64-byte aligned (so every scratch view meets the
// 16-byte alignment that linear's operands need). Never fails short of
// std::bad_alloc, which it turns into a RuntimeError.
Status allocate_scratch(const Device& device, std::size_t bytes, Stream stream, std::shared_ptr<void>* owner);
// dst[i] = float(src[i]): exact widening of a contiguous float tensor
// (fp32/bf16/fp16) into a contiguous fp32 tensor with the same numel.
Status upcast_to_f32(const TensorView& src, const TensorView& dst, Stream stream);
}  // namespace cpu

namespace cuda {
// cudaMallocAsync on `stream`, 256-byte aligned; freed with cudaFreeAsync on
// `stream` when the last copy of *owner is destroyed.
Status allocate_scratch(const Device& device, std::size_t bytes, Stream stream, std::shared_ptr<void>* owner);
// As cpu::upcast_to_f32, on `stream`.
Status upcast_to_f32(const TensorView& src, const TensorView& dst, Stream stream);
}  // namespace cuda

// `bytes` of scratch memory on `device` (the backend's allocate_scratch).
Status allocate_scratch(const Device& device, std::size_t bytes, Stream stream, std::shared_ptr<void>* owner);

// A contiguous scratch tensor of `shape` and `dtype` on `device`; *owner keeps
// its memory alive. Dispatches to the backend of `device`.
Status scratch_tensor(const Device& device, DType dtype, std::initializer_list<int64_t> shape, Stream stream,
                      std::shared_ptr<void>* owner, TensorView* view);

}  // namespace detdit
