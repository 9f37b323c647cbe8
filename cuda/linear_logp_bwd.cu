// The CUDA backward, two strategies over the same pieces:
//   dlogit   dlogit = dz * inv_temp (dtype), dT per row (fixed reduction order) and, with a bias,
//            db by column sums in row order;
//   dH = dlogit W (BwdArgs::dhidden_dtype out) and dW = dlogit^T H (dtype out): cuBLAS GEMMs
//   (blas.h says why).
// fast  p comes from the forward's saved record (FwdArgs::saved_logits, SavedLayout: fp16 q with fp32 group
//       maxima and chunk moments; fp32 operands: z); one memory-bound pass (dlogit_kernel, one
//       block per row) overwrites q (z) with dlogit in place (same element size: fp16 -> bf16/fp16,
//       fp32 -> fp32), and dT comes from the moments. Work: the two gradient GEMMs plus ~4 bytes
//       moved per logit; extra memory: the saved record.
// lean  dlogit is formed per (vocab piece, row pass) in a tile: on Hopper by the sm90 kernel
//       itself (it recomputes z and writes dlogit from its accumulators), elsewhere by a cuBLAS
//       GEMM into an fp32 z tile and dlogit_kernel. dH accumulates over pieces in fp32 (piece
//       order), dW over passes in an fp32 piece accumulator (pass order; one pass, the common
//       case, writes dW directly). Work: three GEMMs; all extra memory in a workspace planned
//       within 256 MiB; where n * h makes dH's fp32 accumulator too large, dH comes in row
//       sweeps that recompute the rows left (lean_plan.h plans both).
// A nucleus (BwdArgs::keep) changes dz only (dz_of's nucleus form): dlogit_kernel reads the kept
// bytes beside z or q; lean takes the gemm path for it (the sm90 epilogue takes no nucleus).
// No atomics: every sum has one order fixed by the shapes, so repeated runs give the same bits.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>

#include "blas.h"
#include "lean_plan.h"
#include "linear_logp_cuda.h"
#include "lp_gemm_portable.cuh"  // to_f / from_f
#include "lp_internal.h"

