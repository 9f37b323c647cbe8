// The executors: one call of the plain API on one platform, counted in the route counters when
// it runs. Shared by the XLA FFI handlers and the DLPack entry points, so both frontends reach
// the kernels through the same code.
#pragma once

#include "rlk/linear_logp.h"
#if RLK_HAVE_CUDA
#include "linear_logp_cuda.h"
#endif

namespace rlk {

struct CpuExec {
  size_t kept_bytes(const Problem& p) const { return cpu::kept_bytes(p); }
  Status forward(const Problem& p, const FwdArgs& a) {
    count_call(Backend::kCpu, false, p.n);
    return cpu::forward(p, a);
  }
  Status combine(const CombineArgs& a) { return cpu::combine(a); }
  Status backward(const Problem& p, const BwdArgs& a) {
    count_call(Backend::kCpu, true, p.n, a.logits != nullptr);
    return cpu::backward(p, a);
  }
};

#if RLK_HAVE_CUDA
// Asynchronous on `stream`; scratch is the caller's (`ws`), checked against what the call needs.
struct CudaExec {
  cudaStream_t stream;
  cuda::Workspace ws;

  size_t kept_bytes(const Problem& p) const { return cuda::kept_bytes(p); }

  Status forward(const Problem& p, const FwdArgs& a) {
    Backend ran = Backend::kCudaPortable;
    Status s = cuda::forward(p, a, ws, stream, &ran);
    if (!s) count_call(ran, false, p.n);
    return s;
  }
  Status combine(const CombineArgs& a) { return cuda::combine(a, stream); }
  Status backward(const Problem& p, const BwdArgs& a) {
    Status s = cuda::backward(p, a, ws, stream);
    if (!s) count_call(Backend::kCudaBlas, true, p.n, a.logits != nullptr);
    return s;
  }
};
#endif

}  // namespace rlk
