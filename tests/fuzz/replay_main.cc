// Replays a libFuzzer harness's committed corpus without libFuzzer, so every
// build compiles the harnesses (they follow the public Params) and every test
// run, the sanitizer job's included, passes each committed input through the
// harness's checks (a violated check traps; tests/CMakeLists.txt):
//   detdit_fuzz_replay_<target> CORPUS_DIR
// Exits 1 when the directory cannot be read or holds no input.
#include <dirent.h>

#include <cstdint>
#include <cstdio>
#include <fstream>
#include <iterator>
#include <string>

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size);

int main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: %s CORPUS_DIR\n", argv[0]);
    return 2;
  }
  const std::string dir = argv[1];
  DIR* d = ::opendir(dir.c_str());
  if (d == nullptr) {
    std::fprintf(stderr, "cannot read the corpus directory %s\n", dir.c_str());
    return 1;
  }
  int replayed = 0;
  while (dirent* entry = ::readdir(d)) {
    const std::string name = entry->d_name;
    if (name == "." || name == "..") continue;
    std::ifstream in(dir + "/" + name, std::ios::binary);
    const std::string bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    LLVMFuzzerTestOneInput(reinterpret_cast<const uint8_t*>(bytes.data()), bytes.size());
    ++replayed;
  }
  ::closedir(d);
  std::printf("replayed %d inputs of %s\n", replayed, dir.c_str());
  return replayed > 0 ? 0 : 1;
}
