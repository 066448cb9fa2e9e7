// safetensors reader and writer (io/safetensors.h): round trip of every
// dtype, every malformed-file case the reader must refuse (with the file name
// and the problem in the message, never a crash), hand-made edge cases, the
// fuzz corpus replayed, and SHA-256 against the FIPS 180-2 test vectors.
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <string>
#include <vector>

#include "support/child_process.h"
#include "support/files.h"
#include "support/test_util.h"
#include "io/safetensors.h"
#include "io/sha256.h"

namespace detdit {
namespace {

using io::SafetensorsFile;

// A file image: 8-byte little-endian header length, the header, data bytes
// 0, 1, 2, ... (mod 251).
std::string image(const std::string& header, std::size_t data_bytes) {
  std::string out(8, '\0');
  uint64_t n = header.size();
  for (int i = 0; i < 8; ++i) out[i] = static_cast<char>((n >> (8 * i)) & 0xff);
  out += header;
  for (std::size_t i = 0; i < data_bytes; ++i) out.push_back(static_cast<char>(i % 251));
  return out;
}

Status parse(const std::string& bytes, SafetensorsFile* file) {
  return SafetensorsFile::parse(reinterpret_cast<const uint8_t*>(bytes.data()), bytes.size(), "mem.safetensors",
                                file);
}

// Expects a parse failure of `kind` whose message names the file and contains `needle`.
void expect_rejected(const std::string& bytes, ErrorKind kind, const std::string& needle) {
  SafetensorsFile file;
  Status s = parse(bytes, &file);
  ASSERT_FALSE(s.ok()) << "accepted; expected an error containing '" << needle << "'";
  EXPECT_EQ(s.kind(), kind) << s.to_string();
  EXPECT_NE(s.message().find("mem.safetensors: "), std::string::npos) << s.message();
  EXPECT_NE(s.message().find(needle), std::string::npos) << "message: " << s.message() << "\nexpected: " << needle;
}

std::string temp_path(const std::string& name) {
  return ::testing::TempDir() + "/detdit_st_" + std::to_string(::getpid()) + "_" + name;
}

std::vector<uint8_t> pattern_bytes(std::size_t n, uint8_t seed) {
  std::vector<uint8_t> b(n);
  for (std::size_t i = 0; i < n; ++i) b[i] = static_cast<uint8_t>(seed + 37 * i);
  return b;
}

TEST(Safetensors, RoundTripEveryDtype) {
  struct Spec {
    const char* name;
    DType dtype;
    std::vector<int64_t> shape;
  };
  const std::vector<Spec> specs = {{"f32", DType::kF32, {3, 5}},   {"bf16", DType::kBF16, {7}},
                                   {"f16", DType::kF16, {2, 2, 3}}, {"i32", DType::kI32, {1, 1, 1, 4}},
                                   {"i64", DType::kI64, {6}},      {"empty", DType::kF32, {0, 3}}};
  std::vector<io::TensorToWrite> tensors;
  std::vector<std::vector<uint8_t>> payloads;
  payloads.reserve(specs.size());  // the producers keep pointers into it
  for (std::size_t i = 0; i < specs.size(); ++i) {
    int64_t numel = 1;
    for (int64_t d : specs[i].shape) numel *= d;
    payloads.push_back(pattern_bytes(static_cast<std::size_t>(numel) * dtype_size(specs[i].dtype), uint8_t(i)));
    io::TensorToWrite t;
    t.name = specs[i].name;
    t.dtype = specs[i].dtype;
    t.shape = specs[i].shape;
    const std::vector<uint8_t>* payload = &payloads.back();
    t.fill = [payload](uint8_t* out, uint64_t bytes) {
      EXPECT_EQ(bytes, payload->size());
      if (bytes > 0) std::memcpy(out, payload->data(), bytes);  // an empty payload's data() may be null
      return Status::ok_status();
    };
    tensors.push_back(t);
  }
  const std::string path = temp_path("roundtrip.safetensors");
  DETDIT_ASSERT_OK(io::write_safetensors(path, tensors, {{"format", "pt"}, {"note", "a \"quoted\" value"}}));
  SafetensorsFile file;
  DETDIT_ASSERT_OK(SafetensorsFile::open(path, &file));
  EXPECT_EQ(file.data_start() % io::kDataAlignment, 0u);
  EXPECT_EQ(file.metadata().at("format"), "pt");
  EXPECT_EQ(file.metadata().at("note"), "a \"quoted\" value");
  ASSERT_EQ(file.entries().size(), specs.size());
  for (std::size_t i = 0; i < specs.size(); ++i) {
    const io::TensorEntry* e = file.find(specs[i].name);
    ASSERT_NE(e, nullptr) << specs[i].name;
    EXPECT_EQ(e->dtype, specs[i].dtype);
    EXPECT_EQ(e->shape, specs[i].shape);
    ASSERT_EQ(e->nbytes(), payloads[i].size());
    if (!payloads[i].empty()) {  // (an empty payload's data() may be null, which memcmp must not get)
      EXPECT_EQ(0, std::memcmp(file.data(*e), payloads[i].data(), payloads[i].size())) << specs[i].name;
    }
    TensorView v;
    DETDIT_ASSERT_OK(file.view(specs[i].name, &v));
    EXPECT_EQ(v.dtype, specs[i].dtype);
    EXPECT_EQ(v.rank, static_cast<int>(specs[i].shape.size()));
    EXPECT_TRUE(v.is_contiguous());
    EXPECT_EQ(v.data, static_cast<const void*>(file.data(*e)));
  }
  // Written in the given order: the data offsets ascend in that order.
  EXPECT_EQ(file.entries()[0].name, "f32");
  EXPECT_EQ(file.entries()[0].begin, 0u);
  std::remove(path.c_str());
}

TEST(Safetensors, ValidMinimalFiles) {
  SafetensorsFile file;
  DETDIT_ASSERT_OK(parse(image("{}", 0), &file));
  EXPECT_TRUE(file.entries().empty());
  // Trailing spaces are legal padding; entries in any JSON order.
  DETDIT_ASSERT_OK(parse(image(R"({"b":{"dtype":"F32","shape":[1],"data_offsets":[4,8]},)"
                               R"("a":{"dtype":"I32","shape":[1],"data_offsets":[0,4]}}    )",
                               8),
                         &file));
  ASSERT_EQ(file.entries().size(), 2u);
  EXPECT_EQ(file.entries()[0].name, "a");  // sorted by offset
  // A scalar (rank 0) is a valid entry, but a TensorView cannot hold it.
  DETDIT_ASSERT_OK(parse(image(R"({"s":{"dtype":"F32","shape":[],"data_offsets":[0,4]}})", 4), &file));
  TensorView v;
  Status s = file.view("s", &v);
  EXPECT_FALSE(s.ok());
  EXPECT_NE(s.message().find("rank 0"), std::string::npos) << s.message();
  // Zero-size tensors may share an offset with their neighbours.
  DETDIT_ASSERT_OK(parse(image(R"({"z":{"dtype":"F32","shape":[0],"data_offsets":[4,4]},)"
                               R"("a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},)"
                               R"("b":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}})",
                               8),
                         &file));
}

