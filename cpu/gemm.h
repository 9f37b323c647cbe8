// The CPU backend of the plain API (tiled, streaming log-sum-exp, fp32 throughout, no [n, v]
// buffer): its GEMM micro-kernels, packing and tiles. An internal header of cpu/ (forward.cc and
// backward.cc include it; everything here has internal linkage in each, as it had in one file);
// the saved logits are saved_logits.h's.
//
// Layout of the work. Hidden is packed once per call into fp32 panels of kPanel rows, k-major
// (`Ap[k][r]`), so the logits micro-kernel broadcasts one weight value and multiplies a whole
// vector of rows. Weight tiles of kTileV vocab rows are read in their natural layout (`W[j][k]`),
// in place where the weight already is fp32 (else converted). A logits tile is `T[j][r]`
// (vocab-major): every epilogue then works on vectors of rows, one lane per row, so a row's bits
// never depend on the other rows in the call.
// bf16 operands on a CPU with AVX512-BF16 take the logits from bf16 pairs instead (`dp_bf16`):
// vdpbf16ps multiplies two k of bf16 exactly and adds both products to the fp32 accumulator, twice
// the fp32 FMA rate, so the panels hold pairs of k (`Ap2[k/2][r]`) and the weight tile keeps its
// bf16 rows. The logits' order is then fixed per pair of k; every logit (tiles and target) of
// such a call comes from the same instruction sequence.
// Its backward's GEMMs take the same instruction: dlogit is rounded to bf16 once (as the CUDA
// backends round it to the operand dtype) and the pairs run along each GEMM's reduction, two vocab
// rows for dH = dlogit W, two hidden rows for dW = dlogit^T H; db and dT keep the fp32 dlogit.
//
// Order of every reduction is fixed by shapes alone (the units: forward.cc, backward.cc).
// The fp32 gradient GEMMs take several tiles (dH: kDhTiles vocab tiles, dW: kDwBlocks row blocks)
// per call, so the accumulators stay in registers over longer chains.
// Every GEMM sums in short chains (Outer): the logits' chains of kChain steps along h summed
// pairwise (their error flat in h, a BLAS's or below), the gradients' chains (one a call, along
// vocab rows for dH, rows for dW and db) added in order.
#pragma once

#include <algorithm>
#include <cmath>
#include <vector>

#if defined(__AVX512BF16__)
#include <immintrin.h>
#endif

#include "parallel.h"
#include "rlk/linear_logp.h"
#include "simd.h"

