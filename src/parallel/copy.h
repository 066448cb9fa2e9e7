// Byte copies of the parallel ops on the CPU (memcpy) or a CUDA device
// (stream-ordered device-to-device copies). Internal.
#pragma once

#include <cstddef>
#include <cstring>
#include <vector>

#include "detdit/numerics.h"
#include "detdit/status.h"
#include "detdit/tensor.h"
#include "parallel/comm_copy.h"

namespace detdit {
namespace parallel_copy {

inline Status copy(const Device& device, void* dst, const void* src, std::size_t bytes, Stream stream) {
  if (bytes == 0) return Status();
  if (device.is_cuda()) return cuda::comm_copy_async(dst, src, bytes, stream);
  std::memcpy(dst, src, bytes);
  return Status();
}

// `height` rows of `width` bytes from src (pitch src_pitch) to dst (pitch dst_pitch).
inline Status copy_2d(const Device& device, void* dst, std::size_t dst_pitch, const void* src, std::size_t src_pitch,
                      std::size_t width, std::size_t height, Stream stream) {
  if (device.is_cuda()) return cuda::comm_copy_2d_async(dst, dst_pitch, src, src_pitch, width, height, stream);
  for (std::size_t i = 0; i < height; ++i)
    std::memcpy(static_cast<char*>(dst) + i * dst_pitch, static_cast<const char*>(src) + i * src_pitch, width);
  return Status();
}

}  // namespace parallel_copy
}  // namespace detdit
