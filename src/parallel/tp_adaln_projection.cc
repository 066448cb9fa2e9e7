// tp_adaln_projection: the AdaLN projection with its output columns split
// over tp ranks (contract in include/detdit/parallel.h). Every bit comes from
// the WS1 pieces: a column of linear depends only on act and its own weight
// row, and a rank owns whole 64-column d_x chunks (a contiguous run of them,
// the runs in rank order), so gathering the local columns and the local chunk
// partials in rank order reproduces the WS1 table and the WS1 fold exactly.
// Ranks may own different numbers of chunks: each sends a block padded to the
// most any rank owns (rank 0's) through the equal-size all-gather, and the
// receiver copies the real bytes out in rank order; the padding is never read.
#include <algorithm>
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

// N is 3 modalities x 6 chunks x H (H3, chunks = 0) or a positive multiple of a family's chunk count.
Status check_columns(const TensorView& t, const char* name, int chunks) {
  DETDIT_RETURN_IF_ERROR(check::present(t, name));
  DETDIT_RETURN_IF_ERROR(check::rank(t, name, 2, "(T, N)"));
  DETDIT_RETURN_IF_ERROR(check::contiguous(t, name));
  if (chunks < 0)
    return Status::value_error("chunks must be 0 (H3's projection) or a family's chunk count > 0, got " +
                               std::to_string(chunks));
  if (chunks == 0 && t.shape[1] % kTableColumnGroups != 0)
    return Status::value_error(std::string(name) + ": N=" + std::to_string(t.shape[1]) +
                               " is not 3 modalities x 6 chunks x H, got " + t.describe());
  if (chunks > 0 && (t.shape[1] == 0 || t.shape[1] % chunks != 0))
    return Status::value_error(std::string(name) + ": N=" + std::to_string(t.shape[1]) +
                               " is not a positive multiple of chunks=" + std::to_string(chunks) + ", got " +
                               t.describe());
  return Status();
}

// The shard rows of weight-like tensors: (end - begin) rows; the message
// names them as the caller did (weight and bias, or d_weight and d_bias).
Status check_shard_rows(const TensorView& weight, const char* weight_name, const TensorView& bias,
                        const char* bias_name, int rank, int world, int64_t begin, int64_t end) {
  const int64_t rows = end - begin;
  const bool weight_ok = weight.present() && weight.rank == 2 && weight.shape[0] == rows;
  const bool bias_ok = !bias.present() || (bias.rank == 1 && bias.shape[0] == rows);
  if (weight_ok && bias_ok) return Status();
  return Status::value_error("rank " + std::to_string(rank) + " of tp=" + std::to_string(world) + " owns W rows [" +
                             std::to_string(begin) + ", " + std::to_string(end) + ") = " + std::to_string(rows) +
                             " rows (pass the shard, not the full weight), got " + weight_name + " " +
                             weight.describe() + " and " + bias_name + " " +
                             (bias.present() ? bias.describe() : std::string("absent")));
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

// The 64-column d_x chunks of `columns` columns (the last one may be short).
int64_t chunk_count(int64_t columns) { return (columns + kLinearChunkRows - 1) / kLinearChunkRows; }

// The columns of rank 0, the most any rank owns: the size of every rank's
// block in the gathers. Called once this rank's split is known to be valid.
int64_t widest_shard(int64_t columns, int world) {
  int64_t begin = 0, end = 0;
  return tp_column_shard(columns, world, 0, &begin, &end).ok() ? end - begin : 0;
}

// What decides this rank's collectives and the bits of the replicated
// results (the profile decides act's): every rank must agree on it.
std::string call_signature(const char* op, const TensorView& temb, const TensorView& table, DType dtype,
                           Numerics numerics, int chunks, bool gathers_d_temb) {
  auto dim = [](const TensorView& t, int d) { return std::to_string(t.rank > d ? t.shape[d] : 0); };
  return std::string(op) + "(T=" + dim(temb, 0) + ", D=" + dim(temb, 1) + ", N=" + dim(table, 1) + ", " +
         dtype_name(dtype) + ", " + numerics_name(numerics) + ", chunks " + std::to_string(chunks) + ", gathers d_temb " + (gathers_d_temb ? "1" : "0") + ")";
}

}  // namespace

Status tp_column_shard(int64_t columns, int world, int rank, int64_t* begin, int64_t* end) {
  if (world < 1 || rank < 0 || rank >= world)
    return Status::value_error("need 0 <= rank < tp, got rank=" + std::to_string(rank) +
                               ", tp=" + std::to_string(world));
  if (columns < 1) return Status::value_error("N must be >= 1, got " + std::to_string(columns));
  // The WS1 chunks: C = ceil(N / 64), the last one short when 64 does not divide N.
  const int64_t chunks = chunk_count(columns);
  // A rank without a chunk would hold a (0, D) shard: refused rather than
  // carried through every validator and the gather as a special case.
  if (world > chunks)
    return Status::value_error("tp=" + std::to_string(world) + " is more ranks than the " + std::to_string(chunks) +
                               " 64-column chunks of N=" + std::to_string(columns) +
                               ": every rank needs a chunk; valid tp: 1 to " + std::to_string(chunks));
  // C / tp chunks each, one more for each of the first C % tp ranks: the
  // counts differ by at most one and rank 0 owns the most.
  const int64_t base = chunks / world, extra = chunks % world;
  const int64_t first = rank * base + std::min<int64_t>(rank, extra), count = base + (rank < extra ? 1 : 0);
  *begin = first * kLinearChunkRows;
  *end = std::min((first + count) * kLinearChunkRows, columns);
  return Status();
}