namespace rlk::cpu::RLK_CPU_ISA {  // one namespace per ISA level (cpu/dispatch.h)
namespace {

constexpr int64_t kPanel = 32;           // rows per packed hidden panel
constexpr int64_t kBlock = 2 * kPanel;   // rows per work unit
constexpr int64_t kTileV = 64;           // vocab rows per weight tile
constexpr int kRowVecs = kBlock / kLanes;

// Register blocks of the GEMMs (outer_block): a block of M broadcast scalars by NV vectors keeps M * NV
// accumulators, NV operand vectors and one broadcast in registers.
#if defined(__AVX512F__)
// 32 zmm registers: 16 or 24 accumulators.
constexpr int64_t kGroupV = 8;  // logits: vocab rows per block
constexpr int kLogitVecs = 2;   //   by vectors of hidden rows
constexpr int kGradRows = 8;    // dH, and dW under dp_bf16: rows of c (hidden or vocab rows) per block
constexpr int kGradVecs = 3;    //   by vectors of k (8 x 2: docs/benchmarks.md §7, "dH register block")
constexpr int kDwK = 4;         // dW in fp32: k per block
constexpr int kDwVecs = 4;      //   by vectors of vocab rows
#else
// 16 ymm registers: 12 accumulators, 2 operand vectors and the broadcast; 12 independent FMA chains
// cover the FMA latency at two FMAs a cycle.
constexpr int64_t kGroupV = 6;
constexpr int kLogitVecs = 2;
constexpr int kGradRows = 6;
constexpr int kGradVecs = 2;
constexpr int kDwK = 6;
constexpr int kDwVecs = 2;
#endif
static_assert(kPanel % (kLogitVecs * kLanes) == 0 && kTileV % (kDwVecs * kLanes) == 0);
constexpr int64_t kDwBlocks = 4;  // row blocks per dW GEMM: chains of 256 steps (128 pairs)
constexpr int64_t kDhTiles = 4;   // vocab tiles per fp32 dH GEMM: up to 256 steps, chains of kStepBlock
constexpr int64_t kDhBlocks = 2;  // row blocks per pass-1 unit (given enough blocks): one weight read serves them
// Steps per block of the fp32 dH GEMM (by_step_blocks): the dlogit rows' slice stays in L1.
constexpr int64_t kStepBlock = 128;
// Steps per chain of the fp32 logits (logits_panel): H in chains of kChain steps, summed pairwise.
constexpr int64_t kChain = 128;

inline int64_t cdiv(int64_t a, int64_t b) { return (a + b - 1) / b; }

#if defined(__AVX512BF16__)
constexpr bool kDpBf16 = true;
#else
constexpr bool kDpBf16 = false;
#endif
bool dp_bf16(const Problem& p) { return kDpBf16 && p.dtype == DType::kBF16; }
int64_t pair_steps(const Problem& p) { return cdiv(p.h, 2); }

// bf16 elements x[2q], x[2q + 1] as one 32-bit pair (low half first: the element order in memory),
// the missing x[h] of an odd h as 0.
inline uint32_t bf16_pair(const uint16_t* x, int64_t q, int64_t h) {
  return uint32_t(x[2 * q]) | (2 * q + 1 < h ? uint32_t(x[2 * q + 1]) << 16 : 0u);
}

// Rows of the hidden panels: n rounded up to whole row blocks.
int64_t padded_n(const Problem& p) { return cdiv(p.n, kBlock) * kBlock; }

// Hidden [n, h] -> panels Ap[panel][k][width] in fp32, rows past n zero: width = kPanel for the
// logits, or padded_n for the fp32 dW GEMM (one panel: hidden^T, whose steps run over any rows).
std::vector<float> pack_hidden(const Problem& p, const void* hidden, int64_t width) {
  std::vector<float> ap(size_t(padded_n(p) * p.h), 0.f);
  const int64_t units = cdiv(p.n, kPanel);
  parallel_for(units, workers_for(units), [&](int, int64_t q) {
    std::vector<float> row(size_t(p.h));
    for (int64_t r = q * kPanel; r < std::min(p.n, (q + 1) * kPanel); ++r) {
      to_f32(p.dtype, hidden, r * p.h, p.h, row.data());
      float* dst = ap.data() + r / width * width * p.h + r % width;
      for (int64_t k = 0; k < p.h; ++k) dst[k * width] = row[k];
    }
  });
  return ap;
}

// bf16 hidden -> pair panels Ap2[panel][k/2][kPanel] (dp_bf16); rows past n are zero.
std::vector<uint32_t> pack_hidden_pairs(const Problem& p, const void* hidden) {
  const int64_t panels = 2 * cdiv(p.n, kBlock), hk = pair_steps(p);
  std::vector<uint32_t> ap(size_t(panels * kPanel * hk), 0u);
  const uint16_t* x = static_cast<const uint16_t*>(hidden);
  parallel_for(panels, workers_for(panels), [&](int, int64_t q) {
    uint32_t* dst = ap.data() + q * kPanel * hk;
    for (int64_t r = 0; r < kPanel && q * kPanel + r < p.n; ++r)
      for (int64_t k = 0; k < hk; ++k) dst[k * kPanel + r] = bf16_pair(x + (q * kPanel + r) * p.h, k, p.h);
  });
  return ap;
}

// The hidden panels a call's GEMMs read: fp32 (the logits' unless dp_bf16) and bf16 pairs (the
// logits' when dp_bf16), and the dW GEMM's operand.
struct Panels {
  std::vector<float> f32;
  std::vector<float> t;  // the backward's fp32 dW operand, hidden^T (pack_hidden, width padded_n)
  std::vector<uint32_t> pairs;
  std::vector<uint32_t> row_pairs;  // the backward's dW operand when dp_bf16 (pack_hidden_row_pairs)
};

// Weight rows [v0, v0 + kTileV) -> wf[kTileV][h] fp32; rows at or past `v_end` are zero.
void load_weight_tile(const Problem& p, const void* weight, int64_t v0, int64_t v_end, float* wf) {
  const int64_t rows = std::max<int64_t>(0, std::min(kTileV, v_end - v0));
  to_f32(p.dtype, weight, v0 * p.h, rows * p.h, wf);
  std::fill(wf + rows * p.h, wf + kTileV * p.h, 0.f);
}

// Weight rows [v0, v0 + kTileV) -> wb[kTileV][h/2] bf16 pairs (dp_bf16); rows past `v_end` zero.
void load_weight_pairs(const Problem& p, const void* weight, int64_t v0, int64_t v_end, uint32_t* wb) {
  const int64_t rows = std::max<int64_t>(0, std::min(kTileV, v_end - v0)), hk = pair_steps(p);
  const uint16_t* w = static_cast<const uint16_t*>(weight);
  for (int64_t j = 0; j < rows; ++j)
    for (int64_t k = 0; k < hk; ++k) wb[j * hk + k] = bf16_pair(w + (v0 + j) * p.h, k, p.h);
  std::fill(wb + rows * hk, wb + kTileV * hk, 0u);
}

// Levels of the logits' pairwise stack (logits_panel) for h steps: the bits of its chains' count.
int64_t chain_levels(int64_t steps) {
  int64_t l = 1;
  while (cdiv(steps, kChain) >> l) ++l;
  return l;
}

// A weight tile as the logits read it: fp32 rows [kTileV][h] (f32) or, under dp_bf16, bf16 pairs
// [kTileV][h/2] (pairs). A whole tile whose weight already has that layout (fp32; bf16 of even h)
// is read in place: its rows are streamed once, each row in order. Other tiles are converted into
// wf or wb, with zero rows past the vocab's end.
struct WeightTile {
  std::vector<float> wf;
  std::vector<uint32_t> wb;
  std::vector<float> stack;  // the fp32 logits' pairwise stack (logits_panel)
  const float* f32 = nullptr;
  const uint32_t* pairs = nullptr;
};

// The GEMMs' operands: c[i][x] (+)= sum_{s < steps} a[s as + i ai] b[s bs + x] for rows i and
// columns x of c (row i at c + i ci, columns contiguous). E = float: one FMA a step; E = uint32_t
// (dp_bf16): a and b hold bf16 pairs and a step is one vdpbf16ps, both products of the pair.
// A call's sum is one accumulator chain from zero, then stored (zero_c) or added to c: c + chain,
// so a long reduction split over calls is a sum of short chains (a blocked sum, as a BLAS's).
template <class E>
struct Outer {
  const E* a;
  int64_t as, ai;
  const E* b;
  int64_t bs, steps;
  float* c;
  int64_t ci;
  Outer rows_from(int64_t i) const { return {a + i * ai, as, ai, b, bs, steps, c + i * ci, ci}; }
  Outer cols_from(int64_t x) const { return {a, as, ai, b + x, bs, steps, c + x, ci}; }
  Outer steps_from(int64_t s0, int64_t count) const { return {a + s0 * as, as, ai, b + s0 * bs, bs, count, c, ci}; }
};

// gemm(o', zero_c') for o's steps in blocks of kStepBlock, in order: c + each block's chain (see
// Outer), and a block's slice of the operand every register block reads stays in L1.
template <class E, class Gemm>
void by_step_blocks(const Outer<E>& o, bool zero_c, Gemm&& gemm) {
  for (int64_t s0 = 0; s0 < o.steps; s0 += kStepBlock)
    gemm(o.steps_from(s0, std::min(kStepBlock, o.steps - s0)), zero_c && s0 == 0);
}

// The pairwise sum of chains 0 .. chains - 1 (a binary counter): chain b's sum p first takes the
// partial sums its carries meet (levels l = 0.. while bit l of b is 1), then goes on the stack at
// the first free level, unless b is the last chain: then it takes the levels still held (the
// higher set bits of b) and is the whole sum. The tree depends on `chains` alone.
struct Pairwise {
  int carries = 0;    // levels taken first
  uint64_t held = 0;  // the last chain: the higher levels it takes (bit l: level l)
  bool last = true;
  Pairwise(int64_t b, int64_t chains) {
    while ((b >> carries) & 1) ++carries;
    last = b + 1 >= chains;
    held = last ? uint64_t(b) >> (carries + 1) << (carries + 1) : 0;
  }
  // Chain p's merge with the stack (x_l: level l's element; logits_panel per tile, target_dot per
  // scalar): true when p is the sum.
  template <class P, class Level>
  bool merge(P&& add, Level&& level) const {
    for (int l = 0; l < carries; ++l) add(l);
    if (!last) {
      level(carries);
      return false;
    }
    for (uint64_t rest = held; rest; rest &= rest - 1) add(__builtin_ctzll(rest));
    return true;
  }
};

// One step of an accumulator chain: acc + a b.
inline fvec mac(fvec a, fvec b, fvec acc, float) { return vfma(a, b, acc); }
inline fvec bcast(float x) { return broadcast(x); }
inline fvec load_operand(const float* p) { return vload(p); }
#if defined(__AVX512BF16__)
inline __m512bh bf16_pairs(fvec x) { return reinterpret_cast<__m512bh&>(x); }
inline fvec mac(fvec a, fvec b, fvec acc, uint32_t) { return _mm512_dpbf16_ps(acc, bf16_pairs(a), bf16_pairs(b)); }
inline fvec bcast(uint32_t x) { return _mm512_castsi512_ps(_mm512_set1_epi32(int32_t(x))); }
inline fvec load_operand(const uint32_t* p) { return vload(reinterpret_cast<const float*>(p)); }
#endif

// Rows i < M by NV vectors of columns, accumulators in registers: each element is one chain over
// s in increasing order from 0, then stored (zero_c) or added to c. kPrefetch: b's rows are far apart (the
// weight's own rows, read in place), too many streams for the hardware prefetcher, so each step
// also asks for its row's next NV vectors, the next column block's operand.
template <int M, int NV, class E, bool kPrefetch = false>
inline __attribute__((always_inline)) void outer_block(const Outer<E>& o, bool zero_c) {
  fvec acc[M][NV];
#pragma GCC unroll 16
  for (int i = 0; i < M; ++i)
#pragma GCC unroll 16
    for (int v = 0; v < NV; ++v) acc[i][v] = splat(0.f);
  for (int64_t s = 0; s < o.steps; ++s) {
    fvec b[NV];
#pragma GCC unroll 16
    for (int v = 0; v < NV; ++v) {
      // b in a register: GCC would otherwise fold the load into each of the M FMAs that use it,
      // M loads a vector instead of one, and the loads, not the FMAs, would set the pace.
      fvec x = load_operand(o.b + s * o.bs + v * kLanes);
#if defined(__AVX__)  // a 32-byte vector has a register from AVX on (none in the x86-64 baseline)
      __asm__("" : "+v"(x));
#endif
      b[v] = x;
    }
    if constexpr (kPrefetch)
      for (int v = 0; v < NV; ++v) __builtin_prefetch(o.b + s * o.bs + (NV + v) * kLanes);
#pragma GCC unroll 16
    for (int i = 0; i < M; ++i) {
      const fvec x = bcast(o.a[s * o.as + i * o.ai]);
#pragma GCC unroll 16
      for (int v = 0; v < NV; ++v) acc[i][v] = mac(x, b[v], acc[i][v], E{});
    }
  }
#pragma GCC unroll 16
  for (int i = 0; i < M; ++i)
#pragma GCC unroll 16
    for (int v = 0; v < NV; ++v) {
      float* c = o.c + i * o.ci + v * kLanes;
      vstore(c, zero_c ? acc[i][v] : vload(c) + acc[i][v]);
    }
}

// Rows [0, m) in blocks of M (the last m % M rows by smaller blocks), NV vectors of columns.
template <int M, int NV, class E, bool kPrefetch = false>
void outer_rows(const Outer<E>& o, int64_t m, bool zero_c) {
  int64_t i = 0;
  for (; i + M <= m; i += M) outer_block<M, NV, E, kPrefetch>(o.rows_from(i), zero_c);
  if constexpr (M > 1)
    if (i < m) outer_rows<M - 1, NV, E, kPrefetch>(o.rows_from(i), m - i, zero_c);
}

// Rows [0, m) by nv vectors of columns: blocks of NV vectors (the rest by smaller blocks), each
// over all rows.
template <int M, int NV, class E, bool kPrefetch = false>
void outer_grid(const Outer<E>& o, int64_t m, int64_t nv, bool zero_c) {
  int64_t v = 0;
  for (; v + NV <= nv; v += NV) outer_rows<M, NV, E, kPrefetch>(o.cols_from(v * kLanes), m, zero_c);
  if constexpr (NV > 1)
    if (v < nv) outer_grid<M, NV - 1, E, kPrefetch>(o.cols_from(v * kLanes), m, nv - v, zero_c);
}

// Columns [x0, x1) of c, each element the same FMA chain as outer_block's (one chain a call, not
// pairwise): the columns past the last whole vector.
void outer_tail(const Outer<float>& o, int64_t m, int64_t x0, int64_t x1, bool zero_c) {
  for (int64_t i = 0; i < m; ++i)
    for (int64_t x = x0; x < x1; ++x) {
      float acc = 0.f;
      for (int64_t s = 0; s < o.steps; ++s) acc = std::fma(o.a[s * o.as + i * o.ai], o.b[s * o.bs + x], acc);
      o.c[i * o.ci + x] = zero_c ? acc : o.c[i * o.ci + x] + acc;
    }
}

// Rows [0, m) by `cols` columns of c in fp32: whole vectors by outer_grid, the rest by outer_tail.
template <int M, int NV, bool kPrefetch = false>
void outer_f32(const Outer<float>& o, int64_t m, int64_t cols, bool zero_c) {
  outer_grid<M, NV, float, kPrefetch>(o, m, cols / kLanes, zero_c);
  outer_tail(o, m, cols - cols % kLanes, cols, zero_c);
}

// T[j][r] = sum_k wf[j][k] ap[k][r] for j < kTileV, r < kPanel: per element, chains of kChain
// steps (k in order) summed pairwise (Pairwise, tile by tile), the error of a BLAS's blocked sum or
// below. A chain's GEMM writes straight into the level it goes to, level 0 being t itself (free
// whenever an even chain starts, and at the end), level l > 0 at stack + (l - 1) kTileV ldt
// (chain_levels(h) - 1 panels laid out as t). Every logit of the library is computed by this
// function (or, dp_bf16, by the pair version below), or by target_dot's copy of its sequence.
inline void logits_panel(const float* wf, const float* ap, int64_t h, float* t, int64_t ldt, float* stack) {
  const int64_t chains = std::max<int64_t>(1, cdiv(h, kChain));  // h = 0: one chain of no steps, zeros
  auto level = [&](int l) { return l == 0 ? t : stack + (l - 1) * kTileV * ldt; };
  auto tile_op = [&](float* dst, const float* src, auto&& f) {
    for (int64_t j = 0; j < kTileV; ++j)
      for (int64_t r = 0; r < kPanel; r += kLanes) f(dst + j * ldt + r, src + j * ldt + r);
  };
  for (int64_t b = 0; b < chains; ++b) {
    const int64_t s0 = b * kChain;
    const Pairwise plan(b, chains);
    float* p = level(plan.carries);  // the chain's sum, then its partial sum
    outer_grid<kGroupV, kLogitVecs>(
        Outer<float>{wf + s0, 1, h, ap + s0 * kPanel, kPanel, std::min(kChain, h - s0), p, ldt}, kTileV,
        kPanel / kLanes, true);
    auto add = [&](int l) { tile_op(p, level(l), [](float* y, const float* x) { vstore(y, vload(x) + vload(y)); }); };
    if (plan.merge(add, [](int) {}) && p != t) tile_op(t, p, [](float* y, const float* x) { vstore(y, vload(x)); });
  }
}

#if defined(__AVX512BF16__)
// The same for bf16 pairs: T[j][r] = sum over pairs q of wb[j][q] . ap[q][r], one vdpbf16ps per
// pair, q in order.
inline void logits_panel(const uint32_t* wb, const uint32_t* ap, int64_t hk, float* t, int64_t ldt) {
  outer_grid<kGroupV, kLogitVecs>(Outer<uint32_t>{wb, 1, hk, ap, kPanel, hk, t, ldt}, kTileV, kPanel / kLanes, true);
}

// One logit by logits_panel's sequence (a target's z_t): the pairs broadcast to every lane.
float dot_pairs(const uint16_t* x, const uint16_t* w, int64_t h) {
  fvec acc = splat(0.f);
  for (int64_t q = 0; q < cdiv(h, 2); ++q)
    acc = mac(bcast(bf16_pair(w, q, h)), bcast(bf16_pair(x, q, h)), acc, uint32_t{});
  return acc[0];
}
#endif

// Logits tile T[kTileV][kBlock] for the row block starting at panel q0 (two panels), `steps`: h
// (fp32) or the pair steps (bf16 pairs).
template <class E, class... Stack>
void logits_tile(const E* w, const E* ap, int64_t q0, int64_t steps, float* t, Stack... stack) {
  for (int64_t pq = 0; pq < 2; ++pq)
    logits_panel(w, ap + (q0 + pq) * kPanel * steps, steps, t + pq * kPanel, kBlock, (stack + pq * kPanel)...);
}

// The logits tile of row block blk from the weight tile w.
void tile_logits(const Problem& p, const Panels& ap, WeightTile& w, int64_t blk, float* t) {
#if defined(__AVX512BF16__)
  if (dp_bf16(p)) return logits_tile(w.pairs, ap.pairs.data(), 2 * blk, pair_steps(p), t);
#endif
  logits_tile(w.f32, ap.f32.data(), 2 * blk, p.h, t, w.stack.data());
}

// The weight tile the logits read: pairs when dp_bf16, else f32 (see WeightTile).
void load_logits_weight(const Problem& p, const void* weight, int64_t v0, int64_t v_end, WeightTile& w) {
  const bool whole = v_end - v0 == kTileV;
  if (dp_bf16(p)) {
    if (whole && p.h % 2 == 0) {
      w.pairs = static_cast<const uint32_t*>(weight) + v0 * p.h / 2;
      return;
    }
    load_weight_pairs(p, weight, v0, v_end, w.wb.data());
    w.pairs = w.wb.data();
  } else if (whole && p.dtype == DType::kF32) {
    w.f32 = static_cast<const float*>(weight) + v0 * p.h;
  } else {
    load_weight_tile(p, weight, v0, v_end, w.wf.data());
    w.f32 = w.wf.data();
  }
}

WeightTile weight_tile(const Problem& p) {
  WeightTile w;
  w.wf.resize(size_t(kTileV * p.h));
  if (!dp_bf16(p)) w.stack.resize(size_t((chain_levels(p.h) - 1) * kTileV * kBlock));
  if (dp_bf16(p)) w.wb.resize(size_t(kTileV * pair_steps(p)));
  return w;
}

// h rounded up to whole vectors: the row length of the pair GEMMs' operands and outputs (dp_bf16).
int64_t padded_h(const Problem& p) { return cdiv(p.h, kLanes) * kLanes; }
// The row length of the backward's dH scratch.
int64_t dh_stride(const Problem& p) { return dp_bf16(p) ? padded_h(p) : p.h; }

#if defined(__AVX512BF16__)
// ---- the gradient GEMMs in bf16 pairs (dp_bf16) ---------------------------------------------------
// dH = dlogit W and dW = dlogit^T H take vdpbf16ps too: dlogit is rounded to bf16 once (round_bf16;
// the CUDA backends also round it to the operand dtype before their GEMMs), the products are exact
// and the sums fp32. A pair runs along the GEMM's reduction: two vocab rows for dH, two hidden rows
// for dW. The operands' rows are padded with zeros to hp columns, whole vectors, so the kernels have
// no column tail.

// Rows x and y of h bf16 (null: zeros) -> dst[k] = (x[k], y[k]) for k < hp, zero past h.
// vpermt2w indices of pair_rows: x[k] to the even halves, y[k] (index 32 + k) to the odd ones;
// `hi` the same for k + 16. Built once, not per row pair.
struct PairIndex {
  alignas(64) int16_t lo[32], hi[32];
  PairIndex() {
    for (int i = 0; i < 32; ++i) {
      lo[i] = int16_t(i / 2 + (i % 2) * 32);
      hi[i] = int16_t(lo[i] + 16);
    }
  }
};
const PairIndex kPairIndex;

void pair_rows(const uint16_t* x, const uint16_t* y, int64_t h, int64_t hp, uint32_t* dst) {
  const __m512i ilo = _mm512_load_si512(kPairIndex.lo), ihi = _mm512_load_si512(kPairIndex.hi);
  int64_t k = 0;
  if (x && y)
    for (; k + 32 <= h; k += 32) {
      const __m512i a = _mm512_loadu_si512(x + k), b = _mm512_loadu_si512(y + k);
      _mm512_storeu_si512(dst + k, _mm512_permutex2var_epi16(a, ilo, b));
      _mm512_storeu_si512(dst + k + 16, _mm512_permutex2var_epi16(a, ihi, b));
    }
  for (; k < hp; ++k) dst[k] = uint32_t(x && k < h ? x[k] : 0) | uint32_t(y && k < h ? y[k] : 0) << 16;
}

// bf16 hidden -> hr[n/2][hp], pairs of adjacent rows (dW's operand), over whole row blocks; rows
// past n are zero.
std::vector<uint32_t> pack_hidden_row_pairs(const Problem& p, const void* hidden) {
  const int64_t blocks = cdiv(p.n, kBlock), hp = padded_h(p);
  std::vector<uint32_t> hr(size_t(blocks * kBlock / 2 * hp));
  const uint16_t* x = static_cast<const uint16_t*>(hidden);
  auto row = [&](int64_t r) { return r < p.n ? x + r * p.h : nullptr; };
  parallel_for(blocks, workers_for(blocks), [&](int, int64_t blk) {
    for (int64_t q = blk * kBlock / 2; q < (blk + 1) * kBlock / 2; ++q)
      pair_rows(row(2 * q), row(2 * q + 1), p.h, hp, hr.data() + q * hp);
  });
  return hr;
}

// Weight rows [v0, v0 + kTileV) -> wj[kTileV/2][hp], pairs of adjacent rows (dH's operand); rows
// at or past v_end are zero.
void load_weight_row_pairs(const Problem& p, const void* weight, int64_t v0, int64_t v_end, uint32_t* wj) {
  const uint16_t* w = static_cast<const uint16_t*>(weight);
  const int64_t hp = padded_h(p);
  auto row = [&](int64_t j) { return v0 + j < v_end ? w + (v0 + j) * p.h : nullptr; };
  for (int64_t q = 0; q < kTileV / 2; ++q) pair_rows(row(2 * q), row(2 * q + 1), p.h, hp, wj + q * hp);
}

// dlogit's one rounding: 16 fp32 -> 16 bf16, to nearest even.
inline __m256i round_bf16(fvec x) {
  const __m256bh b = _mm512_cvtneps_pbh(x);
  return reinterpret_cast<const __m256i&>(b);
}

// dlogit tile T[j][r] -> dH's pairs of vocab rows, dv[j/2][r] = (T[2q][r], T[2q + 1][r]).
void dlogit_vocab_pairs(const float* t, uint32_t* dv) {
  for (int64_t q = 0; q < kTileV / 2; ++q)
    for (int rv = 0; rv < kRowVecs; ++rv) {
      const __m512i lo = _mm512_cvtepu16_epi32(round_bf16(vload(t + 2 * q * kBlock + rv * kLanes)));
      const __m512i hi = _mm512_cvtepu16_epi32(round_bf16(vload(t + (2 * q + 1) * kBlock + rv * kLanes)));
      _mm512_storeu_si512(dv + q * kBlock + rv * kLanes, _mm512_or_si512(lo, _mm512_slli_epi32(hi, 16)));
    }
}

// dlogit tile T[j][r] -> dW's pairs of rows, dr[j][r/2] = (T[j][2q], T[j][2q + 1]) with row
// stride ldr: the bf16 of a vocab row's 32 rows in order are 16 such pairs.
void dlogit_row_pairs(const float* t, uint32_t* dr, int64_t ldr) {
  static_assert(kRowVecs % 2 == 0);
  for (int64_t j = 0; j < kTileV; ++j)
    for (int rv = 0; rv < kRowVecs; rv += 2) {
      const float* x = t + j * kBlock + rv * kLanes;
      const __m512i pairs =
          _mm512_inserti64x4(_mm512_castsi256_si512(round_bf16(vload(x))), round_bf16(vload(x + kLanes)), 1);
      _mm512_storeu_si512(dr + j * ldr + rv * kLanes / 2, pairs);
    }
}
#endif

// z = (acc + b_j) * inv_temp, in place, for the first `valid` vocab rows of the tile.
void scale_tile(float* t, const float* bias_f, int64_t valid, const fvec* inv_temp) {
  for (int64_t j = 0; j < valid; ++j)
    for (int rv = 0; rv < kRowVecs; ++rv) {
      float* z = t + j * kBlock + rv * kLanes;
      vstore(z, (vload(z) + (bias_f ? bias_f[j] : 0.f)) * inv_temp[rv]);
    }
}

// The nucleus of rows r0.. at columns [v0, v0 + valid) as a tile K[j][r] of 1 (kept) and 0 (not
// kept, and rows past n).
void keep_tile(const Problem& p, const uint8_t* keep, int64_t r0, int64_t v0, int64_t valid, float* kt) {
  for (int64_t r = 0; r < kBlock; ++r) {
    const uint8_t* row = r0 + r < p.n ? keep + (r0 + r) * p.v + v0 : nullptr;
    for (int64_t j = 0; j < valid; ++j) kt[j * kBlock + r] = row && row[j] ? 1.f : 0.f;
  }
}

}  // namespace
}  // namespace rlk::cpu::RLK_CPU_ISA
