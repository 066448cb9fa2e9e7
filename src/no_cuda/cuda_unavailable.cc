// The CUDA backend of a build without nvcc: every entry point of the backend
// lists (src/common/backends.h) and of the communicators' copies says so.
#include "common/backends.h"
#include "parallel/comm_copy.h"

namespace detdit {
namespace cuda {
namespace {
Status unavailable() {
  return Status::runtime_error(
      "this detdit was built without CUDA (nvcc was not found at configure time); rebuild on a machine "
      "with the CUDA toolkit to use CUDA tensors");
}
}  // namespace

#define DETDIT_STUB_BACKEND_OP(name, ...) \
  Status name(__VA_ARGS__) { return unavailable(); }
DETDIT_BACKEND_OPS(DETDIT_STUB_BACKEND_OP)
DETDIT_CUDA_ONLY_OPS(DETDIT_STUB_BACKEND_OP)
DETDIT_COMM_COPY_OPS(DETDIT_STUB_BACKEND_OP)
#undef DETDIT_STUB_BACKEND_OP
void comm_event_destroy(void*) {}

}  // namespace cuda
}  // namespace detdit