TEST(Safetensors, RejectsTruncatedFiles) {
  expect_rejected("", ErrorKind::kValue, "truncated: 0 bytes");
  expect_rejected(std::string(7, '\0'), ErrorKind::kValue, "truncated: 7 bytes");
  // Every proper prefix of a valid file is refused (length, header or data cut).
  const std::string good = image(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}})", 8);
  SafetensorsFile file;
  DETDIT_ASSERT_OK(parse(good, &file));
  for (std::size_t n = 0; n < good.size(); ++n) {
    Status s = parse(good.substr(0, n), &file);
    EXPECT_FALSE(s.ok()) << "prefix of " << n << " bytes accepted";
    EXPECT_EQ(s.kind(), ErrorKind::kValue) << s.to_string();
  }
}

TEST(Safetensors, RejectsHeaderLengthPastTheEnd) {
  std::string bytes = image("{}", 0);
  bytes[0] = 100;
  expect_rejected(bytes, ErrorKind::kValue, "header length 100 runs past the end of the file");
  std::string huge(8, '\xff');
  expect_rejected(huge + "{}", ErrorKind::kValue, "runs past the end");
}

TEST(Safetensors, RejectsHeaderOver100MiB) {
  std::string header = "{}";
  header.append((100u << 20) + 1 - header.size(), ' ');
  expect_rejected(image(header, 0), ErrorKind::kValue, "exceeds the 100 MiB limit");
}

