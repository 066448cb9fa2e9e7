// safetensors reader (mmap + strict validation) and writer; the contract is
// in safetensors.h.
#include "io/safetensors.h"

#include <sys/mman.h>
#include <sys/sysinfo.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <limits>
#include <nlohmann/json.hpp>
#include <new>
#include <set>
#include <unordered_set>

#include "common/out_of_memory.h"
#include "io/files.h"

namespace detdit {
namespace io {
namespace {

using Json = nlohmann::json;

// The header never nests deeper than {name: {shape: [..]}}; anything deeper is
// refused while parsing, before a DOM of it is built.
constexpr int kMaxHeaderDepth = 3;

Status malformed(const std::string& file, const std::string& problem) {
  return Status::value_error(file + ": " + problem);
}

// The reader's and the writer's allocations are bounded by the input (a
// header of at most 100 MiB needs a DOM of a few hundred MB; the writer's
// buffer is one tensor), yet may exceed the memory at hand: each runs through
// out_of_memory_is_an_error (src/common/out_of_memory.h), naming the file.

bool host_is_little_endian() {
  const uint16_t probe = 1;
  uint8_t first = 0;
  std::memcpy(&first, &probe, 1);
  return first == 1;
}

uint64_t read_le64(const uint8_t* p) {
  uint64_t v = 0;
  for (int i = 7; i >= 0; --i) v = (v << 8) | p[i];
  return v;
}

// What nlohmann's DOM parser accepts and the reader must not: a key twice in
// one object (nlohmann keeps the last silently) and nesting deeper than
// kMaxHeaderDepth. Checked by a SAX pass before the DOM is built, in time
// linear in the header: one hash set of keys per open object. (nlohmann's
// callback parser, used for this before, rescans the parent object at every
// object end: quadratic in the entry count, minutes for a 7 MB header.)
class HeaderStructureCheck final : public nlohmann::json_sax<Json> {
 public:
  // Empty while the header is acceptable; else the problem, for the message.
  const std::string& problem() const { return problem_; }

  bool null() override { return value(); }
  bool boolean(bool) override { return value(); }
  bool number_integer(number_integer_t) override { return value(); }
  bool number_unsigned(number_unsigned_t) override { return value(); }
  bool number_float(number_float_t, const string_t&) override { return value(); }
  bool string(string_t&) override { return value(); }
  bool binary(binary_t&) override { return value(); }
  bool start_object(std::size_t) override {
    if (!value()) return false;
    ++open_;
    keys_of_open_objects_.emplace_back();
    return true;
  }
  bool key(string_t& key) override {
    if (!value()) return false;
    if (keys_of_open_objects_.back().insert(key).second) return true;
    problem_ = "header JSON has the key \"" + key + "\" twice" + (open_ == 1 ? " (a duplicated tensor name)" : "");
    return false;
  }
  bool end_object() override {
    --open_;
    keys_of_open_objects_.pop_back();
    return true;
  }
  bool start_array(std::size_t) override {
    if (!value()) return false;
    ++open_;
    return true;
  }
  bool end_array() override {
    --open_;
    return true;
  }
  bool parse_error(std::size_t, const std::string&, const nlohmann::detail::exception& e) override {
    problem_ = std::string("header is not valid JSON: ") + e.what();
    return false;
  }

 private:
  // Every value, key and container start sits inside `open_` containers.
  bool value() {
    if (open_ <= kMaxHeaderDepth) return true;
    problem_ = "header JSON nests deeper than " + std::to_string(kMaxHeaderDepth) +
               " levels; a safetensors header is {name: {dtype, shape, data_offsets}}";
    return false;
  }

