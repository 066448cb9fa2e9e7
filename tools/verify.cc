#include <cstdio>

#include "cli.h"

namespace detdit {
namespace cli {

const char* const kUsage =
    "usage: detdit <command> [options]\n"
    "\n"
    "commands:\n"
    "  verify    run the conditioning ops and check every bitwise claim and accuracy bar\n"
    "\n"
    "detdit <command> --help describes each command's options.";

int run_verify(int, char**) {
  std::puts("detdit verify: no checks registered yet");
  return 1;
}

}  // namespace cli
}  // namespace detdit
