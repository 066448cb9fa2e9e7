// The elementwise helpers on the CPU (src/common/backends.h). add is numerics 5.10: out[i] = R_T(rn(a[i] + b[i])), each
// element on its own, so the split over threads never changes a bit.
#include "common/backends.h"

#include <cstring>

#include "common/scalar_math.h"
#include "common/storage.h"
#include "cpu/parallel.h"
#include "cpu/unaligned.h"

namespace detdit {

namespace cpu {

Status add(const TensorView& a, const TensorView& b, const TensorView& out, Stream) {
  dispatch_float_dtype(out.dtype, [&](auto tag) {
    using T = decltype(tag);
    // in place (out == a or b) is safe: element i is read before it is written;
    // the operands may sit at any byte address (cpu::load / cpu::store)
    const void *lhs = a.data, *rhs = b.data;
    void* sum = out.data;
    parallel_for(0, out.numel(), [lhs, rhs, sum](int64_t i) {
      store(sum, i, from_float<T>(num::add32(to_float(load<T>(lhs, i)), to_float(load<T>(rhs, i)))));
    });
  });
  return Status();
}

Status copy_tensor(const TensorView& src, const TensorView& dst, Stream) {
  if (dst.nbytes() > 0) std::memcpy(dst.data, src.data, dst.nbytes());
  return Status();
}

Status fill_zero(const TensorView& t, Stream) {
  if (t.nbytes() > 0) std::memset(t.data, 0, t.nbytes());
  return Status();
}

}  // namespace cpu
}  // namespace detdit
