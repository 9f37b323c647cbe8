// The portable (sm_80+) GEMM tile engine of the CUDA backend.
//
// One CTA of 256 threads computes one 128x128 fp32 tile C = A . B over a K range and leaves it in
// shared memory (Cs, row stride kCsLd), where the caller's epilogue reads it. Operands are staged
// through a 3-stage cp.async pipeline. bf16/fp16 multiply on the tensor cores through WMMA
// (16x16x16, fp32 accumulators); fp32 multiplies with plain FFMA (never tf32: the contract is fp32),
// its sum over K blocked as a BLAS's: chains of kChainK steps, each from zero, added in order to
// the element's total (one chain over K grew its error with K: sqrt(K) roundings at the row's scale).
//
// Layout: both operands K-major, A(m,k) = A[m*lda+k] and B(k,n) = B[n*ldb+k]: the logits H W^T
// (the backward's GEMMs are cuBLAS's, cuda/blas.h). Out-of-range elements load as zeros. Every
// output element is a sum over k in the same fixed order whatever its row or column position in
// the tile, which keeps results independent of the batch around a row.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <mma.h>

#include <cstdint>

namespace rlk::cuda::detail {

template <typename T> struct Storage {
  using type = uint16_t;
};
template <> struct Storage<float> {
  using type = float;
};

__device__ __forceinline__ float to_f(float x) { return x; }
__device__ __forceinline__ float to_f(__half x) { return __half2float(x); }
__device__ __forceinline__ float to_f(__nv_bfloat16 x) { return __bfloat162float(x); }
template <typename T> __device__ __forceinline__ T from_f(float x);
template <> __device__ __forceinline__ float from_f<float>(float x) { return x; }
template <> __device__ __forceinline__ __half from_f<__half>(float x) { return __float2half_rn(x); }
template <> __device__ __forceinline__ __nv_bfloat16 from_f<__nv_bfloat16>(float x) { return __float2bfloat16_rn(x); }

constexpr int kBM = 128, kBN = 128, kThreads = 256, kStages = 3;
constexpr int kCsLd = kBN + 4;  // fp32 row stride of the C tile in shared memory
constexpr size_t kCsBytes = size_t(kBM) * kCsLd * sizeof(float);
constexpr int kChainK = 128;  // fp32: steps per accumulator chain (a multiple of TileCfg<float>::BK)

template <typename T> struct TileCfg {
  static constexpr int BK = 64 / int(sizeof(T));   // 32 halves or 16 floats: 64-byte rows
  static constexpr int VEC = 16 / int(sizeof(T));  // elements per 16-byte vector
  static constexpr int PAD = VEC;                  // one vector of padding per smem row
  static constexpr int LD = BK + PAD;              // smem row stride (elements) of both operands
};

template <typename T> struct GemmSmem {
  using C = TileCfg<T>;
  static constexpr int A_ELEMS = kBM * C::LD;
  static constexpr int B_ELEMS = kBN * C::LD;
  static constexpr size_t STAGE_BYTES = size_t(A_ELEMS + B_ELEMS) * sizeof(T);
  static constexpr size_t PIPE_BYTES = STAGE_BYTES * kStages;
  static constexpr size_t BYTES = PIPE_BYTES > kCsBytes ? PIPE_BYTES : kCsBytes;
};

__device__ __forceinline__ void cp_async16(void* smem, const void* gmem, bool pred) {
  const unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  const int sz = pred ? 16 : 0;
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(s), "l"(gmem), "r"(sz));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N> __device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N)); }

