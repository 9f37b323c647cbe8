// parallel_for over independent work units on a few std::threads. Units write disjoint outputs
// and the split of work into units depends on shapes only, so the thread count (RLK_NUM_THREADS,
// default: the hardware's) never changes a result bit.
// Exception safe: an exception in a work unit, or a worker thread that cannot be started, stops
// the remaining units, joins every thread that did start and is rethrown to the caller (the
// executors in ffi/exec.h turn it into an error Status).
#pragma once

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <exception>
#include <mutex>
#include <thread>
#include <vector>

namespace rlk::cpu::RLK_CPU_ISA {  // one namespace per ISA level (cpu/dispatch.h)

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
  std::exception_ptr error;
  std::mutex error_lock;
  auto fail = [&](std::exception_ptr e) {
    next = units;  // no unit starts after a failure
    std::lock_guard<std::mutex> lock(error_lock);
    if (!error) error = e;
  };
  auto loop = [&](int worker) {
    try {
      for (int64_t u = next++; u < units; u = next++) fn(worker, u);
    } catch (...) {
      fail(std::current_exception());
    }
  };
  std::vector<std::thread> pool;
  try {
    pool.reserve(size_t(std::max(workers - 1, 0)));
    for (int w = 1; w < workers; ++w) pool.emplace_back(loop, w);
  } catch (...) {  // std::system_error (no thread) or std::bad_alloc
    fail(std::current_exception());
  }
  loop(0);
  for (auto& t : pool) t.join();
  if (error) std::rethrow_exception(error);
}

inline int workers_for(int64_t units) { return int(std::min<int64_t>(num_threads(), std::max<int64_t>(units, 1))); }

}  // namespace rlk::cpu::RLK_CPU_ISA
