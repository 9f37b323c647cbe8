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

// Which forward kernel `forward` will run for this problem on the current device; `nucleus`: with
// FwdArgs::keep (the portable kernel: the sm90 epilogue takes no nucleus).
Backend forward_backend(const Problem& p, bool nucleus = false);

size_t forward_workspace_bytes(const Problem& p);

// The CUDA backend's saved logits (FwdArgs::saved_logits, BwdArgs::saved_logits), n rows:
//   fp32 operands: z [n, v] fp32, as the forward computed it.
//   16-bit operands, the max-relative record (as the CPU backend's, in a layout for TMA stores):
//     float head[n][floats]  per row: moments[chunks][6], the chunk's (m, s, a, b, sk, ak) with
//                            b = sum_j exp(z_j - m) (z_j - m)^2 and sk, ak the sums of s and a
//                            over the nucleus (FwdArgs::keep; 0 without); group_max[groups]; z_target;
//                            zeros up to a multiple of 64 floats: q starts 256-byte aligned for
//                            any n (the gradient GEMMs read q's bytes as dlogit, and cuBLASLt
//                            picks slower kernels for a less aligned operand: docs/benchmarks.md
//                            §5, "its q 16-byte aligned")
//     fp16  q[n][v]          q_j = exp(z_j - mt), mt = group_max of the column's group: 128
//                            columns counted from the chunk's first (the portable kernel's tile;
//                            the sm90 kernel gives both halves of its 256-column tile the tile's max)
//   so that p_j = q_j exp((mt - m) - log_s) has fp16's relative error (2^-11) at every |z| and
//   temperature, and dT comes from the fp32 moments (moments_dzz), not from q.
// Row-separable: the bytes of n rows are n times those of one.
struct SavedLayout {
  static constexpr int64_t kGroupCols = 128;
  static constexpr int64_t kMoments = 6;
  int64_t chunks, groups_per_chunk, floats;  // floats: the head's per row
  SavedLayout() = default;
  explicit SavedLayout(const Problem& p)
      : chunks(num_chunks(p)), groups_per_chunk((p.chunk + kGroupCols - 1) / kGroupCols),
        floats((chunks * kMoments + chunks * groups_per_chunk + 1 + 63) / 64 * 64) {}
  RLK_HD int64_t moments_at(int64_t c) const { return c * kMoments; }  // offsets in a row's head
  RLK_HD int64_t group_max_at() const { return chunks * kMoments; }
  RLK_HD int64_t z_target_at() const { return group_max_at() + chunks * groups_per_chunk; }
  // The group of the column at offset `off` of chunk `c`.
  RLK_HD int64_t group_at(int64_t c, int64_t off) const { return c * groups_per_chunk + off / kGroupCols; }
  // The group of local column `col` in chunk `c` (col in [c * chunk, (c + 1) * chunk)).
  RLK_HD int64_t group(int64_t c, int64_t col, int64_t chunk) const { return group_at(c, col - c * chunk); }
};
inline bool saved_q(DType t) { return t != DType::kF32; }
inline size_t saved_logits_bytes(const Problem& p) {
  if (!saved_q(p.dtype)) return size_t(p.n) * size_t(p.v) * 4;
  return size_t(p.n) * (size_t(SavedLayout(p).floats) * 4 + size_t(p.v) * 2);
}
// Row 0 of the saved logits of p.n rows: the head (16-bit operands; else null) and the [n, v] matrix
// (z, or q).
struct SavedRows {
  float* head;
  void* z;
};
inline SavedRows saved_rows(const Problem& p, void* saved) {
  if (!saved_q(p.dtype)) return {nullptr, saved};
  float* head = static_cast<float*>(saved);
  return {head, head + p.n * SavedLayout(p).floats};
}
// `fast`: the backward reads saved logits (BwdArgs::saved_logits); else it recomputes them (lean: all of
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
