// Helpers shared by the verify and bench cases (verify.h).
#include <chrono>
#include <cmath>
#include <cstdio>
#include <algorithm>
#include <cstring>
#include <memory>

#include "verify.h"

#ifdef DETDIT_WITH_CUDA
#include <cuda_runtime_api.h>
#endif

namespace detdit {
namespace cli {

double now_seconds() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

void compare_bytes(const void* expected, const void* actual, std::size_t bytes, DType dtype, const std::string& what,
                   CheckRow* row) {
  ++row->bitwise_run;
  const cases::Mismatch m =
      cases::compare_bytes(expected, actual, static_cast<int64_t>(bytes / dtype_size(dtype)), dtype);
  if (m.equal()) {
    ++row->bitwise_passed;
    return;
  }
  if (row->detail.empty()) row->detail = what + ": " + m.describe();
}

void add_output_reports(const std::vector<cases::OutputReport>& reports, CheckRow* row) {
  for (const cases::OutputReport& r : reports) {
    ++row->bitwise_run;
    if (r.mismatch.equal() && !r.still_canary) {
      ++row->bitwise_passed;
    } else if (row->detail.empty()) {
      row->detail = r.output + ": " + (r.still_canary ? "the reference output was never written" : r.mismatch.describe());
    }
  }
}

void finish_row(CheckRow* row) {
  const bool bitwise_ok = row->bitwise_passed == row->bitwise_run;
  // A check with a bound measured an error: NaN or above the bound fails it.
  const bool error_ok = std::isnan(row->bound) || row->max_error <= row->bound;
  row->pass = bitwise_ok && error_ok;
  if (!error_ok && row->detail.empty()) {
    char text[128];
    std::snprintf(text, sizeof text, "max error %.3g %s exceeds the bound %.3g", row->max_error,
                  row->error_unit.c_str(), row->bound);
    row->detail = text;
  }
}

}  // namespace cli
}  // namespace detdit
