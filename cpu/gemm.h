// GEMM building blocks of the CPU backend: a register-blocked fp32 micro-kernel and the packing of
// weight tiles into the layouts it reads.
//
// Every output element is one FMA chain over the reduction index in increasing order, continued
// from the value already in C when `accumulate` is set. Splitting the reduction into slices (to keep
// operands in L1) and reloading C between them therefore gives the same bits as a single pass, and
// how callers block rows and columns never changes a result.
#pragma once

#include <algorithm>
#include <cstdint>

#include "simd.h"

namespace rlk::cpu {

// c[i * ldc + v * kLanes + l] (+)= sum_{k < kc, in order} a[k * ak + i * ai] * b[k * ldb + v * kLanes + l]
// for i < MR, v < NV, l < kLanes: MR broadcast scalars against NV vectors per step, MR x NV
// accumulators kept in registers.
template <int MR, int NV>
inline void gemm_micro(int64_t kc, const float* a, int64_t ak, int64_t ai, const float* b, int64_t ldb, float* c,
                       int64_t ldc, bool accumulate) {
  f32x16 acc[MR][NV];
#pragma GCC unroll 16
  for (int i = 0; i < MR; ++i)
#pragma GCC unroll 8
    for (int v = 0; v < NV; ++v) acc[i][v] = accumulate ? load16(c + i * ldc + v * kLanes) : splat(0.f);
  for (int64_t k = 0; k < kc; ++k) {
    f32x16 bv[NV];
#pragma GCC unroll 8
    for (int v = 0; v < NV; ++v) bv[v] = load16(b + k * ldb + v * kLanes);
#pragma GCC unroll 16
    for (int i = 0; i < MR; ++i) {
      const float s = a[k * ak + i * ai];
#pragma GCC unroll 8
      for (int v = 0; v < NV; ++v) acc[i][v] += s * bv[v];
    }
  }
#pragma GCC unroll 16
  for (int i = 0; i < MR; ++i)
#pragma GCC unroll 8
    for (int v = 0; v < NV; ++v) store16(c + i * ldc + v * kLanes, acc[i][v]);
}

// Rows [0, rows) of `src` (dtype t, row length h, starting at element `offset`) -> fp32 k-major
// dst[k * ld + j]; rows [rows, ld) are zero. Blocked over k so the rows written stay in L1.
inline void pack_transposed(DType t, const void* src, int64_t offset, int64_t rows, int64_t h, int64_t ld,
                            float* dst) {
  constexpr int64_t kSlice = 64;
  float row[kSlice];
  for (int64_t k0 = 0; k0 < h; k0 += kSlice) {
    const int64_t kn = std::min(kSlice, h - k0);
    for (int64_t j = 0; j < rows; ++j) {
      to_f32(t, src, offset + j * h + k0, kn, row);
      for (int64_t k = 0; k < kn; ++k) dst[(k0 + k) * ld + j] = row[k];
    }
    for (int64_t k = k0; k < k0 + kn; ++k) std::fill(dst + k * ld + rows, dst + (k + 1) * ld, 0.f);
  }
}

}  // namespace rlk::cpu
