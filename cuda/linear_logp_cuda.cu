// The CUDA backend of linear_logp: dispatch, the portable (sm_80+) kernels, combine, backward.
//
// Forward (per pass of at most fwd_rows_per_pass rows):
//   1. fwd_split_kernel (portable) or the sm90 kernel (linear_logp_sm90.cu): one CTA per
//      (128-row tile, split); it walks the split's column tiles in order, folds each logit tile into
//      per-row running (m, s, a) and writes per-(row, split) partials to the workspace. Logits
//      never reach global memory.
//   2. finalize_kernel: per (row, chunk), merges the chunk's splits in split order (stats_merge).
//   3. target_logit_kernel: one warp per row, z_t by a fixed-order dot product.
// Backward: the local vocab is cut into pieces of P columns (P depends on v and h only) and rows
// into passes of at most kBwdRows. Per (piece, pass): recompute logits, write dlogit (dtype) for
// the piece, per-(row, 128-column tile) dzz partials and per-(128-row tile, column) db partials;
// dH += dlogit W[piece] (fp32, in piece order); dW[piece] accumulates over row passes in fp32 and
// is written in dtype. The portable path runs these GEMMs on the WMMA/FFMA tile engine
// (lp_gemm_portable.cuh); on sm_90 with bf16/fp16 and h % 64 == 0, backward_sm90 runs them on the
// wgmma kernel, all operands K-major (W and H pieces are transposed into the workspace and the
// dlogit epilogue writes dlogit in both layouts).
// No atomics anywhere; every sum has one fixed order that depends on shapes only, so a row's
// stats, logp and dH do not depend on the other rows of the call.
#include "linear_logp_cuda.h"

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <atomic>
#include <cstdlib>
#include <cstring>
#include <mutex>

#include "lp_gemm_portable.cuh"
#include "lp_internal.h"

namespace rlk::cuda {
namespace detail {
namespace {

#define RLK_CHECK_LAUNCH(msg)                              \
  do {                                                     \
    if (cudaGetLastError() != cudaSuccess) return msg;     \
  } while (0)

// ---- device capability cache ------------------------------------------------------------------
constexpr int kMaxDevices = 64;
int g_cc[kMaxDevices];  // 0 = unknown, else major*10+minor
std::once_flag g_cc_once[kMaxDevices];

[[maybe_unused]] int device_cc() {
  int dev = 0;
  if (cudaGetDevice(&dev) != cudaSuccess || dev < 0 || dev >= kMaxDevices) return 0;
  std::call_once(g_cc_once[dev], [dev] {
    int ma = 0, mi = 0;
    cudaDeviceGetAttribute(&ma, cudaDevAttrComputeCapabilityMajor, dev);
    cudaDeviceGetAttribute(&mi, cudaDevAttrComputeCapabilityMinor, dev);
    g_cc[dev] = ma * 10 + mi;
  });
  return g_cc[dev];
}

std::atomic<int> g_sm90_on{-1};  // -1: not read from the environment yet

// ---- small helpers ----------------------------------------------------------------------------
__device__ __forceinline__ float warp_max(float x) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, o));
  return x;
}
__device__ __forceinline__ float warp_sum(float x) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) x += __shfl_xor_sync(0xffffffffu, x, o);
  return x;
}

template <typename T> const T* cptr(const void* p) { return static_cast<const T*>(p); }

