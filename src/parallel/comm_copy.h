// Stream-ordered copies and events for the CUDA side of the communicators and
// the parallel ops (src/cuda/comm_copy.cu; a build without CUDA returns a
// RuntimeError from each). Events are opaque cudaEvent_t handles.
#pragma once

#include <cstddef>

#include "detdit/numerics.h"
#include "detdit/status.h"
#include "detdit/tensor.h"

namespace detdit {
namespace cuda {

Status comm_event_create(const Device& device, void** event);
void comm_event_destroy(void* event);
Status comm_event_record(void* event, Stream stream);
// Later work on `stream` waits for the work recorded in `event`.
Status comm_stream_wait(Stream stream, void* event);
// Device-to-device copy of `bytes` bytes, ordered on `stream`.
Status comm_copy_async(void* dst, const void* src, std::size_t bytes, Stream stream);
// `height` rows of `width` bytes: dst + i*dst_pitch <- src + i*src_pitch
// (device to device), ordered on `stream`.
Status comm_copy_2d_async(void* dst, std::size_t dst_pitch, const void* src, std::size_t src_pitch,
                          std::size_t width, std::size_t height, Stream stream);
// dst[t, j] = fp32(src[t*src_row_stride + j]) for t < rows, j < cols; src is
// fp32 or bf16 (exact upcast), dst (rows, cols) fp32 contiguous.
Status comm_columns_to_f32(const void* src, DType src_dtype, int64_t src_row_stride, int64_t rows, int64_t cols,
                           float* dst, Stream stream);

}  // namespace cuda
}  // namespace detdit