namespace rlk::cuda {
namespace {

using detail::from_f;
using detail::to_f;

#define RLK_CHECK_LAUNCH(msg)                          \
  do {                                                 \
    if (cudaGetLastError() != cudaSuccess) return msg; \
  } while (0)

constexpr int kRowThreads = 256;  // dlogit: one block per row
constexpr int kVec = 8;           // columns per thread step (16-byte loads of 2-byte elements)

// ---- dlogit -----------------------------------------------------------------------------------
struct DlogitParams {
  const void* z;
  int64_t ldz;  // [rows, cols] ZT: saved z or q, or (raw) h.W still without bias and 1/T
  bool raw;
  const float* head;            // the saved record's head [rows, saved.floats] when z holds q, else null
  SavedLayout saved;
  int64_t chunk;
  void* dlog;
  int64_t ldd;  // [rows, cols] dtype; fast: the same memory as z
  int64_t cols;
  int64_t col0;                 // global id of column 0
  int64_t real_vocab, ignore_index;
  const float* bias;            // raw only: of column 0, or null
  const int32_t* targets;       // per row (row 0 = this launch's first row), as are the next six
  const float *temperature, *m, *log_s, *ent, *g, *e;  // ent, e may be null
  const uint8_t* keep;          // the nucleus [rows, cols] (row stride ldk) of column 0, or null,
  int64_t ldk;
  const float* log_s_keep;      // with its log_s_keep per row
  float* dtemp;                 // per row, or null: sum_j dz z accumulates here over the pieces,
  bool dzz_add;                 // (pieces after the first add to it)
  bool dtemp_last;              // and the last piece turns it into dT = -inv_temp * sum
  bool vec;                     // z and dlog rows are 16-byte aligned with ldz, ldd % 8 == 0
};

template <typename T> __device__ __forceinline__ void load_vec(const T* p, float* x) {
  if constexpr (sizeof(T) == 2) {
    const uint4 u = *reinterpret_cast<const uint4*>(p);
    const T* v = reinterpret_cast<const T*>(&u);
#pragma unroll
    for (int q = 0; q < kVec; ++q) x[q] = to_f(v[q]);
  } else {
    const float4 a = reinterpret_cast<const float4*>(p)[0], b = reinterpret_cast<const float4*>(p)[1];
    x[0] = a.x;
    x[1] = a.y;
    x[2] = a.z;
    x[3] = a.w;
    x[4] = b.x;
    x[5] = b.y;
    x[6] = b.z;
    x[7] = b.w;
  }
}
template <typename T> __device__ __forceinline__ void store_vec(T* p, const float* x) {
  if constexpr (sizeof(T) == 2) {
    uint4 u;
    T* v = reinterpret_cast<T*>(&u);
#pragma unroll
    for (int q = 0; q < kVec; ++q) v[q] = from_f<T>(x[q]);
    *reinterpret_cast<uint4*>(p) = u;
  } else {
    reinterpret_cast<float4*>(p)[0] = make_float4(x[0], x[1], x[2], x[3]);
    reinterpret_cast<float4*>(p)[1] = make_float4(x[4], x[5], x[6], x[7]);
  }
}

// Columns [c0, c0 + kVec) of a row into / out of registers (the row's tail element-wise).
template <typename T> __device__ __forceinline__ void load_cols(const T* r, int64_t c0, const DlogitParams& q,
                                                                float* x) {
  if (q.vec && c0 + kVec <= q.cols) return load_vec(r + c0, x);
#pragma unroll
  for (int k = 0; k < kVec; ++k) x[k] = c0 + k < q.cols ? to_f(r[c0 + k]) : 0.f;
}
template <typename T> __device__ __forceinline__ void store_cols(T* r, int64_t c0, const DlogitParams& q,
                                                                 const float* x) {
  if (q.vec && c0 + kVec <= q.cols) return store_vec(r + c0, x);
#pragma unroll
  for (int k = 0; k < kVec; ++k)
    if (c0 + k < q.cols) r[c0 + k] = from_f<T>(x[k]);
}

// With q (16-bit saved record): p = q w, the nucleus's p = q wk and z - m = log q + d for the
// columns of one group, d = mt - m, w = exp(d - log_s), wk = exp(d - log_s_keep).
struct GroupScale {
  float w, wk, d;
};
__device__ __forceinline__ GroupScale group_scale(const float* group_max, int64_t g, float m, float log_s,
                                                  float log_s_keep) {
  const float d = group_max[g] - m;
  return {__expf(d - log_s), __expf(d - log_s_keep), d};
}
// Where a thread's vector of columns lies in the saved record's groups (SavedLayout): chunk c, offset
// off in it. Advanced by additions only: a 64-bit division per vector slowed the pass (docs/benchmarks.md §5).
struct ChunkPos {
  int64_t c, off;
  __device__ __forceinline__ void advance(int64_t cols, int64_t chunk) {
    for (off += cols; off >= chunk; off -= chunk) ++c;
  }
};
// The group scales of the vector's kVec columns at pos (columns past the row: any value).
__device__ __forceinline__ void vector_scales(const DlogitParams& q, const float* gmax, ChunkPos pos, float m,
                                              float log_s, float log_s_keep, GroupScale (&gs)[kVec]) {
  const int64_t w = SavedLayout::kGroupCols;
  if (pos.off + kVec <= q.chunk && pos.off % w + kVec <= w) {  // one group (always, when chunk % 8 == 0)
    const GroupScale one = group_scale(gmax, q.saved.group_at(pos.c, pos.off), m, log_s, log_s_keep);
#pragma unroll
    for (int k = 0; k < kVec; ++k) gs[k] = one;
    return;
  }
#pragma unroll
  for (int k = 0; k < kVec; ++k) {  // across a group or chunk start
    const bool next = pos.off + k >= q.chunk;
    const int64_t c = pos.c + (next ? 1 : 0), off = pos.off + k - (next ? q.chunk : 0);
    gs[k] = c < q.saved.chunks ? group_scale(gmax, q.saved.group_at(c, off), m, log_s, log_s_keep)
                               : GroupScale{0.f, 0.f, 0.f};
  }
}

// dT's sum_j dz_j z_j over this shard's columns of a row, from the saved record's moments: the sum
// of dz_j (z_j - m) (with a nucleus, kept_moments_dzz; the target counts when kept), plus m sum_j
// dz_j, which is 0 over the shards unless the target is outside the nucleus: then -g, added by the
// target's shard.
__device__ float saved_dzz(const DlogitParams& q, const float* head, const uint8_t* keep, int64_t t, float m,
                           float log_s, float log_s_keep, float ent, float g, float e, int64_t live_cols) {
  float acc = 0.f;
  for (int64_t c = 0; c < q.saved.chunks; ++c) {
    const float* mom = head + q.saved.moments_at(c);
    acc += keep ? kept_moments_dzz(mom, m, log_s, log_s_keep, log_s - ent, g, e)
                : moments_dzz(mom, m, log_s, log_s - ent, g, e);
  }
  const int64_t tl = t - q.col0;
  if (tl >= 0 && tl < live_cols) acc += !keep || keep[tl] ? g * (head[q.saved.z_target_at()] - m) : -g * m;
  return acc;
}

// One block per row. A thread reads its columns before writing them, so dlog may alias z; no
// __restrict__ on these two. The pass is one load and one store per element, but its arithmetic
// per element is close to that: the checks go per vector (only the row's last vectors hold
// padding), the target is one small-int compare, and p = __expf(zm - log_s) (ex2.approx, a few ulp:
// the result is rounded to 16 bits; the sm90 epilogue's form). Four vectors in flight per thread
// instead of one gained nothing (docs/benchmarks.md §5).
// kSave: q.keep is set (a template argument, so the pass without a nucleus is compiled as if
// there were none).
template <typename ZT, typename T, bool kSave>
__global__ void __launch_bounds__(kRowThreads) dlogit_kernel(DlogitParams q) {
  __shared__ float red[kRowThreads];
  const int64_t row = blockIdx.x;
  const int64_t t = q.targets[row];
  const bool active = classify_target(t, q.real_vocab, q.ignore_index) == TargetKind::kValid;
  const float it = reciprocal(q.temperature[row]);
  const float m = active ? q.m[row] : 0.f, log_s = active ? q.log_s[row] : 0.f;
  const uint8_t* keep = kSave ? q.keep + row * q.ldk : nullptr;
  const float log_s_keep = active && keep ? q.log_s_keep[row] : log_s;
  // a row with non-finite statistics (a NaN row; with a nucleus, also an empty one) gets NaN in
  // every real column, -inf logits too
  const float g = !active ? 0.f : isfinite(m) && isfinite(log_s) && isfinite(log_s_keep) ? q.g[row] : NAN;
  const float ent = active && q.ent ? q.ent[row] : 0.f, e = active && q.e ? q.e[row] : 0.f;
  const ZT* zr = static_cast<const ZT*>(q.z) + row * q.ldz;
  T* dr = static_cast<T*>(q.dlog) + row * q.ldd;
  // columns [0, live_cols) are real ids of this row's vocab; past them (padding, the tile's
  // spare columns) no gradient
  const int64_t live_cols = active ? std::min(q.cols, q.real_vocab - q.col0) : 0;
  const float* head = q.head ? q.head + row * q.saved.floats : nullptr;
  float dzz = 0.f;
  ChunkPos pos{0, int64_t(threadIdx.x) * kVec};
  if (head) pos.advance(0, q.chunk);
  for (int64_t c0 = int64_t(threadIdx.x) * kVec; c0 < q.cols; c0 += int64_t(kRowThreads) * kVec) {
    float x[kVec];
    load_cols(zr, c0, q, x);
    const int64_t rest = live_cols - c0;
    const int nlive = rest >= kVec ? kVec : rest > 0 ? int(rest) : 0;
    const int kt = t - q.col0 >= c0 && t - q.col0 < c0 + kVec ? int(t - q.col0 - c0) : -1;
    bool in_k[kVec];  // the nucleus's columns (all, without one; pk is then p)
#pragma unroll
    for (int k = 0; k < kVec; ++k) in_k[k] = !keep || (k < nlive && keep[c0 + k] != 0);
    if (head) {  // q = 0: p = 0 (a -inf logit, or below fp16); z - m only for the entropy term
      GroupScale gs[kVec];
      vector_scales(q, head + q.saved.group_max_at(), pos, m, log_s, log_s_keep, gs);
      pos.advance(int64_t(kRowThreads) * kVec, q.chunk);
#pragma unroll
      for (int k = 0; k < kVec; ++k) {
        const bool live = k < nlive && x[k] != 0.f;
        const float pr = live ? x[k] * gs[k].w : 0.f;
        const float zm = live && e != 0.f ? __logf(x[k]) + gs[k].d : 0.f;
        const float pk = !kSave ? pr : live && in_k[k] ? x[k] * gs[k].wk : 0.f;
        x[k] = (k < nlive ? dz_of(zm, pr, pk, in_k[k] && k == kt, log_s, ent, g, e) : 0.f) * it;
      }
      store_cols(dr, c0, q, x);
      continue;
    }
#pragma unroll
    for (int k = 0; k < kVec; ++k) {
      float z = x[k];
      if (q.raw) z = (z + (q.bias && c0 + k < q.cols ? q.bias[c0 + k] : 0.f)) * it;
      // -inf: probability 0 (a logit masked by the bias); NaN stays live
      const bool live = k < nlive && !(z == -INFINITY);
      const float zm = live ? z - m : 0.f, pr = live ? __expf(zm - log_s) : 0.f;
      const float pk = !kSave ? pr : live && in_k[k] ? __expf(zm - log_s_keep) : 0.f;
      const float dz = k < nlive ? dz_of(zm, pr, pk, in_k[k] && k == kt, log_s, ent, g, e) : 0.f;
      if (live) dzz = fmaf(dz, z, dzz);
      x[k] = dz * it;
    }
    store_cols(dr, c0, q, x);
  }
  if (!q.dtemp) return;
  if (head) {
    if (threadIdx.x == 0)
      q.dtemp[row] = active ? -it * saved_dzz(q, head, keep, t, m, log_s, log_s_keep, ent, g, e, live_cols) : 0.f;
    return;
  }
  red[threadIdx.x] = dzz;  // fixed-shape tree: the same order for every row and every run
  __syncthreads();
  for (int s = kRowThreads / 2; s > 0; s >>= 1) {
    if (int(threadIdx.x) < s) red[threadIdx.x] += red[threadIdx.x + s];
    __syncthreads();
  }
  if (threadIdx.x == 0) {
    const float sum = (q.dzz_add ? q.dtemp[row] : 0.f) + red[0];
    q.dtemp[row] = q.dtemp_last ? -it * sum : sum;
  }
}

// db[c] (+)= sum over rows, in row order, of dlog[r, c]: one thread per column.
template <typename T>
__global__ void colsum_kernel(const T* __restrict__ dlog, int64_t ldd, int64_t rows, int64_t cols,
                              float* __restrict__ db, bool add) {
  const int64_t c = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (c >= cols) return;
  float s = 0.f;
  for (int64_t r = 0; r < rows; ++r) s += to_f(dlog[r * ldd + c]);
  db[c] = (add ? db[c] : 0.f) + s;
}

template <typename T>
__global__ void to_dtype_kernel(const float* __restrict__ in, T* __restrict__ out, int64_t count) {
  const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i < count) out[i] = from_f<T>(in[i]);
}

unsigned blocks_of(int64_t count, int threads) { return unsigned((count + threads - 1) / threads); }

bool aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15) == 0; }