// ---- forward: per-(row, split) partial statistics ---------------------------------------------
// Epilogue thread map (also used by the backward): warp w owns tile rows w*16 .. w*16+15; lane l
// owns columns l*4 .. l*4+3 of each. Every row sees the identical reduction tree.
template <typename T>
__global__ void __launch_bounds__(kThreads) fwd_split_kernel(
    const T* __restrict__ hidden, const T* __restrict__ weight, const float* __restrict__ bias,
    const float* __restrict__ inv_temp, float* __restrict__ part, int64_t rows, int64_t h,
    int64_t chunk, int64_t spc, int64_t nsplit, int64_t vocab_start, int64_t real_vocab) {
  extern __shared__ __align__(128) unsigned char smem[];
  float* Cs = reinterpret_cast<float*>(smem);
  const int64_t r0 = int64_t(blockIdx.x) * kBM;
  const int64_t gs = blockIdx.y;
  const int64_t c = gs / spc, sp = gs % spc;
  const int64_t col0 = c * chunk + sp * kSplitCols;
  const int64_t col_end = min(col0 + kSplitCols, (c + 1) * chunk);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;

  float rm[16], rs[16], ra[16];
  float itemp[16];
#pragma unroll
  for (int rr = 0; rr < 16; ++rr) {
    rm[rr] = -INFINITY; rs[rr] = 0.f; ra[rr] = 0.f;
    const int64_t row = r0 + warp * 16 + rr;
    itemp[rr] = row < rows ? inv_temp[row] : 1.f;
  }
  for (int64_t t0 = col0; t0 < col_end; t0 += kBN) {
    gemm_tile<T, true, true>(hidden + r0 * h, h, rows - r0, weight + t0 * h, h, col_end - t0, h, smem, Cs);
    float bcol[4];
    bool live[4];
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int64_t col = t0 + lane * 4 + e;
      live[e] = col < col_end && vocab_start + col < real_vocab;
      bcol[e] = (bias != nullptr && col < col_end) ? bias[col] : 0.f;
    }
#pragma unroll
    for (int rr = 0; rr < 16; ++rr) {
      const float4 acc = *reinterpret_cast<const float4*>(Cs + (warp * 16 + rr) * kCsLd + lane * 4);
      const float av[4] = {acc.x, acc.y, acc.z, acc.w};
      float z[4];
      float mx = -INFINITY;
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        z[e] = live[e] ? (av[e] + bcol[e]) * itemp[rr] : -INFINITY;
        mx = fmaxf(mx, z[e]);
      }
      mx = warp_max(mx);
      float s = 0.f, a = 0.f;
      if (mx > -INFINITY) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          if (z[e] > -INFINITY) {
            const float d = z[e] - mx, ex = expf(d);
            s += ex;
            a += ex * d;
          }
        }
      }
      s = warp_sum(s);
      a = warp_sum(a);
      stats_merge(mx, s, a, rm[rr], rs[rr], ra[rr]);
    }
    __syncthreads();  // Cs is reused by the next tile's pipeline
  }
  if (lane == 0) {
#pragma unroll
    for (int rr = 0; rr < 16; ++rr) {
      const int64_t row = r0 + warp * 16 + rr;
      if (row < rows) {
        float* o = part + (row * nsplit + gs) * kStatWidth;
        o[0] = rm[rr]; o[1] = rs[rr]; o[2] = ra[rr];
      }
    }
  }
}

// Per (row, chunk): merge the chunk's splits in order.
__global__ void finalize_kernel(const float* __restrict__ part, float* __restrict__ stats, int64_t rows,
                                int64_t nchunks, int64_t spc) {
  const int64_t idx = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (idx >= rows * nchunks) return;
  const int64_t row = idx / nchunks, c = idx % nchunks;
  const float* p = part + (row * nchunks * spc + c * spc) * kStatWidth;
  float m = -INFINITY, s = 0.f, a = 0.f;
  for (int64_t k = 0; k < spc; ++k) stats_merge(p[k * 3], p[k * 3 + 1], p[k * 3 + 2], m, s, a);
  float* o = stats + idx * kStatWidth;
  o[0] = m; o[1] = s; o[2] = a;
}

// z_t per row by one warp: fixed-order dot product (lane-strided, then a butterfly).
template <typename T>
__global__ void target_logit_kernel(const T* __restrict__ hidden, const T* __restrict__ weight,
                                    const float* __restrict__ bias, const int32_t* __restrict__ targets,
                                    const float* __restrict__ inv_temp, float* __restrict__ out, int64_t n,
                                    int64_t h, int64_t v, int64_t vocab_start, int64_t real_vocab,
                                    int64_t ignore_index) {
  const int64_t row = int64_t(blockIdx.x) * (blockDim.x / 32) + threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  if (row >= n) return;
  const int64_t t = targets[row];
  const int64_t loc = t - vocab_start;
  const bool mine = classify_target(t, real_vocab, ignore_index) == TargetKind::kValid && loc >= 0 && loc < v;
  if (!mine) {
    if (lane == 0) out[row] = 0.f;
    return;
  }
  const T* hr = hidden + row * h;
  const T* wr = weight + loc * h;
  float acc = 0.f;
  for (int64_t k = lane; k < h; k += 32) acc = fmaf(to_f(hr[k]), to_f(wr[k]), acc);
  acc = warp_sum(acc);
  if (lane == 0) out[row] = (acc + (bias ? bias[loc] : 0.f)) * inv_temp[row];
}

__global__ void combine_kernel(CombineArgs a) {
  const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= a.n) return;
  const RowResult r = combine_row(a.stats + i * a.k * kStatWidth, a.k, a.target_logit[i], a.targets[i],
                                  a.real_vocab, a.ignore_index);
  if (a.logp) a.logp[i] = r.logp;
  if (a.lse) a.lse[i] = r.lse;
  if (a.entropy) a.entropy[i] = r.entropy;
}

// ---- backward ---------------------------------------------------------------------------------
constexpr int64_t kBwdRows = 4096;  // rows per backward pass

