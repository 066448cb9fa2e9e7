// Element access at any byte address, for the CPU reference's tensors whose
// alignment validation does not require (docs/ops.md): a typed load or store
// through a misaligned pointer is undefined behaviour (UBSan's "misaligned
// address"), memcpy of one element is not, and compiles to the same move.
//
// Loops that store through these take their bases and bounds in locals of the
// loop's own scope: a memcpy store may alias any memory, so a bound or base
// read through a reference or a capture would be reloaded every iteration and
// keep the loop from vectorising (the aligned path would get slower).
#pragma once

#include <cstdint>
#include <cstring>

#include "detdit/tensor.h"

namespace detdit {
namespace cpu {

// Element i of the T array at `base`.
template <typename T>
T load(const void* base, int64_t i) {
  T v;
  std::memcpy(&v, static_cast<const char*>(base) + i * static_cast<int64_t>(sizeof(T)), sizeof(T));
  return v;
}

template <typename T>
void store(void* base, int64_t i, T v) {
  std::memcpy(static_cast<char*>(base) + i * static_cast<int64_t>(sizeof(T)), &v, sizeof(T));
}

// The address of row r of a 2-D view with unit column stride (any row
// stride): its elements are load / store indices 0.. from there.
inline void* row_address(const TensorView& view, int64_t r) {
  return static_cast<char*>(view.data) + r * view.strides[0] * static_cast<int64_t>(dtype_size(view.dtype));
}

}  // namespace cpu
}  // namespace detdit
