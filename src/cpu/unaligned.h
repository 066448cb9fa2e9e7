// Element access at any byte address, for the CPU reference's tensors whose
// alignment validation does not require (docs/ops.md): a typed load or store
// through a misaligned pointer is undefined behaviour (UBSan's "misaligned
// address"), memcpy of one element is not, and compiles to the same move.
#pragma once

#include <cstdint>
#include <cstring>

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

}  // namespace cpu
}  // namespace detdit
