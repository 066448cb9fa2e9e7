// Replays a libFuzzer harness's committed corpus without libFuzzer, so every
// build compiles the harnesses (they follow the public Params) and every test
// run, the sanitizer job's included, passes each committed input through the
// harness's checks (a violated check traps; tests/CMakeLists.txt):
//   detdit_fuzz_replay_<target> CORPUS_DIR
// Exits 1 when the directory cannot be read or holds no input.
#include <cstdint>
#include <cstdio>
#include <string>
#include <vector>

#include "support/files.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size);

int main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: %s CORPUS_DIR\n", argv[0]);
    return 2;
  }
  const std::string dir = argv[1];
  std::vector<std::string> names;
  if (!detdit::testing::list_directory(dir, &names)) {
    std::fprintf(stderr, "cannot read the corpus directory %s\n", dir.c_str());
    return 1;
  }
  for (const std::string& name : names) {
    const std::string bytes = detdit::testing::read_file(dir + "/" + name);
    LLVMFuzzerTestOneInput(reinterpret_cast<const uint8_t*>(bytes.data()), bytes.size());
  }
  std::printf("replayed %zu inputs of %s\n", names.size(), dir.c_str());
  return names.empty() ? 1 : 0;
}
