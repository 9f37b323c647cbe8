// The CUDA backend's dispatch, in one place: which kernel runs a problem on a device (the
// architecture test, the sm90 switch, the shapes and options the sm90 kernel takes), for the
// forward and for the lean backward's recompute, and why the sm90 kernel cannot run, for the
// module's report (_rlk_core.platforms). Host C++.
#include <atomic>
#include <cstdlib>
#include <cstring>
#include <mutex>

#include "linear_logp_cuda.h"
#include "lp_internal.h"

namespace rlk::cuda {
namespace {

// ---- device capability cache ------------------------------------------------------------------
constexpr int kMaxDevices = 64;
int g_cc[kMaxDevices];  // 0 = unknown, else major*10+minor
std::once_flag g_cc_once[kMaxDevices];

std::atomic<int> g_sm90_on{-1};  // -1: not read from the environment yet

int current_device() {
  int dev = 0;
  return cudaGetDevice(&dev) == cudaSuccess ? dev : -1;
}

}  // namespace

int device_cc(int dev) {
  if (dev < 0 || dev >= kMaxDevices) return 0;
  std::call_once(g_cc_once[dev], [dev] {
    int ma = 0, mi = 0;
    cudaDeviceGetAttribute(&ma, cudaDevAttrComputeCapabilityMajor, dev);
    cudaDeviceGetAttribute(&mi, cudaDevAttrComputeCapabilityMinor, dev);
    g_cc[dev] = ma * 10 + mi;
  });
  return g_cc[dev];
}

void detail::set_sm90_enabled(bool on) { g_sm90_on.store(on ? 1 : 0); }
bool detail::sm90_enabled() {
  int v = g_sm90_on.load();
  if (v < 0) {
    const char* e = std::getenv("RLK_CUDA_DISABLE_SM90");
    v = (e != nullptr && std::strcmp(e, "0") != 0) ? 0 : 1;
    int expect = -1;
    g_sm90_on.compare_exchange_strong(expect, v);
    v = g_sm90_on.load();
  }
  return v == 1;
}

const char* sm90_unsupported(int device, const Problem* p, bool nucleus) {
#if RLK_HAVE_SM90
  if (!detail::sm90_enabled()) return "disabled by RLK_CUDA_DISABLE_SM90";
  if (device_cc(device) != 90) return "needs a device of compute capability 9.0 (sm_90a)";
  if (nucleus) return "a nucleus (keep mask) runs on the portable kernel";
  if (p && p->dtype != DType::kBF16 && p->dtype != DType::kF16) return "bfloat16 and float16 operands only";
  if (p && !(p->h > 0 && p->h % detail::kSm90HMultiple == 0)) return "the hidden size must be a multiple of 64";
  return nullptr;
#else
  (void)device, (void)p, (void)nucleus;
  return "built without the SM90 fast path (nvcc < 12 or RLK_SM90=OFF)";
#endif
}

Backend forward_backend(const Problem& p, bool nucleus) {
  return sm90_unsupported(current_device(), &p, nucleus) ? Backend::kCudaPortable : Backend::kCudaSm90;
}

bool detail::lean_fused(const Problem& p, bool nucleus) { return forward_backend(p, nucleus) == Backend::kCudaSm90; }

}  // namespace rlk::cuda