int64_t bwd_piece_cols(const Problem& p) {
  int64_t P = (int64_t(16) << 20) / (p.h > 0 ? p.h : 1);  // dW fp32 accumulator <= 64 MB
  P = (P / 256) * 256;                                     // whole 256-column sm90 tiles
  if (P > 8192) P = 8192;
  if (P < 256) P = 256;
  const int64_t v256 = ((p.v + 255) / 256) * 256;
  return P < v256 ? P : v256;
}

bool bwd_uses_sm90_shape(const Problem& p) {
#if RLK_HAVE_SM90
  return (p.dtype == DType::kBF16 || p.dtype == DType::kF16) && p.h > 0 && p.h % kSm90HMultiple == 0;
#else
  (void)p;
  return false;
#endif
}

struct BwdLayout {
  int64_t P, R, nt;  // piece columns, rows per pass, 128-column tiles per piece
  size_t off_dlog, off_dzz, off_db, off_dwacc, off_dlogT, off_wt, off_ht, total;
};

// Depends on the Problem's shapes and dtype only (never on the device).
BwdLayout bwd_layout(const Problem& p) {
  BwdLayout L{};
  L.P = bwd_piece_cols(p);
  {  // passes of equal size (a fuller last wave), at most kBwdRows rows each
    const int64_t np = (p.n + kBwdRows - 1) / kBwdRows;
    const int64_t per = np > 0 ? (p.n + np - 1) / np : 1;
    L.R = ((per + kBM - 1) / kBM) * kBM;
  }
  if (L.R < kBM) L.R = kBM;
  L.nt = L.P / kBN;
  auto al = [](size_t x) { return (x + 255) & ~size_t(255); };
  const size_t eb = dtype_bytes(p.dtype);
  size_t o = 0;
  L.off_dlog = o; o += al(size_t(L.R) * L.P * eb);
  L.off_dzz = o;  o += al(size_t(L.R) * L.nt * sizeof(float));
  L.off_db = o;   o += al(size_t(L.R / kBM) * L.P * sizeof(float));
  L.off_dwacc = o;
  if (p.n > L.R) o += al(size_t(L.P) * p.h * sizeof(float));
  L.off_dlogT = L.off_wt = L.off_ht = o;
  if (bwd_uses_sm90_shape(p)) {  // transposed copies for the all-K-major wgmma GEMMs
    L.off_dlogT = o; o += al(size_t(L.P) * L.R * eb);
    L.off_wt = o;    o += al(size_t(p.h) * L.P * eb);
    L.off_ht = o;    o += al(size_t(p.h) * L.R * eb);
  }
  L.total = o;
  return L;
}

// out[c, r] = in[r, c] for 2-byte elements; in [rows, cols] (ld_in), out ld_out.
__global__ void transpose16_kernel(const uint16_t* __restrict__ in, int64_t rows, int64_t cols, int64_t ld_in,
                                   uint16_t* __restrict__ out, int64_t ld_out) {
  __shared__ uint16_t t[32][34];
  const int64_t c0 = int64_t(blockIdx.x) * 32, r0 = int64_t(blockIdx.y) * 32;
  for (int i = threadIdx.y; i < 32; i += 8) {
    const int64_t r = r0 + i, c = c0 + threadIdx.x;
    if (r < rows && c < cols) t[i][threadIdx.x] = in[r * ld_in + c];
  }
  __syncthreads();
  for (int i = threadIdx.y; i < 32; i += 8) {
    const int64_t c = c0 + i, r = r0 + threadIdx.x;
    if (r < rows && c < cols) out[c * ld_out + r] = t[threadIdx.x][i];
  }
}

[[maybe_unused]] Status transpose16(const void* in, int64_t rows, int64_t cols, int64_t ld_in, void* out, int64_t ld_out,
                   cudaStream_t st) {
  const dim3 grid(unsigned((cols + 31) / 32), unsigned((rows + 31) / 32));
  transpose16_kernel<<<grid, dim3(32, 8), 0, st>>>(static_cast<const uint16_t*>(in), rows, cols, ld_in,
                                                   static_cast<uint16_t*>(out), ld_out);
  RLK_CHECK_LAUNCH("rlk cuda: transpose kernel launch failed");
  return nullptr;
}

