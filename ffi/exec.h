// The executors: one call of the plain API on one platform, counted in the route counters when
// it runs. Shared by the XLA FFI handlers and the DLPack entry points, so both frontends reach
// the kernels through the same code.
#pragma once

#include <new>
#include <system_error>

#include "rlk/linear_logp.h"
#if RLK_HAVE_CUDA
#include "linear_logp_cuda.h"
#endif

namespace rlk {

// One CPU kernel call, its exceptions (allocation, thread start, a work unit's) as a Status: an
// exception must not cross the XLA FFI or end the process.
template <class Call>
Status cpu_guarded(Call&& call) {
  try {
    return call();
  } catch (const std::bad_alloc&) {
    return "rlk cpu: out of memory (std::bad_alloc)";
  } catch (const std::system_error&) {
    return "rlk cpu: could not start a worker thread (std::system_error); lower RLK_NUM_THREADS or the "
           "process's thread count";
  } catch (...) {
    return "rlk cpu: a kernel raised an unexpected C++ exception";
  }
}

// Counted after the kernel ran and succeeded: a call its checks reject is not counted.
struct CpuExec {
  static size_t saved_logits_bytes(const Problem& p) { return cpu::saved_logits_bytes(p); }
  void use_workspace(void*, size_t) {}  // the CPU backend allocates its own scratch
  Status forward(const Problem& p, const FwdArgs& a) {
    const Status s = cpu_guarded([&] { return cpu::forward(p, a); });
    if (!s) count_call(Backend::kCpu, false, p.n);
    return s;
  }
  Status combine(const CombineArgs& a) {
    return cpu_guarded([&] { return cpu::combine(a); });
  }
  Status backward(const Problem& p, const BwdArgs& a) {
    const Status s = cpu_guarded([&] { return cpu::backward(p, a); });
    if (!s) count_call(Backend::kCpu, true, p.n, a.saved_logits != nullptr);
    return s;
  }
};

#if RLK_HAVE_CUDA
// Asynchronous on `stream`; scratch is the caller's (use_workspace), checked against what the call needs.
struct CudaExec {
  cudaStream_t stream;
  cuda::Workspace ws{};

  static size_t saved_logits_bytes(const Problem& p) { return cuda::saved_logits_bytes(p); }
  void use_workspace(void* data, size_t bytes) { ws = {data, bytes}; }

  Status forward(const Problem& p, const FwdArgs& a) {
    Backend ran = Backend::kCudaPortable;
    Status s = cuda::forward(p, a, ws, stream, &ran);
    if (!s) count_call(ran, false, p.n);
    return s;
  }
  Status combine(const CombineArgs& a) { return cuda::combine(a, stream); }
  Status backward(const Problem& p, const BwdArgs& a) {
    Status s = cuda::backward(p, a, ws, stream);
    if (!s) count_call(Backend::kCudaBlas, true, p.n, a.saved_logits != nullptr);
    return s;
  }
};
#endif

}  // namespace rlk
