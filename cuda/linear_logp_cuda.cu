// The CUDA backend of linear_logp: the forward's dispatch, its portable (sm_80+) kernels, combine.
//
// Forward (per pass of at most fwd_rows_per_pass rows):
//   1. fwd_split_kernel (portable) or the sm90 kernel (linear_logp_sm90.cu): one CTA per
//      (128-row tile, split); it walks the split's column tiles in order, folds each logit tile into
//      per-row running (m, s, a) and writes per-(row, split) partials to the workspace. Logits
//      reach global memory only when the fast backward asks for them (FwdArgs::saved_logits).
//   2. finalize_kernel: per (row, chunk), merges the chunk's splits in split order (stats_merge).
//   3. target_logit_kernel: one warp per row, z_t by a fixed-order dot product.
// A nucleus (FwdArgs::keep) runs on the portable kernel, which adds the kept ids' sums (sk, ak)
// beside (s, a) from the same exponentials; the unmasked statistics keep their bits.
// Backward: linear_logp_bwd.cu.
// No atomics anywhere; every sum has one fixed order that depends on shapes only, so a row's
// stats, logp and dH do not depend on the other rows of the call.
#include "linear_logp_cuda.h"

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "lp_gemm_portable.cuh"
#include "lp_internal.h"

namespace rlk::cuda {
namespace detail {
namespace {

#define RLK_CHECK_LAUNCH(msg)                          \
  do {                                                 \
    if (cudaGetLastError() != cudaSuccess) return msg; \
  } while (0)

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

// What the forward keeps for the fast backward (FwdArgs::saved_logits, SavedLayout), rows of one pass:
// z [rows, v] fp32 for fp32 operands; for 16-bit ones q [rows, v] fp16 and the head [rows, floats].
template <typename T> using Saved = std::conditional_t<sizeof(T) == 4, float, __half>;
template <typename T> struct SavedOut {
  Saved<T>* z = nullptr;  // null: nothing saved
  float* head = nullptr;
  SavedLayout layout;
};
// A nucleus, rows of one pass: keep [rows, v] bytes and the splits' kept sums
// kpart [rows, nsplit, kKeepPartWidth] (null: no nucleus).
struct Nucleus {
  const uint8_t* keep = nullptr;
  float* kpart = nullptr;
};

// ---- forward: per-(row, split) partial statistics ---------------------------------------------
// Epilogue thread map (also used by the backward): warp w owns tile rows w*16 .. w*16+15; lane l
// owns columns l*4 .. l*4+3 of each. Every row sees the identical reduction tree.
template <typename T>
__global__ void __launch_bounds__(kThreads)
    fwd_split_kernel(const T* __restrict__ hidden, const T* __restrict__ weight, const float* __restrict__ bias,
                     const float* __restrict__ temperature, float* __restrict__ part, SavedOut<T> saved, Nucleus nuc,
                     int64_t rows, int64_t h, int64_t chunk, int64_t spc, int64_t nsplit, int64_t vocab_start,
                     int64_t real_vocab, int64_t v) {
  constexpr bool kQ = sizeof(T) == 2;  // the saved record holds q, the group maxima and b
  extern __shared__ __align__(128) unsigned char smem[];
  float* Cs = reinterpret_cast<float*>(smem);
  const int64_t r0 = int64_t(blockIdx.x) * kBM;
  const int64_t gs = blockIdx.y;
  const int64_t c = gs / spc, sp = gs % spc;
  const int64_t col0 = c * chunk + sp * kSplitCols;
  const int64_t col_end = min(col0 + kSplitCols, (c + 1) * chunk);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;

  const bool save = saved.z != nullptr;
  float rm[16], rs[16], ra[16], rb[16], rsk[16], rak[16];
  float itemp[16];
#pragma unroll
  for (int rr = 0; rr < 16; ++rr) {
    rm[rr] = -INFINITY;
    rs[rr] = 0.f;
    ra[rr] = 0.f;
    rb[rr] = 0.f;
    rsk[rr] = 0.f;
    rak[rr] = 0.f;
    const int64_t row = r0 + warp * 16 + rr;
    itemp[rr] = row < rows ? reciprocal(temperature[row]) : 1.f;
  }
  for (int64_t t0 = col0; t0 < col_end; t0 += kBN) {
    gemm_tile<T>(hidden + r0 * h, h, rows - r0, weight + t0 * h, h, col_end - t0, h, smem, Cs);
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
      const int64_t row = r0 + warp * 16 + rr;
      mx = warp_max(mx);
      bool in_k[4] = {false, false, false, false};  // the nucleus's columns
      if (nuc.keep && row < rows) {
#pragma unroll
        for (int e = 0; e < 4; ++e) in_k[e] = live[e] && nuc.keep[row * v + t0 + lane * 4 + e] != 0;
      }
      float s = 0.f, a = 0.f, b = 0.f, sk = 0.f, ak = 0.f, ex[4] = {0.f, 0.f, 0.f, 0.f};
      if (!(mx == -INFINITY)) {  // NaN logits (and a NaN max) make the sums NaN
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          if (!(z[e] == -INFINITY)) {
            const float d = z[e] - mx;
            ex[e] = expf(d);
            s += ex[e];
            a = fmaf(ex[e], d, a);  // explicit: b's products must not change a's rounding
            if (kQ && save) b = fmaf(ex[e] * d, d, b);
            if (in_k[e]) {
              sk += ex[e];
              ak = fmaf(ex[e], d, ak);
            }
          }
        }
      }
      if (save && row < rows) {
#pragma unroll
        for (int e = 0; e < 4; ++e)
          if (t0 + lane * 4 + e < col_end) saved.z[row * v + t0 + lane * 4 + e] = from_f<Saved<T>>(kQ ? ex[e] : z[e]);
        if (kQ && lane == 0)
          saved.head[row * saved.layout.floats + saved.layout.group_max_at() + saved.layout.group(c, t0, chunk)] = mx;
      }
      s = warp_sum(s);
      a = warp_sum(a);
      if (kQ && save) b = warp_sum(b);
      if (nuc.keep) nucleus_merge(mx, s, warp_sum(sk), warp_sum(ak), rm[rr], rs[rr], rsk[rr], rak[rr]);
      moments_merge(mx, s, a, b, rm[rr], rs[rr], ra[rr], rb[rr]);
    }
    __syncthreads();  // Cs is reused by the next tile's pipeline
  }
  if (lane == 0) {
#pragma unroll
    for (int rr = 0; rr < 16; ++rr) {
      const int64_t row = r0 + warp * 16 + rr;
      if (row < rows) {
        float* o = part + (row * nsplit + gs) * kPartWidth;
        o[0] = rm[rr];
        o[1] = rs[rr];
        o[2] = ra[rr];
        o[3] = rb[rr];
        if (nuc.keep) {
          float* k = nuc.kpart + (row * nsplit + gs) * kKeepPartWidth;
          k[0] = rsk[rr];
          k[1] = rak[rr];
        }
      }
    }
  }
}

// Per (row, chunk): merge the chunk's splits in order; with a saved head, also its moments there;
// with a nucleus (kpart), its kept sum into keep_sum [rows, nchunks].
__global__ void finalize_kernel(const float* __restrict__ part, const float* __restrict__ kpart,
                                float* __restrict__ stats, float* __restrict__ keep_sum, float* __restrict__ head,
                                SavedLayout layout, int64_t rows, int64_t nchunks, int64_t spc) {
  const int64_t idx = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (idx >= rows * nchunks) return;
  const int64_t row = idx / nchunks, c = idx % nchunks, first = row * nchunks * spc + c * spc;
  float m = -INFINITY, s = 0.f, a = 0.f, b = 0.f, sk = 0.f, ak = 0.f;
  for (int64_t k = 0; k < spc; ++k) {
    const float* p = part + (first + k) * kPartWidth;
    if (kpart) {
      const float* q = kpart + (first + k) * kKeepPartWidth;
      nucleus_merge(p[0], p[1], q[0], q[1], m, s, sk, ak);
    }
    moments_merge(p[0], p[1], p[2], p[3], m, s, a, b);
  }
  float* o = stats + idx * kStatWidth;
  o[0] = m;
  o[1] = s;
  o[2] = a;
  if (kpart) keep_sum[idx] = sk;
  if (head) {
    float* mom = head + row * layout.floats + layout.moments_at(c);
    mom[0] = m;
    mom[1] = s;
    mom[2] = a;
    mom[3] = b;
    mom[4] = sk;
    mom[5] = ak;
  }
}

// Eight consecutive elements of a row into fp32 registers: one or two 16-byte loads where `vec`,
// else element by element (zeros past h).
constexpr int kDotPiece = 8;
template <typename T>
__device__ __forceinline__ void load_piece(const T* r, int64_t k0, int64_t h, bool vec, float (&x)[kDotPiece]) {
  if (vec && k0 + kDotPiece <= h) {
    const uint4* p = reinterpret_cast<const uint4*>(r + k0);
#pragma unroll
    for (int u = 0; u < int(sizeof(T)) * kDotPiece / 16; ++u) {
      const uint4 w = p[u];
      const T* e = reinterpret_cast<const T*>(&w);
#pragma unroll
      for (int q = 0; q < 16 / int(sizeof(T)); ++q) x[u * (16 / int(sizeof(T))) + q] = to_f(e[q]);
    }
    return;
  }
#pragma unroll
  for (int q = 0; q < kDotPiece; ++q) x[q] = k0 + q < h ? to_f(r[k0 + q]) : 0.f;
}

// z_t per row by one warp: a fixed-order dot product. Lane l sums the pieces of kDotPiece elements
// l, l + 32, l + 64, ... (in order within a piece), then a butterfly: an order set by h alone, the
// same whether a piece comes by 16-byte loads (both rows 16-byte aligned) or element by element.
// With a saved head (16-bit operands), also z_t and the head's zero padding there.
template <typename T>
__global__ void target_logit_kernel(const T* __restrict__ hidden, const T* __restrict__ weight,
                                    const float* __restrict__ bias, const int32_t* __restrict__ targets,
                                    const float* __restrict__ temperature, const uint8_t* __restrict__ keep,
                                    float* __restrict__ out, float* __restrict__ head, SavedLayout layout, int64_t n,
                                    int64_t h, int64_t v, int64_t vocab_start, int64_t real_vocab,
                                    int64_t ignore_index) {
  const int64_t row = int64_t(blockIdx.x) * (blockDim.x / 32) + threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  if (row >= n) return;
  const int64_t t = targets[row];
  const int64_t loc = t - vocab_start;
  const bool mine = classify_target(t, real_vocab, ignore_index) == TargetKind::kValid && loc >= 0 && loc < v;
  float zt = 0.f;
  if (mine && keep && !keep[row * v + loc]) {  // outside the nucleus: probability 0
    zt = -INFINITY;
  } else if (mine) {
    const T* hr = hidden + row * h;
    const T* wr = weight + loc * h;
    const bool vec = ((reinterpret_cast<uintptr_t>(hr) | reinterpret_cast<uintptr_t>(wr)) & 15) == 0;
    float acc = 0.f;
    for (int64_t k0 = int64_t(lane) * kDotPiece; k0 < h; k0 += 32 * kDotPiece) {
      float x[kDotPiece], y[kDotPiece];
      load_piece(hr, k0, h, vec, x);
      load_piece(wr, k0, h, vec, y);
#pragma unroll
      for (int q = 0; q < kDotPiece; ++q) acc = fmaf(x[q], y[q], acc);
    }
    acc = warp_sum(acc);
    zt = (acc + (bias ? bias[loc] : 0.f)) * reciprocal(temperature[row]);
  }
  if (lane != 0) return;
  out[row] = zt;
  if (head)
    for (int64_t i = layout.z_target_at(); i < layout.floats; ++i)
      head[row * layout.floats + i] = i == layout.z_target_at() ? zt : 0.f;
}

__global__ void combine_kernel(CombineArgs a) {
  const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i < a.n) combine_one(a, i);
}

