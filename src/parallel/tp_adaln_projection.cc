// tp_adaln_projection: the AdaLN projection with its output columns split
// over tp ranks (contract in include/detdit/parallel.h). Every bit comes from
// the WS1 pieces: a column of linear depends only on act and its own weight
// row, and a 64-aligned shard owns whole d_x chunks, so gathering the local
// columns and the local chunk partials in rank order reproduces the WS1 table
// and the WS1 fold exactly.
#include <string>
#include <vector>

#include "common/backends.h"
#include "common/projection.h"
#include "common/scratch.h"
#include "common/storage.h"
#include "common/validate.h"
#include "detdit/linear.h"
#include "detdit/parallel.h"
#include "parallel/copy.h"

namespace detdit {
namespace {

constexpr int64_t kTableColumnGroups = 3 * kAdalnChunks;  // 3 modalities x 6 chunks

Status check_columns(const TensorView& t, const char* name) {
  DETDIT_RETURN_IF_ERROR(check::present(t, name));
  DETDIT_RETURN_IF_ERROR(check::rank(t, name, 2, "(T, N)"));
  DETDIT_RETURN_IF_ERROR(check::contiguous(t, name));
  if (t.shape[1] % kTableColumnGroups != 0)
    return Status::value_error(std::string(name) + ": N=" + std::to_string(t.shape[1]) +
                               " is not 3 modalities x 6 chunks x H, got " + t.describe());
  return Status();
}

// The shard rows of weight-like tensors: (end - begin) rows.
Status check_shard_rows(const TensorView& weight, const TensorView& bias, int rank, int world, int64_t begin,
                        int64_t end) {
  const int64_t rows = end - begin;
  const bool weight_ok = weight.present() && weight.rank == 2 && weight.shape[0] == rows;
  const bool bias_ok = !bias.present() || (bias.rank == 1 && bias.shape[0] == rows);
  if (weight_ok && bias_ok) return Status();
  return Status::value_error("rank " + std::to_string(rank) + " of tp=" + std::to_string(world) + " owns W rows [" +
                             std::to_string(begin) + ", " + std::to_string(end) + ") = " + std::to_string(rows) +
                             " rows (pass the shard, not the full weight), got weight " + weight.describe() +
                             " and bias " + (bias.present() ? bias.describe() : std::string("absent")));
}

// The first (T, columns) of t as a contiguous view: the shape a local call
// sees, used to run the WS1 validators on the shard.
TensorView local_shape(const TensorView& t, int64_t columns) {
  return TensorView::contiguous(t.data, t.dtype, {t.shape[0], columns}, t.device);
}

// dst (T, columns) fp32 <- grad_table[:, begin:begin+columns] upcast exactly.
Status columns_to_f32(const TensorView& grad_table, int64_t begin, int64_t columns, float* dst, Stream stream) {
  const int64_t rows = grad_table.shape[0], stride = grad_table.strides[0];
  const std::size_t element = dtype_size(grad_table.dtype);
  const char* src = static_cast<const char*>(grad_table.data) + begin * element;
  if (grad_table.device.is_cuda())
    return cuda::comm_columns_to_f32(src, grad_table.dtype, stride, rows, columns, dst, stream);
  dispatch_float_dtype(grad_table.dtype, [&](auto tag) {
    using T = decltype(tag);
    for (int64_t t = 0; t < rows; ++t)
      for (int64_t j = 0; j < columns; ++j) dst[t * columns + j] = to_float(reinterpret_cast<const T*>(src)[t * stride + j]);
  });
  return Status();
}

// What decides this rank's collectives and the bits of the replicated
// results (the profile decides act's): every rank must agree on it.
std::string call_signature(const char* op, const TensorView& temb, const TensorView& table, DType dtype,
                           Numerics numerics, bool gathers_d_temb) {
  auto dim = [](const TensorView& t, int d) { return std::to_string(t.rank > d ? t.shape[d] : 0); };
  return std::string(op) + "(T=" + dim(temb, 0) + ", D=" + dim(temb, 1) + ", N=" + dim(table, 1) + ", " +
         dtype_name(dtype) + ", " + numerics_name(numerics) + ", gathers d_temb " + (gathers_d_temb ? "1" : "0") + ")";
}

}  // namespace

Status tp_column_shard(int64_t columns, int world, int rank, int64_t* begin, int64_t* end) {
  if (world < 1 || rank < 0 || rank >= world)
    return Status::value_error("need 0 <= rank < tp, got rank=" + std::to_string(rank) +
                               ", tp=" + std::to_string(world));
  if (columns < 1) return Status::value_error("N must be >= 1, got " + std::to_string(columns));
  if (columns % (world * kLinearChunkRows) != 0) {
    std::string valid;
    const int64_t chunks = columns % kLinearChunkRows == 0 ? columns / kLinearChunkRows : 0;
    int listed = 0;
    for (int64_t tp = 1; tp <= chunks; ++tp) {
      if (chunks % tp != 0) continue;
      if (listed == 10) {
        valid += ", ...";
        break;
      }
      valid += (listed++ ? ", " : "") + std::to_string(tp);
    }
    return Status::value_error("tp=" + std::to_string(world) + " does not split N=" + std::to_string(columns) +
                               " into 64-column chunks; valid tp: " +
                               (valid.empty() ? std::string("none (N is not a multiple of 64)") : valid));
  }
  const int64_t per_rank = columns / world;
  *begin = rank * per_rank;
  *end = *begin + per_rank;
  return Status();
}

Status tp_adaln_projection_forward(Communicator& comm, const AdalnProjectionParams& p, Stream stream) {
  const int world = comm.world_size(), rank = comm.rank();
  int64_t begin = 0, end = 0;
  Status valid = check_columns(p.table, "table");
  if (valid.ok()) valid = tp_column_shard(p.table.shape[1], world, rank, &begin, &end);
  if (valid.ok()) valid = check_shard_rows(p.in.weight, p.in.bias, rank, world, begin, end);
  if (valid.ok())
    valid = validate_projection_forward(p.in.temb, p.in.weight, p.in.bias, local_shape(p.table, end - begin), p.act, p.in.numerics);
  if (valid.ok()) valid = check::same_device(p.table, "table", p.in.temb, "temb");
  for (auto [in, name] : {std::pair<const TensorView*, const char*>{&p.in.temb, "temb"}, {&p.in.weight, "weight"},
                          {&p.in.bias, "bias"}, {&p.act, "act"}})
    if (valid.ok()) valid = check::no_alias(p.table, "table", *in, name);
  // local columns (T, n) -> gathered (tp, T, n) -> table (T, N), rank r's block at column r*n.
  // The scratch before the agreement: a failed allocation fails every rank.
  const Device device = p.in.temb.device;
  const int64_t rows = valid.ok() ? p.table.shape[0] : 0, columns = end - begin;
  const std::size_t element = dtype_size(p.table.dtype), block = static_cast<std::size_t>(rows * columns) * element;
  std::shared_ptr<void> memory;
  if (valid.ok()) valid = allocate_scratch(device, block * (1 + world), stream, &memory);
  DETDIT_RETURN_IF_ERROR(
      comm.agree(valid, call_signature("tp_adaln_projection_forward", p.in.temb, p.table, p.table.dtype,
                                       p.in.numerics, false)));

  char* local = static_cast<char*>(memory.get());
  char* gathered = local + block;
  const TensorView local_table = TensorView::contiguous(local, p.table.dtype, {rows, columns}, device);
  DETDIT_RETURN_IF_ERROR(projection_forward(p.in.temb, p.in.weight, p.in.bias, local_table, p.act, p.in.numerics, stream));
  DETDIT_RETURN_IF_ERROR(comm.all_gather(local, block, gathered, p.table.dtype, stream));
  const std::size_t row_bytes = static_cast<std::size_t>(columns) * element;
  for (int r = 0; r < world; ++r)
    DETDIT_RETURN_IF_ERROR(parallel_copy::copy_2d(device, static_cast<char*>(p.table.data) + r * row_bytes,
                                                  world * row_bytes, gathered + r * block, row_bytes, row_bytes,
                                                  static_cast<std::size_t>(rows), stream));
  return Status();
}

Status tp_adaln_projection_backward(Communicator& comm, const AdalnProjectionBackwardParams& p, Stream stream) {
  const int world = comm.world_size(), rank = comm.rank();
  int64_t begin = 0, end = 0;
  Status valid = check_columns(p.grad_table, "grad_table");
  if (valid.ok()) valid = tp_column_shard(p.grad_table.shape[1], world, rank, &begin, &end);
  if (valid.ok()) valid = check_shard_rows(p.in.weight, TensorView(), rank, world, begin, end);
  if (valid.ok() && (p.d_weight.present() || p.d_bias.present()))
    valid = check_shard_rows(p.d_weight.present() ? p.d_weight : p.in.weight, p.d_bias, rank, world, begin, end);
  if (valid.ok())
    valid = validate_projection_backward(p.in.temb, p.in.weight, p.act, local_shape(p.grad_table, end - begin), p.d_temb,
                                         p.d_weight, p.d_bias, p.in.numerics);
  for (auto [out, name] : {std::pair<const TensorView*, const char*>{&p.d_temb, "d_temb"}, {&p.d_weight, "d_weight"},
                           {&p.d_bias, "d_bias"}})
    if (valid.ok()) valid = check::no_alias(*out, name, p.grad_table, "grad_table");
  // [g (T, n) fp32 | partials (chunks, T, D) | gathered (tp*chunks, T, D) | d_act (T, D)], allocated
  // before the agreement: a failed allocation fails every rank.
  const Device device = p.in.temb.device;
  const int64_t rows = valid.ok() ? p.in.temb.shape[0] : 0, in_features = valid.ok() ? p.in.temb.shape[1] : 0;
  const int64_t columns = end - begin, chunks = columns / kLinearChunkRows, all_chunks = chunks * world;
  const std::size_t g_bytes = static_cast<std::size_t>(rows * columns) * sizeof(float);
  const std::size_t block = static_cast<std::size_t>(chunks * rows * in_features) * sizeof(float);
  const std::size_t act_bytes = static_cast<std::size_t>(rows * in_features) * sizeof(float);
  auto round_up = [](std::size_t b) { return (b + 255) / 256 * 256; };
  std::shared_ptr<void> memory;
  if (valid.ok())
    valid = allocate_scratch(device, round_up(g_bytes) + round_up(block) + round_up(block * world) + act_bytes,
                             stream, &memory);
  DETDIT_RETURN_IF_ERROR(comm.agree(valid, call_signature("tp_adaln_projection_backward", p.in.temb, p.grad_table,
                                                          p.in.weight.dtype, p.in.numerics, p.d_temb.present())));

  char* base = static_cast<char*>(memory.get());
  float* g = reinterpret_cast<float*>(base);
  char* partials = base + round_up(g_bytes);
  char* gathered = partials + round_up(block);
  float* d_act = reinterpret_cast<float*>(gathered + round_up(block * world));
  DETDIT_RETURN_IF_ERROR(columns_to_f32(p.grad_table, begin, columns, g, stream));
  const TensorView grad = TensorView::contiguous(g, DType::kF32, {rows, columns}, device);

  // The exchange first, every output after it.
  LinearBackwardInputParams fold;
  if (p.d_temb.present()) {
    LinearBackwardInputParams input;
    input.grad = grad;
    input.weight = p.in.weight;
    input.partials = TensorView::contiguous(partials, DType::kF32, {chunks, rows, in_features}, device);
    DETDIT_RETURN_IF_ERROR(linear_backward_input_partials(input, stream));
    // Rank r's chunks are WS1 chunks [r*chunks, (r+1)*chunks): the rank-ordered
    // gather is the global chunk order.
    DETDIT_RETURN_IF_ERROR(comm.all_gather(partials, block, gathered, DType::kF32, stream));
    fold.partials = TensorView::contiguous(gathered, DType::kF32, {all_chunks, rows, in_features}, device);
    fold.d_x = TensorView::contiguous(d_act, DType::kF32, {rows, in_features}, device);
    DETDIT_RETURN_IF_ERROR(linear_fold_partials(fold, stream));
  }
  if (p.d_weight.present() || p.d_bias.present())
    DETDIT_RETURN_IF_ERROR(linear_backward_weight(LinearBackwardWeightParams{grad, p.act, p.d_weight, p.d_bias}, stream));
  if (!p.d_temb.present()) return Status();
  SiluBackwardParams silu;
  silu.grad = fold.d_x;
  silu.pre = p.in.temb;
  silu.d_pre = p.d_temb;
  silu.numerics = p.in.numerics;
  return silu_backward(silu, stream);
}

}  // namespace detdit
