// File helpers of the tests and of the fuzz corpus replays: header only, so
// the replays (tests/fuzz/replay_main.cc) need neither GoogleTest nor the test
// utilities.
#pragma once

#include <dirent.h>

#include <fstream>
#include <sstream>
#include <string>
#include <vector>

namespace detdit {
namespace testing {

// The whole file at `path` ("" when it cannot be read).
inline std::string read_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream text;
  text << in.rdbuf();
  return text.str();
}

// The names in directory `dir` but "." and "..", in readdir's order; false
// when the directory cannot be read.
inline bool list_directory(const std::string& dir, std::vector<std::string>* names) {
  names->clear();
  DIR* d = ::opendir(dir.c_str());
  if (d == nullptr) return false;
  while (const dirent* entry = ::readdir(d)) {
    const std::string name = entry->d_name;
    if (name != "." && name != "..") names->push_back(name);
  }
  ::closedir(d);
  return true;
}

}  // namespace testing
}  // namespace detdit