template <typename K> cudaError_t set_smem(K kernel, size_t bytes) {
  return cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(bytes));
}

template <typename T>
Status forward_portable_partials(const Problem& p, const T* hidden, int64_t rows, const T* weight, const float* bias,
                                 const float* temperature, float* part, SavedOut<T> saved, Nucleus nuc,
                                 cudaStream_t st) {
  constexpr size_t smem = GemmSmem<T>::BYTES;
  // Set on every call (cheap, host-only, legal under stream capture): the attribute is per device.
  if (set_smem(fwd_split_kernel<T>, smem) != cudaSuccess) return "rlk cuda: cudaFuncSetAttribute failed (forward)";
  const dim3 grid(unsigned((rows + kBM - 1) / kBM), unsigned(total_splits(p)));
  fwd_split_kernel<T><<<grid, kThreads, smem, st>>>(hidden, weight, bias, temperature, part, saved, nuc, rows, p.h,
                                                    p.chunk, splits_per_chunk(p.chunk), total_splits(p), p.vocab_start,
                                                    p.real_vocab, p.v);
  RLK_CHECK_LAUNCH("rlk cuda: forward kernel launch failed");
  return nullptr;
}

template <typename T>
Status forward_t(const Problem& p, const FwdArgs& a, Workspace ws, cudaStream_t st, Backend* ran) {
  Backend be = forward_backend(p, a.keep != nullptr);
  if (ran) *ran = be;
  const T* H = cptr<T>(a.hidden);
  const T* W = cptr<T>(a.weight);
  const float* B = p.has_bias ? a.bias : nullptr;
  const int64_t R = fwd_rows_per_pass(p);
  const int64_t K = num_chunks(p);
  float* part = static_cast<float*>(ws.ptr);
  float* kpart = part + R * total_splits(p) * kPartWidth;
  const SavedRows kr = a.saved_logits ? saved_rows(p, a.saved_logits) : SavedRows{nullptr, nullptr};
  const SavedLayout layout(p);
  for (int64_t r0 = 0; r0 < p.n; r0 += R) {
    const int64_t rows = p.n - r0 < R ? p.n - r0 : R;
    Status s = nullptr;
    SavedOut<T> saved;
    Nucleus nuc;
    if (a.keep) nuc = {a.keep + r0 * p.v, kpart};
    if (kr.z) {
      saved.z = static_cast<Saved<T>*>(kr.z) + r0 * p.v;
      saved.head = kr.head ? kr.head + r0 * layout.floats : nullptr;
      saved.layout = layout;
    }
#if RLK_HAVE_SM90
    if (be == Backend::kCudaSm90) {
      s = sm90_forward_partials(p, H + r0 * p.h, rows, a.weight, B, a.temperature + r0, part, saved.z, saved.head, st);
      if (s == kSm90Misaligned) {  // TMA needs 16-byte aligned bases: the portable kernel takes it
        be = Backend::kCudaPortable;
        if (ran) *ran = be;
        s = forward_portable_partials<T>(p, H + r0 * p.h, rows, W, B, a.temperature + r0, part, saved, nuc, st);
      }
    } else
#endif
    {
      s = forward_portable_partials<T>(p, H + r0 * p.h, rows, W, B, a.temperature + r0, part, saved, nuc, st);
    }
    if (s) return s;
    const int64_t tot = rows * K;
    finalize_kernel<<<unsigned((tot + 255) / 256), 256, 0, st>>>(part, nuc.kpart, a.stats + r0 * K * kStatWidth,
                                                                 a.keep ? a.keep_sum + r0 * K : nullptr, saved.head,
                                                                 layout, rows, K, splits_per_chunk(p.chunk));
    RLK_CHECK_LAUNCH("rlk cuda: finalize kernel launch failed");
  }
  target_logit_kernel<T><<<unsigned((p.n + 7) / 8), 256, 0, st>>>(H, W, B, a.targets, a.temperature, a.keep,
                                                                  a.target_logit, kr.head, layout, p.n, p.h, p.v,
                                                                  p.vocab_start, p.real_vocab, p.ignore_index);
  RLK_CHECK_LAUNCH("rlk cuda: target logit kernel launch failed");
  return nullptr;
}

}  // namespace
}  // namespace detail

// ---- the API ----------------------------------------------------------------------------------
using namespace detail;

size_t forward_workspace_bytes(const Problem& p) {
  if (p.n <= 0 || p.v <= 0 || p.chunk <= 0) return 0;
  return size_t(fwd_rows_per_pass(p)) * size_t(total_splits(p)) * (kPartWidth + kKeepPartWidth) * sizeof(float);
}

Status forward(const Problem& p, const FwdArgs& a, Workspace ws, cudaStream_t stream, Backend* ran) {
  if (Status s = check_shape(p)) return s;
  if (a.keep && !a.keep_sum) return "rlk cuda: a keep mask needs keep_sum";
  if (ran) *ran = forward_backend(p, a.keep != nullptr);
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

}  // namespace rlk::cuda
