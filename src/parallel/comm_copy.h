// Stream-ordered copies and events for the CUDA side of the communicators and
// the parallel ops (src/cuda/comm_copy.cu; a build without CUDA returns a
// RuntimeError from each). Events are opaque cudaEvent_t handles.
#pragma once

#include <cstddef>
#include <cstdint>

#include "detdit/numerics.h"
#include "detdit/status.h"
#include "detdit/tensor.h"

namespace detdit {
namespace cuda {

// The Status-returning entry points, as one list (X(name, parameter types...))
// from which src/no_cuda/ generates its stubs:
//   comm_event_create(device, event): a new event in *event;
//   comm_event_record(event, stream);
//   comm_stream_wait(stream, event): later work on `stream` waits for `event`;
//   comm_copy_async(dst, src, bytes, stream): device-to-device copy, ordered on `stream`;
//   comm_copy_2d_async(dst, dst_pitch, src, src_pitch, width, height, stream):
//     `height` rows of `width` bytes, dst + i*dst_pitch <- src + i*src_pitch;
//   comm_columns_to_f32(src, src_dtype, src_row_stride, rows, cols, dst, stream):
//     dst[t, j] = fp32(src[t*src_row_stride + j]) for t < rows, j < cols; src
//     fp32 or bf16 (exact upcast), dst (rows, cols) fp32 contiguous.
#define DETDIT_COMM_COPY_OPS(X)                                                                  \
  X(comm_event_create, const Device&, void**)                                                    \
  X(comm_event_record, void*, Stream)                                                            \
  X(comm_stream_wait, Stream, void*)                                                             \
  X(comm_copy_async, void*, const void*, std::size_t, Stream)                                    \
  X(comm_copy_2d_async, void*, std::size_t, const void*, std::size_t, std::size_t, std::size_t,  \
    Stream)                                                                                      \
  X(comm_columns_to_f32, const void*, DType, int64_t, int64_t, int64_t, float*, Stream)

#define DETDIT_DECLARE_COMM_COPY_OP(name, ...) Status name(__VA_ARGS__);
DETDIT_COMM_COPY_OPS(DETDIT_DECLARE_COMM_COPY_OP)
#undef DETDIT_DECLARE_COMM_COPY_OP
void comm_event_destroy(void* event);

}  // namespace cuda
}  // namespace detdit
