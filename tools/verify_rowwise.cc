// verify cases of the row-wise path on the weights' hidden size, T = 3,
// block packing (cases/index_case.h):
//   rmsnorm, gate_residual, gate_residual_rmsnorm: the op-case library's
//     verify cases (block 0's norm1 weight; gate_msa with a 3 randn sublayer
//     output; the two fused, with d_h), each checked by verify_op_case
//     (accuracy vs FP64, repeatability, the fused op = its separate ops, row
//     invariance, CUDA = CPU);
//   adaln_row_gather: the forward equals a direct byte gather of the rows.
#include <cstring>

#include "detdit/adaln.h"
#include "detdit/plan.h"
#include "verify.h"

namespace detdit {
namespace cli {
namespace {

Status verify_rmsnorm(const VerifyContext& ctx, std::vector<CheckRow>* rows) {
  return verify_op_cases(ctx, "rmsnorm", rows);
}
DETDIT_VERIFY_CASE("rmsnorm", "modulated, norm1 of block 0", true, true, verify_rmsnorm);

Status verify_gate(const VerifyContext& ctx, std::vector<CheckRow>* rows) {
  return verify_op_cases(ctx, "gate_residual", rows);
}
DETDIT_VERIFY_CASE("gate_residual", "gate_msa, 3 randn sublayer", true, true, verify_gate);

Status verify_gate_residual_rmsnorm(const VerifyContext& ctx, std::vector<CheckRow>* rows) {
  return verify_op_cases(ctx, "gate_residual_rmsnorm", rows);
}
DETDIT_VERIFY_CASE("gate_residual_rmsnorm", "gate_msa then norm2, d_h", true, true, verify_gate_residual_rmsnorm);

Status verify_gather(const VerifyContext& ctx, std::vector<CheckRow>* rows) {
  const cases::IndexCase index = cases::make_index_case(cases::Packing::kBlock, ctx.quick ? 257 : 4097, 3, 1);
  const int64_t H = ctx.weights->config.hidden, S = index.seq_len, R = index.num_rows();
  HostTensor table(DType::kBF16, {R, 6 * H});
  fill_verify_normal(&table, ctx.seed + 21, 0.0, 0.5);
  rows->push_back(timed_check("byte copy = direct gather", [&](CheckRow* row) {
    DeviceTensor rows_on_device, out;
    IndexPlan plan;
    DETDIT_RETURN_IF_ERROR(DeviceTensor::from_host(table, ctx.device, &rows_on_device));
    DETDIT_RETURN_IF_ERROR(cases::adaln_plan(index, ctx.device, &plan));
    DETDIT_RETURN_IF_ERROR(DeviceTensor::empty(DType::kBF16, {6, S, H}, ctx.device, &out));
    DETDIT_RETURN_IF_ERROR(adaln_row_gather_forward({rows_on_device.view(), plan, out.view()}));
    HostTensor got;
    DETDIT_RETURN_IF_ERROR(out.to_host(&got));
    HostTensor expected(DType::kBF16, {6, S, H});
    const std::size_t row_bytes = static_cast<std::size_t>(H) * 2;
    for (int64_t c = 0; c < 6; ++c)
      for (int64_t s = 0; s < S; ++s)
        std::memcpy(static_cast<char*>(expected.data()) + (c * S + s) * row_bytes,
                    static_cast<const char*>(table.data()) + (index.row(s) * 6 + c) * row_bytes, row_bytes);
    compare_bytes(expected.data(), got.data(), got.nbytes(), DType::kBF16, "gathered rows", row);
    return Status::ok_status();
  }));
  return Status::ok_status();
}
DETDIT_VERIFY_CASE("adaln_row_gather", "six chunks", true, true, verify_gather);

}  // namespace
}  // namespace cli
}  // namespace detdit