// Recompute the logits of one (128-row, 128-column) tile of the piece, write dlogit (dtype),
// dzz partials [row, tile] and db partials [row tile, column].
template <typename T>
__global__ void __launch_bounds__(kThreads) dlogit_kernel(
    const T* __restrict__ hidden, const T* __restrict__ weight, const float* __restrict__ bias,
    const int32_t* __restrict__ targets, const float* __restrict__ inv_temp, const float* __restrict__ lse,
    const float* __restrict__ ent, const float* __restrict__ g, const float* __restrict__ e,
    T* __restrict__ dlog, float* __restrict__ dzz_part, float* __restrict__ db_part, int64_t rn, int64_t h,
    int64_t p0, int64_t pw, int64_t P, int64_t nt, int64_t vocab_start, int64_t real_vocab,
    int64_t ignore_index) {
  extern __shared__ __align__(128) unsigned char smem[];
  float* Cs = reinterpret_cast<float*>(smem);
  __shared__ float db_s[kThreads / 32][kBN];
  const int64_t r0 = int64_t(blockIdx.y) * kBM;  // row within the pass
  const int64_t tl = blockIdx.x;                 // column tile within the piece
  const int64_t c0 = p0 + tl * kBN;              // local vocab column of the tile
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  gemm_tile<T, true, true>(hidden + r0 * h, h, rn - r0, weight + c0 * h, h, pw - tl * kBN, h, smem, Cs);

  float bcol[4];
  bool live[4];
#pragma unroll
  for (int q = 0; q < 4; ++q) {
    const int64_t col = tl * kBN + lane * 4 + q;  // within the piece
    live[q] = col < pw && vocab_start + p0 + col < real_vocab;
    bcol[q] = (bias != nullptr && col < pw) ? bias[p0 + col] : 0.f;
  }
  float dbacc[4] = {0.f, 0.f, 0.f, 0.f};
  for (int rr = 0; rr < 16; ++rr) {
    const int64_t row = r0 + warp * 16 + rr;
    const bool row_in = row < rn;
    float it = 1.f, l = 0.f, en = 0.f, gg = 0.f, ee = 0.f;
    int64_t tloc = -1;
    bool valid = false;
    if (row_in) {
      const int64_t t = targets[row];
      valid = classify_target(t, real_vocab, ignore_index) == TargetKind::kValid;
      if (valid) {
        it = inv_temp[row]; l = lse[row]; gg = g[row];
        if (e != nullptr) { ee = e[row]; en = ent[row]; }
        tloc = t - vocab_start - p0 - tl * kBN;  // target's column within this tile, if here
      }
    }
    const float4 acc = *reinterpret_cast<const float4*>(Cs + (warp * 16 + rr) * kCsLd + lane * 4);
    const float av[4] = {acc.x, acc.y, acc.z, acc.w};
    float dl[4];
    float zz = 0.f;
#pragma unroll
    for (int q = 0; q < 4; ++q) {
      dl[q] = 0.f;
      const float z = (av[q] + bcol[q]) * it;
      if (valid && live[q] && z > -INFINITY) {  // a -inf logit (bias mask) is padding
        const float dz = dz_of(z, tloc == lane * 4 + q, l, en, gg, ee);
        zz = fmaf(dz, z, zz);
        dl[q] = dz * it;
      }
      dbacc[q] += dl[q];
    }
    zz = warp_sum(zz);
    if (row_in) {
      T* o = dlog + row * P + tl * kBN + lane * 4;
#pragma unroll
      for (int q = 0; q < 4; ++q) o[q] = from_f<T>(dl[q]);
      if (lane == 0) dzz_part[row * nt + tl] = zz;
    }
  }
  if (db_part != nullptr) {
#pragma unroll
    for (int q = 0; q < 4; ++q) db_s[warp][lane * 4 + q] = dbacc[q];
    __syncthreads();
    if (threadIdx.x < kBN) {
      float s = 0.f;
#pragma unroll
      for (int w = 0; w < kThreads / 32; ++w) s += db_s[w][threadIdx.x];
      db_part[blockIdx.y * P + tl * kBN + threadIdx.x] = s;
    }
  }
}

// dzz[row] += partials of the piece's column tiles, one chain in column order.
__global__ void dzz_reduce_kernel(const float* __restrict__ part, float* __restrict__ dzz, int64_t rn,
                                  int64_t nt, int64_t ntiles) {
  const int64_t r = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (r >= rn) return;
  float acc = dzz[r];
  for (int64_t t = 0; t < ntiles; ++t) acc += part[r * nt + t];
  dzz[r] = acc;
}

// dbias[col] += partials of the pass's row tiles, one chain in row order.
__global__ void db_reduce_kernel(const float* __restrict__ part, float* __restrict__ db, int64_t pw,
                                 int64_t P, int64_t nrt) {
  const int64_t c = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (c >= pw) return;
  float acc = db[c];
  for (int64_t t = 0; t < nrt; ++t) acc += part[t * P + c];
  db[c] = acc;
}

