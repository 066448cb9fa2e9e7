// safetensors reader and writer (https://github.com/huggingface/safetensors).
//
// File layout: an 8-byte little-endian u64 N, then N bytes of a UTF-8 JSON
// object (optionally padded with trailing spaces), then the data section.
// Each JSON key except "__metadata__" names a tensor:
//   {"dtype": "BF16", "shape": [96768, 2688], "data_offsets": [begin, end]}
// with byte offsets relative to the start of the data section. "__metadata__",
// if present, is an object of string -> string.
//
// The reader accepts exactly what the format allows and rejects everything
// else with a Status naming the file and the problem, before any tensor is
// handed out (never a crash, never a partial read):
//   - a path that is not a regular file (a FIFO, directory, device: refused
//     without blocking, io/files.h);
//   - a file shorter than 8 bytes; N larger than the file or than 100 MiB;
//   - a header that is not valid JSON, not an object, or has a duplicated key
//     at any depth or nests deeper than 3 levels (nlohmann keeps the last
//     duplicate silently, so a SAX pass checks both before the DOM is built);
//   - a tensor entry that is not an object, lacks or has extra fields, a dtype
//     outside F32/BF16/F16/I32/I64 (TypeError naming the dtype), a shape that
//     is not a list of non-negative integers or whose byte size overflows,
//     data_offsets that are not two integers with begin <= end;
//   - end - begin != numel * dtype size;
//   - ranges that overlap, leave a gap, or do not cover the data section
//     exactly (sorted by begin, they must tile [0, data size): the rule of the
//     reference implementation, so every byte of the file is accounted for);
//   - "__metadata__" that is not an object of strings.
// Error kinds: TypeError for an unsupported dtype, RuntimeError when the OS
// fails (open, stat, mmap, write) or memory runs out, ValueError for every
// malformed content and for a tensor asked for by a name the file does not
// have. Parsing is linear in the header size (a 100 MiB header of zero-size
// entries included) and find() is a hash lookup, so no header makes the
// reader or its callers quadratic.
//
// The data section is memory-mapped read-only (MAP_PRIVATE, PROT_READ); views
// handed out point into the mapping and stay valid while any copy of the
// SafetensorsFile lives. The views are CPU views; writing through them faults.
//
// The writer pads the header with spaces so the data section starts at a
// multiple of 64 bytes, writes the tensors contiguously in the given order,
// and writes to "<path>.tmp.<pid>" first, renaming on success, so a failed
// write never leaves a partial file at `path`. The temporary is registered
// for removal on a signal and stale temporaries of `path` left by dead
// processes are deleted first (io/files.h). The largest tensor's buffer is
// allocated before the temporary is created: a tensor too large for memory
// is a RuntimeError that leaves no file behind.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <unordered_map>
#include <vector>

#include "detdit/status.h"
#include "detdit/tensor.h"

namespace detdit {
namespace io {

constexpr uint64_t kMaxHeaderBytes = 100ull << 20;  // the reference implementation's limit
constexpr uint64_t kDataAlignment = 64;             // the writer aligns the data section to this

// "F32" <-> DType::kF32 and so on. Returns false for any other string.
bool safetensors_dtype_from_string(const std::string& name, DType* dtype);
const char* safetensors_dtype_string(DType dtype);

struct TensorEntry {
  std::string name;
  DType dtype = DType::kF32;
  std::vector<int64_t> shape;
  uint64_t begin = 0;  // byte offsets within the data section
  uint64_t end = 0;
  int64_t numel() const;
  uint64_t nbytes() const { return end - begin; }
};

class SafetensorsFile {
 public:
  SafetensorsFile() = default;
  // Opens, maps and validates `path` completely.
  static Status open(const std::string& path, SafetensorsFile* file);
  // Validates an in-memory image (the fuzzer and tests use this; `open`
  // calls it on the mapping). `bytes` must outlive the returned file's views.
  static Status parse(const uint8_t* bytes, uint64_t size, const std::string& name,
                      SafetensorsFile* file);

  const std::string& path() const { return path_; }
  uint64_t file_size() const { return file_size_; }
  uint64_t header_bytes() const { return header_bytes_; }  // N
  uint64_t data_start() const { return 8 + header_bytes_; }
  // In ascending data offset.
  const std::vector<TensorEntry>& entries() const { return entries_; }
  const std::map<std::string, std::string>& metadata() const { return metadata_; }

  // nullptr when absent.
  const TensorEntry* find(const std::string& name) const;
  // A CPU view of tensor `name` (ValueError naming the file when absent, or
  // when its rank is 0 or above kMaxRank, which TensorView cannot hold).
  Status view(const std::string& name, TensorView* view) const;
  // The whole file (header included) and the bytes of an entry.
  const uint8_t* file_bytes() const { return data_ - data_start(); }
  const uint8_t* data(const TensorEntry& entry) const { return data_ + entry.begin; }

 private:
  std::string path_;
  uint64_t file_size_ = 0;
  uint64_t header_bytes_ = 0;
  const uint8_t* data_ = nullptr;
  std::vector<TensorEntry> entries_;
  std::unordered_map<std::string, std::size_t> index_;  // name -> position in entries_
  std::map<std::string, std::string> metadata_;
  std::shared_ptr<const void> mapping_;  // unmaps when the last copy goes

  // parse() without the out-of-memory guard (open() guards the mapping too).
  static Status parse_unguarded(const uint8_t* bytes, uint64_t size, const std::string& name,
                                SafetensorsFile* file);
};

// A tensor to write: name, dtype, shape, and a producer that fills its bytes
// (exactly numel * dtype size of them) into `out`, which is sized already.
struct TensorToWrite {
  std::string name;
  DType dtype = DType::kF32;
  std::vector<int64_t> shape;
  std::function<Status(uint8_t* out, uint64_t bytes)> fill;
};

// Writes a safetensors file; names must be unique and "__metadata__" is
// reserved. The tensors are produced one at a time (peak memory: the largest
// tensor), in the given order. `before_rename`, when given, runs once the
// temporary is complete and before it is renamed to `path`; an error from it
// discards the temporary and leaves `path` as it was (a caller commits a
// companion file there, e.g. synth's SHA256SUMS).
Status write_safetensors(const std::string& path, const std::vector<TensorToWrite>& tensors,
                         const std::map<std::string, std::string>& metadata,
                         const std::function<Status()>& before_rename = {});

}  // namespace io
}  // namespace detdit
