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

#include "common/backends.h"
#include "detdit/numerics.h"
#include "detdit/status.h"
#include "detdit/tensor.h"

namespace detdit {

// The backends' allocate_scratch (backends.h): cpu:: takes 64-byte aligned
// host memory (so every scratch view meets linear's 16-byte rule) and turns
// std::bad_alloc into a RuntimeError; cuda:: takes memory from detdit's pool
// of the device (src/cuda/memory.cu) on `stream`, 256-byte aligned, freed with
// cudaFreeAsync on `stream` when the last copy of *owner is destroyed.

// `bytes` of scratch memory on `device` (its backend's allocate_scratch).
Status allocate_scratch(const Device& device, std::size_t bytes, Stream stream, std::shared_ptr<void>* owner);

// A contiguous scratch tensor of `shape` and `dtype` on `device`; *owner keeps
// its memory alive. Dispatches to the backend of `device`.
Status scratch_tensor(const Device& device, DType dtype, std::initializer_list<int64_t> shape, Stream stream,
                      std::shared_ptr<void>* owner, TensorView* view);

}  // namespace detdit