TEST(Safetensors, RejectsMalformedJson) {
  expect_rejected(image("{", 0), ErrorKind::kValue, "header is not valid JSON");
  expect_rejected(image("not json", 0), ErrorKind::kValue, "header is not valid JSON");
  expect_rejected(image(std::string("{}\0\0", 4), 0), ErrorKind::kValue, "header is not valid JSON");
  expect_rejected(image("[1, 2]", 0), ErrorKind::kValue, "header must be a JSON object, got a JSON array");
  expect_rejected(image("\"text\"", 0), ErrorKind::kValue, "got a JSON string");
  expect_rejected(image(R"({"a": 1})", 0), ErrorKind::kValue, "tensor \"a\" must be an object");
  expect_rejected(image(R"({"a":{"dtype":"F32","shape":[[1]],"data_offsets":[0,4]}})", 4), ErrorKind::kValue,
                  "nests deeper than 3 levels");
  expect_rejected(image(R"({"a":{"dtype":"F32","shape":[true],"data_offsets":[0,4]}})", 4), ErrorKind::kValue,
                  "shape[0] must be a non-negative integer, got true");
  expect_rejected(image(R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4],"x":{"y":{"z":1}}}})", 4),
                  ErrorKind::kValue, "nests deeper than 3 levels");
}

TEST(Safetensors, RejectsUnknownDtypes) {
  for (const char* dtype : {"F64", "U8", "BOOL", "F8_E4M3", "bf16", ""}) {
    const std::string header =
        std::string(R"({"a":{"dtype":")") + dtype + R"(","shape":[1],"data_offsets":[0,8]}})";
    expect_rejected(image(header, 8), ErrorKind::kType, std::string("dtype \"") + dtype + "\", which detdit does not read");
  }
  expect_rejected(image(R"({"a":{"dtype":4,"shape":[1],"data_offsets":[0,4]}})", 4), ErrorKind::kValue,
                  "dtype must be a string");
}

TEST(Safetensors, RejectsShapeByteRangeMismatch) {
  expect_rejected(image(R"({"a":{"dtype":"F32","shape":[2,2],"data_offsets":[0,8]}})", 8), ErrorKind::kValue,
                  "is F32 [2,2] = 16 bytes, but data_offsets [0,8] span 8 bytes");
  expect_rejected(image(R"({"a":{"dtype":"BF16","shape":[3],"data_offsets":[0,8]}})", 8), ErrorKind::kValue,
                  "= 6 bytes");
}

TEST(Safetensors, RejectsOverlapsGapsAndUncoveredBytes) {
  expect_rejected(image(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},)"
                        R"("b":{"dtype":"F32","shape":[2],"data_offsets":[4,12]}})",
                        12),
                  ErrorKind::kValue, "overlap tensor \"a\"");
  expect_rejected(image(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},)"
                        R"("b":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}})",
                        8),
                  ErrorKind::kValue, "overlap");
  expect_rejected(image(R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},)"
                        R"("b":{"dtype":"F32","shape":[1],"data_offsets":[8,12]}})",
                        12),
                  ErrorKind::kValue, "gap of unclaimed bytes [4, 8)");
  expect_rejected(image(R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}})", 8), ErrorKind::kValue,
                  "gap of unclaimed bytes [0, 4)");
  expect_rejected(image(R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}})", 9), ErrorKind::kValue,
                  "data section has 9 bytes but the tensors cover 4");
  expect_rejected(image(R"({"a":{"dtype":"F32","shape":[0],"data_offsets":[8,4]}})", 8), ErrorKind::kValue,
                  "end before begin");
}

