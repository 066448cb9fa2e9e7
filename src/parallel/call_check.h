// The cross-rank call check shared by every communicator (include/detdit/comm.h).
//
// Before any payload moves, every rank contributes a fixed-size CallHeader
// (one all-gather of sizeof(CallHeader) bytes by the backend's own means) and
// every rank runs check_call_headers on the same gathered headers, so all
// ranks reach the same verdict: either every rank copies, or every rank
// returns the same error. agree() gathers fixed-size AgreeRecords the same way.
// A rank that leaves (the MPI backend: destroys its communicator, or ends its
// process with it alive) contributes one last header of op kLeave: a peer
// waiting in a call learns from it who left, instead of waiting forever.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

#include "detdit/status.h"
#include "detdit/tensor.h"

namespace detdit {
namespace comm_detail {

enum class CallOp : int32_t { kAllGather = 1, kAgree = 2, kBroadcast = 3, kLeave = 4 };

struct CallHeader {
  uint64_t sequence = 0;   // this rank's collective call count, from 0
  uint64_t bytes = 0;      // payload bytes per rank
  int32_t op = 0;          // CallOp
  int32_t dtype = 0;       // DType of the elements
  int32_t local_error = 0; // 1: this rank's arguments are invalid (it still takes part)
  int32_t root = 0;        // broadcast: the rank whose buffer is copied (0 for the other ops)
};
static_assert(sizeof(CallHeader) == 32, "CallHeader is exchanged as raw bytes");

constexpr std::size_t kAgreeMessageBytes = 240;
struct AgreeRecord {
  int32_t kind = 0;  // ErrorKind of the rank's local status
  int32_t padding = 0;
  uint64_t signature = 0;  // FNV-1a hash of the call signature (what decides the collectives)
  char message[kAgreeMessageBytes] = {};
};
static_assert(sizeof(AgreeRecord) == 256, "AgreeRecord is exchanged as raw bytes");

// Local validity of one rank's all_gather arguments (ValueError/TypeError).
Status check_local_all_gather(const void* send, std::size_t bytes, const void* recv, DType dtype, int world);
// Local validity of one rank's broadcast arguments (ValueError).
Status check_local_broadcast(const void* buffer, std::size_t bytes, int root, DType dtype, int world);
CallHeader make_header(uint64_t sequence, CallOp op, std::size_t bytes, DType dtype, bool local_error,
                       int root = 0);
// The verdict on the gathered headers of `world` ranks: RuntimeError naming
// the ranks that left while the others made a call (every rank, the leaving
// ones included, gets it), ValueError naming the first two disagreeing calls,
// or naming the ranks with invalid arguments (`local` is returned unchanged
// on a rank whose own arguments were invalid). Ranks that all leave agree.
Status check_call_headers(const CallHeader* headers, int world, const Status& local);
// Whether any of the gathered headers is a leave: the communicator cannot be
// used again on any rank.
bool any_rank_left(const CallHeader* headers, int world);

AgreeRecord make_record(const Status& local, const std::string& signature);
// The verdict on the gathered records (see Communicator::agree).
Status resolve_agreement(const AgreeRecord* records, int world, const Status& local, const std::string& signature);

}  // namespace comm_detail
}  // namespace detdit