// Rows [r0, r0 + rows) of a: the per-row inputs of dlogit_kernel.
DlogitParams row_params(const Problem& p, const BwdArgs& a, int64_t r0) {
  DlogitParams q{};
  q.real_vocab = p.real_vocab;
  q.ignore_index = p.ignore_index;
  q.targets = a.targets + r0;
  q.temperature = a.temperature + r0;
  q.m = a.m + r0;
  q.log_s = a.log_s + r0;
  q.g = a.g + r0;
  q.ent = p.with_entropy && a.entropy ? a.entropy + r0 : nullptr;
  q.e = p.with_entropy && a.e ? a.e + r0 : nullptr;
  q.dtemp = a.dtemp ? a.dtemp + r0 : nullptr;
  if (a.keep) {
    q.keep = a.keep + r0 * p.v;
    q.ldk = p.v;
    q.log_s_keep = a.log_s_keep + r0;
  }
  return q;
}

template <typename ZT, typename T>
Status launch_dlogit(DlogitParams q, int64_t rows, cudaStream_t st) {
  q.vec = q.ldz % kVec == 0 && q.ldd % kVec == 0 && aligned16(q.z) && aligned16(q.dlog);
  if (rows > 0 && q.keep) dlogit_kernel<ZT, T, true><<<unsigned(rows), kRowThreads, 0, st>>>(q);
  if (rows > 0 && !q.keep) dlogit_kernel<ZT, T, false><<<unsigned(rows), kRowThreads, 0, st>>>(q);
  RLK_CHECK_LAUNCH("rlk cuda: dlogit kernel launch failed");
  return nullptr;
}