TEST(Safetensors, RejectsOffsetsOutsideTheFile) {
  expect_rejected(image(R"({"a":{"dtype":"F32","shape":[4],"data_offsets":[0,16]}})", 8), ErrorKind::kValue,
                  "lie outside the data section of 8 bytes");
  expect_rejected(image(R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[-4,0]}})", 0), ErrorKind::kValue,
                  "data_offsets[0] must be a non-negative integer, got -4");
  expect_rejected(image(R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[0]}})", 4), ErrorKind::kValue,
                  "data_offsets must be a list [begin, end]");
  expect_rejected(image(R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[0,18446744073709551615]}})", 4),
                  ErrorKind::kValue, "larger than int64 can hold");
}

TEST(Safetensors, RejectsNegativeFractionalAndOversizedShapes) {
  expect_rejected(image(R"({"a":{"dtype":"F32","shape":[-1],"data_offsets":[0,4]}})", 4), ErrorKind::kValue,
                  "shape[0] must be a non-negative integer, got -1");
  expect_rejected(image(R"({"a":{"dtype":"F32","shape":[1.5],"data_offsets":[0,4]}})", 4), ErrorKind::kValue,
                  "got 1.5");
  expect_rejected(image(R"({"a":{"dtype":"F32","shape":[4611686018427387904,8],"data_offsets":[0,4]}})", 4),
                  ErrorKind::kValue, "overflows 64 bits");
  expect_rejected(image(R"({"a":{"dtype":"F32","shape":[9223372036854775808],"data_offsets":[0,4]}})", 4),
                  ErrorKind::kValue, "larger than int64 can hold");
  expect_rejected(image(R"({"a":{"dtype":"F32","shape":"4","data_offsets":[0,4]}})", 4), ErrorKind::kValue,
                  "shape must be a list");
}

TEST(Safetensors, RejectsDuplicateNames) {
  // nlohmann keeps the last duplicate silently; the reader must not.
  expect_rejected(image(R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},)"
                        R"("a":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}})",
                        8),
                  ErrorKind::kValue, "has the key \"a\" twice (a duplicated tensor name)");
  expect_rejected(image(R"({"a":{"dtype":"F32","dtype":"F16","shape":[1],"data_offsets":[0,4]}})", 4),
                  ErrorKind::kValue, "key \"dtype\" twice");
  expect_rejected(image(R"({"__metadata__":{"k":"1","k":"2"}})", 0), ErrorKind::kValue, "key \"k\" twice");
  // The same key in two different objects is fine.
  SafetensorsFile file;
  DETDIT_EXPECT_OK(parse(image(R"({"__metadata__":{"dtype":"x"},"dtype":{"dtype":"F32","shape":[1],)"
                               R"("data_offsets":[0,4]}})",
                               4),
                         &file));
}

