// Route counters: incremented by the handlers when a kernel actually runs (not at trace time).
#include <atomic>

#include "rlk/linear_logp.h"

namespace rlk {
namespace {
constexpr int kSlots = 5;
std::atomic<int64_t> g_counts[int(Backend::kCount)][kSlots];
}  // namespace

const char* backend_name(Backend b) {
  switch (b) {
    case Backend::kCpu: return "cpu";
    case Backend::kCudaSm90: return "cuda_sm90";
    case Backend::kCudaPortable: return "cuda_portable";
    case Backend::kCudaBlas: return "cuda_cublas";
    default: return "unknown";
  }
}

void count_call(Backend b, bool backward, int64_t tokens, bool fast) {
  auto& slot = g_counts[int(b)];
  slot[backward ? 2 : 0].fetch_add(1, std::memory_order_relaxed);
  slot[backward ? 3 : 1].fetch_add(tokens, std::memory_order_relaxed);
  if (backward && fast) slot[4].fetch_add(1, std::memory_order_relaxed);
}

RouteCounts read_counts(Backend b) {
  auto& slot = g_counts[int(b)];
  return {slot[0].load(), slot[1].load(), slot[2].load(), slot[3].load(), slot[4].load()};
}

void reset_counts() {
  for (auto& slot : g_counts)
    for (auto& c : slot) c.store(0);
}

}  // namespace rlk