// out = (init ? init : 0) + A.B over one 128x128 tile; out fp32 or dtype.
//   mode 0: outf = Cs;  1: outf += Cs;  2: outT = T(Cs);  3: outT = T(accf + Cs)
template <typename T, bool AK, bool BKM>
__global__ void __launch_bounds__(kThreads) gemm_out_kernel(const T* __restrict__ A, int64_t lda,
                                                            const T* __restrict__ B, int64_t ldb, int64_t M,
                                                            int64_t N, int64_t K, float* __restrict__ outf,
                                                            T* __restrict__ outT, int64_t ldo, int mode) {
  extern __shared__ __align__(128) unsigned char smem[];
  float* Cs = reinterpret_cast<float*>(smem);
  const int64_t m0 = int64_t(blockIdx.y) * kBM, n0 = int64_t(blockIdx.x) * kBN;
  const T* Ab = AK ? A + m0 * lda : A + m0;
  const T* Bb = BKM ? B + n0 * ldb : B + n0;
  gemm_tile<T, AK, BKM>(Ab, lda, M - m0, Bb, ldb, N - n0, K, smem, Cs);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  for (int rr = 0; rr < kBM / 8; ++rr) {
    const int r = warp + 8 * rr;
    const int64_t m = m0 + r;
    if (m >= M) break;
#pragma unroll
    for (int q = 0; q < 4; ++q) {
      const int cc = lane + 32 * q;
      const int64_t n = n0 + cc;
      if (n >= N) continue;
      const float x = Cs[r * kCsLd + cc];
      const int64_t o = m * ldo + n;
      switch (mode) {
        case 0: outf[o] = x; break;
        case 1: outf[o] = outf[o] + x; break;
        case 2: outT[o] = from_f<T>(x); break;
        default: outT[o] = from_f<T>(outf[o] + x); break;
      }
    }
  }
}

template <typename K> cudaError_t set_smem(K kernel, size_t bytes) {
  return cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(bytes));
}

template <typename T>
Status forward_portable_partials(const Problem& p, const T* hidden, int64_t rows, const T* weight,
                                 const float* bias, const float* inv_temp, float* part, cudaStream_t st) {
  constexpr size_t smem = GemmSmem<T, true, true>::BYTES;
  // Set on every call (cheap, host-only, legal under stream capture): the attribute is per device.
  if (set_smem(fwd_split_kernel<T>, smem) != cudaSuccess) return "rlk cuda: cudaFuncSetAttribute failed (forward)";
  const dim3 grid(unsigned((rows + kBM - 1) / kBM), unsigned(total_splits(p)));
  fwd_split_kernel<T><<<grid, kThreads, smem, st>>>(hidden, weight, bias, inv_temp, part, rows, p.h, p.chunk,
                                                    splits_per_chunk(p.chunk), total_splits(p), p.vocab_start,
                                                    p.real_vocab);
  RLK_CHECK_LAUNCH("rlk cuda: forward kernel launch failed");
  return nullptr;
}

template <typename T>
Status forward_t(const Problem& p, const FwdArgs& a, Workspace ws, cudaStream_t st, Backend* ran) {
  Backend be = forward_backend(p);
  if (ran) *ran = be;
  const T* H = cptr<T>(a.hidden);
  const T* W = cptr<T>(a.weight);
  const float* B = p.has_bias ? a.bias : nullptr;
  const int64_t R = fwd_rows_per_pass(p);
  const int64_t K = num_chunks(p);
  float* part = static_cast<float*>(ws.ptr);
  for (int64_t r0 = 0; r0 < p.n; r0 += R) {
    const int64_t rows = p.n - r0 < R ? p.n - r0 : R;
    Status s = nullptr;
#if RLK_HAVE_SM90
    if (be == Backend::kCudaSm90) {
      s = sm90_forward_partials(p, H + r0 * p.h, rows, a.weight, B, a.inv_temp + r0, part, st);
      if (s == kSm90Misaligned) {  // TMA needs 16-byte aligned bases: the portable kernel takes it
        be = Backend::kCudaPortable;
        if (ran) *ran = be;
        s = forward_portable_partials<T>(p, H + r0 * p.h, rows, W, B, a.inv_temp + r0, part, st);
      }
    } else
#endif
    {
      s = forward_portable_partials<T>(p, H + r0 * p.h, rows, W, B, a.inv_temp + r0, part, st);
    }
    if (s) return s;
    const int64_t tot = rows * K;
    finalize_kernel<<<unsigned((tot + 255) / 256), 256, 0, st>>>(part, a.stats + r0 * K * kStatWidth, rows, K,
                                                                 splits_per_chunk(p.chunk));
    RLK_CHECK_LAUNCH("rlk cuda: finalize kernel launch failed");
  }
  target_logit_kernel<T><<<unsigned((p.n + 7) / 8), 256, 0, st>>>(H, W, B, a.targets, a.inv_temp, a.target_logit,
                                                                   p.n, p.h, p.v, p.vocab_start, p.real_vocab,
                                                                   p.ignore_index);
  RLK_CHECK_LAUNCH("rlk cuda: target logit kernel launch failed");
  return nullptr;
}