// Load one [OUTER x INNER] tile (INNER contiguous in global and in shared memory) whose origin is
// `g` (global, already offset), with `outer_lim`/`inner_lim` valid extents, into smem `s` (row
// stride INNER + PAD). vec_ok: the 16-byte path is legal (ld and base aligned).
template <typename T, int OUTER, int INNER>
__device__ __forceinline__ void load_tile(T* s, const T* g, int64_t ld, int64_t outer_lim, int64_t inner_lim,
                                          bool vec_ok) {
  using Cfg = TileCfg<T>;
  using S = typename Storage<T>::type;
  constexpr int VPR = INNER / Cfg::VEC;  // vectors per row
  constexpr int NV = OUTER * VPR;
  static_assert(NV % kThreads == 0, "tile must split evenly");
#pragma unroll
  for (int it = 0; it < NV / kThreads; ++it) {
    const int idx = threadIdx.x + it * kThreads;
    const int o = idx / VPR, c = (idx % VPR) * Cfg::VEC;
    T* dst = s + o * (INNER + Cfg::PAD) + c;
    const T* src = g + int64_t(o) * ld + c;
    const bool row_ok = o < outer_lim;
    if (vec_ok && (!row_ok || c + Cfg::VEC <= inner_lim || c >= inner_lim)) {
      const bool ok = row_ok && c + Cfg::VEC <= inner_lim;
      cp_async16(dst, ok ? (const void*)src : (const void*)g, ok);
    } else {
      S* d = reinterpret_cast<S*>(dst);
      const S* sp = reinterpret_cast<const S*>(src);
#pragma unroll
      for (int e = 0; e < Cfg::VEC; ++e) d[e] = (row_ok && c + e < inner_lim) ? sp[e] : S(0);
    }
  }
}

