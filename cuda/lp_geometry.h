// Shape-only sizes of the CUDA backend that host code plans with (lean_plan.cc, the module's
// workspace sizes): host C++ only, no CUDA headers, so they build without nvcc too.
#pragma once

#include <cstddef>
#include <cstdint>

#include "rlk/linear_logp.h"

namespace rlk::cuda {
namespace detail {

// ---- forward split geometry -------------------------------------------------------------------
// A canonical chunk is cut into "splits" of kSplitCols consecutive columns counted from the
// chunk's first column (the last split of a chunk may be shorter). One CTA owns one (row tile,
// split) and walks the split's column tiles in order, so a split's statistics depend on the
// chunk's content only, never on where the chunk sits in the local vocab (TP invariance) nor on
// other rows (batch invariance). The per-(row, split) partials are merged per chunk, in split
// order, by the finalize kernel. Both forward kernels (portable and sm90) use this geometry.
constexpr int64_t kSplitCols = 1024;  // a multiple of the sm90 kernel's 256-column tile
// A split's partials: the chunk statistics' (m, s, a) and the saved record's moment b (moments_merge;
// 0 when nothing is saved).
constexpr int kPartWidth = 4;
// With a nucleus (FwdArgs::keep; the portable kernel), a split's kept sums (sk, ak) in a second
// array of the workspace (nucleus_merge).
constexpr int kKeepPartWidth = 2;

// The lean backward's recompute on the sm90 kernel (sm90_dlogit) splits its vocab pieces the same
// way, in shorter splits, so that a piece's few row tiles still make enough units to fill the last
// wave (only the order of the dT sum depends on it).
constexpr int64_t kDlogitSplitCols = 512;

inline int64_t splits_per_chunk(int64_t chunk, int64_t split_cols = kSplitCols) {
  return (chunk + split_cols - 1) / split_cols;
}
inline int64_t total_splits(const Problem& p) { return num_chunks(p) * splits_per_chunk(p.chunk); }

}  // namespace detail

namespace blas {

constexpr size_t kWorkspaceBytes = size_t(32) << 20;  // cuBLAS's recommendation for Hopper
// What a caller reserves for it: cuBLAS needs a 256-byte aligned workspace, and a frontend's
// scratch buffer (XLA's) may be aligned to less; gemm() aligns within this.
constexpr size_t kWorkspaceAlloc = kWorkspaceBytes + 256;

}  // namespace blas
}  // namespace rlk::cuda
