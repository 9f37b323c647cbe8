// The gradient GEMMs of the CUDA backward run on cuBLAS (its cuBLASLt API), bound at run time.
//
// Why cuBLAS and not our own wgmma kernels (cuda/linear_logp_sm90.cu): the backward's two
// gradient GEMMs (dH = dlogit W, dW = dlogit^T H) are plain GEMMs with no fused epilogue left to
// gain (dlogit is formed before them: by one memory-bound pass over the saved record, or by the sm90
// kernel's recompute), and our own wgmma GEMMs plus the transposes they need ran slower than
// cuBLAS's (docs/benchmarks.md §5, "our own SM90 gradient GEMMs").
// cuBLAS takes the transposed layouts directly.
//
// Why cuBLASLt: its heuristics take a reduction-scheme mask. The algorithm is cuBLASLt's first
// pick among those that do not split K (blas.cc, first_pick): each output element sums its k terms
// in one pass, and compute-sanitizer's racecheck, which reported hazards inside cuBLAS's split-K
// kernels, has nothing to report. The pick is cached per shape, dtypes and operand alignment;
// where C's rows are tokens (the fast path's dH) it is made for a fixed row count, so that a
// token's gradient does not depend on the batch around it (batch_rows below).
// A large GEMM (blas.cc, kTuneFlops) instead runs the fastest of the first few such candidates
// that give the first pick's bits, timed once per size class on the call's own operands
// (blas.cc, "the tuned pick"; RLK_BLAS_TUNE=0 keeps the first pick everywhere).
//
// Why bound at run time (dlopen), not linked: every process that runs these kernels already has
// cuBLASLt loaded — jax's CUDA plugin and torch both ship and load it — so both frontends call the
// very same library through the very same code here, and the build needs no cuBLAS headers or
// libraries (CI builds with a bare nvcc). The library already in the process is preferred;
// otherwise the usual soname search; RLK_CUBLASLT_PATH names a file explicitly.
//
// Determinism: cuBLASLt gives the same bits on every run for the same shapes, GPU and library
// version for a fixed algorithm and workspace; each call gets kWorkspaceBytes of the caller's
// scratch. The tuned pick cannot change the bits: it admits only candidates whose output equals
// the first pick's. Batch invariance (batch_rows): one first pick for every row count, tuned ones
// admitted with its bits, and no split K: each output element sums its k terms in one order.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "lp_geometry.h"  // kWorkspaceBytes, kWorkspaceAlloc
#include "rlk/linear_logp.h"

namespace rlk::cuda::blas {

// A row-major matrix view: `rows` x `cols`, row stride `ld` elements.
struct Mat {
  const void* ptr;
  DType dtype;
  int64_t rows, cols, ld;
};

// C[m, n] = A' B' + beta C, with A' = A or A^T (`ta`), B' = B or B^T (`tb`), row-major, fp32
// accumulation, C in `c_dtype` (row stride ldc); `workspace`: kWorkspaceAlloc bytes of the
// caller's scratch. `batch_rows`: C's rows are the batch's tokens (A untransposed), and a row's
// bits must not depend on how many there are (blas.cc, kPinnedRows).
// Asynchronous on `stream`; the handle of the current device is created on first use (before any
// graph capture; see prepare()).
Status gemm(cudaStream_t stream, void* workspace, const Mat& A, bool ta, const Mat& B, bool tb, void* C, DType c_dtype,
            int64_t ldc, float beta, bool batch_rows);

// Load cuBLASLt and create device `device`'s handle now (outside any CUDA-graph capture).
Status prepare(int device);

}  // namespace rlk::cuda::blas
