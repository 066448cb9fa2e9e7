// verify case of adaln_row_gather on the weights' hidden size, T = 3, block
// packing (cases/index_case.h): the forward equals a direct byte gather of the
// rows. (rmsnorm, gate_residual and gate_residual_rmsnorm are op cases:
// cases/rowwise_cases.cc, registered in verify_cases.cc.)
#include <cstring>

#include "detdit/adaln.h"
#include "detdit/plan.h"
#include "verify.h"

namespace detdit {
namespace cli {
namespace {

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
