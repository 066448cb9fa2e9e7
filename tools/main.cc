// detdit CLI entry point: detdit verify|bench|report|weights.
#include <cstdio>
#include <cstring>
#include <exception>
#include <new>
#include <string>

#include "cli.h"

namespace detdit {
namespace cli {

const char* const kUsage =
    "usage: detdit <command> [options]\n"
    "\n"
    "commands:\n"
    "  verify    run the conditioning ops and check every bitwise claim and accuracy bar\n"
    "  bench     time the ops: median time, GB/s, % of the copy bandwidth, #wrong\n"
    "  report    draw the SVG figure of a verify report\n"
    "  weights   synth | verify | inspect | manifest: the H3 conditioning weights\n"
    "\n"
    "detdit <command> --help describes each command's options; detdit --version prints the version.\n"
    "Exit codes: 0 every check passes, 1 a check fails, 2 usage or input error.\n";

}  // namespace cli
}  // namespace detdit

namespace {

int dispatch(int argc, char** argv) {
  using namespace detdit::cli;
  // Before any command can exit: under mpirun every rank takes part.
  const int mismatch = agree_on_command_line(argc, argv);
  if (mismatch >= 0) return mismatch;
  if (argc < 2) {
    std::fputs(kUsage, stderr);
    return 2;
  }
  const std::string command = argv[1];
  if (command == "--help" || command == "-h" || command == "help") {
    std::fputs(kUsage, stdout);
    return 0;
  }
  if (command == "--version") {
    std::printf("detdit %s\n", DETDIT_VERSION);
    return 0;
  }
  if (command == "verify") return run_verify(argc - 1, argv + 1);
  if (command == "bench") return run_bench(argc - 1, argv + 1);
  if (command == "report") return run_report(argc - 1, argv + 1);
  if (command == "weights") return run_weights(argc - 1, argv + 1);
  std::fprintf(stderr, "detdit: unknown command '%s'\n\n%s", command.c_str(), kUsage);
  return 2;
}

}  // namespace

// The last guard, not the error handling: inputs are validated where they are
// read, and the library returns a Status. An exception that still escapes a
// command (the CLI's own buffers, e.g. verify's at dimensions from a file)
// ends it with exit 2 and a message instead of std::terminate (exit 134).
int main(int argc, char** argv) {
  try {
    return dispatch(argc, argv);
  } catch (const std::bad_alloc&) {
    std::fprintf(stderr, "detdit: out of memory (the inputs ask for more memory than this host has)\n");
  } catch (const std::exception& e) {
    std::fprintf(stderr, "detdit: unexpected error: %s\n", e.what());
  }
  return 2;
}