#if RLK_HAVE_SM90
Status backward_sm90(const Problem& p, const BwdArgs& a, Workspace ws, cudaStream_t st);
#endif

template <typename T>
Status backward_t(const Problem& p, const BwdArgs& a, Workspace ws, cudaStream_t st, Backend* ran) {
  const BwdLayout L = bwd_layout(p);
  unsigned char* base = static_cast<unsigned char*>(ws.ptr);
  T* dlog = reinterpret_cast<T*>(base + L.off_dlog);
  float* dzz_part = reinterpret_cast<float*>(base + L.off_dzz);
  float* db_part = p.has_bias ? reinterpret_cast<float*>(base + L.off_db) : nullptr;
  float* dwacc = reinterpret_cast<float*>(base + L.off_dwacc);
  const T* H = cptr<T>(a.hidden);
  const T* W = cptr<T>(a.weight);
  const float* B = p.has_bias ? a.bias : nullptr;
  T* dW = static_cast<T*>(a.dweight);
  const float* ent = p.with_entropy ? a.entropy : nullptr;
  const float* e = p.with_entropy ? a.e : nullptr;

  if (set_smem(dlogit_kernel<T>, GemmSmem<T, true, true>::BYTES) != cudaSuccess ||
      set_smem(gemm_out_kernel<T, true, false>, GemmSmem<T, true, false>::BYTES) != cudaSuccess ||
      set_smem(gemm_out_kernel<T, false, false>, GemmSmem<T, false, false>::BYTES) != cudaSuccess) return "rlk cuda: cudaFuncSetAttribute failed (backward)";

  if (cudaMemsetAsync(a.dhidden, 0, size_t(p.n) * p.h * sizeof(float), st) != cudaSuccess ||
      (a.dzz && cudaMemsetAsync(a.dzz, 0, size_t(p.n) * sizeof(float), st) != cudaSuccess) ||
      (p.has_bias && a.dbias && cudaMemsetAsync(a.dbias, 0, size_t(p.v) * sizeof(float), st) != cudaSuccess))
    return "rlk cuda: memset failed (backward)";
  if (p.n == 0) {
    if (cudaMemsetAsync(a.dweight, 0, size_t(p.v) * p.h * dtype_bytes(p.dtype), st) != cudaSuccess)
      return "rlk cuda: memset failed (backward)";
    return nullptr;
  }
#if RLK_HAVE_SM90
  if (bwd_uses_sm90_shape(p) && sm90_enabled() && device_cc() == 90 &&
      ((reinterpret_cast<uintptr_t>(a.hidden) | reinterpret_cast<uintptr_t>(a.weight)) & 15) == 0) {
    if (ran) *ran = Backend::kCudaSm90;
    return backward_sm90(p, a, ws, st);
  }
#endif
  const int npass = int((p.n + L.R - 1) / L.R);
  for (int64_t p0 = 0; p0 < p.v; p0 += L.P) {
    const int64_t pw = p.v - p0 < L.P ? p.v - p0 : L.P;
    const int64_t ntiles = (pw + kBN - 1) / kBN;
    for (int pass = 0; pass < npass; ++pass) {
      const int64_t r0 = int64_t(pass) * L.R;
      const int64_t rn = p.n - r0 < L.R ? p.n - r0 : L.R;
      const unsigned nrt = unsigned((rn + kBM - 1) / kBM);
      dlogit_kernel<T><<<dim3(unsigned(ntiles), nrt), kThreads, GemmSmem<T, true, true>::BYTES, st>>>(
          H + r0 * p.h, W, B, a.targets + r0, a.inv_temp + r0, a.lse + r0, ent ? ent + r0 : nullptr, a.g + r0,
          e ? e + r0 : nullptr, dlog, dzz_part, db_part, rn, p.h, p0, pw, L.P, L.nt, p.vocab_start, p.real_vocab,
          p.ignore_index);
      RLK_CHECK_LAUNCH("rlk cuda: dlogit kernel launch failed");
      if (a.dzz) {
        dzz_reduce_kernel<<<unsigned((rn + 255) / 256), 256, 0, st>>>(dzz_part, a.dzz + r0, rn, L.nt, ntiles);
        RLK_CHECK_LAUNCH("rlk cuda: dzz kernel launch failed");
      }
      if (p.has_bias && a.dbias) {
        db_reduce_kernel<<<unsigned((pw + 255) / 256), 256, 0, st>>>(db_part, a.dbias + p0, pw, L.P, nrt);
        RLK_CHECK_LAUNCH("rlk cuda: db kernel launch failed");
      }
      // dH[r0:r0+rn] += dlogit[rn, pw] . W[p0:p0+pw]
      gemm_out_kernel<T, true, false><<<dim3(unsigned((p.h + kBN - 1) / kBN), nrt), kThreads,
                                         GemmSmem<T, true, false>::BYTES, st>>>(
          dlog, L.P, W + p0 * p.h, p.h, rn, p.h, pw, a.dhidden + r0 * p.h, nullptr, p.h, 1);
      RLK_CHECK_LAUNCH("rlk cuda: dH kernel launch failed");
      // dW[p0:p0+pw] (+)= dlogit^T . H[r0:r0+rn]
      const int mode = npass == 1 ? 2 : (pass == 0 ? 0 : (pass == npass - 1 ? 3 : 1));
      gemm_out_kernel<T, false, false><<<dim3(unsigned((p.h + kBN - 1) / kBN), unsigned(ntiles)), kThreads,
                                          GemmSmem<T, false, false>::BYTES, st>>>(
          dlog, L.P, H + r0 * p.h, p.h, pw, p.h, rn, dwacc, dW + p0 * p.h, p.h, mode);
      RLK_CHECK_LAUNCH("rlk cuda: dW kernel launch failed");
    }
  }
  return nullptr;
}

