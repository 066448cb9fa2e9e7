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

int run_command(int argc, char** argv, const char* usage, const char* kind,
                std::initializer_list<std::pair<const char*, int (*)(int, char**)>> commands) {
  const std::string command = argc < 2 ? "" : argv[1];
  for (const auto& [name, run] : commands)
    if (command == name) return run(argc - 1, argv + 1);
  const bool help = command == "--help" || command == "-h";
  if (argc < 2 || help) {
    std::fputs(usage, help ? stdout : stderr);
    return help ? 0 : 2;
  }
  std::fprintf(stderr, "detdit: unknown %scommand '%s'\n\n%s", kind, command.c_str(), usage);
  return 2;
}

int fail(const std::string& message, bool print) {
  if (print) std::fprintf(stderr, "detdit: %s\n", message.c_str());
  return 2;
}

}  // namespace cli
}  // namespace detdit

namespace {

int dispatch(int argc, char** argv) {
  using namespace detdit::cli;
  // Before any command can exit: under mpirun every rank takes part.
  const int mismatch = agree_on_command_line(argc, argv);
  if (mismatch >= 0) return mismatch;
  const std::string command = argc < 2 ? "" : argv[1];
  if (command == "help" || command == "--version") {
    std::printf("%s", command == "help" ? kUsage : "detdit " DETDIT_VERSION "\n");
    return 0;
  }
  return run_command(argc, argv, kUsage, "",
                     {{"verify", run_verify}, {"bench", run_bench}, {"report", run_report}, {"weights", run_weights}});
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