// A header of many zero-size entries (legal: they tile an empty data section)
// is parsed in time linear in its size: 150,000 entries (8.8 MB, well inside
// the 100 MiB limit) parse in about 0.5 s (2 s under ASan); the quadratic
// duplicate-key check of nlohmann's callback parser took about 90 s (50,000
// entries: 10 s). A duplicate after all of them is still found. The deadline
// leaves room for a loaded machine and a sanitizer build.
TEST(Safetensors, ManyEntriesParseInLinearTime) {
  constexpr int kEntries = 150000;
  std::string header = "{";
  for (int i = 0; i < kEntries; ++i) {
    header += "\"t" + std::to_string(i) + "\":{\"dtype\":\"F32\",\"shape\":[0],\"data_offsets\":[0,0]},";
  }
  const std::string valid = image(header.substr(0, header.size() - 1) + "}", 0);
  const std::string duplicated = image(header + "\"t7\":{\"dtype\":\"F32\",\"shape\":[0],\"data_offsets\":[0,0]}}", 0);
  const testing::ChildOutcome outcome = testing::run_in_child(
      [&] {
        SafetensorsFile file;
        if (!parse(valid, &file).ok() || file.entries().size() != kEntries) return 1;
        const Status s = parse(duplicated, &file);
        return s.message().find("has the key \"t7\" twice (a duplicated tensor name)") != std::string::npos ? 0 : 2;
      },
      /*timeout_seconds=*/45);
  EXPECT_TRUE(outcome.passed()) << "1: the valid header failed, 2: the duplicate was not refused; "
                                << outcome.describe();
}

TEST(Safetensors, FieldsAndMetadata) {
  expect_rejected(image(R"({"a":{"dtype":"F32","shape":[1]}})", 4), ErrorKind::kValue, "has no \"data_offsets\"");
  expect_rejected(image(R"({"a":{"shape":[1],"data_offsets":[0,4]}})", 4), ErrorKind::kValue, "has no \"dtype\"");
  expect_rejected(image(R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4],"extra":1}})", 4),
                  ErrorKind::kValue, "unknown field \"extra\"");
  expect_rejected(image(R"({"":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}})", 4), ErrorKind::kValue,
                  "empty name");
  expect_rejected(image(R"({"__metadata__":[1]})", 0), ErrorKind::kValue, "__metadata__ must be an object of strings");
  expect_rejected(image(R"({"__metadata__":{"n":1}})", 0), ErrorKind::kValue,
                  "__metadata__ \"n\" must be a string, got 1");
  SafetensorsFile file;
  DETDIT_ASSERT_OK(parse(image(R"({"__metadata__":{"format":"pt"}})", 0), &file));
  EXPECT_EQ(file.metadata().size(), 1u);
  EXPECT_TRUE(file.entries().empty());  // __metadata__ is not a tensor
}

TEST(Safetensors, MissingTensorAndFileErrors) {
  SafetensorsFile file;
  DETDIT_ASSERT_OK(parse(image(R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}})", 4), &file));
  TensorView v;
  Status s = file.view("b", &v);
  EXPECT_EQ(s.kind(), ErrorKind::kValue);
  EXPECT_EQ(s.message(), "mem.safetensors: has no tensor \"b\"");
  EXPECT_EQ(file.find("b"), nullptr);

  s = SafetensorsFile::open(temp_path("does_not_exist"), &file);
  EXPECT_EQ(s.kind(), ErrorKind::kRuntime) << s.to_string();
  EXPECT_NE(s.message().find("cannot open"), std::string::npos);
  s = SafetensorsFile::open(::testing::TempDir(), &file);
  EXPECT_EQ(s.kind(), ErrorKind::kValue) << s.to_string();
  EXPECT_NE(s.message().find("not a regular file"), std::string::npos);
  // A malformed file on disk: the path is in the message.
  const std::string path = temp_path("bad.safetensors");
  { std::ofstream(path) << image("{", 0); }
  s = SafetensorsFile::open(path, &file);
  EXPECT_NE(s.message().find(path + ": header is not valid JSON"), std::string::npos) << s.message();
  std::remove(path.c_str());
}

// A FIFO (or any non-regular file) is refused without blocking: open() of a
// FIFO for reading waits for a writer, so the reader must not wait for one.
TEST(Safetensors, OpenRefusesAFifoWithoutBlocking) {
  const std::string fifo = temp_path("fifo.safetensors");
  std::remove(fifo.c_str());
  ASSERT_EQ(::mkfifo(fifo.c_str(), 0600), 0) << std::strerror(errno);
  const testing::ChildOutcome outcome = testing::run_in_child(
      [&] {
        SafetensorsFile file;
        const Status s = SafetensorsFile::open(fifo, &file);
        return s.kind() == ErrorKind::kValue && s.message() == fifo + ": not a regular file (a FIFO)" ? 0 : 1;
      },
      /*timeout_seconds=*/10);
  EXPECT_TRUE(outcome.passed()) << outcome.describe();
  std::remove(fifo.c_str());
}

