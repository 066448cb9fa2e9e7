// The detdit CLI's commands. Exit codes: 0 every check passed, 1 a check
// failed, 2 usage or input error.
#pragma once

namespace detdit {
namespace cli {

extern const char* const kUsage;

int run_verify(int argc, char** argv);

}  // namespace cli
}  // namespace detdit
