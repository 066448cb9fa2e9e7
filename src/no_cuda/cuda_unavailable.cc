// The CUDA backend of a build without nvcc: every entry point says so.
#include "common/backends.h"
#include "common/elementwise.h"
#include "common/scratch.h"
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

Status timestep_sinusoid_forward(const TimestepSinusoidParams&, Stream) { return unavailable(); }
Status timestep_sinusoid_backward(const TimestepSinusoidBackwardParams&, Stream) { return unavailable(); }
Status linear_forward(const LinearParams&, Stream) { return unavailable(); }
Status linear_backward_input_partials(const LinearBackwardInputParams&, Stream) { return unavailable(); }
Status linear_backward_weight(const LinearBackwardWeightParams&, Stream) { return unavailable(); }
Status silu_backward(const SiluBackwardParams&, Stream) { return unavailable(); }
Status silu_cast(const TensorView&, const TensorView&, Numerics, Stream) { return unavailable(); }
Status adaln_row_gather_forward(const AdalnRowGatherParams&, Stream) { return unavailable(); }
Status adaln_row_gather_backward_partials(const AdalnRowGatherBackwardParams&, const TensorView&, Stream) {
  return unavailable();
}
Status rmsnorm_forward(const RmsnormParams&, Stream) { return unavailable(); }
Status gate_residual_forward(const GateResidualParams&, Stream) { return unavailable(); }

Status rmsnorm_backward_rows(const RmsnormBackwardParams&, Stream) { return unavailable(); }
Status rmsnorm_backward_partials(const RmsnormBackwardParams&, const ChunkSelection&, const ExtraRows&,
                                 const TensorView&, const TensorView&, Stream) {
  return unavailable();
}
Status gate_residual_backward_rows(const GateResidualBackwardParams&, Stream) { return unavailable(); }
Status gate_residual_backward_partials(const GateResidualBackwardParams&, const ChunkSelection&, const ExtraRows&,
                                       const TensorView&, Stream) {
  return unavailable();
}
Status fold_segment_partials(const IndexPlan&, const TensorView&, const TensorView&, Stream) { return unavailable(); }
Status fold_chunk_partials(const TensorView&, const TensorView&, Stream) { return unavailable(); }
Status copy_to_host(const void*, void*, std::size_t, const Device&, Stream) { return unavailable(); }
Status upload_tables(const Device&, const std::vector<const std::vector<int32_t>*>&, std::vector<const int32_t*>*,
                     std::shared_ptr<void>*, Stream) {
  return unavailable();
}

Status comm_event_create(const Device&, void**) { return unavailable(); }
void comm_event_destroy(void*) {}
Status comm_event_record(void*, Stream) { return unavailable(); }
Status comm_stream_wait(Stream, void*) { return unavailable(); }
Status comm_copy_async(void*, const void*, std::size_t, Stream) { return unavailable(); }
Status comm_copy_2d_async(void*, std::size_t, const void*, std::size_t, std::size_t, std::size_t, Stream) {
  return unavailable();
}
Status comm_columns_to_f32(const void*, DType, int64_t, int64_t, int64_t, float*, Stream) { return unavailable(); }

Status allocate_scratch(const Device&, std::size_t, Stream, std::shared_ptr<void>*) { return unavailable(); }
Status upcast_to_f32(const TensorView&, const TensorView&, Stream) { return unavailable(); }

Status add(const TensorView&, const TensorView&, const TensorView&, Stream) { return unavailable(); }
Status copy_tensor(const TensorView&, const TensorView&, Stream) { return unavailable(); }
Status fill_zero(const TensorView&, Stream) { return unavailable(); }
}  // namespace cuda
}  // namespace detdit
