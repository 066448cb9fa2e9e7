// detdit CLI entry point: detdit verify|bench|report|weights.
#include <cstdio>
#include <cstring>
#include <string>

#include "cli.h"

int main(int argc, char** argv) {
  if (argc < 2 || !std::strcmp(argv[1], "--help") || !std::strcmp(argv[1], "-h")) {
    std::puts(detdit::cli::kUsage);
    return argc < 2 ? 2 : 0;
  }
  std::string command = argv[1];
  if (command == "verify") return detdit::cli::run_verify(argc - 1, argv + 1);
  std::fprintf(stderr, "detdit: unknown command '%s'\n\n%s\n", command.c_str(), detdit::cli::kUsage);
  return 2;
}