template <typename T>
Status launch_colsum(const void* dlog, int64_t ldd, int64_t rows, int64_t cols, float* db, bool add, cudaStream_t st) {
  colsum_kernel<T><<<blocks_of(cols, 256), 256, 0, st>>>(static_cast<const T*>(dlog), ldd, rows, cols, db, add);
  RLK_CHECK_LAUNCH("rlk cuda: db kernel launch failed");
  return nullptr;
}

// ---- fast ---------------------------------------------------------------------------------------
template <typename T>
Status backward_fast(const Problem& p, const BwdArgs& a, Workspace ws, cudaStream_t st) {
  using ZT = std::conditional_t<sizeof(T) == 4, float, __half>;  // z, or q
  const SavedRows kr = saved_rows(p, a.saved_logits);
  DlogitParams q = row_params(p, a, 0);
  q.z = kr.z;
  q.ldz = p.v;
  q.dlog = kr.z;
  q.ldd = p.v;
  q.head = kr.head;
  q.saved = SavedLayout(p);
  q.chunk = p.chunk;
  q.cols = p.v;
  q.col0 = p.vocab_start;
  q.dtemp_last = true;
  if (Status s = launch_dlogit<ZT, T>(q, p.n, st)) return s;
  if (p.has_bias && a.dbias)
    if (Status s = launch_colsum<T>(kr.z, p.v, p.n, p.v, a.dbias, false, st)) return s;
  const blas::Mat D{kr.z, p.dtype, p.n, p.v, p.v};
  const blas::Mat W{a.weight, p.dtype, p.v, p.h, p.h}, H{a.hidden, p.dtype, p.n, p.h, p.h};
  if (Status s = blas::gemm(st, ws.ptr, D, false, W, false, a.dhidden, a.dhidden_dtype, p.h, 0.f, /*batch_rows=*/true))
    return s;
  return blas::gemm(st, ws.ptr, D, true, H, false, a.dweight, p.dtype, p.h, 0.f, /*batch_rows=*/false);
}