Status tp_adaln_projection_forward(Communicator& comm, const AdalnProjectionParams& p, Stream stream) {
  const int world = comm.world_size(), rank = comm.rank();
  int64_t begin = 0, end = 0;
  Status valid = check_columns(p.table, "table", p.in.chunks);
  if (valid.ok()) valid = tp_column_shard(p.table.shape[1], world, rank, &begin, &end);
  if (valid.ok()) valid = check_shard_rows(p.in.weight, "weight", p.in.bias, "bias", rank, world, begin, end);
  if (valid.ok())
    valid = validate_projection_forward(p.in.temb, p.in.weight, p.in.bias, local_shape(p.table, end - begin), p.act,
                                        p.in.numerics, p.in.chunks != 0);
  if (valid.ok()) valid = check::same_device(p.table, "table", p.in.temb, "temb");
  for (auto [in, name] : {std::pair<const TensorView*, const char*>{&p.in.temb, "temb"}, {&p.in.weight, "weight"},
                          {&p.in.bias, "bias"}, {&p.act, "act"}})
    if (valid.ok()) valid = check::no_alias(p.table, "table", *in, name);
  // local columns (T, n_r) at the start of a block of T * n_0 elements (rank 0
  // owns the most) -> gathered (tp blocks) -> table (T, N), rank r's columns
  // at begin_r. The scratch before the agreement: a failed allocation fails
  // every rank.
  const Device device = p.in.temb.device;
  const int64_t rows = valid.ok() ? p.table.shape[0] : 0, columns = end - begin;
  const int64_t widest = valid.ok() ? widest_shard(p.table.shape[1], world) : 0;
  const std::size_t element = dtype_size(p.table.dtype), block = static_cast<std::size_t>(rows * widest) * element;
  std::shared_ptr<void> memory;
  if (valid.ok()) valid = allocate_scratch(device, block * (1 + world), stream, &memory);
  DETDIT_RETURN_IF_ERROR(
      comm.agree(valid, call_signature("tp_adaln_projection_forward", p.in.temb, p.table, p.table.dtype,
                                       p.in.numerics, p.in.chunks, false)));

  char* local = static_cast<char*>(memory.get());
  char* gathered = local + block;
  const TensorView local_table = TensorView::contiguous(local, p.table.dtype, {rows, columns}, device);
  DETDIT_RETURN_IF_ERROR(projection_forward(p.in.temb, p.in.weight, p.in.bias, local_table, p.act, p.in.numerics, stream));
  DETDIT_RETURN_IF_ERROR(comm.all_gather(local, block, gathered, p.table.dtype, stream));
  const std::size_t table_pitch = static_cast<std::size_t>(p.table.shape[1]) * element;
  for (int r = 0; r < world; ++r) {
    int64_t rank_begin = 0, rank_end = 0;
    DETDIT_RETURN_IF_ERROR(tp_column_shard(p.table.shape[1], world, r, &rank_begin, &rank_end));
    const std::size_t row_bytes = static_cast<std::size_t>(rank_end - rank_begin) * element;
    DETDIT_RETURN_IF_ERROR(parallel_copy::copy_2d(device, static_cast<char*>(p.table.data) + rank_begin * element,
                                                  table_pitch, gathered + r * block, row_bytes, row_bytes,
                                                  static_cast<std::size_t>(rows), stream));
  }
  return Status();
}