TEST(Safetensors, WriterValidatesBeforeCreatingAnything) {
  auto zeros = [](uint8_t* out, uint64_t bytes) {
    std::memset(out, 0, bytes);
    return Status::ok_status();
  };
  const std::string path = temp_path("writer.safetensors");
  std::remove(path.c_str());
  Status s = io::write_safetensors(path, {{"a", DType::kF32, {1}, zeros}, {"a", DType::kF32, {1}, zeros}}, {});
  EXPECT_NE(s.message().find("given twice"), std::string::npos) << s.to_string();
  s = io::write_safetensors(path, {{"__metadata__", DType::kF32, {1}, zeros}}, {});
  EXPECT_NE(s.message().find("cannot write a tensor named"), std::string::npos) << s.to_string();
  s = io::write_safetensors(path, {{"a", DType::kF32, {-1}, zeros}}, {});
  EXPECT_NE(s.message().find("negative dimension"), std::string::npos) << s.to_string();
  EXPECT_NE(::access(path.c_str(), F_OK), 0) << "a refused write created " << path;
  // A producer failing midway leaves neither the file nor its temporary.
  auto failing = [](uint8_t*, uint64_t) { return Status::runtime_error("producer failed"); };
  s = io::write_safetensors(path, {{"a", DType::kF32, {1}, zeros}, {"b", DType::kF32, {1}, failing}}, {});
  EXPECT_EQ(s.message(), "producer failed");
  EXPECT_NE(::access(path.c_str(), F_OK), 0);
  EXPECT_NE(::access((path + ".tmp." + std::to_string(::getpid())).c_str(), F_OK), 0);
}

// Replays tests/fuzz/corpus: every input parses or fails with a message naming
// the input; inputs named valid-* must parse (they are the fuzzer's seeds).
TEST(Safetensors, FuzzCorpusReplays) {
  const std::string dir = std::string(DETDIT_SOURCE_DIR) + "/tests/fuzz/corpus";
  std::vector<std::string> names;
  ASSERT_TRUE(testing::list_directory(dir, &names)) << dir;
  for (const std::string& name : names) {
    const std::string bytes = testing::read_file(dir + "/" + name);
    SafetensorsFile file;
    Status s = SafetensorsFile::parse(reinterpret_cast<const uint8_t*>(bytes.data()), bytes.size(), name, &file);
    if (name.rfind("valid-", 0) == 0) {
      EXPECT_TRUE(s.ok()) << name << ": " << s.to_string();
    } else if (!s.ok()) {
      EXPECT_EQ(s.message().rfind(name + ": ", 0), 0u) << s.message();
    }
  }
  EXPECT_GE(names.size(), 3u) << "the corpus in " << dir << " is missing";
}

TEST(Sha256, FipsVectors) {
  EXPECT_EQ(io::sha256_hex("", 0), "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855");
  EXPECT_EQ(io::sha256_hex("abc", 3), "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad");
  const std::string two_blocks = "abcdbcdecdefdefgefghfghighijhijkijkljklmklmnlmnomnopnopq";
  EXPECT_EQ(io::sha256_hex(two_blocks.data(), two_blocks.size()),
            "248d6a61d20638b8e5c026930c3e6039a33ce45964ff2167f6ecedd419db06c1");
  const std::string million(1000000, 'a');
  EXPECT_EQ(io::sha256_hex(million.data(), million.size()),
            "cdc76e5c9914fb9281a1c7e284d73e67f1809a48a497200e046d39ccc7112cd0");
}

}  // namespace
}  // namespace detdit
