// Temporary: CUDA entry points not yet implemented return a RuntimeError.
// Each is removed from this file as its kernel lands in src/cuda/<op>.cu.
#include "common/backends.h"
#include "common/scratch.h"

namespace detdit {
namespace cuda {
namespace {
Status pending(const char* op) {
  return Status::runtime_error(std::string("the CUDA kernel of ") + op + " is not implemented yet");
}
}  // namespace

Status timestep_sinusoid_forward(const TimestepSinusoidParams&, Stream) { return pending("timestep_sinusoid"); }
Status timestep_sinusoid_backward(const TimestepSinusoidBackwardParams&, Stream) { return pending("timestep_sinusoid"); }
Status linear_forward(const LinearParams&, Stream) { return pending("linear"); }
Status linear_backward_input_partials(const LinearBackwardInputParams&, Stream) { return pending("linear"); }
Status linear_fold_partials(const LinearBackwardInputParams&, Stream) { return pending("linear"); }
Status linear_backward_weight(const LinearBackwardWeightParams&, Stream) { return pending("linear"); }
Status silu_backward(const SiluBackwardParams&, Stream) { return pending("silu_backward"); }
Status silu_cast(const TensorView&, const TensorView&, Numerics, Stream) { return pending("silu_cast"); }
Status adaln_row_gather_forward(const AdalnRowGatherParams&, Stream) { return pending("adaln_row_gather"); }
Status adaln_row_gather_backward(const AdalnRowGatherBackwardParams&, Stream) { return pending("adaln_row_gather"); }
Status rmsnorm_forward(const RmsnormParams&, Stream) { return pending("rmsnorm"); }
Status rmsnorm_backward(const RmsnormBackwardParams&, Stream) { return pending("rmsnorm"); }
Status gate_residual_forward(const GateResidualParams&, Stream) { return pending("gate_residual"); }
Status gate_residual_backward(const GateResidualBackwardParams&, Stream) { return pending("gate_residual"); }
Status rmsnorm_backward_rows(const RmsnormBackwardParams&, Stream) { return pending("rmsnorm"); }
Status rmsnorm_backward_partials(const RmsnormBackwardParams&, const ChunkSelection&, const ExtraRows&,
                                 const TensorView&, const TensorView&, Stream) {
  return pending("rmsnorm");
}
Status gate_residual_backward_rows(const GateResidualBackwardParams&, Stream) { return pending("gate_residual"); }
Status gate_residual_backward_partials(const GateResidualBackwardParams&, const ChunkSelection&, const ExtraRows&,
                                       const TensorView&, Stream) {
  return pending("gate_residual");
}
Status fold_segment_partials(const IndexPlan&, const TensorView&, const TensorView&, Stream) { return pending("fold"); }
Status fold_chunk_partials(const TensorView&, const TensorView&, Stream) { return pending("fold"); }
Status copy_to_host(const void*, void*, std::size_t, const Device&, Stream) { return pending("copy_to_host"); }
Status upload_tables(const Device&, const std::vector<const std::vector<int32_t>*>&, std::vector<const int32_t*>*,
                     std::shared_ptr<void>*, Stream) {
  return pending("upload_tables");
}

Status allocate_scratch(const Device&, std::size_t, Stream, std::shared_ptr<void>*) { return pending("allocate_scratch"); }
Status upcast_to_f32(const TensorView&, const TensorView&, Stream) { return pending("upcast_to_f32"); }
}  // namespace cuda
}  // namespace detdit
