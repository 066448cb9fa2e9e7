// parallel_for over an index range on the host's cores. Work is split into
// contiguous blocks; each index is computed by exactly one thread with the
// same code as a serial loop, so results never depend on the thread count.
#pragma once

#include <algorithm>
#include <cstdint>
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
  std::vector<std::thread> pool;
  pool.reserve(static_cast<std::size_t>(threads));
  for (int64_t w = 0; w < threads; ++w) {
    int64_t lo = begin + count * w / threads;
    int64_t hi = begin + count * (w + 1) / threads;
    pool.emplace_back([lo, hi, &fn] {
      for (int64_t i = lo; i < hi; ++i) fn(i);
    });
  }
  for (auto& t : pool) t.join();
}

}  // namespace cpu
}  // namespace detdit
