// Internal declarations shared by the CUDA backend's translation units (not part of the API).
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "rlk/linear_logp.h"

namespace rlk::cuda::detail {

// ---- forward split geometry -------------------------------------------------------------------
// A canonical chunk is cut into "splits" of kSplitCols consecutive columns counted from the
// chunk's first column (the last split of a chunk may be shorter). One CTA owns one (row tile,
// split) and walks the split's column tiles in order, so a split's statistics depend on the
// chunk's content only, never on where the chunk sits in the local vocab (TP invariance) nor on
// other rows (batch invariance). The per-(row, split) partials are merged per chunk, in split
// order, by the finalize kernel. Both forward kernels (portable and sm90) use this geometry.
constexpr int64_t kSplitCols = 1024;

inline int64_t splits_per_chunk(int64_t chunk) { return (chunk + kSplitCols - 1) / kSplitCols; }
inline int64_t total_splits(const Problem& p) { return num_chunks(p) * splits_per_chunk(p.chunk); }

// Rows per forward launch: bounds the partial-statistics workspace (rows * splits * 3 floats).
// Depends on shapes only; rows are independent, so the cut is invisible in the results.
inline int64_t fwd_rows_per_pass(const Problem& p) {
  const int64_t per_row = total_splits(p) * kStatWidth * (int64_t)sizeof(float);
  int64_t r = (int64_t(192) << 20) / (per_row > 0 ? per_row : 1);
  r = (r / 128) * 128;
  if (r < 128) r = 128;
  const int64_t n128 = ((p.n + 127) / 128) * 128;
  return r < n128 ? r : (n128 > 0 ? n128 : 128);
}

// Debug/test switch: when false, forward_backend never picks the sm90 kernel. Initialised from the
// environment variable RLK_CUDA_DISABLE_SM90 (any value but "0" disables) at first use.
void set_sm90_enabled(bool on);
bool sm90_enabled();

#if RLK_HAVE_SM90
extern const char* const kSm90Misaligned;  // returned when TMA cannot take the pointers
// The Hopper forward: fills part[rows, total_splits, 3] for rows [0, rows) of the given hidden
// pointer (already offset to the pass's first row). Returns nullptr or a static error.
const char* sm90_forward_partials(const Problem& p, const void* hidden, int64_t rows,
                                  const void* weight, const float* bias, const float* inv_temp,
                                  float* part, cudaStream_t stream);
constexpr int64_t kSm90HMultiple = 64;

// The Hopper backward pieces (see linear_logp_cuda.cu for the driver).
struct Sm90DlogitArgs {
  const void* hidden;   // pass's first row, [rn, h]
  const void* weight;   // piece's first vocab row, [pw, h]
  const float* bias;    // piece's first column (f32) or null
  const int32_t* targets; const float *inv_temp, *lse, *ent, *g, *e;  // pass-offset; ent/e may be null
  int64_t rn, pw, p0, P, R;
  void* dlog;   // [rn, P] dtype
  void* dlogT;  // [P, R] dtype
  float* dzz_part;  // [R, P/128]
  float* db_part;   // [R/128, P] or null
};
const char* sm90_dlogit(const Problem& p, const Sm90DlogitArgs& a, cudaStream_t stream);
// out[M, N] (mode as gemm_out_kernel) from A [M, K] (row stride lda) and B [N, K] (ldb), both K-major.
const char* sm90_gemm_out(const Problem& p, const void* A, int64_t lda, const void* B, int64_t ldb, int64_t M,
                          int64_t N, int64_t K, float* outf, void* outT, int64_t ldo, int mode, cudaStream_t stream);  // h must be a multiple of this (one K tile)
#endif

}  // namespace rlk::cuda::detail