// ---- lean ---------------------------------------------------------------------------------------
// Per (vocab piece, row pass): the dlogit tile, then dH[pass] (+)= dlogit W[piece] and
// dW[piece] (+)= dlogit^T H[pass]. The tile is "fused" (the sm90 kernel, Epi::kDlogit: wherever
// forward_backend picks it) or made by the "gemm" path (cuBLAS z in fp32, then dlogit_kernel).
// The workspace, the pieces and the dH row sweeps are planned on the host (lean_plan.h).
using detail::lean_fused;  // dispatch.cc

#if RLK_HAVE_SM90
// dtemp (+)= the row's sum over this piece's splits, in split order; the last piece makes it dT.
__global__ void dzz_rows_kernel(const float* __restrict__ dzz, int64_t rows, int64_t splits,
                                const float* __restrict__ temperature, float* __restrict__ dtemp, bool add, bool last) {
  const int64_t r = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (r >= rows) return;
  float s = 0.f;
  for (int64_t k = 0; k < splits; ++k) s += dzz[r * splits + k];
  s += add ? dtemp[r] : 0.f;
  dtemp[r] = last ? -reciprocal(temperature[r]) * s : s;
}
#endif

// Where a piece's tiles lie: z (gemm path), dlogit [rows, ld] and dzz (fused).
struct LeanTile {
  float* z;
  void* dlog;
  float* dzz;
};