  int open_ = 0;
  std::vector<std::unordered_set<std::string>> keys_of_open_objects_;
  std::string problem_;
};

// Parses the header JSON after the structure check.
Status parse_header_json(const char* begin, const char* end, const std::string& file, Json* header) {
  try {
    HeaderStructureCheck check;
    if (!Json::sax_parse(begin, end, &check)) {
      return malformed(file, check.problem().empty() ? "header is not valid JSON" : check.problem());
    }
    *header = Json::parse(begin, end);
  } catch (const Json::exception& e) {
    return malformed(file, std::string("header is not valid JSON: ") + e.what());
  }
  if (!header->is_object()) {
    return malformed(file, std::string("header must be a JSON object, got a JSON ") + header->type_name());
  }
  return Status::ok_status();
}

// A JSON value as a non-negative integer that fits int64 (shape dims and
// offsets). `what` names the value in the message.
Status json_to_count(const Json& value, const std::string& file, const std::string& what, uint64_t* out) {
  if (value.is_number_unsigned()) {
    uint64_t v = value.get<uint64_t>();
    if (v > static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) {
      return malformed(file, what + " is " + std::to_string(v) + ", larger than int64 can hold");
    }
    *out = v;
    return Status::ok_status();
  }
  return malformed(file, what + " must be a non-negative integer, got " + value.dump());
}

Status parse_entry(const std::string& name, const Json& value, const std::string& file, TensorEntry* entry) {
  const std::string where = "tensor \"" + name + "\"";
  if (name.empty()) return malformed(file, "a tensor has an empty name");
  if (!value.is_object()) {
    return malformed(file, where + " must be an object {dtype, shape, data_offsets}, got a JSON " +
                               std::string(value.type_name()));
  }
  for (const char* field : {"dtype", "shape", "data_offsets"}) {
    if (!value.contains(field)) return malformed(file, where + " has no \"" + field + "\"");
  }
  if (value.size() != 3) {
    for (auto it = value.begin(); it != value.end(); ++it) {
      if (it.key() != "dtype" && it.key() != "shape" && it.key() != "data_offsets") {
        return malformed(file, where + " has an unknown field \"" + it.key() +
                                   "\" (expected only dtype, shape, data_offsets)");
      }
    }
  }
  entry->name = name;

  const Json& dtype = value["dtype"];
  if (!dtype.is_string()) return malformed(file, where + " dtype must be a string, got " + dtype.dump());
  if (!safetensors_dtype_from_string(dtype.get<std::string>(), &entry->dtype)) {
    return Status::type_error(file + ": " + where + " has dtype \"" + dtype.get<std::string>() +
                              "\", which detdit does not read (supported: F32, BF16, F16, I32, I64)");
  }

  const Json& shape = value["shape"];
  if (!shape.is_array()) return malformed(file, where + " shape must be a list, got " + shape.dump());
  uint64_t bytes = dtype_size(entry->dtype);
  entry->shape.clear();
  for (std::size_t d = 0; d < shape.size(); ++d) {
    uint64_t dim = 0;
    DETDIT_RETURN_IF_ERROR(json_to_count(shape[d], file, where + " shape[" + std::to_string(d) + "]", &dim));
    if (dim != 0 && bytes > std::numeric_limits<uint64_t>::max() / dim) {
      return malformed(file, where + " shape " + shape.dump() + " has a byte size that overflows 64 bits");
    }
    bytes *= dim;
    entry->shape.push_back(static_cast<int64_t>(dim));
  }

  const Json& offsets = value["data_offsets"];
  if (!offsets.is_array() || offsets.size() != 2) {
    return malformed(file, where + " data_offsets must be a list [begin, end], got " + offsets.dump());
  }
  DETDIT_RETURN_IF_ERROR(json_to_count(offsets[0], file, where + " data_offsets[0]", &entry->begin));
  DETDIT_RETURN_IF_ERROR(json_to_count(offsets[1], file, where + " data_offsets[1]", &entry->end));
  if (entry->end < entry->begin) {
    return malformed(file, where + " data_offsets " + offsets.dump() + " end before begin");
  }
  if (entry->end - entry->begin != bytes) {
    return malformed(file, where + " is " + std::string(dtype.get<std::string>()) + " " + shape.dump() + " = " +
                               std::to_string(bytes) + " bytes, but data_offsets " + offsets.dump() + " span " +
                               std::to_string(entry->end - entry->begin) + " bytes");
  }
  return Status::ok_status();
}

Status parse_metadata(const Json& value, const std::string& file, std::map<std::string, std::string>* metadata) {
  if (!value.is_object()) {
    return malformed(file, std::string("__metadata__ must be an object of strings, got a JSON ") + value.type_name());
  }
  for (auto it = value.begin(); it != value.end(); ++it) {
    if (!it.value().is_string()) {
      return malformed(file, "__metadata__ \"" + it.key() + "\" must be a string, got " + it.value().dump());
    }
    (*metadata)[it.key()] = it.value().get<std::string>();
  }
  return Status::ok_status();
}

// Sorted by begin, the ranges must tile [0, data_size) exactly.
Status check_ranges(std::vector<TensorEntry>* entries, uint64_t data_size, const std::string& file) {
  for (const TensorEntry& e : *entries) {
    if (e.end > data_size) {
      return malformed(file, "tensor \"" + e.name + "\" data_offsets [" + std::to_string(e.begin) + ", " +
                                 std::to_string(e.end) + "] lie outside the data section of " +
                                 std::to_string(data_size) + " bytes (truncated file?)");
    }
  }
  std::sort(entries->begin(), entries->end(), [](const TensorEntry& a, const TensorEntry& b) {
    return a.begin != b.begin ? a.begin < b.begin : a.end < b.end;
  });
  uint64_t cursor = 0;
  const TensorEntry* previous = nullptr;
  for (const TensorEntry& e : *entries) {
    if (e.begin < cursor) {
      return malformed(file, "tensor \"" + e.name + "\" bytes [" + std::to_string(e.begin) + ", " +
                                 std::to_string(e.end) + ") overlap tensor \"" + previous->name + "\" [" +
                                 std::to_string(previous->begin) + ", " + std::to_string(previous->end) + ")");
    }
    if (e.begin > cursor) {
      return malformed(file, "data section has a gap of unclaimed bytes [" + std::to_string(cursor) + ", " +
                                 std::to_string(e.begin) + ") before tensor \"" + e.name + "\"");
    }
    cursor = e.end;
    previous = &e;
  }
  if (cursor != data_size) {
    return malformed(file, "data section has " + std::to_string(data_size) + " bytes but the tensors cover " +
                               std::to_string(cursor) + " (trailing bytes no tensor claims)");
  }
  return Status::ok_status();
}

Status write_unguarded(const std::string& path, const std::vector<TensorToWrite>& tensors,
                       const std::map<std::string, std::string>& metadata, const std::function<Status()>& before_rename) {
  // Validate every input before creating any file.
  DETDIT_RETURN_IF_ERROR(check_replaceable(path));
  nlohmann::ordered_json header = nlohmann::ordered_json::object();
  if (!metadata.empty()) header["__metadata__"] = metadata;
  std::set<std::string> names;
  std::vector<uint64_t> sizes;
  uint64_t offset = 0;
  for (const TensorToWrite& t : tensors) {
    if (t.name.empty() || t.name == "__metadata__") {
      return Status::value_error(path + ": cannot write a tensor named \"" + t.name + "\"");
    }
    if (!names.insert(t.name).second) return Status::value_error(path + ": tensor \"" + t.name + "\" given twice");
    if (!t.fill) return Status::value_error(path + ": tensor \"" + t.name + "\" has no producer");
    uint64_t bytes = dtype_size(t.dtype);
    for (int64_t d : t.shape) {
      if (d < 0) return Status::value_error(path + ": tensor \"" + t.name + "\" has a negative dimension");
      if (d != 0 && bytes > std::numeric_limits<uint64_t>::max() / static_cast<uint64_t>(d)) {
        return Status::value_error(path + ": tensor \"" + t.name + "\" is too large");
      }
      bytes *= static_cast<uint64_t>(d);
    }
    if (bytes > std::numeric_limits<uint64_t>::max() - offset) {
      return Status::value_error(path + ": the tensors up to \"" + t.name + "\" exceed 2^64 bytes");
    }
    header[t.name] = {{"dtype", safetensors_dtype_string(t.dtype)},
                      {"shape", t.shape},
                      {"data_offsets", {offset, offset + bytes}}};
    sizes.push_back(bytes);
    offset += bytes;
  }
  std::string text = header.dump();
  // Spaces after the JSON are legal padding; they put the data section on a
  // 64-byte boundary so bf16/fp32 views meet the ops' 16-byte alignment.
  text.append((kDataAlignment - (8 + text.size()) % kDataAlignment) % kDataAlignment, ' ');

  // The tensors are produced one at a time into one buffer of the largest
  // size, allocated before any file exists: a tensor too large for memory
  // fails here, not after gigabytes of its predecessors were written. The
  // buffer is zero-filled, so it must fit in RAM + swap (checked first: some
  // allocators abort on a huge request instead of throwing bad_alloc).
  std::vector<uint8_t> buffer;
  const auto largest = std::max_element(sizes.begin(), sizes.end());
  if (largest != sizes.end()) {
    const std::string& name = tensors[static_cast<std::size_t>(largest - sizes.begin())].name;
    struct sysinfo host;
    const uint64_t memory = ::sysinfo(&host) == 0
                                ? (static_cast<uint64_t>(host.totalram) + host.totalswap) * host.mem_unit
                                : std::numeric_limits<uint64_t>::max();
    if (*largest > memory || *largest > buffer.max_size()) {
      return Status::runtime_error(path + ": cannot allocate the " + std::to_string(*largest) +
                                   "-byte buffer of tensor \"" + name + "\": this host has " +
                                   std::to_string(memory) + " bytes of RAM and swap; nothing was written");
    }
    try {
      buffer.resize(std::max<std::size_t>(1, static_cast<std::size_t>(*largest)));  // never a null data()
    } catch (const std::bad_alloc&) {
      return Status::runtime_error(path + ": cannot allocate the " + std::to_string(*largest) +
                                   "-byte buffer of tensor \"" + name + "\" (out of memory); nothing was written");
    }
  }

  remove_stale_temporaries(path);
  const std::string tmp = temporary_path(path);
  DETDIT_RETURN_IF_ERROR(register_temporary(tmp));
  std::FILE* out = std::fopen(tmp.c_str(), "wb");
  if (out == nullptr) {
    const int err = errno;
    unregister_temporary(tmp);
    return Status::runtime_error(path + ": cannot create " + tmp + ": " + std::strerror(err));
  }
  auto discard = [&](Status status) {
    std::remove(tmp.c_str());
    unregister_temporary(tmp);
    return status;
  };
  auto fail = [&](Status status) {
    std::fclose(out);
    return discard(status);
  };
  uint8_t length[8];
  for (int i = 0; i < 8; ++i) length[i] = static_cast<uint8_t>(static_cast<uint64_t>(text.size()) >> (8 * i));
  if (std::fwrite(length, 1, 8, out) != 8 || std::fwrite(text.data(), 1, text.size(), out) != text.size()) {
    return fail(Status::runtime_error(path + ": write failed: " + std::strerror(errno)));
  }
  for (std::size_t i = 0; i < tensors.size(); ++i) {
    std::fill_n(buffer.data(), sizes[i], uint8_t{0});
    Status filled = tensors[i].fill(buffer.data(), sizes[i]);
    if (!filled.ok()) return fail(filled);
    if (std::fwrite(buffer.data(), 1, sizes[i], out) != sizes[i]) {
      return fail(Status::runtime_error(path + ": write of tensor \"" + tensors[i].name +
                                        "\" failed: " + std::strerror(errno)));
    }
  }
  if (std::fclose(out) != 0) return discard(Status::runtime_error(path + ": close failed: " + std::strerror(errno)));
  if (before_rename) {
    Status ready = before_rename();
    if (!ready.ok()) return discard(ready);
  }
  if (std::rename(tmp.c_str(), path.c_str()) != 0) {
    const int err = errno;
    return discard(Status::runtime_error(path + ": cannot rename " + tmp + " into place: " + std::strerror(err)));
  }
  unregister_temporary(tmp);
  return Status::ok_status();
}

}  // namespace

bool safetensors_dtype_from_string(const std::string& name, DType* dtype) {
  static const std::pair<const char*, DType> kNames[] = {
      {"F32", DType::kF32}, {"BF16", DType::kBF16}, {"F16", DType::kF16}, {"I32", DType::kI32}, {"I64", DType::kI64}};
  for (const auto& entry : kNames) {
    if (name == entry.first) {
      *dtype = entry.second;
      return true;
    }
  }
  return false;
}

const char* safetensors_dtype_string(DType dtype) {
  switch (dtype) {
    case DType::kF32: return "F32";
    case DType::kBF16: return "BF16";
    case DType::kF16: return "F16";
    case DType::kI32: return "I32";
    case DType::kI64: return "I64";
  }
  return "?";
}

int64_t TensorEntry::numel() const {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

Status SafetensorsFile::parse(const uint8_t* bytes, uint64_t size, const std::string& name, SafetensorsFile* file) {
  return out_of_memory_is_an_error([&] { return name + ": out of memory"; },
                                   [&] { return parse_unguarded(bytes, size, name, file); });
}

Status SafetensorsFile::parse_unguarded(const uint8_t* bytes, uint64_t size, const std::string& name,
                                        SafetensorsFile* file) {
  if (!host_is_little_endian()) {
    return Status::runtime_error(name + ": safetensors data is little-endian and this host is not");
  }
  if (size < 8) {
    return malformed(name, "truncated: " + std::to_string(size) +
                               " bytes, a safetensors file starts with an 8-byte header length");
  }
  const uint64_t header_bytes = read_le64(bytes);
  if (header_bytes > size - 8) {
    return malformed(name, "header length " + std::to_string(header_bytes) + " runs past the end of the file (" +
                               std::to_string(size - 8) + " bytes follow the length)");
  }
  if (header_bytes > kMaxHeaderBytes) {
    return malformed(name, "header length " + std::to_string(header_bytes) + " exceeds the 100 MiB limit");
  }
  // nlohmann stops at a NUL byte as if the input ended there, so "{}\0junk"
  // would parse; JSON never holds a raw NUL, so any NUL is refused here.
  const void* nul = std::memchr(bytes + 8, 0, header_bytes);
  if (nul != nullptr) {
    return malformed(name, "header is not valid JSON: it holds a NUL byte at header offset " +
                               std::to_string(static_cast<const uint8_t*>(nul) - (bytes + 8)));
  }
  Json header;
  const char* text = reinterpret_cast<const char*>(bytes + 8);
  DETDIT_RETURN_IF_ERROR(parse_header_json(text, text + header_bytes, name, &header));

  SafetensorsFile parsed;
  parsed.path_ = name;
  parsed.file_size_ = size;
  parsed.header_bytes_ = header_bytes;
  parsed.data_ = bytes + 8 + header_bytes;
  for (auto it = header.begin(); it != header.end(); ++it) {
    if (it.key() == "__metadata__") {
      DETDIT_RETURN_IF_ERROR(parse_metadata(it.value(), name, &parsed.metadata_));
      continue;
    }
    TensorEntry entry;
    DETDIT_RETURN_IF_ERROR(parse_entry(it.key(), it.value(), name, &entry));
    parsed.entries_.push_back(std::move(entry));
  }
  DETDIT_RETURN_IF_ERROR(check_ranges(&parsed.entries_, size - 8 - header_bytes, name));
  parsed.index_.reserve(parsed.entries_.size());
  for (std::size_t i = 0; i < parsed.entries_.size(); ++i) parsed.index_.emplace(parsed.entries_[i].name, i);
  *file = std::move(parsed);
  return Status::ok_status();
}

Status SafetensorsFile::open(const std::string& path, SafetensorsFile* file) {
  int fd = -1;
  uint64_t size = 0;
  DETDIT_RETURN_IF_ERROR(open_regular_file(path, &fd, &size));
  if (size < 8) {
    ::close(fd);
    return malformed(path, "truncated: " + std::to_string(size) +
                               " bytes, a safetensors file starts with an 8-byte header length");
  }
  void* mapped = ::mmap(nullptr, size, PROT_READ, MAP_PRIVATE, fd, 0);
  int err = errno;
  ::close(fd);  // the mapping keeps the file referenced
  if (mapped == MAP_FAILED) return Status::runtime_error(path + ": cannot mmap: " + std::strerror(err));
  return out_of_memory_is_an_error([&] { return path + ": out of memory"; }, [&] {
    // (A failed allocation of the control block unmaps through the deleter.)
    std::shared_ptr<const void> mapping(mapped, [size](const void* p) { ::munmap(const_cast<void*>(p), size); });
    SafetensorsFile parsed;
    DETDIT_RETURN_IF_ERROR(parse_unguarded(static_cast<const uint8_t*>(mapped), size, path, &parsed));
    parsed.mapping_ = std::move(mapping);
    *file = std::move(parsed);
    return Status::ok_status();
  });
}

const TensorEntry* SafetensorsFile::find(const std::string& name) const {
  const auto it = index_.find(name);
  return it == index_.end() ? nullptr : &entries_[it->second];
}

Status SafetensorsFile::view(const std::string& name, TensorView* view) const {
  const TensorEntry* e = find(name);
  if (e == nullptr) return Status::value_error(path_ + ": has no tensor \"" + name + "\"");
  if (e->shape.empty() || e->shape.size() > static_cast<std::size_t>(kMaxRank)) {
    return Status::value_error(path_ + ": tensor \"" + name + "\" has rank " + std::to_string(e->shape.size()) +
                               "; a TensorView holds ranks 1.." + std::to_string(kMaxRank));
  }
  TensorView v;
  v.data = const_cast<uint8_t*>(data(*e));  // read-only mapping: views are inputs only
  v.dtype = e->dtype;
  v.rank = static_cast<int>(e->shape.size());
  int64_t stride = 1;
  for (int d = v.rank - 1; d >= 0; --d) {
    v.shape[d] = e->shape[d];
    v.strides[d] = stride;
    stride *= e->shape[d];
  }
  *view = v;
  return Status::ok_status();
}

Status write_safetensors(const std::string& path, const std::vector<TensorToWrite>& tensors,
                         const std::map<std::string, std::string>& metadata,
                         const std::function<Status()>& before_rename) {
  return out_of_memory_is_an_error([&] { return path + ": out of memory"; },
                                   [&] { return write_unguarded(path, tensors, metadata, before_rename); });
}

}  // namespace io
}  // namespace detdit
