// The case registries of `detdit verify` and `detdit bench`: every case file
// registers its cases during static initialisation through a Registrar (the
// DETDIT_VERIFY_CASE / DETDIT_BENCH_CASE macros of verify.h and bench.h); the
// commands read registry<Case>() once main() runs.
#pragma once

#include <vector>

namespace detdit {
namespace cli {

// The one registry of `Case`s. A function-local static, so registrations from
// other translation units' static initialisers always find it constructed.
template <typename Case>
std::vector<Case>& registry() {
  static std::vector<Case> cases;
  return cases;
}

template <typename Case>
struct Registrar {
  explicit Registrar(const Case& c) { registry<Case>().push_back(c); }
};

}  // namespace cli
}  // namespace detdit

#define DETDIT_CLI_CONCAT_(a, b) a##b
#define DETDIT_CLI_CONCAT(a, b) DETDIT_CLI_CONCAT_(a, b)
// Appends Case{fields...} to registry<Case>() during static initialisation,
// through a Registrar named `prefix` + the registering line.
#define DETDIT_CLI_REGISTER(Case, prefix, ...) \
  static ::detdit::cli::Registrar<Case> DETDIT_CLI_CONCAT(prefix, __LINE__)(Case{__VA_ARGS__})