// The dlogit tile of rows [r0, r0 + rn) x the piece's columns (and, unless dh_only, this tile's
// share of dtemp and of db).
template <typename T>
Status lean_tile(const Problem& p, const BwdArgs& a, const LeanLayout& L, const LeanPiece& pc, const LeanTile& t,
                 void* ws, int64_t r0, int64_t rn, bool first_pass, bool dh_only, cudaStream_t st) {
  const size_t eb = dtype_bytes(p.dtype);
  const bool first_piece = pc.c == 0, last_piece = pc.c + pc.cols == p.v;
  if (L.fused) {
#if RLK_HAVE_SM90
    Problem q = p;  // the piece as a problem of its own: one chunk, whose splits fix dzz's order
    q.v = pc.cols;
    q.chunk = pc.cols;
    q.vocab_start = p.vocab_start + pc.c;
    q.n = rn;
    BwdArgs b = a;
    b.hidden = static_cast<const unsigned char*>(a.hidden) + r0 * p.h * eb;
    b.weight = static_cast<const unsigned char*>(a.weight) + pc.c * p.h * eb;
    b.bias = p.has_bias ? a.bias + pc.c : nullptr;
    b.targets = a.targets + r0;
    b.temperature = a.temperature + r0;
    b.m = a.m + r0;
    b.log_s = a.log_s + r0;
    b.g = a.g + r0;
    if (p.with_entropy && a.e) {
      b.entropy = a.entropy + r0;
      b.e = a.e + r0;
    }
    float* dzz = a.dtemp && !dh_only ? t.dzz : nullptr;
    if (Status s = detail::sm90_dlogit(q, b, rn, t.dlog, pc.w, dzz, st)) return s;
    if (dzz) {
      dzz_rows_kernel<<<blocks_of(rn, 256), 256, 0, st>>>(dzz, rn, dlogit_splits(pc.cols), a.temperature + r0,
                                                          a.dtemp + r0, !first_piece, last_piece);
      RLK_CHECK_LAUNCH("rlk cuda: dT kernel launch failed");
    }
#else
    return "rlk cuda: the fused lean path needs the sm90 build";  // lean_fused is never true then
#endif
  } else {
    const blas::Mat Wp{static_cast<const unsigned char*>(a.weight) + pc.c * p.h * eb, p.dtype, pc.cols, p.h, p.h};
    const blas::Mat Hp{static_cast<const unsigned char*>(a.hidden) + r0 * p.h * eb, p.dtype, rn, p.h, p.h};
    // z[rn, cols] = H[pass] W[piece]^T   (fp32; bias and 1/T are applied by dlogit_kernel)
    if (Status s = blas::gemm(st, ws, Hp, false, Wp, true, t.z, DType::kF32, pc.w, 0.f, /*batch_rows=*/false)) return s;
    DlogitParams q = row_params(p, a, r0);
    q.z = t.z;
    q.ldz = pc.w;
    q.dlog = t.dlog;
    q.ldd = pc.w;
    q.cols = pc.cols;
    q.col0 = p.vocab_start + pc.c;
    q.raw = true;
    q.bias = p.has_bias ? a.bias + pc.c : nullptr;
    if (q.keep) q.keep += pc.c;
    if (dh_only) q.dtemp = nullptr;
    q.dzz_add = !first_piece;
    q.dtemp_last = last_piece;
    if (Status s = launch_dlogit<float, T>(q, rn, st)) return s;
  }
  if (p.has_bias && a.dbias && !dh_only)
    if (Status s = launch_colsum<T>(t.dlog, pc.w, rn, pc.cols, a.dbias + pc.c, !first_pass, st)) return s;
  return nullptr;
}

// The sweep's dH rows among [r0, r0 + rn) (+)= their rows of D W[piece], D the pass's dlogit
// rows from r0, in fp32: rows below sw.r0 + sw.in inside dhidden's bytes, the others in the workspace.
Status dh_accumulate(const Problem& p, const BwdArgs& a, const LeanLayout& L, const DhSweep& sw, unsigned char* base,
                     void* ws, const blas::Mat& D, const blas::Mat& Wp, int64_t r0, int64_t rn, float beta,
                     cudaStream_t st) {
  const size_t eb = dtype_bytes(p.dtype);
  // rows [lo, hi) into the fp32 matrix acc, whose row 0 is row `first`
  auto rows = [&](int64_t lo, int64_t hi, float* acc, int64_t first) -> Status {
    if (hi <= lo) return nullptr;
    const blas::Mat Dr{static_cast<const unsigned char*>(D.ptr) + (lo - r0) * D.ld * eb, D.dtype, hi - lo, D.cols,
                       D.ld};
    return blas::gemm(st, ws, Dr, false, Wp, false, acc + (lo - first) * p.h, DType::kF32, p.h, beta,
                      /*batch_rows=*/false);  // (its pieces follow n: lean's dH is not batch invariant)
  };
  const int64_t lo = std::max(r0, sw.r0), hi = std::min(r0 + rn, sw.r1);
  if (hi <= lo) return nullptr;  // a pass of the first sweep past its dH rows
  const int64_t split = std::clamp(sw.r0 + sw.in, lo, hi);
  float* in_dh =
      reinterpret_cast<float*>(static_cast<unsigned char*>(a.dhidden) + sw.r0 * p.h * dtype_bytes(a.dhidden_dtype));
  if (Status s = rows(lo, split, in_dh, sw.r0)) return s;
  return rows(split, hi, reinterpret_cast<float*>(base + L.off_dh), sw.r0 + sw.in);
}

