#include "parallel/call_check.h"

#include <algorithm>
#include <cstring>
#include <string>

#include "common/fnv1a.h"

namespace detdit {
namespace comm_detail {
namespace {

const char* op_name(int32_t op) {
  switch (static_cast<CallOp>(op)) {
    case CallOp::kAgree: return "agree";
    case CallOp::kBroadcast: return "broadcast";
    case CallOp::kLeave: return "leave";
    default: return "all_gather";
  }
}

std::string describe(const CallHeader& h, int rank) {
  std::string what = "rank " + std::to_string(rank) + " called " + op_name(h.op) + " #" + std::to_string(h.sequence);
  if (h.op != static_cast<int32_t>(CallOp::kAgree))
    what += " with " + std::to_string(h.bytes) + " bytes of " + dtype_name(static_cast<DType>(h.dtype));
  if (h.op == static_cast<int32_t>(CallOp::kBroadcast)) what += " from root " + std::to_string(h.root);
  return what;
}

}  // namespace

Status check_local_all_gather(const void* send, std::size_t bytes, const void* recv, DType dtype, int world) {
  const std::size_t element = dtype_size(dtype);
  if (element == 0 || bytes % element != 0)
    return Status::value_error("all_gather bytes must be a multiple of the " + std::string(dtype_name(dtype)) +
                               " element size " + std::to_string(element) + ", got " + std::to_string(bytes));
  if (bytes == 0) return Status();
  if (send == nullptr) return Status::value_error("all_gather send buffer is null for " + std::to_string(bytes) + " bytes");
  if (recv == nullptr) return Status::value_error("all_gather recv buffer is null for " + std::to_string(bytes) + " bytes");
  // send must not overlap recv (world * bytes): the copy would read what it wrote.
  auto s = reinterpret_cast<std::uintptr_t>(send), r = reinterpret_cast<std::uintptr_t>(recv);
  if (s < r + bytes * static_cast<std::size_t>(world) && r < s + bytes)
    return Status::value_error("all_gather send buffer must not overlap the recv buffer (world * bytes = " +
                               std::to_string(bytes * static_cast<std::size_t>(world)) + " bytes)");
  return Status();
}

Status check_local_broadcast(const void* buffer, std::size_t bytes, int root, DType dtype, int world) {
  if (root < 0 || root >= world)
    return Status::value_error("broadcast root must be in [0, " + std::to_string(world) + "), got " +
                               std::to_string(root));
  const std::size_t element = dtype_size(dtype);
  if (element == 0 || bytes % element != 0)
    return Status::value_error("broadcast bytes must be a multiple of the " + std::string(dtype_name(dtype)) +
                               " element size " + std::to_string(element) + ", got " + std::to_string(bytes));
  if (bytes > 0 && buffer == nullptr)
    return Status::value_error("broadcast buffer is null for " + std::to_string(bytes) + " bytes");
  return Status();
}

CallHeader make_header(uint64_t sequence, CallOp op, std::size_t bytes, DType dtype, bool local_error, int root) {
  CallHeader h;
  h.sequence = sequence;
  h.bytes = bytes;
  h.op = static_cast<int32_t>(op);
  h.dtype = static_cast<int32_t>(dtype);
  h.local_error = local_error ? 1 : 0;
  h.root = root;
  return h;
}

bool any_rank_left(const CallHeader* headers, int world) {
  for (int r = 0; r < world; ++r)
    if (headers[r].op == static_cast<int32_t>(CallOp::kLeave)) return true;
  return false;
}

Status check_call_headers(const CallHeader* headers, int world, const Status& local) {
  // A rank that left never makes the others' call: name it (before any other
  // check, whatever the others' arguments), unless every rank left.
  std::string left;
  int leavers = 0, caller = -1;
  for (int r = 0; r < world; ++r) {
    if (headers[r].op == static_cast<int32_t>(CallOp::kLeave)) {
      left += (left.empty() ? "" : ", ") + std::to_string(r);
      ++leavers;
    } else if (caller < 0) {
      caller = r;
    }
  }
  if (leavers > 0 && caller >= 0)
    return Status::runtime_error(std::string(leavers == 1 ? "rank " : "ranks ") + left +
                                 " left the communicator (destroyed it, or its process ended) while " +
                                 describe(headers[caller], caller) +
                                 "; a communicator that a rank has left cannot be used again");
  if (leavers > 0) return Status();
  for (int r = 1; r < world; ++r) {
    const CallHeader& a = headers[0];
    const CallHeader& b = headers[r];
    if (a.sequence != b.sequence || a.op != b.op || a.bytes != b.bytes || a.dtype != b.dtype || a.root != b.root)
      return Status::value_error("collective calls do not match across ranks: " + describe(a, 0) + ", " +
                                 describe(b, r) + "; every rank must make the same calls with the same sizes");
  }
  if (!local.ok()) return local;
  std::string bad;
  for (int r = 0; r < world; ++r)
    if (headers[r].local_error) bad += (bad.empty() ? "" : ", ") + std::to_string(r);
  if (!bad.empty())
    return Status::value_error(std::string(op_name(headers[0].op)) + " #" + std::to_string(headers[0].sequence) +
                               " was called with invalid arguments on rank(s) " + bad + "; nothing was copied");
  return Status();
}

AgreeRecord make_record(const Status& local, const std::string& signature) {
  AgreeRecord record;
  record.kind = static_cast<int32_t>(local.kind());
  record.signature = fnv1a(signature);  // the same on every process
  const std::string& m = local.message();
  std::memcpy(record.message, m.data(), std::min(m.size(), kAgreeMessageBytes - 1));
  return record;
}

Status resolve_agreement(const AgreeRecord* records, int world, const Status& local, const std::string& signature) {
  if (!local.ok()) return local;
  for (int r = 0; r < world; ++r) {
    if (records[r].kind == static_cast<int32_t>(ErrorKind::kOk)) continue;
    std::string message(records[r].message, strnlen(records[r].message, kAgreeMessageBytes));
    return Status(static_cast<ErrorKind>(records[r].kind),
                  "rank " + std::to_string(r) + " rejected the call: " + message);
  }
  for (int r = 1; r < world; ++r)
    if (records[r].signature != records[0].signature)
      return Status::value_error(
          "the ranks' calls differ: rank " + std::to_string(r) + "'s call does not match rank 0's (this rank: " +
          (signature.empty() ? std::string("no signature") : signature) +
          "); every rank must make the same call: the same index plan, replicated shapes, profile and gathered "
          "outputs");
  return Status();
}

}  // namespace comm_detail
}  // namespace detdit