// C tile (128x128 fp32, into Cs) = sum over k in [0, K) of A(m,k) B(k,n).
//   A: origin at (m0, 0); m_lim valid rows. B: origin at (0, n0); n_lim valid columns.
template <typename T>
__device__ void gemm_tile(const T* __restrict__ A, int64_t lda, int64_t m_lim, const T* __restrict__ B, int64_t ldb,
                          int64_t n_lim, int64_t K, unsigned char* smem, float* Cs) {
  using Cfg = TileCfg<T>;
  using SM = GemmSmem<T>;
  constexpr int BK = Cfg::BK;
  const int tid = threadIdx.x;
  const bool vec_a = (lda % Cfg::VEC == 0) && ((reinterpret_cast<uintptr_t>(A) & 15) == 0);
  const bool vec_b = (ldb % Cfg::VEC == 0) && ((reinterpret_cast<uintptr_t>(B) & 15) == 0);
  const int64_t KT = (K + BK - 1) / BK;

  auto stageA = [&](int s) { return reinterpret_cast<T*>(smem + s * SM::STAGE_BYTES); };
  auto stageB = [&](int s) { return reinterpret_cast<T*>(smem + s * SM::STAGE_BYTES) + SM::A_ELEMS; };
  auto load = [&](int s, int64_t kt) {
    const int64_t k0 = kt * BK;
    const int64_t klim = K - k0;
    load_tile<T, kBM, BK>(stageA(s), A + k0, lda, m_lim, klim, vec_a);
    load_tile<T, kBN, BK>(stageB(s), B + k0, ldb, n_lim, klim, vec_b);
  };

  constexpr bool kTensor = sizeof(T) == 2;
  constexpr int AL = Cfg::LD, BL = Cfg::LD;

  // Accumulators: WMMA fragments (16-bit) or an 8x8 FFMA micro tile (fp32: the chain facc and the
  // total ftot of the chains before it).
  using namespace nvcuda;
  using FragC = wmma::fragment<wmma::accumulator, 16, 16, 16, float>;
  const int warp = tid / 32;
  const int wm = warp / 4, wn = warp % 4;  // warp tile 64 x 32
  FragC acc[kTensor ? 4 : 1][kTensor ? 2 : 1];
  float facc[kTensor ? 1 : 8][kTensor ? 1 : 8], ftot[kTensor ? 1 : 8][kTensor ? 1 : 8];
  if constexpr (kTensor) {
#pragma unroll
    for (int i = 0; i < 4; ++i)
#pragma unroll
      for (int j = 0; j < 2; ++j) wmma::fill_fragment(acc[i][j], 0.f);
  } else {
#pragma unroll
    for (int i = 0; i < 8; ++i)
#pragma unroll
      for (int j = 0; j < 8; ++j) facc[i][j] = ftot[i][j] = 0.f;
  }

#pragma unroll
  for (int s = 0; s < kStages - 1; ++s) {
    if (s < KT) load(s, s);
    cp_async_commit();
  }
  for (int64_t kt = 0; kt < KT; ++kt) {
    cp_async_wait<kStages - 2>();
    __syncthreads();
    {
      const int64_t nk = kt + kStages - 1;
      if (nk < KT) load(int(nk % kStages), nk);
      cp_async_commit();
    }
    const T* As = stageA(int(kt % kStages));
    const T* Bs = stageB(int(kt % kStages));
    if constexpr (kTensor) {
      using FragA = wmma::fragment<wmma::matrix_a, 16, 16, 16, T, wmma::row_major>;
      using FragB = wmma::fragment<wmma::matrix_b, 16, 16, 16, T, wmma::col_major>;
#pragma unroll
      for (int kk = 0; kk < BK; kk += 16) {
        FragA fa[4];
        FragB fb[2];
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          const int m = wm * 64 + i * 16;
          wmma::load_matrix_sync(fa[i], As + m * AL + kk, AL);
        }
#pragma unroll
        for (int j = 0; j < 2; ++j) {
          const int n = wn * 32 + j * 16;
          wmma::load_matrix_sync(fb[j], Bs + n * BL + kk, BL);
        }
#pragma unroll
        for (int i = 0; i < 4; ++i)
#pragma unroll
          for (int j = 0; j < 2; ++j) wmma::mma_sync(acc[i][j], fa[i], fb[j], acc[i][j]);
      }
    } else {
      const int ty = tid / 16, tx = tid % 16;
#pragma unroll
      for (int k = 0; k < BK; ++k) {
        float a[8], b[8];
#pragma unroll
        for (int i = 0; i < 8; ++i) {
          const int m = ty + 16 * i;
          a[i] = to_f(As[m * AL + k]);
        }
#pragma unroll
        for (int j = 0; j < 8; ++j) {
          const int n = tx + 16 * j;
          b[j] = to_f(Bs[n * BL + k]);
        }
#pragma unroll
        for (int i = 0; i < 8; ++i)
#pragma unroll
          for (int j = 0; j < 8; ++j) facc[i][j] = fmaf(a[i], b[j], facc[i][j]);
      }
      static_assert(kChainK % BK == 0);
      if ((kt + 1) % (kChainK / BK) == 0 || kt + 1 == KT) {  // the chain's end: into the total
#pragma unroll
        for (int i = 0; i < 8; ++i)
#pragma unroll
          for (int j = 0; j < 8; ++j) {
            ftot[i][j] += facc[i][j];
            facc[i][j] = 0.f;
          }
      }
    }
  }
  cp_async_wait<0>();
  __syncthreads();  // all warps are done with the pipeline buffers that Cs aliases
  if constexpr (kTensor) {
#pragma unroll
    for (int i = 0; i < 4; ++i)
#pragma unroll
      for (int j = 0; j < 2; ++j)
        wmma::store_matrix_sync(Cs + (wm * 64 + i * 16) * kCsLd + wn * 32 + j * 16, acc[i][j], kCsLd,
                                wmma::mem_row_major);
  } else {
    const int ty = tid / 16, tx = tid % 16;
#pragma unroll
    for (int i = 0; i < 8; ++i)
#pragma unroll
      for (int j = 0; j < 8; ++j) Cs[(ty + 16 * i) * kCsLd + tx + 16 * j] = ftot[i][j];
  }
  __syncthreads();
}

}  // namespace rlk::cuda::detail