#if RLK_HAVE_SM90
// The Hopper backward: the same pieces and passes as backward_t, each of the three GEMMs on the
// wgmma kernel with both operands K-major (W and H pieces are transposed into the workspace, and
// the dlogit epilogue writes dlogit in both layouts).
Status backward_sm90(const Problem& p, const BwdArgs& a, Workspace ws, cudaStream_t st) {
  const BwdLayout L = bwd_layout(p);
  unsigned char* base = static_cast<unsigned char*>(ws.ptr);
  void* dlog = base + L.off_dlog;
  void* dlogT = base + L.off_dlogT;
  void* wt = base + L.off_wt;
  void* ht = base + L.off_ht;
  float* dzz_part = reinterpret_cast<float*>(base + L.off_dzz);
  float* db_part = p.has_bias ? reinterpret_cast<float*>(base + L.off_db) : nullptr;
  float* dwacc = reinterpret_cast<float*>(base + L.off_dwacc);
  const size_t eb = dtype_bytes(p.dtype);
  const unsigned char* H = static_cast<const unsigned char*>(a.hidden);
  const unsigned char* W = static_cast<const unsigned char*>(a.weight);
  const float* B = p.has_bias ? a.bias : nullptr;
  unsigned char* dW = static_cast<unsigned char*>(a.dweight);
  const float* ent = p.with_entropy ? a.entropy : nullptr;
  const float* e = p.with_entropy ? a.e : nullptr;
  const int npass = int((p.n + L.R - 1) / L.R);
  if (npass == 1)
    if (Status s = transpose16(H, p.n, p.h, p.h, ht, L.R, st)) return s;
  for (int64_t p0 = 0; p0 < p.v; p0 += L.P) {
    const int64_t pw = p.v - p0 < L.P ? p.v - p0 : L.P;
    const int64_t ntiles = (pw + kBN - 1) / kBN;
    if (Status s = transpose16(W + p0 * p.h * eb, pw, p.h, p.h, wt, L.P, st)) return s;
    for (int pass = 0; pass < npass; ++pass) {
      const int64_t r0 = int64_t(pass) * L.R;
      const int64_t rn = p.n - r0 < L.R ? p.n - r0 : L.R;
      const unsigned nrt = unsigned((rn + kBM - 1) / kBM);
      if (npass > 1)
        if (Status s = transpose16(H + r0 * p.h * eb, rn, p.h, p.h, ht, L.R, st)) return s;
      Sm90DlogitArgs d{};
      d.hidden = H + r0 * p.h * eb; d.weight = W + p0 * p.h * eb; d.bias = B ? B + p0 : nullptr;
      d.targets = a.targets + r0; d.inv_temp = a.inv_temp + r0; d.lse = a.lse + r0;
      d.ent = ent ? ent + r0 : nullptr; d.g = a.g + r0; d.e = e ? e + r0 : nullptr;
      d.rn = rn; d.pw = pw; d.p0 = p0; d.P = L.P; d.R = L.R;
      d.dlog = dlog; d.dlogT = dlogT; d.dzz_part = dzz_part; d.db_part = db_part;
      if (Status s = sm90_dlogit(p, d, st)) return s;
      if (a.dzz) {
        dzz_reduce_kernel<<<unsigned((rn + 255) / 256), 256, 0, st>>>(dzz_part, a.dzz + r0, rn, L.nt, ntiles);
        RLK_CHECK_LAUNCH("rlk cuda: dzz kernel launch failed");
      }
      if (p.has_bias && a.dbias) {
        db_reduce_kernel<<<unsigned((pw + 255) / 256), 256, 0, st>>>(db_part, a.dbias + p0, pw, L.P, nrt);
        RLK_CHECK_LAUNCH("rlk cuda: db kernel launch failed");
      }
      // dH[r0:r0+rn] += dlogit[rn, pw] . W[p0:p0+pw]   (B = W^T piece, K-major)
      if (Status s = sm90_gemm_out(p, dlog, L.P, wt, L.P, rn, p.h, pw, a.dhidden + r0 * p.h, nullptr, p.h, 1, st))
        return s;
      // dW[p0:p0+pw] (+)= dlogit^T . H[r0:r0+rn]       (A = dlogit^T, B = H^T pass, K-major)
      const int mode = npass == 1 ? 2 : (pass == 0 ? 0 : (pass == npass - 1 ? 3 : 1));
      if (Status s = sm90_gemm_out(p, dlogT, L.R, ht, L.R, pw, p.h, rn, dwacc, dW + p0 * p.h * eb, p.h, mode, st))
        return s;
    }
  }
  return nullptr;
}
#endif

}  // namespace
}  // namespace detail