Status tp_adaln_projection_backward(Communicator& comm, const AdalnProjectionBackwardParams& p, Stream stream) {
  const int world = comm.world_size(), rank = comm.rank();
  int64_t begin = 0, end = 0;
  Status valid = check_columns(p.grad_table, "grad_table", p.in.chunks);
  if (valid.ok()) valid = tp_column_shard(p.grad_table.shape[1], world, rank, &begin, &end);
  if (valid.ok()) valid = check_shard_rows(p.in.weight, "weight", TensorView(), "bias", rank, world, begin, end);
  if (valid.ok() && (p.d_weight.present() || p.d_bias.present()))
    valid = check_shard_rows(p.d_weight.present() ? p.d_weight : p.in.weight,
                             p.d_weight.present() ? "d_weight" : "weight", p.d_bias, "d_bias", rank, world, begin, end);
  if (valid.ok())
    valid = validate_projection_backward(p.in.temb, p.in.weight, p.act, local_shape(p.grad_table, end - begin), p.d_temb,
                                         p.d_weight, p.d_bias, p.in.numerics, p.in.chunks != 0);
  for (auto [out, name] : {std::pair<const TensorView*, const char*>{&p.d_temb, "d_temb"}, {&p.d_weight, "d_weight"},
                           {&p.d_bias, "d_bias"}})
    if (valid.ok()) valid = check::no_alias(*out, name, p.grad_table, "grad_table");
  // [g (T, n) fp32 | partials: a block of rank 0's chunk count (T, D) | gathered (tp blocks) |
  // ordered (C, T, D), only when some rank owns fewer chunks than rank 0 | d_act (T, D) | a
  // family's bf16 temb in FP32 (the SiLU's VJP reads FP32, as WS1's)], allocated before the
  // agreement: a failed allocation fails every rank.
  const Device device = p.in.temb.device;
  const int64_t rows = valid.ok() ? p.in.temb.shape[0] : 0, in_features = valid.ok() ? p.in.temb.shape[1] : 0;
  const int64_t columns = end - begin, chunks = chunk_count(columns);
  const int64_t widest_chunks = valid.ok() ? chunk_count(widest_shard(p.grad_table.shape[1], world)) : 0;
  const int64_t all_chunks = valid.ok() ? chunk_count(p.grad_table.shape[1]) : 0;
  const bool padded = all_chunks != widest_chunks * world;
  const std::size_t g_bytes = static_cast<std::size_t>(rows * columns) * sizeof(float);
  const std::size_t chunk_bytes = static_cast<std::size_t>(rows * in_features) * sizeof(float);
  const std::size_t block = static_cast<std::size_t>(widest_chunks) * chunk_bytes;
  const std::size_t ordered_bytes = padded ? static_cast<std::size_t>(all_chunks) * chunk_bytes : 0;
  const std::size_t act_bytes = static_cast<std::size_t>(rows * in_features) * sizeof(float);
  const bool temb_f32 = !valid.ok() || p.in.temb.dtype == DType::kF32;
  auto round_up = [](std::size_t b) { return (b + 255) / 256 * 256; };
  std::shared_ptr<void> memory;
  if (valid.ok())
    valid = allocate_scratch(device,
                             round_up(g_bytes) + round_up(block) + round_up(block * world) + round_up(ordered_bytes) +
                                 round_up(act_bytes) + (temb_f32 ? 0 : act_bytes),
                             stream, &memory);
  DETDIT_RETURN_IF_ERROR(comm.agree(valid, call_signature("tp_adaln_projection_backward", p.in.temb, p.grad_table,
                                                          p.in.weight.dtype, p.in.numerics, p.in.chunks,
                                                          p.d_temb.present())));

  char* base = static_cast<char*>(memory.get());
  float* g = reinterpret_cast<float*>(base);
  char* partials = base + round_up(g_bytes);
  char* gathered = partials + round_up(block);
  char* ordered = gathered + round_up(block * world);
  float* d_act = reinterpret_cast<float*>(ordered + round_up(ordered_bytes));
  float* temb32 = reinterpret_cast<float*>(reinterpret_cast<char*>(d_act) + round_up(act_bytes));
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
    // Rank r's chunks are WS1 chunks [begin_r/64, ceil(end_r/64)), the ranks'
    // runs in rank order: copied out of the padded blocks in rank order they
    // are the global chunk order (without padding the gathered blocks already
    // are). The fold is then the WS1 fold, ascending over all C chunks.
    DETDIT_RETURN_IF_ERROR(comm.all_gather(partials, block, gathered, DType::kF32, stream));
    if (!padded) ordered = gathered;
    else
      for (int r = 0; r < world; ++r) {
        int64_t rank_begin = 0, rank_end = 0;
        DETDIT_RETURN_IF_ERROR(tp_column_shard(p.grad_table.shape[1], world, r, &rank_begin, &rank_end));
        DETDIT_RETURN_IF_ERROR(parallel_copy::copy(
            device, ordered + static_cast<std::size_t>(rank_begin / kLinearChunkRows) * chunk_bytes,
            gathered + r * block, static_cast<std::size_t>(chunk_count(rank_end - rank_begin)) * chunk_bytes, stream));
      }
    fold.partials = TensorView::contiguous(ordered, DType::kF32, {all_chunks, rows, in_features}, device);
    fold.d_x = TensorView::contiguous(d_act, DType::kF32, {rows, in_features}, device);
    DETDIT_RETURN_IF_ERROR(linear_fold_partials(fold, stream));
  }
  if (p.d_weight.present() || p.d_bias.present())
    DETDIT_RETURN_IF_ERROR(linear_backward_weight(LinearBackwardWeightParams{grad, p.act, p.d_weight, p.d_bias}, stream));
  if (!p.d_temb.present()) return Status();
  TensorView pre = p.in.temb;
  if (!temb_f32) {
    pre = TensorView::contiguous(temb32, DType::kF32, {rows, in_features}, device);
    DETDIT_RETURN_IF_ERROR(backend::upcast_to_f32(device, p.in.temb, pre, stream));
  }
  SiluBackwardParams silu;
  silu.grad = fold.d_x;
  silu.pre = pre;
  silu.d_pre = p.d_temb;
  silu.numerics = p.in.numerics;
  return silu_backward(silu, stream);
}

}  // namespace detdit