// A 16-bit dhidden's rows [sw.r0, sw.r1) from the sweep's fp32 accumulator. The rows inside
// dhidden are rounded in chunks through the workspace tile and copied down (a row's 16-bit place
// overlaps fp32 rows already read); then the workspace rows go straight to their place, which by
// then holds nothing still needed.
template <typename T>
Status finish_dhidden(const Problem& p, const BwdArgs& a, const LeanLayout& L, const DhSweep& sw, unsigned char* base,
                      cudaStream_t st) {
  T* out = static_cast<T*>(a.dhidden) + sw.r0 * p.h;
  const float* acc = reinterpret_cast<const float*>(out);  // the sweep's fp32 rows start at row r0's place
  const int64_t chunk = finish_rows(p, L);
  T* tmp = reinterpret_cast<T*>(base + L.off_dlog);
  for (int64_t r0 = 0; r0 < sw.in; r0 += chunk) {
    const int64_t rows = sw.in - r0 < chunk ? sw.in - r0 : chunk;
    to_dtype_kernel<T><<<blocks_of(rows * p.h, 256), 256, 0, st>>>(acc + r0 * p.h, tmp, rows * p.h);
    RLK_CHECK_LAUNCH("rlk cuda: dH conversion launch failed");
    if (cudaMemcpyAsync(out + r0 * p.h, tmp, size_t(rows) * p.h * sizeof(T), cudaMemcpyDeviceToDevice, st) !=
        cudaSuccess)
      return "rlk cuda: dH copy failed";
  }
  const int64_t rest = (sw.r1 - sw.r0 - sw.in) * p.h;
  if (rest > 0) {
    to_dtype_kernel<T><<<blocks_of(rest, 256), 256, 0, st>>>(reinterpret_cast<const float*>(base + L.off_dh),
                                                             out + sw.in * p.h, rest);
    RLK_CHECK_LAUNCH("rlk cuda: dH conversion launch failed");
  }
  return nullptr;
}

// One dH sweep. The first (sw.r0 == 0) is the whole backward: every row, dW, db, dT, and the
// sweep's dH rows; a later one recomputes the tiles of its own rows for dH alone.
template <typename T>
Status lean_sweep(const Problem& p, const BwdArgs& a, const LeanLayout& first, const DhSweep& sw, void* cublas_ws,
                  unsigned char* base, cudaStream_t st) {
  const bool full = sw.r0 == 0;
  const LeanLayout L = sweep_layout(p, first, sw);
  const int64_t row0 = full ? 0 : sw.r0, row1 = full ? p.n : sw.r1, R = L.t.R;
  const int64_t npass = (row1 - row0 + R - 1) / R;
  const size_t eb = dtype_bytes(p.dtype);
  const unsigned char* hid = static_cast<const unsigned char*>(a.hidden);
  const unsigned char* wgt = static_cast<const unsigned char*>(a.weight);
  unsigned char* dw = static_cast<unsigned char*>(a.dweight);
  float* dwacc = reinterpret_cast<float*>(base + L.off_dwacc);
  // dW's rows past a piece are unwritten only during the first sweep: later ones do not borrow
  return for_each_lean_piece(p, L, full, [&](const LeanPiece& pc) -> Status {
    LeanTile t{reinterpret_cast<float*>(base + L.off_z), base + L.off_dlog, reinterpret_cast<float*>(base + L.off_dzz)};
    if (pc.borrowed) {
      unsigned char* b = align256(dw + (pc.c + pc.w) * p.h * eb);
      if (!L.fused) {
        t.z = reinterpret_cast<float*>(b);
        b += size_t(R) * pc.w * 4;
      }
      t.dlog = b;
    }
    const blas::Mat Wp{wgt + pc.c * p.h * eb, p.dtype, pc.cols, p.h, p.h};
    unsigned char* dwp = dw + pc.c * p.h * eb;
    for (int64_t pass = 0; pass < npass; ++pass) {
      const int64_t r0 = row0 + pass * R, rn = row1 - r0 < R ? row1 - r0 : R;
      if (Status e = lean_tile<T>(p, a, L, pc, t, cublas_ws, r0, rn, pass == 0, !full, st)) return e;
      const blas::Mat Hp{hid + r0 * p.h * eb, p.dtype, rn, p.h, p.h};
      const blas::Mat D{t.dlog, p.dtype, rn, pc.cols, pc.w};
      // dH[pass] (+)= dlogit W[piece], accumulated over pieces in fp32
      if (Status e = dh_accumulate(p, a, L, sw, base, cublas_ws, D, Wp, r0, rn, pc.c > 0 ? 1.f : 0.f, st)) return e;
      if (!full) continue;
      // dW[piece] (+)= dlogit^T H[pass]: straight to dtype with one pass, else through fp32
      if (npass == 1)
        return blas::gemm(st, cublas_ws, D, true, Hp, false, dwp, p.dtype, p.h, 0.f, /*batch_rows=*/false);
      if (Status e = blas::gemm(st, cublas_ws, D, true, Hp, false, dwacc, DType::kF32, p.h, pass > 0 ? 1.f : 0.f,
                                /*batch_rows=*/false))
        return e;
    }
    if (!full) return nullptr;
    to_dtype_kernel<T><<<blocks_of(pc.cols * p.h, 256), 256, 0, st>>>(dwacc, reinterpret_cast<T*>(dwp), pc.cols * p.h);
    RLK_CHECK_LAUNCH("rlk cuda: dW conversion launch failed");
    return nullptr;
  });
}

