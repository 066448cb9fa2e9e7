// libFuzzer harness of the safetensors reader: any byte string either parses
// (then every entry's bytes and view are touched, so an accepted range that
// lies outside the input shows up under AddressSanitizer) or fails with a
// Status. Build and run: tests/fuzz/run_fuzzer.sh (docs/weights.md).
#include <cstddef>
#include <cstdint>

#include "io/safetensors.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  detdit::io::SafetensorsFile file;
  detdit::Status status = detdit::io::SafetensorsFile::parse(data, size, "fuzz-input", &file);
  if (!status.ok()) {
    if (status.message().rfind("fuzz-input: ", 0) != 0) __builtin_trap();  // every error names the file
    return 0;
  }
  volatile uint8_t sink = 0;
  for (const detdit::io::TensorEntry& e : file.entries()) {
    const uint8_t* bytes = file.data(e);
    for (uint64_t i = 0; i < e.nbytes(); ++i) sink = sink ^ bytes[i];
    detdit::TensorView view;
    (void)file.view(e.name, &view);
  }
  return 0;
}
