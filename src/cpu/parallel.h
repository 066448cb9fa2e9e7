// parallel_for over an index range on the host's cores. Work is split into
// contiguous blocks; each index is computed by exactly one thread with the
// same code as a serial loop, so results never depend on the thread count.
// An exception in a block (std::bad_alloc of a block's working memory) is
// rethrown to the caller after every thread has joined, never out of a
// thread (std::terminate); a thread that cannot be started leaves its blocks
// to the calling thread (the same bits, serially).
#pragma once

#include <algorithm>
#include <cstdint>
#include <exception>
#include <mutex>
#include <thread>
#include <vector>

namespace detdit {
namespace cpu {

template <typename Fn>
void parallel_for(int64_t begin, int64_t end, Fn&& fn) {
  int64_t count = end - begin;
  if (count <= 0) return;
  int64_t threads = std::min<int64_t>(std::max(1u, std::thread::hardware_concurrency()), count);
  if (threads <= 1) {
    for (int64_t i = begin; i < end; ++i) fn(i);
    return;
  }
  std::exception_ptr failure;
  std::mutex failure_mutex;
  auto run_block = [&](int64_t w) {
    const int64_t lo = begin + count * w / threads, hi = begin + count * (w + 1) / threads;
    try {
      for (int64_t i = lo; i < hi; ++i) fn(i);
    } catch (...) {
      std::lock_guard<std::mutex> lock(failure_mutex);
      if (!failure) failure = std::current_exception();
    }
  };
  std::vector<std::thread> pool;
  int64_t started = 0;
  try {
    pool.reserve(static_cast<std::size_t>(threads));
    for (; started < threads; ++started) pool.emplace_back(run_block, started);
  } catch (const std::exception&) {  // std::system_error (no thread), std::bad_alloc (no pool)
  }
  for (int64_t w = started; w < threads; ++w) run_block(w);
  for (auto& t : pool) t.join();
  if (failure) std::rethrow_exception(failure);
}

}  // namespace cpu
}  // namespace detdit