template <typename T>
Status backward_lean(const Problem& p, const BwdArgs& a, Workspace ws, cudaStream_t st) {
  // TMA cannot take misaligned operands: the gemm path then (the workspace holds either layout)
  const bool tma_ok = ((reinterpret_cast<uintptr_t>(a.hidden) | reinterpret_cast<uintptr_t>(a.weight)) & 15) == 0;
  const LeanLayout L = lean_layout(p, lean_fused(p, a.keep != nullptr) && tma_ok, a.dhidden_dtype);
  if (L.total > ws.bytes) return "rlk cuda: lean backward workspace too small";
  if (a.dhidden_dtype != DType::kF32 && finish_rows(p, L) < 1)  // before anything is written
    return "rlk cuda: h too large for the lean backward's tile (at most 32768)";
  unsigned char* base = align256(static_cast<unsigned char*>(ws.ptr) + blas::kWorkspaceAlloc);
  return for_each_dh_sweep(p, L, a.dhidden_dtype, [&](const DhSweep& sw) -> Status {
    if (Status s = lean_sweep<T>(p, a, L, sw, ws.ptr, base, st)) return s;
    return a.dhidden_dtype == DType::kF32 ? nullptr : finish_dhidden<T>(p, a, L, sw, base, st);
  });
}

template <typename T>
Status backward_t(const Problem& p, const BwdArgs& a, Workspace ws, cudaStream_t st) {
  if (p.n == 0) {  // no rows: dW and db are zero
    if (cudaMemsetAsync(a.dweight, 0, size_t(p.v) * p.h * sizeof(T), st) != cudaSuccess ||
        (p.has_bias && a.dbias && cudaMemsetAsync(a.dbias, 0, size_t(p.v) * 4, st) != cudaSuccess))
      return "rlk cuda backward: memset failed";
    return nullptr;
  }
  return a.saved_logits ? backward_fast<T>(p, a, ws, st) : backward_lean<T>(p, a, ws, st);
}

}  // namespace

size_t backward_workspace_bytes(const Problem& p, bool fast, DType dhidden_dtype) {
  if (p.n <= 0 || p.v <= 0 || p.h <= 0) return 0;
  return fast ? blas::kWorkspaceAlloc : lean_workspace_bytes(p, lean_fused(p), dhidden_dtype);
}

Status backward(const Problem& p, const BwdArgs& a, Workspace ws, cudaStream_t stream) {
  if (Status s = detail::check_shape(p)) return s;
  if (a.keep && !a.log_s_keep) return "rlk cuda: a keep mask needs log_s_keep";
  if (Status s = check_dhidden_dtype(p, a.dhidden_dtype)) return s;
  const size_t need = backward_workspace_bytes(p, a.saved_logits != nullptr, a.dhidden_dtype);
  if (ws.bytes < need || (need && !ws.ptr)) return "rlk cuda: backward workspace too small";
  switch (p.dtype) {
    case DType::kF32: return backward_t<float>(p, a, ws, stream);
    case DType::kF16: return backward_t<__half>(p, a, ws, stream);
    case DType::kBF16: return backward_t<__nv_bfloat16>(p, a, ws, stream);
  }
  return "rlk cuda: bad dtype";
}

Status prepare_backward(int device) { return blas::prepare(device); }

}  // namespace rlk::cuda
