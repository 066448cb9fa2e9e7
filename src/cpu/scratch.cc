// CPU scratch memory and the exact FP32 upcast (src/common/backends.h),
// scratch_tensor (src/common/scratch.h) and release_scratch_memory
// (include/detdit/memory.h).
#include "common/scratch.h"

#include <new>
#include <string>

#include "common/storage.h"
#include "detdit/memory.h"
#include "cpu/parallel.h"
#include "cpu/unaligned.h"

namespace detdit {

namespace cpu {

Status allocate_scratch(const Device&, std::size_t bytes, Stream, std::shared_ptr<void>* owner) {
  // 64-byte alignment: every view into scratch meets linear's 16-byte rule.
  constexpr std::align_val_t kAlignment{64};
  void* memory = ::operator new(bytes > 0 ? bytes : 1, kAlignment, std::nothrow);
  if (memory == nullptr)
    return Status::runtime_error("could not allocate " + std::to_string(bytes) + " bytes of host scratch memory");
  *owner = std::shared_ptr<void>(memory, [kAlignment](void* m) { ::operator delete(m, kAlignment); });
  return Status();
}

// src is a caller's tensor (a bf16 grad_table) at any byte address; dst is scratch.
Status upcast_to_f32(const TensorView& src, const TensorView& dst, Stream) {
  float* out = dst.ptr<float>();
  dispatch_float_dtype(src.dtype, [&](auto tag) {
    using In = decltype(tag);
    parallel_for(0, src.numel(), [&](int64_t i) { out[i] = to_float(load<In>(src.data, i)); });
  });
  return Status();
}

}  // namespace cpu

Status allocate_scratch(const Device& device, std::size_t bytes, Stream stream, std::shared_ptr<void>* owner) {
  return backend::allocate_scratch(device, device, bytes, stream, owner);
}

Status release_scratch_memory(const Device& device) {
  if (!device.is_cuda()) return Status();  // host scratch goes back to the heap when freed
  const Status s = cuda::release_scratch_memory(device);
  if (s.ok()) return s;
  return Status(s.kind(), "release_scratch_memory(" + device.to_string() + "): " + s.message());
}

Status scratch_tensor(const Device& device, DType dtype, std::initializer_list<int64_t> shape, Stream stream,
                      std::shared_ptr<void>* owner, TensorView* view) {
  TensorView shaped = TensorView::contiguous(nullptr, dtype, shape, device);
  DETDIT_RETURN_IF_ERROR(allocate_scratch(device, shaped.nbytes(), stream, owner));
  shaped.data = owner->get();
  *view = shaped;
  return Status();
}

}  // namespace detdit
