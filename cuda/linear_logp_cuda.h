// The CUDA backend of the plain API (include/rlk/linear_logp.h).
//
// Every call is asynchronous on `stream`, allocates nothing (scratch comes from the caller, sized
// by the *_workspace_bytes functions, which depend on the Problem's shapes only), performs no host
// synchronisation and picks its launch configuration from shapes only: the calls are safe inside
// CUDA graphs (XLA command buffers, torch.cuda.CUDAGraph).
#pragma once

#include <cuda_runtime.h>

#include "rlk/linear_logp.h"

namespace rlk::cuda {

struct Workspace {
  void* ptr = nullptr;
  size_t bytes = 0;
};

// Which forward kernel `forward` will run for this problem on the current device.
Backend forward_backend(const Problem& p);

size_t forward_workspace_bytes(const Problem& p);

// The CUDA backend's kept buffer (FwdArgs::logits, BwdArgs::logits): z [n, v] in kept_dtype,
// clamped to +-kMaxKeptLogit. (Not yet the CPU backend's max-relative record: that one is
// validated on the CPU only.)
inline DType kept_dtype(DType t) { return t == DType::kF32 ? DType::kF32 : DType::kF16; }
constexpr float kMaxKeptLogit = 65504.f;
inline size_t kept_bytes(const Problem& p) { return size_t(p.n) * size_t(p.v) * dtype_bytes(kept_dtype(p.dtype)); }
// `fast`: the backward reads kept logits (BwdArgs::logits); else it recomputes them (lean: all of
// its extra memory is this workspace, at most 256 MiB for any n and v and h up to 32768, see
// lean_plan.h). `dhidden_dtype`: BwdArgs::dhidden_dtype. The lean layout also depends on
// whether the sm90 kernel does the recompute (forward_backend), fixed per device and process.
size_t backward_workspace_bytes(const Problem& p, bool fast, DType dhidden_dtype);

// `ran` (may be null) receives the backend that ran.
Status forward(const Problem& p, const FwdArgs& a, Workspace ws, cudaStream_t stream, Backend* ran);
Status combine(const CombineArgs& a, cudaStream_t stream);
// The backward is counted as Backend::kCudaBlas: its GEMMs are cuBLAS's; the lean recompute runs on
// the sm90 kernel where forward_backend is kCudaSm90 (linear_logp_bwd.cu).
Status backward(const Problem& p, const BwdArgs& a, Workspace ws, cudaStream_t stream);
// Load cuBLAS and create device `device`'s handle now, outside any CUDA-graph capture (the
// frontends call it before they first launch a backward).
Status prepare_backward(int device);

}  // namespace rlk::cuda
