// Internal declarations shared by the CUDA backend's translation units (not part of the API).
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "lp_geometry.h"
#include "rlk/linear_logp.h"

namespace rlk::cuda::detail {

// The shapes every call takes: rows >= 0, h and v > 0, canonical chunks that tile the local vocab.
inline Status check_shape(const Problem& p) {
  if (p.n < 0 || p.h <= 0 || p.v <= 0 || p.chunk <= 0 || p.v % p.chunk != 0) return "rlk cuda: bad problem shape";
  return nullptr;
}

// Rows per forward launch: bounds the partial-statistics workspace (rows * splits * (kPartWidth +
// kKeepPartWidth) floats). Depends on shapes only; rows are independent, so the cut is invisible in
// the results.
inline int64_t fwd_rows_per_pass(const Problem& p) {
  const int64_t per_row = total_splits(p) * (kPartWidth + kKeepPartWidth) * (int64_t)sizeof(float);
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
// The Hopper forward: fills part[rows, total_splits, kPartWidth] for rows [0, rows) of the given
// hidden pointer (already offset to the pass's first row) and, when `saved_head` is not null, the
// saved record's q (fp16, row stride p.v) and group maxima (linear_logp_cuda.h, SavedLayout; both
// offset likewise). Returns nullptr or a static error.
const char* sm90_forward_partials(const Problem& p, const void* hidden, int64_t rows, const void* weight,
                                  const float* bias, const float* temperature, float* part, void* saved_q,
                                  float* saved_head, cudaStream_t stream);
// The lean backward's recompute on the same kernel: for rows [0, rows) of a.hidden (already offset,
// as are the per-row pointers of a) against the p.v rows of a.weight (the piece; p.vocab_start is
// its first global id, p.chunk == p.v), dlogit = dz / T in p.dtype into dlog [rows, p.v] (row
// stride ldd), and, when dzz is not null, sum_j dz_j z_j per (row, split) into dzz [rows,
// total_splits(p)].
const char* sm90_dlogit(const Problem& p, const BwdArgs& a, int64_t rows, void* dlog, int64_t ldd, float* dzz,
                        cudaStream_t stream);
constexpr int64_t kSm90HMultiple = 64;  // h must be a multiple of this (one K tile)
#endif

}  // namespace rlk::cuda::detail
