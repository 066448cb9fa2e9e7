// The detdit CLI's commands. Exit codes: 0 every check passed, 1 a check
// failed, 2 usage or input error. Every command answers --help.
#pragma once

#include <nlohmann/json_fwd.hpp>
#include <string>

#include "detdit/status.h"

namespace detdit {
namespace cli {

extern const char* const kUsage;

int run_verify(int argc, char** argv);   // verify.cc
int run_bench(int argc, char** argv);    // bench.cc
int run_report(int argc, char** argv);   // report.cc
int run_weights(int argc, char** argv);  // weights_cmd.cc

// The figure of a verify report (report.cc).
Status write_report_svg(const nlohmann::json& report, const std::string& path);

}  // namespace cli
}  // namespace detdit