// ---- the API ----------------------------------------------------------------------------------
using namespace detail;

void detail::set_sm90_enabled(bool on) { g_sm90_on.store(on ? 1 : 0); }
bool detail::sm90_enabled() {
  int v = g_sm90_on.load();
  if (v < 0) {
    const char* e = std::getenv("RLK_CUDA_DISABLE_SM90");
    v = (e != nullptr && std::strcmp(e, "0") != 0) ? 0 : 1;
    int expect = -1;
    g_sm90_on.compare_exchange_strong(expect, v);
    v = g_sm90_on.load();
  }
  return v == 1;
}

Backend forward_backend(const Problem& p) {
#if RLK_HAVE_SM90
  if (sm90_enabled() && device_cc() == 90 && (p.dtype == DType::kBF16 || p.dtype == DType::kF16) && p.h > 0 &&
      p.h % kSm90HMultiple == 0)
    return Backend::kCudaSm90;
#else
  (void)p;
#endif
  return Backend::kCudaPortable;
}

size_t forward_workspace_bytes(const Problem& p) {
  if (p.n <= 0 || p.v <= 0 || p.chunk <= 0) return 0;
  return size_t(fwd_rows_per_pass(p)) * size_t(total_splits(p)) * kStatWidth * sizeof(float);
}

size_t backward_workspace_bytes(const Problem& p) {
  if (p.n <= 0 || p.v <= 0) return 0;
  return bwd_layout(p).total;
}

static Status validate(const Problem& p) {
  if (p.n < 0 || p.h <= 0 || p.v <= 0 || p.chunk <= 0 || p.v % p.chunk != 0) return "rlk cuda: bad problem shape";
  return nullptr;
}

Status forward(const Problem& p, const FwdArgs& a, Workspace ws, cudaStream_t stream, Backend* ran) {
  if (Status s = validate(p)) return s;
  if (ran) *ran = forward_backend(p);
  if (p.n == 0) return nullptr;
  if (ws.bytes < forward_workspace_bytes(p) || (forward_workspace_bytes(p) && !ws.ptr))
    return "rlk cuda: forward workspace too small";
  switch (p.dtype) {
    case DType::kF32: return forward_t<float>(p, a, ws, stream, ran);
    case DType::kF16: return forward_t<__half>(p, a, ws, stream, ran);
    case DType::kBF16: return forward_t<__nv_bfloat16>(p, a, ws, stream, ran);
  }
  return "rlk cuda: bad dtype";
}

Status combine(const CombineArgs& a, cudaStream_t stream) {
  if (a.n <= 0) return nullptr;
  combine_kernel<<<unsigned((a.n + 255) / 256), 256, 0, stream>>>(a);
  RLK_CHECK_LAUNCH("rlk cuda: combine kernel launch failed");
  return nullptr;
}

Status backward(const Problem& p, const BwdArgs& a, Workspace ws, cudaStream_t stream, Backend* ran) {
  if (Status s = validate(p)) return s;
  if (ran) *ran = Backend::kCudaPortable;
  if (ws.bytes < backward_workspace_bytes(p) || (backward_workspace_bytes(p) && !ws.ptr))
    return "rlk cuda: backward workspace too small";
  switch (p.dtype) {
    case DType::kF32: return backward_t<float>(p, a, ws, stream, ran);
    case DType::kF16: return backward_t<__half>(p, a, ws, stream, ran);
    case DType::kBF16: return backward_t<__nv_bfloat16>(p, a, ws, stream, ran);
  }
  return "rlk cuda: bad dtype";
}

}  // namespace rlk::cuda
