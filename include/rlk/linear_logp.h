// rlk: the plain C++ API of the linear_logp operator family.
//
// No framework types here: pointers, shapes and a stream. The CPU backend (cpu/) and the CUDA
// backend (cuda/) implement it; the XLA FFI handlers and the DLPack entry points (ffi/) call it.
//
// Math (all in fp32; operands in their own dtype, fp32 accumulation), per row i:
//   z_j    = (h_i . W_j + b_j) * inv_temp_i        global id j >= real_vocab -> -inf (padding)
//            inv_temp_i = reciprocal(T_i), formed by the kernels themselves (see reciprocal)
//   m_i    = max_j z_j ;  log_s_i = log sum_j exp(z_j - m_i)   (lse_i = m_i + log_s_i)
//   logp_i = (z_{t_i} - m_i) - log_s_i ;  ent_i = log_s_i - sum_j p_j (z_j - m_i)
//   p_j    = exp((z_j - m_i) - log_s_i)
//   dz_j   = g_i (delta_{j t_i} - p_j) + e_i p_j ((log_s_i - ent_i) - (z_j - m_i))
//   dlogit_j = dz_j * inv_temp_i ; dH = dlogit W ; dW = dlogit^T H ; db = sum_i dlogit
//   dT_i   = -inv_temp_i * sum_j dz_j z_j
//
// A nucleus (the top-p keep mask of an RL rollout; FwdArgs::keep) renormalizes logp over the
// row's kept ids K, on every shard, and leaves the entropy that of the whole distribution:
//   log_s_keep_i = log sum_{j in K} exp(z_j - m_i) ;  logp_i = (z_{t_i} - m_i) - log_s_keep_i
//   (-inf for a target outside K; NaN when the kept sum is 0: no kept id, or all underflow)
//   dz_j   = g_i kept_j (delta_{j t_i} - exp((z_j - m_i) - log_s_keep_i)) + (the entropy term above)
// m_i stays the max over all ids, so the unmasked statistics do not change bit for bit.
//
// Everything is formed from row-max-relative quantities (z - m, log_s), never from z - lse with lse
// rounded at the magnitude of m: a logp near 0 keeps its own precision at any |z|.
//
// Non-finite values propagate: a row whose logits or statistics are not finite (NaN or +inf in
// hidden, weight or bias, a NaN, 0 or overflowing 1/T) gives NaN logp and entropy, and NaN
// gradients; a logit of -inf is a probability of 0, like padding.
//
// Canonical chunks (the consistency contract): the global padded vocab is cut into chunks of a
// width that depends on the global vocab size only (canonical_chunk). The forward emits per-(row,
// chunk) statistics; a chunk's statistics are computed in an order fixed relative to the chunk's
// first column, so they do not depend on the tensor-parallel degree, on N, or on a row's position.
// combine_row merges chunk statistics in chunk order. TP = 1, 2, 4, 8 therefore give the same bits.
#pragma once

#include <cmath>
#include <cstddef>
#include <cstdint>

#if defined(__CUDACC__)
#define RLK_HD __host__ __device__ __forceinline__
#else
#define RLK_HD inline
#endif

