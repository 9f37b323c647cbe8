// parallel_for over independent work units on a few std::threads. Units write disjoint outputs
// and the split of work into units depends on shapes only, so the thread count (RLK_NUM_THREADS,
// default: the hardware's) never changes a result bit.
#pragma once

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <thread>
#include <vector>

namespace rlk::cpu {

inline int num_threads() {
  static const int n = [] {
    const char* env = std::getenv("RLK_NUM_THREADS");
    int v = env ? std::atoi(env) : int(std::thread::hardware_concurrency());
    return std::max(1, v);
  }();
  return n;
}

// fn(worker, unit) for unit in [0, units); worker in [0, workers) names per-worker scratch.
template <class Fn>
void parallel_for(int64_t units, int workers, Fn&& fn) {
  std::atomic<int64_t> next{0};
  auto loop = [&](int worker) {
    for (int64_t u = next++; u < units; u = next++) fn(worker, u);
  };
  std::vector<std::thread> pool;
  for (int w = 1; w < workers; ++w) pool.emplace_back(loop, w);
  loop(0);
  for (auto& t : pool) t.join();
}

inline int workers_for(int64_t units) { return int(std::min<int64_t>(num_threads(), std::max<int64_t>(units, 1))); }

}  // namespace rlk::cpu