namespace rlk {

enum class DType : int32_t { kF32 = 0, kF16 = 1, kBF16 = 2 };

inline size_t dtype_bytes(DType t) { return t == DType::kF32 ? 4 : 2; }

// One call: n rows of hidden [n, h] against this shard's v vocab rows of weight [v, h].
struct Problem {
  int64_t n = 0;             // rows (tokens)
  int64_t h = 0;             // hidden size
  int64_t v = 0;             // local vocab rows of weight
  int64_t vocab_start = 0;   // global id of local vocab row 0
  int64_t real_vocab = 0;    // global ids >= real_vocab are padding (logit -inf)
  int64_t chunk = 0;         // canonical chunk width in columns; v % chunk == 0
  int64_t ignore_index = -100;
  DType dtype = DType::kBF16;
  bool has_bias = false;
  bool with_entropy = false;  // forward: fill the entropy statistic; backward: e is given
};

inline int64_t num_chunks(const Problem& p) { return p.v / p.chunk; }

// Statistics per (row, chunk), kStatWidth fp32 values, in this order:
//   m = max_j z_j ;  s = sum_j exp(z_j - m) ;  a = sum_j exp(z_j - m) (z_j - m)
// A chunk made only of padding has m = -inf, s = 0, a = 0.
constexpr int kStatWidth = 3;

// Largest TP degree whose shards own whole chunks; chunks per global vocab is the largest power
// of two dividing it, capped here. Shards of TP degrees above this still work, without the
// bitwise TP-invariance promise.
constexpr int64_t kMaxInvariantTp = 8;

inline int64_t canonical_chunk(int64_t vocab_global) {
  int64_t parts = 1;
  while (parts < kMaxInvariantTp && vocab_global % (parts * 2) == 0) parts *= 2;
  return vocab_global > 0 ? vocab_global / parts : 1;
}

// Target validity, shared by every backend: ignored rows give 0, out-of-range ids give NaN.
enum class TargetKind : int32_t { kValid = 0, kIgnored = 1, kInvalid = 2 };

RLK_HD TargetKind classify_target(int64_t t, int64_t real_vocab, int64_t ignore_index) {
  if (t == ignore_index) return TargetKind::kIgnored;
  if (t < 0 || t >= real_vocab) return TargetKind::kInvalid;
  return TargetKind::kValid;
}

// Merge statistics (m2, s2, a2) into (m, s, a); used in a fixed order only. Empty statistics
// (s2 = 0: only padding) change nothing; NaN statistics make the result NaN.
RLK_HD void stats_merge(float m2, float s2, float a2, float& m, float& s, float& a) {
  if (s2 == 0.f) return;
  if (s == 0.f) {
    m = m2;
    s = s2;
    a = a2;
    return;
  }
  if (m2 > m) {
    const float d = m - m2, alpha = expf(d);
    a = alpha * (a + d * s) + a2;
    s = alpha * s + s2;
    m = m2;
  } else {
    const float d = m2 - m, alpha = expf(d);
    a = a + alpha * (a2 + d * s2);
    s = s + alpha * s2;
  }
}

// The saved records' chunk moments: (m, s, a) as stats_merge, plus b = sum_j exp(z_j - m) (z_j - m)^2
// (the fast backward's dT, see moments_dzz). (m, s, a) come out with stats_merge's bits.
RLK_HD void moments_merge(float m2, float s2, float a2, float b2, float& m, float& s, float& a, float& b) {
  // Explicit fmaf: no product here is shared with stats_merge's expressions, whose contraction
  // into fma must not depend on whether b is merged too (the same (m, s, a) bits either way).
  // A part whose exponentials underflow against the other's max adds nothing to b (its d^2 s may
  // overflow at a logit spread above about 1e19: not 0 * inf = NaN); b's other bits are unchanged.
  if (s2 == 0.f) return;
  if (s == 0.f) {
    b = b2;
  } else if (m2 > m) {  // rebase (m, s, a, b) to m2: z - m2 = (z - m) + d
    const float d = m - m2, alpha = expf(d);
    b = alpha == 0.f ? b2 : fmaf(alpha, fmaf(d, fmaf(d, s, 2.f * a), b), b2);
  } else {
    const float d = m2 - m, alpha = expf(d);
    b = alpha == 0.f ? b : fmaf(alpha, fmaf(d, fmaf(d, s2, 2.f * a2), b2), b);
  }
  stats_merge(m2, s2, a2, m, s, a);
}

// sum_j dz_j (z_j - m) over the columns of one chunk whose moments (m_c, s_c, a_c, b_c) are mom
// (relative to m_c), for a row of max m and log-sum log_s, c = log_s - ent, upstream grads g, e,
// without the target's g (z_t - m): with d = m_c - m and w = exp(d - log_s) (p = w exp(z - m_c)),
//   w [(c e - g)(a_c + d s_c) - e (b_c + d (2 a_c + d s_c))].
// The fast backward's dT from fp32 sums, where its saved fp16 probabilities would round it.
// A chunk whose p all underflow (w = 0) adds 0, as its columns do in lean's sum: its d^2 s_c may
// overflow (a logit spread above about 1e19), and 0 * inf is NaN. (A NaN row's g is NaN and keeps
// its dT NaN through the chunk of its max, where w > 0.)
RLK_HD float moments_dzz(const float* mom, float m, float log_s, float c, float g, float e) {
  if (mom[1] == 0.f) return 0.f;  // only padding
  const float d = mom[0] - m, w = expf(d - log_s);
  if (w == 0.f) return 0.f;
  const float ad = mom[2] + d * mom[1];
  return w * ((c * e - g) * ad - e * (mom[3] + d * (2.f * mom[2] + d * mom[1])));
}

// The nucleus's sums of a chunk, sk = sum_{j in K} exp(z_j - m) and ak = sum_{j in K} exp(z_j - m) (z_j - m),
// merged like (s, a) in stats_merge: (m2, s2) and (m, s) are the two parts' full statistics, before
// stats_merge (or moments_merge) folds them, so the rebasing follows the same max.
RLK_HD void nucleus_merge(float m2, float s2, float sk2, float ak2, float m, float s, float& sk, float& ak) {
  if (s2 == 0.f) return;
  if (s == 0.f) {
    sk = sk2;
    ak = ak2;
    return;
  }
  if (m2 > m) {
    const float d = m - m2, alpha = expf(d);
    ak = fmaf(alpha, fmaf(d, sk, ak), ak2);
    sk = fmaf(alpha, sk, sk2);
  } else {
    const float d = m2 - m, alpha = expf(d);
    ak = fmaf(alpha, fmaf(d, sk2, ak2), ak);
    sk = fmaf(alpha, sk2, sk);
  }
}

// moments_dzz with a nucleus: the logp term over the chunk's kept ids alone, from their sums
// (sk_c, ak_c) = (mom[4], mom[5]) relative to m_c and the row's log_s_keep: - g wk (ak_c + d sk_c),
// wk = exp(d - log_s_keep). The target's g (z_t - m) is the caller's, when the target is kept.
RLK_HD float kept_moments_dzz(const float* mom, float m, float log_s, float log_s_keep, float c, float g, float e) {
  if (mom[1] == 0.f) return 0.f;  // only padding
  const float d = mom[0] - m, wk = expf(d - log_s_keep);
  return moments_dzz(mom, m, log_s, c, 0.f, e) - (wk == 0.f ? 0.f : g * wk * (mom[5] + d * mom[4]));
}

// 1 / T, correctly rounded on every platform. The kernels take the temperature, not its inverse:
// XLA's GPU division is not correctly rounded (div.full.f32, up to 1 ulp off) while torch's is,
// so an inverse formed by each frontend would differ between JAX and torch.
RLK_HD float reciprocal(float t) {
#if defined(__CUDA_ARCH__)
  return __frcp_rn(t);
#else
  return 1.f / t;
#endif
}

// The row results: logp and entropy, and the row's m, log_s and log_s_keep (the backward's p and
// nucleus p, see dz_of; log_s_keep = log_s without a nucleus).
struct RowResult {
  float logp, entropy, m, log_s, log_s_keep;
};

// log sum_c exp(m_c - m) keep_sum_c over the k chunks in order: the row's kept sum relative to its
// max m, from each chunk's kept sum relative to the chunk's max m_c (a chunk of only padding has
// m_c = -inf and adds nothing; a NaN keeps the result NaN). A kept sum of 0 (an empty nucleus, or
// every kept logit underflowing against m) gives NaN, not -inf: a logp formed from it would be
// +inf, clamped to a plausible 0.
RLK_HD float log_keep_sum(const float* stats, const float* keep_sum, int64_t k, float m) {
  float s = 0.f;
  for (int64_t c = 0; c < k; ++c)
    if (keep_sum[c] != 0.f) s += expf(stats[c * kStatWidth] - m) * keep_sum[c];
  return s == 0.f ? NAN : logf(s);
}

// Combine k chunk statistics of one row (stats: k * kStatWidth floats, chunk order) and the
// target logit into a RowResult. Every backend and every TP degree calls this. With keep_sum (k
// floats, FwdArgs::keep_sum of every chunk) logp is over the nucleus, and target_logit is the
// nucleus's (-inf for a target outside it, see FwdArgs).
RLK_HD RowResult combine_row(const float* stats, int64_t k, float target_logit, int64_t target, int64_t real_vocab,
                             int64_t ignore_index, const float* keep_sum = nullptr) {
  float m = -INFINITY, s = 0.f, a = 0.f;
  for (int64_t c = 0; c < k; ++c)
    stats_merge(stats[c * kStatWidth], stats[c * kStatWidth + 1], stats[c * kStatWidth + 2], m, s, a);
  RowResult r;
  r.m = m;
  r.log_s = logf(s);
  r.entropy = r.log_s - a / s;  // = lse - sum p z, without adding and removing m
  r.log_s_keep = keep_sum ? log_keep_sum(stats, keep_sum, k, m) : r.log_s;
  // (z_t - m) - log_s: z_t - m is exact or rounded at its own magnitude, so a logp near 0 is not
  // rounded at |m|. The target's z is a separate dot, so it may exceed m by a rounding: logp <= 0
  // by a NaN-keeping clamp (fminf(NaN, 0) would be 0).
  const float logp = (target_logit - m) - r.log_s_keep;
  switch (classify_target(target, real_vocab, ignore_index)) {
    case TargetKind::kIgnored:
      r.logp = 0.f;
      r.entropy = 0.f;
      break;
    case TargetKind::kInvalid:
      r.logp = NAN;
      r.entropy = NAN;
      break;
    default: r.logp = logp > 0.f ? 0.f : logp; break;
  }
  return r;
}

// dz for one logit of row i (not padding), given zm = z - m, p = exp(zm - log_s) (from whichever
// exp the caller affords), the row's log_s, entropy and upstream grads. Under a nucleus, pk =
// exp(zm - log_s_keep) for a kept id, else 0, and is_target only for a kept target; the entropy
// term keeps the whole distribution's p. Without one, pk = p.
RLK_HD float dz_of(float zm, float p, float pk, bool is_target, float log_s, float ent, float g, float e) {
  return g * ((is_target ? 1.f : 0.f) - pk) + e * p * ((log_s - ent) - zm);
}

// ---- the calls -------------------------------------------------------------------------------

// The operands forward and backward share: the problem's, and its nucleus (keep, null: none).
struct OperandArgs {
  const void* hidden = nullptr;
  const void* weight = nullptr;
  const float* bias = nullptr;
  const int32_t* targets = nullptr;
  const float* temperature = nullptr;
  const uint8_t* keep = nullptr;
};

// Forward partial statistics.
//   in : hidden [n, h], weight [v, h] (dtype), bias [v] f32 (null when !has_bias; fp32 so that a
//        frontend can also mask padding columns through it, whatever the dtype), targets [n] int32,
//        temperature [n] f32 (> 0)
//        keep [n, v] bytes (null: no nucleus), nonzero for the ids of row i's nucleus K on this
//        shard (a vocab shard's slice of a row's top-p keep mask); padding is never kept
//   out: stats [n, num_chunks, kStatWidth] f32; target_logit [n] f32 = z_t when the target is a
//        real id of this shard (with keep: -inf when it is outside K), else 0 (so a sum over
//        shards is exact); keep_sum [n, num_chunks] f32 (with keep) = sum_{j in K, chunk} exp(z_j -
//        m_chunk), m_chunk the chunk's statistic m; logits (null unless the fast backward will
//        follow): saved_logits_bytes(p, backend) bytes, whatever the backward of that backend needs in its
//        own layout (see saved_logits_bytes).
struct FwdArgs : OperandArgs {
  float* stats = nullptr;
  float* target_logit = nullptr;
  float* keep_sum = nullptr;
  void* saved_logits = nullptr;
};

// Combine: all chunks of the global vocab (k of them) -> logp, entropy, m, log_s [n] f32 (m and
// log_s: what the backward takes; each output may be null). With keep_sum (every shard's
// FwdArgs::keep_sum at its chunks' offsets) logp is over the nucleus and log_s_keep [n] (may be
// null) is the nucleus's, the backward's too.
struct CombineArgs {
  int64_t n = 0, k = 0, real_vocab = 0, ignore_index = -100;
  const float* stats = nullptr;         // [n, k, kStatWidth]
  const float* target_logit = nullptr;  // [n]
  const int32_t* targets = nullptr;     // [n]
  const float* keep_sum = nullptr;      // [n, k] or null
  float* logp = nullptr;
  float* entropy = nullptr;
  float* m = nullptr;
  float* log_s = nullptr;
  float* log_s_keep = nullptr;
};

// Row i of a combine (every backend's combine runs this per row).
RLK_HD void combine_one(const CombineArgs& a, int64_t i) {
  const RowResult r = combine_row(a.stats + i * a.k * kStatWidth, a.k, a.target_logit[i], a.targets[i], a.real_vocab,
                                  a.ignore_index, a.keep_sum ? a.keep_sum + i * a.k : nullptr);
  if (a.logp) a.logp[i] = r.logp;
  if (a.entropy) a.entropy[i] = r.entropy;
  if (a.m) a.m[i] = r.m;
  if (a.log_s) a.log_s[i] = r.log_s;
  if (a.log_s_keep) a.log_s_keep[i] = r.log_s_keep;
}

// Backward. Rows whose target is ignored or invalid get no gradient.
//   in : as forward, plus the combine's m [n] and log_s [n], entropy [n] (null when !with_entropy), g = dL/dlogp [n],
//        e = dL/dentropy [n] (null when !with_entropy)
//   out: dhidden [n, h] in dhidden_dtype: f32 for a vocab shard's partial sum (the frontends add
//        the shards' parts in f32), or the operand dtype for the whole vocab (rounded once from the
//        f32 sum; no f32 [n, h] buffer leaves the backend), dweight [v, h] dtype,
//        dbias [v] f32 (null when !has_bias), dtemp [n] f32 (may be null) = this shard's part of
//        dT = -inv_temp * sum_j dz_j z_j (the frontends sum it over shards).
//   With keep (the forward's, null: none) and the combine's log_s_keep [n], the nucleus's dz.
//   Strategy: with `logits` (the forward's saved logits, saved_logits_bytes of the backend) the backward
//   reads it instead of recomputing z ("fast"; the CUDA backend overwrites the buffer with dlogit,
//   so it serves one backward); without, it recomputes z tile by tile ("lean").
struct BwdArgs : OperandArgs {
  const float* m = nullptr;
  const float* log_s = nullptr;
  const float* entropy = nullptr;
  const float* g = nullptr;
  const float* e = nullptr;
  const float* log_s_keep = nullptr;
  void* saved_logits = nullptr;
  void* dhidden = nullptr;
  DType dhidden_dtype = DType::kF32;  // kF32 or the Problem's dtype
  void* dweight = nullptr;
  float* dbias = nullptr;
  float* dtemp = nullptr;
};

// A status the frontends turn into an exception: nullptr on success, else a static message.
using Status = const char*;

// What every backend's backward checks of BwdArgs::dhidden_dtype.
inline Status check_dhidden_dtype(const Problem& p, DType t) {
  return t == DType::kF32 || t == p.dtype ? nullptr : "rlk backward: dhidden must be float32 or the operand dtype";
}

// Which backends exist and count their calls/tokens (incremented by the handlers that run them).
// The CUDA forward runs on kCudaSm90 or kCudaPortable; the CUDA backward on kCudaBlas (its GEMMs
// are cuBLAS's, see cuda/linear_logp_bwd.cu).
enum class Backend : int32_t { kCpu = 0, kCudaSm90 = 1, kCudaPortable = 2, kCudaBlas = 3, kCount = 4 };
const char* backend_name(Backend b);
struct RouteCounts {
  int64_t fwd_calls, fwd_tokens, bwd_calls, bwd_tokens, bwd_fast_calls;
};
// Thread-safe. `fast`: a backward that read the saved logits.
void count_call(Backend b, bool backward, int64_t tokens, bool fast = false);
RouteCounts read_counts(Backend b);
void reset_counts();

namespace cpu {
// Bytes of the CPU backend's saved logits (FwdArgs::saved_logits, BwdArgs::saved_logits): z fp32 (n v floats,
// by row block) for fp32 operands; for 16-bit operands a record per row of fp16 q = exp(z - tile
// max) with the fp32 tile maxima, chunk moments and target logit (cpu/saved_logits.h).
// Row-separable: the bytes of n rows are n times those of one.
size_t saved_logits_bytes(const Problem& p);
Status forward(const Problem& p, const FwdArgs& a);
Status combine(const CombineArgs& a);
Status backward(const Problem& p, const BwdArgs& a);
}  // namespace cpu

}  // namespace rlk
