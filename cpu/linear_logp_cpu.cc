// CPU backend of the plain API: tiled, streaming log-sum-exp, fp32 throughout, no [n, v] buffer.
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
// Order of every reduction is fixed by shapes alone:
//   forward   unit = (row block, chunk); tiles of the chunk from its first column, in order.
//   backward  pass 1 (dH, dT): unit = kDhBlocks row blocks (one where there are few), each
//                               over all tiles in vocab order; the blocks share the weight's reads.
//             pass 2 (dW, db):  unit = vocab tile, all row blocks in row order.
// The fp32 gradient GEMMs take several tiles (dH: kDhTiles vocab tiles, dW: kDwBlocks row blocks)
// per call, so the accumulators stay in registers over longer chains.
// Every GEMM sums in short chains (Outer): the logits' chains of kChain steps along h summed
// pairwise (their error flat in h, a BLAS's or below), the gradients' chains (one a call, along
// vocab rows for dH, rows for dW and db) added in order.
// The lean backward recomputes logits in both passes (four GEMM-equivalents in all), which keeps
// the threads' outputs disjoint with no fp32 [v, h] or [n, v] scratch; the fast one reads them
// from the forward's kept logits instead (two GEMM-equivalents).
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
constexpr int kGradVecs = 3;    //   by vectors of k (8 x 2 ran the fp32 dH kernel about 10% slower)
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
// Pairwise (chains > 1, logits_panel): the call's steps are chains of kChain steps, from chain
// `chain` on, of one sum of `chains` chains, combined by Pairwise through `stack` (its levels laid
// out as c, level l at stack + l level).
template <class E>
struct Outer {
  const E* a;
  int64_t as, ai;
  const E* b;
  int64_t bs, steps;
  float* c;
  int64_t ci;
  float* stack = nullptr;
  int64_t level = 0, chain = 0, chains = 1;
  Outer rows_from(int64_t i) const { return moved(i * ai, 0, i * ci); }
  Outer cols_from(int64_t x) const { return moved(0, x, x); }
  Outer steps_from(int64_t s0, int64_t count) const {
    Outer o = moved(s0 * as, s0 * bs, 0);
    o.steps = count;
    return o;
  }
  Outer moved(int64_t da, int64_t db, int64_t dc) const {
    Outer o = *this;
    o.a += da, o.b += db, o.c += dc;
    if (stack) o.stack += dc;
    return o;
  }
};

// gemm(o', zero_c') for o's steps in blocks of kStepBlock, in order, and a block's slice of the
// operand every register block reads stays in L1: c + each block's chain (see Outer) or, pairwise
// (o.chains > 1), the block's chains of kChain steps.
template <class E, class Gemm>
void by_step_blocks(const Outer<E>& o, bool zero_c, Gemm&& gemm) {
  int64_t s0 = 0;
  do {
    Outer<E> ob = o.steps_from(s0, std::min(kStepBlock, o.steps - s0));
    if (o.chains > 1) ob.chain = o.chain + s0 / kChain;
    gemm(ob, o.chains > 1 ? zero_c : zero_c && s0 == 0);  // pairwise: zero_c is for the last chain's store
    s0 += kStepBlock;
  } while (s0 < o.steps);
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
  // One scalar sum's chain p with its stack (target_dot): true when p is the sum.
  bool merge(float& p, float* stack) const {
    for (int l = 0; l < carries; ++l) p = stack[l] + p;
    if (!last) {
      stack[carries] = p;
      return false;
    }
    for (uint64_t rest = held; rest; rest &= rest - 1) p = stack[__builtin_ctzll(rest)] + p;
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

// The end of a register block's chains acc[i][v] (element i ci + v kLanes of c), Pairwise's steps
// level by level (one branch a level, not one an element), then stored (zero_c) or added to c.
template <int M, int NV, class E>
inline __attribute__((always_inline)) void finish_block(const Outer<E>& o, const Pairwise& plan, fvec (&acc)[M][NV],
                                                        bool zero_c) {
  auto each = [&](auto&& f) {
#pragma GCC unroll 16
    for (int i = 0; i < M; ++i)
#pragma GCC unroll 16
      for (int v = 0; v < NV; ++v) f(acc[i][v], i * o.ci + v * kLanes);
  };
  for (int l = 0; l < plan.carries; ++l) each([&](fvec& p, int64_t off) { p = vload(o.stack + l * o.level + off) + p; });
  if (!plan.last) return each([&](fvec& p, int64_t off) { vstore(o.stack + plan.carries * o.level + off, p); });
  for (uint64_t rest = plan.held; rest; rest &= rest - 1) {
    const int64_t l = __builtin_ctzll(rest);
    each([&](fvec& p, int64_t off) { p = vload(o.stack + l * o.level + off) + p; });
  }
  if (zero_c) return each([&](fvec& p, int64_t off) { vstore(o.c + off, p); });
  each([&](fvec& p, int64_t off) { vstore(o.c + off, vload(o.c + off) + p); });
}

// Rows i < M by NV vectors of columns, accumulators in registers: each element is one chain over
// s in increasing order from 0, ended by finish. kPrefetch: b's rows are far apart (the
// weight's own rows, read in place), too many streams for the hardware prefetcher, so each step
// also asks for its row's next NV vectors, the next column block's operand.
template <int M, int NV, class E, bool kPrefetch = false>
inline __attribute__((always_inline)) void outer_block(const Outer<E>& o, bool zero_c) {
  // The call's chains: one over all its steps, or (pairwise, o.chains > 1) chains of kChain steps,
  // the first of them chain o.chain. (h = 0: one chain of no steps, zeros.)
  const int64_t len = o.chains > 1 ? kChain : o.steps;
  int64_t s0 = 0, chain = o.chain;
  do {
    fvec acc[M][NV];
#pragma GCC unroll 16
    for (int i = 0; i < M; ++i)
#pragma GCC unroll 16
      for (int v = 0; v < NV; ++v) acc[i][v] = splat(0.f);
    for (int64_t s = s0; s < std::min(o.steps, s0 + len); ++s) {
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
    finish_block<M, NV>(o, Pairwise(chain, o.chains), acc, zero_c);
    s0 += len, ++chain;
  } while (s0 < o.steps);
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
// steps (k in order) summed pairwise (Outer), the error of a BLAS's blocked sum or below; `stack`
// holds chain_levels(h) tiles laid out as t. Every logit of the library is computed by this function
// (or, dp_bf16, by the pair version below), or by target_dot's copy of its sequence.
inline void logits_panel(const float* wf, const float* ap, int64_t h, float* t, int64_t ldt, float* stack) {
  static_assert(kStepBlock % kChain == 0);
  const Outer<float> o{wf, 1, h, ap, kPanel, h, t, ldt, stack, kTileV * ldt, 0, cdiv(h, kChain)};
  by_step_blocks(o, true, [](const Outer<float>& ob, bool zero_c) {
    outer_grid<kGroupV, kLogitVecs>(ob, kTileV, kPanel / kLanes, zero_c);
  });
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
  if (!dp_bf16(p)) w.stack.resize(size_t(chain_levels(p.h) * kTileV * kBlock));
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
      const __m512i pairs = _mm512_inserti64x4(_mm512_castsi256_si512(round_bf16(vload(x))), round_bf16(vload(x + kLanes)), 1);
      _mm512_storeu_si512(dr + j * ldr + rv * kLanes / 2, pairs);
    }
}
#endif

// Per-row data of one row block, as vectors of rows.
struct RowBlock {
  fvec inv_temp[kRowVecs], m[kRowVecs], log_s[kRowVecs], c[kRowVecs], g[kRowVecs], e[kRowVecs];  // c = log_s - ent
  fvec log_s_keep[kRowVecs];  // the nucleus's (BwdArgs::keep)
  ivec target[kRowVecs];
  fvec active[kRowVecs];  // 1 for rows that get gradient, else 0
};

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

// ---- the kept buffer (FwdArgs::logits, the fast backward's input; kept_bytes) --------------------
// fp32 operands: z fp32, as the forward computed it (what lean recomputes, bit for bit), by row
// block: the nr = min(kBlock, n - r0) rows of the block at row r0 keep z^T [v][nr] from float
// r0 v on (kept_z), so a (row block, vocab tile) piece is one contiguous run in the tiles' own
// T[j][r] order, moved with no transpose; n v floats in all.
// 16-bit operands, one record per row (row_bytes):
//   float moments[chunks][6]   the chunk's (m, s, a, b, s_keep, a_keep), b = sum_j exp(z_j - m)
//                              (z_j - m)^2, s_keep and a_keep the sums of s and a over the nucleus
//                              (FwdArgs::keep; 0 without)
//   float tile_max[chunks * tiles_per_chunk]   mt: the running row max after each tile
//   float z_target             the forward's target_logit
//   fp16  q[v (even)]          q_j = exp(z_j - mt) of the column's tile, in [0, 1]
// so p_j = q_j exp((mt - m) - log_s) has fp16's uniform relative error at every |z|, and dT, an
// fp32 output, comes from the fp32 moments (see kept_dzz) instead of from q.
constexpr int64_t kMoments = 6;
struct KeptRow {
  int64_t chunks, tiles_per_chunk, floats, bytes;
  explicit KeptRow(const Problem& p)
      : chunks(num_chunks(p)), tiles_per_chunk(cdiv(p.chunk, kTileV)),
        floats(chunks * kMoments + chunks * tiles_per_chunk + 1), bytes(floats * 4 + 2 * (p.v + p.v % 2)) {}
  float* moments(void* kept, int64_t r) const { return reinterpret_cast<float*>(static_cast<char*>(kept) + r * bytes); }
  float* tile_max(void* kept, int64_t r) const { return moments(kept, r) + chunks * kMoments; }
  float* z_target(void* kept, int64_t r) const { return tile_max(kept, r) + chunks * tiles_per_chunk; }
  uint16_t* q(void* kept, int64_t r) const {
    return reinterpret_cast<uint16_t*>(static_cast<char*>(kept) + r * bytes + floats * 4);
  }
};

bool kept_f32(const Problem& p) { return p.dtype == DType::kF32; }

// Rows of the row block that starts at row r0.
int64_t block_rows(const Problem& p, int64_t r0) { return std::min(kBlock, p.n - r0); }

// The fp32 record's z of column col for the rows of the block at row r0 (contiguous, block_rows).
float* kept_z(const Problem& p, const void* kept, int64_t r0, int64_t col) {
  return const_cast<float*>(static_cast<const float*>(kept)) + r0 * p.v + col * block_rows(p, r0);
}

// Tile T[j][r] (columns v0.., rows r0..) -> the kept buffer for j < cols: z (fp32) or q (16-bit).
void store_kept(const Problem& p, void* kept, int64_t r0, int64_t v0, int64_t cols, const float* t) {
  const int64_t nr = block_rows(p, r0);
  if (kept_f32(p)) {
    for (int64_t j = 0; j < cols; ++j) std::copy_n(t + j * kBlock, nr, kept_z(p, kept, r0, v0 + j));
    return;
  }
  const KeptRow row(p);
  for (int64_t r = 0; r < nr; ++r) {
    uint16_t* q = row.q(kept, r0 + r) + v0;
    for (int64_t j = 0; j < cols; ++j) q[j] = f32_to_f16(t[j * kBlock + r]);
  }
}

// Every byte of the kept buffer is written: chunk c's padding columns [pad0, c1) of rows r0.. get
// z = -inf (fp32) or q = 0 and tile maxima -inf (16-bit; also the odd v's spare q slot).
void fill_kept_padding(const Problem& p, void* kept, int64_t r0, int64_t c, int64_t pad0) {
  const KeptRow row(p);
  const int64_t c0 = c * p.chunk, c1 = c0 + p.chunk;
  if (kept_f32(p)) {
    if (pad0 < c1) std::fill(kept_z(p, kept, r0, pad0), kept_z(p, kept, r0, c1), -INFINITY);
    return;
  }
  for (int64_t r = r0; r < r0 + block_rows(p, r0); ++r) {
    std::fill(row.q(kept, r) + pad0, row.q(kept, r) + c1 + (c1 == p.v ? p.v % 2 : 0), uint16_t(0));
    float* tmax = row.tile_max(kept, r) + c * row.tiles_per_chunk;
    std::fill(tmax + cdiv(pad0 - c0, kTileV), tmax + row.tiles_per_chunk, -INFINITY);
  }
}

// The kept buffer -> T[j][r] for j < valid (z or q); rows past n read as 0 (they get no gradient).
void load_kept(const Problem& p, const void* kept, int64_t r0, int64_t v0, int64_t valid, float* t) {
  const int64_t nr = block_rows(p, r0);
  if (kept_f32(p)) {
    for (int64_t j = 0; j < valid; ++j) {
      std::copy_n(kept_z(p, kept, r0, v0 + j), nr, t + j * kBlock);
      std::fill(t + j * kBlock + nr, t + (j + 1) * kBlock, 0.f);
    }
    return;
  }
  const KeptRow row(p);
  for (int64_t r = 0; r < kBlock; ++r) {
    if (r >= nr) {
      for (int64_t j = 0; j < valid; ++j) t[j * kBlock + r] = 0.f;
    } else {
      const uint16_t* q = row.q(const_cast<void*>(kept), r0 + r) + v0;
      for (int64_t j = 0; j < valid; ++j) t[j * kBlock + r] = f16_to_f32(q[j]);
    }
  }
}

// ---- forward ---------------------------------------------------------------------------------

struct FwdScratch {
  WeightTile w;
  std::vector<float> t, kt;  // logits, nucleus (FwdArgs::keep)
};

void forward_unit(const Problem& p, const FwdArgs& a, const Panels& ap, int64_t blk, int64_t c,
                  FwdScratch& s) {
  const int64_t r0 = blk * kBlock;
  const bool keep_q = a.logits && !kept_f32(p);  // the 16-bit kept record: q, tile maxima, moments
  const KeptRow row(p);
  // sk, ak: s and a over the nucleus (with a.keep; ak only for the kept record)
  fvec inv_temp[kRowVecs], m[kRowVecs], sum[kRowVecs], acc_a[kRowVecs], acc_b[kRowVecs], sk[kRowVecs], ak[kRowVecs];
  for (int rv = 0; rv < kRowVecs; ++rv) {
    float tmp[kLanes];
    for (int l = 0; l < kLanes; ++l) {
      const int64_t r = r0 + rv * kLanes + l;
      tmp[l] = r < p.n ? reciprocal(a.temperature[r]) : 1.f;
    }
    inv_temp[rv] = vload(tmp);
    m[rv] = splat(-INFINITY);
    sum[rv] = acc_a[rv] = acc_b[rv] = sk[rv] = ak[rv] = splat(0.f);
  }
  const int64_t c0 = c * p.chunk, c1 = c0 + p.chunk;
  // Columns at or past `real_end` are padding.
  const int64_t real_end = std::clamp<int64_t>(p.real_vocab - p.vocab_start, 0, p.v);
  for (int64_t v0 = c0; v0 < std::min(c1, real_end); v0 += kTileV) {
    const int64_t valid = std::min({kTileV, c1 - v0, real_end - v0});
    load_logits_weight(p, a.weight, v0, v0 + valid, s.w);
    tile_logits(p, ap, s.w, blk, s.t.data());
    scale_tile(s.t.data(), p.has_bias ? a.bias + v0 : nullptr, valid, inv_temp);
    if (a.logits && !keep_q) store_kept(p, a.logits, r0, v0, valid, s.t.data());
    if (a.keep) keep_tile(p, a.keep, r0, v0, valid, s.kt.data());
    for (int rv = 0; rv < kRowVecs; ++rv) {
      // The tile's sums from zero (few roundings at the row's scale), relative to the new max mt.
      // A NaN logit makes its sums NaN; a logit of -inf counts as probability 0.
      fvec mt = m[rv];
      for (int64_t j = 0; j < valid; ++j) mt = vmax(mt, vload(s.t.data() + j * kBlock + rv * kLanes));
      fvec ts = splat(0.f), ta = splat(0.f), tb = splat(0.f), tsk = splat(0.f), tak = splat(0.f);
      for (int64_t j = 0; j < valid; ++j) {
        float* zp = s.t.data() + j * kBlock + rv * kLanes;
        const fvec z = vload(zp);
        const ivec live = z != -INFINITY;
        const fvec tz = live ? z - mt : splat(0.f);
        const fvec ez = live ? vexp(tz) : splat(0.f);
        ts += ez;
        ta += ez * tz;
        tb += ez * tz * tz;  // also without keep_q: the same arithmetic, so the same bits, either way
        if (a.keep) {
          const ivec kept = vload(s.kt.data() + j * kBlock + rv * kLanes) != 0.f;
          tsk += kept ? ez : splat(0.f);
          tak += kept ? ez * tz : splat(0.f);
        }
        if (keep_q) vstore(zp, ez);
      }
      // Fold the tile into the running sums, rescaled to mt (selects, not products: d is NaN
      // while m = mt = -inf; a NaN sum stays NaN).
      const fvec d = m[rv] - mt;
      const fvec alpha = vexp(d);
      const ivec has = sum[rv] != 0.f;
      ak[rv] = has ? alpha * (ak[rv] + d * sk[rv]) + tak : tak;
      sk[rv] = has ? alpha * sk[rv] + tsk : tsk;
      // b as moments_merge: the old part adds nothing once alpha underflows (d^2 sum may overflow)
      acc_b[rv] = has & (alpha != 0.f) ? alpha * (acc_b[rv] + d * (2.f * acc_a[rv] + d * sum[rv])) + tb : tb;
      acc_a[rv] = has ? alpha * (acc_a[rv] + d * sum[rv]) + ta : ta;
      sum[rv] = has ? alpha * sum[rv] + ts : ts;
      m[rv] = mt;
      if (keep_q)
        for (int l = 0; l < kLanes && r0 + rv * kLanes + l < p.n; ++l)
          row.tile_max(a.logits, r0 + rv * kLanes + l)[c * row.tiles_per_chunk + (v0 - c0) / kTileV] = mt[l];
    }
    if (keep_q) store_kept(p, a.logits, r0, v0, valid, s.t.data());
  }
  if (a.logits) fill_kept_padding(p, a.logits, r0, c, std::clamp(real_end, c0, c1));
  const int64_t k = num_chunks(p);
  for (int rv = 0; rv < kRowVecs; ++rv)
    for (int l = 0; l < kLanes; ++l) {
      const int64_t r = r0 + rv * kLanes + l;
      if (r >= p.n) break;
      float* st = a.stats + (r * k + c) * kStatWidth;
      st[0] = m[rv][l];
      st[1] = sum[rv][l];
      st[2] = p.with_entropy ? acc_a[rv][l] : 0.f;
      if (a.keep) a.keep_sum[r * k + c] = sk[rv][l];
      if (keep_q) {
        float* mom = row.moments(a.logits, r) + c * kMoments;
        mom[0] = m[rv][l], mom[1] = sum[rv][l], mom[2] = acc_a[rv][l], mom[3] = acc_b[rv][l];
        mom[4] = sk[rv][l], mom[5] = ak[rv][l];
      }
    }
}

// h_r . w_j by the logits' own sequence (hrow, wrow: scratch of h floats; logits_panel's chains
// and their pairwise sum).
float target_dot(const Problem& p, const FwdArgs& a, int64_t r, int64_t j, float* hrow, float* wrow) {
#if defined(__AVX512BF16__)
  if (dp_bf16(p))
    return dot_pairs(static_cast<const uint16_t*>(a.hidden) + r * p.h, static_cast<const uint16_t*>(a.weight) + j * p.h,
                     p.h);
#endif
  to_f32(p.dtype, a.hidden, r * p.h, p.h, hrow);
  to_f32(p.dtype, a.weight, j * p.h, p.h, wrow);
  float stack[64], sum = 0.f;
  const int64_t chains = cdiv(p.h, kChain);
  for (int64_t b = 0; b < chains; ++b) {
    float acc = 0.f;
    for (int64_t k = b * kChain; k < std::min(p.h, (b + 1) * kChain); ++k) acc = std::fma(hrow[k], wrow[k], acc);
    if (Pairwise(b, chains).merge(acc, stack)) sum = acc;
  }
  return sum;
}

// target_logit[r]: z of the target when it is a real id of this shard, else 0.
void target_logits(const Problem& p, const FwdArgs& a) {
  const int64_t real_end = std::min(p.real_vocab, p.vocab_start + p.v);
  parallel_for(cdiv(p.n, kBlock), workers_for(cdiv(p.n, kBlock)), [&](int, int64_t blk) {
    std::vector<float> hrow(size_t(p.h)), wrow(size_t(p.h));
    for (int64_t r = blk * kBlock; r < std::min(p.n, (blk + 1) * kBlock); ++r) {
      const int64_t t = a.targets[r];
      if (t == p.ignore_index || t < p.vocab_start || t >= real_end) {
        a.target_logit[r] = 0.f;
        continue;
      }
      if (a.keep && !a.keep[r * p.v + (t - p.vocab_start)]) {  // outside the nucleus: probability 0
        a.target_logit[r] = -INFINITY;
        continue;
      }
      const float acc = target_dot(p, a, r, t - p.vocab_start, hrow.data(), wrow.data());
      const float b = p.has_bias ? a.bias[t - p.vocab_start] : 0.f;
      a.target_logit[r] = (acc + b) * reciprocal(a.temperature[r]);
    }
  });
  if (a.logits && !kept_f32(p)) {
    const KeptRow row(p);
    for (int64_t r = 0; r < p.n; ++r) *row.z_target(a.logits, r) = a.target_logit[r];
  }
}

// ---- backward --------------------------------------------------------------------------------

void load_row_block(const Problem& p, const BwdArgs& a, int64_t blk, RowBlock& rb) {
  for (int rv = 0; rv < kRowVecs; ++rv)
    for (int l = 0; l < kLanes; ++l) {
      const int64_t r = blk * kBlock + rv * kLanes + l;
      const bool in = r < p.n;
      const int64_t t = in ? a.targets[r] : p.ignore_index;
      const bool act = in && classify_target(t, p.real_vocab, p.ignore_index) == TargetKind::kValid;
      // A row with non-finite statistics (a NaN row; with a nucleus, also an empty one) gets NaN in
      // every column, -inf logits too.
      const bool nan_row = act && !(std::isfinite(a.m[r]) && std::isfinite(a.log_s[r]) &&
                                    (!a.keep || std::isfinite(a.log_s_keep[r])));
      rb.inv_temp[rv][l] = in ? reciprocal(a.temperature[r]) : 1.f;
      rb.m[rv][l] = act ? a.m[r] : 0.f;
      rb.log_s[rv][l] = act ? a.log_s[r] : 0.f;
      rb.log_s_keep[rv][l] = act && a.keep ? a.log_s_keep[r] : 0.f;
      rb.c[rv][l] = act && a.entropy ? a.log_s[r] - a.entropy[r] : 0.f;
      rb.g[rv][l] = nan_row ? NAN : act ? a.g[r] : 0.f;
      rb.e[rv][l] = act && a.e ? a.e[r] : 0.f;
      rb.target[rv][l] = int32_t(act ? t : -1);
      rb.active[rv][l] = act ? 1.f : 0.f;
    }
}

// What a backward tile holds: z (lean; fast with fp32 operands), or q of the 16-bit kept record
// with, per row, d = mt - m, w = exp(d - log_s) and wk = exp(d - log_s_keep) (p = q w, the
// nucleus's p = q wk, z - m = log q + d).
struct TileKind {
  bool q = false;
  fvec d[kRowVecs], w[kRowVecs], wk[kRowVecs];
};

// In place: z (or q) tile -> dlogit tile (dz * inv_temp); padded vocab rows and inactive rows give
// 0. kt: the nucleus tile (keep_tile) or null. dzz (may be null) accumulates dz * (z - m) per row
// in vocab order (z tiles only).
void dlogit_tile(float* t, int64_t gid0, int64_t valid, const RowBlock& rb, const TileKind& kind, bool entropy,
                 const float* kt, fvec* dzz) {
  for (int64_t j = 0; j < kTileV; ++j)
    for (int rv = 0; rv < kRowVecs; ++rv) {
      float* zp = t + j * kBlock + rv * kLanes;
      if (j >= valid) {
        vstore(zp, splat(0.f));
        continue;
      }
      const fvec x = vload(zp);
      fvec zm, pr;
      ivec live;
      if (kind.q) {  // q = 0 (-inf, or below fp16): p = 0, and z - m is not needed
        live = x != 0.f;
        pr = x * kind.w[rv];
        zm = entropy ? (live ? vlog(x) + kind.d[rv] : splat(0.f)) : splat(0.f);
      } else {  // z = -inf (a logit masked by the bias): p = 0
        live = x != -INFINITY;
        zm = live ? x - rb.m[rv] : splat(0.f);
        pr = live ? vexp(zm - rb.log_s[rv]) : splat(0.f);
      }
      fvec delta = rb.target[rv] == int32_t(gid0 + j) ? splat(1.f) : splat(0.f), pk = pr;  // the logp term's p
      if (kt) {  // the nucleus: kept (delta - pk), pk = exp((z - m) - log_s_keep)
        const ivec kept = vload(kt + j * kBlock + rv * kLanes) != 0.f;  // a target's q may underflow: not live
        pk = kept & live ? (kind.q ? x * kind.wk[rv] : vexp(zm - rb.log_s_keep[rv])) : splat(0.f);
        delta = kept ? delta : splat(0.f);
      }
      const fvec dz = rb.active[rv] > 0.f ? rb.g[rv] * (delta - pk) + rb.e[rv] * (live ? pr * (rb.c[rv] - zm) : splat(0.f))
                                            : splat(0.f);
      if (dzz) dzz[rv] += live ? dz * zm : splat(0.f);
      vstore(zp, dz * rb.inv_temp[rv]);
    }
}

// The tile of row block `blk` and columns [v0, v0 + valid) (forward tile `tile` of the row): from
// the kept buffer (fast) or recomputed (lean; needs the logits' weight tile in w).
void z_tile(const Problem& p, const BwdArgs& a, const Panels& ap, int64_t blk, int64_t v0, int64_t valid,
            int64_t tile, const RowBlock& rb, WeightTile& w, float* t, TileKind& kind) {
  kind.q = a.logits && !kept_f32(p);
  if (!a.logits) {
    tile_logits(p, ap, w, blk, t);
    scale_tile(t, p.has_bias ? a.bias + v0 : nullptr, valid, rb.inv_temp);
    return;
  }
  load_kept(p, a.logits, blk * kBlock, v0, valid, t);
  if (!kind.q) return;
  const KeptRow row(p);
  for (int rv = 0; rv < kRowVecs; ++rv) {
    float mt[kLanes];
    for (int l = 0; l < kLanes; ++l) {
      const int64_t r = blk * kBlock + rv * kLanes + l;
      mt[l] = rb.active[rv][l] > 0.f ? row.tile_max(a.logits, r)[tile] : 0.f;
    }
    kind.d[rv] = vload(mt) - rb.m[rv];
    kind.w[rv] = vexp(kind.d[rv] - rb.log_s[rv]);
    kind.wk[rv] = vexp(kind.d[rv] - rb.log_s_keep[rv]);
  }
}

// sum_j dz_j (z_j - m) of this shard's columns for the rows of rb, from the 16-bit kept record's
// fp32 chunk moments (m_c, s_c, a_c, b_c, sk_c, ak_c; moments_dzz, with a nucleus kept_moments_dzz)
// and the target, when it is a column of this shard (and, with a nucleus, kept), g (z_t - m).
void kept_dzz(const Problem& p, const BwdArgs& a, int64_t blk, const RowBlock& rb, fvec* dzz) {
  const KeptRow row(p);
  const int64_t real_end = std::clamp<int64_t>(p.real_vocab - p.vocab_start, 0, p.v);
  for (int rv = 0; rv < kRowVecs; ++rv)
    for (int l = 0; l < kLanes; ++l) {
      const int64_t r = blk * kBlock + rv * kLanes + l;
      if (!(rb.active[rv][l] > 0.f)) continue;
      const float m = rb.m[rv][l], log_s = rb.log_s[rv][l], g = rb.g[rv][l], e = rb.e[rv][l], c = rb.c[rv][l];
      const float* mom = row.moments(a.logits, r);
      float acc = 0.f;
      for (int64_t k = 0; k < row.chunks; ++k, mom += kMoments)
        acc += a.keep ? kept_moments_dzz(mom, m, log_s, rb.log_s_keep[rv][l], c, g, e) : moments_dzz(mom, m, log_s, c, g, e);
      const int64_t t = rb.target[rv][l] - p.vocab_start;
      if (t >= 0 && t < real_end && (!a.keep || a.keep[r * p.v + t])) acc += g * (*row.z_target(a.logits, r) - m);
      dzz[rv][l] = acc;
    }
}

// dT needs sum_j dz_j z_j = sum_j dz_j (z_j - m) + m sum_j dz_j. sum_j dz_j = 0 (the nucleus's p
// sums to 1 over the shards) unless the target is outside the nucleus: then it is -g, added here by
// the target's shard.
void outside_nucleus_dzz(const Problem& p, const BwdArgs& a, int64_t blk, const RowBlock& rb, fvec* dzz) {
  const int64_t real_end = std::clamp<int64_t>(p.real_vocab - p.vocab_start, 0, p.v);
  for (int rv = 0; rv < kRowVecs; ++rv)
    for (int l = 0; l < kLanes; ++l) {
      const int64_t r = blk * kBlock + rv * kLanes + l, t = rb.target[rv][l] - p.vocab_start;
      if (rb.active[rv][l] > 0.f && t >= 0 && t < real_end && !a.keep[r * p.v + t])
        dzz[rv][l] -= rb.g[rv][l] * rb.m[rv][l];
    }
}

struct BwdScratch {
  WeightTile w;
  // pass 1: t and dh per row block of the unit; kt the nucleus tile (with BwdArgs::keep; pass 2 too)
  std::vector<float> t, kt, dh;
  // pass 2: dW^T [h][kTileV] (dp_bf16: dW [kTileV][hp]), dlogit^T of kDwBlocks row blocks
  // [kDwBlocks kBlock][kTileV], a dW row [h]
  std::vector<float> dw, dt, row;
  std::vector<uint32_t> wj, dl;  // dp_bf16: the weight tile's pairs (pass 1), the dlogit tile's pairs
};

// The fp32 dH GEMM's operand, the weight's rows [v0, v0 + rows): in place (fp32) or converted
// into s.w.wf, once for all the unit's row blocks.
const float* dh_weight(const Problem& p, const void* weight, int64_t v0, int64_t rows, BwdScratch& s) {
  if (p.dtype == DType::kF32) return static_cast<const float*>(weight) + v0 * p.h;
  to_f32(p.dtype, weight, v0 * p.h, rows * p.h, s.w.wf.data());
  return s.w.wf.data();
}

// dh[r][k] += sum_j dlogit[j][r] w[j][k], j in order: under dp_bf16 from the dlogit tile t and
// the weight tile's pairs s.wj; else from the `rows` dlogit rows gathered in t (up to kDhTiles
// tiles) and w (dh_weight).
// Not inlined (nor dw_tile): inside the units' loops GCC ran out of general registers and kept
// outer_block's b pointer in a vector register, on the loads' critical path.
__attribute__((noinline)) void dh_tile(const Problem& p, const float* w, int64_t rows, const float* t, float* dh,
                                       BwdScratch& s) {
#if defined(__AVX512BF16__)
  if (dp_bf16(p)) {
    const int64_t hp = padded_h(p);
    dlogit_vocab_pairs(t, s.dl.data());
    for (int64_t r = 0; r < kBlock; r += kGradRows)
      outer_grid<kGradRows, kGradVecs>(
          Outer<uint32_t>{s.dl.data() + r, kBlock, 1, s.wj.data(), hp, cdiv(rows, 2), dh + r * hp, hp},
          kGradRows, hp / kLanes, false);
    return;
  }
#endif
  by_step_blocks(Outer<float>{t, kBlock, 1, w, p.h, rows, dh, p.h}, false, [&](const Outer<float>& o, bool zero_c) {
    outer_f32<kGradRows, kGradVecs, true>(o, kBlock, p.h, zero_c);
  });
}

// Pass 1: dH and dT of row blocks [blk0, blk0 + nb), each over the whole local vocab in order.
void dhidden_unit(const Problem& p, const BwdArgs& a, const Panels& ap, int64_t blk0, int64_t nb, BwdScratch& s) {
  RowBlock rb[kDhBlocks];
  fvec dzz[kDhBlocks][kRowVecs] = {};
  TileKind kind[kDhBlocks];
  for (int64_t b = 0; b < nb; ++b) {
    load_row_block(p, a, blk0 + b, rb[b]);
    if (a.logits && !kept_f32(p)) kept_dzz(p, a, blk0 + b, rb[b], dzz[b]);
  }
  const int64_t t_size = s.t.size() / kDhBlocks, dh_size = s.dh.size() / kDhBlocks;
  std::fill(s.dh.begin(), s.dh.end(), 0.f);
  const int64_t real_end = std::clamp<int64_t>(p.real_vocab - p.vocab_start, 0, p.v);
  const int64_t tiles_per_chunk = cdiv(p.chunk, kTileV);
  // The tiles' dlogit rows gather in each block's t until a dH GEMM takes them (every tile under
  // dp_bf16, else every kDhTiles): rows of consecutive tiles are consecutive vocab rows, chunks included.
  int64_t gathered = 0, tiles = 0;
  for (int64_t c0 = 0; c0 < real_end; c0 += p.chunk)
    for (int64_t v0 = c0; v0 < std::min(c0 + p.chunk, real_end); v0 += kTileV) {
      const int64_t valid = std::min({kTileV, c0 + p.chunk - v0, real_end - v0});
      const int64_t tile = c0 / p.chunk * tiles_per_chunk + (v0 - c0) / kTileV;
#if defined(__AVX512BF16__)
      if (dp_bf16(p)) load_weight_row_pairs(p, a.weight, v0, v0 + valid, s.wj.data());  // dH's operand
#endif
      if (!a.logits) load_logits_weight(p, a.weight, v0, v0 + valid, s.w);  // lean's logits
      for (int64_t b = 0; b < nb; ++b) {
        float* t = s.t.data() + b * t_size + gathered * kBlock;
        z_tile(p, a, ap, blk0 + b, v0, valid, tile, rb[b], s.w, t, kind[b]);
        if (a.keep) keep_tile(p, a.keep, (blk0 + b) * kBlock, v0, valid, s.kt.data());
        dlogit_tile(t, p.vocab_start + v0, valid, rb[b], kind[b], p.with_entropy, a.keep ? s.kt.data() : nullptr,
                    kind[b].q ? nullptr : dzz[b]);
      }
      gathered += valid;
      const bool last = v0 + valid >= real_end;
      if (dp_bf16(p) || ++tiles == kDhTiles || last) {
        const float* w = dp_bf16(p) ? nullptr : dh_weight(p, a.weight, v0 + valid - gathered, gathered, s);
        for (int64_t b = 0; b < nb; ++b) dh_tile(p, w, gathered, s.t.data() + b * t_size, s.dh.data() + b * dh_size, s);
        gathered = tiles = 0;
      }
    }
  for (int64_t b = 0; b < nb; ++b) {
    if (a.keep) outside_nucleus_dzz(p, a, blk0 + b, rb[b], dzz[b]);
    for (int64_t i = 0; i < kBlock; ++i) {
      const int64_t r = (blk0 + b) * kBlock + i;
      if (r >= p.n) break;
      from_f32(a.dhidden_dtype, s.dh.data() + b * dh_size + i * dh_stride(p), p.h, a.dhidden, r * p.h);
      if (a.dtemp) a.dtemp[r] = -rb[b].inv_temp[i / kLanes][i % kLanes] * dzz[b][i / kLanes][i % kLanes];
    }
  }
}

// The tile's dW (+)= dlogit^T H of row block blk (of `blocks`), rows in order, from the dlogit
// tile s.t. Under dp_bf16 the dlogit pairs of kDwBlocks row blocks go through one GEMM.
__attribute__((noinline)) void dw_tile(const Problem& p, const Panels& ap, int64_t blk, int64_t blocks, BwdScratch& s) {
#if defined(__AVX512BF16__)
  if (dp_bf16(p)) {  // dw[j][k] += sum over row pairs q of dl[j][q] . hr[q][k]
    const int64_t hp = padded_h(p), g = blk % kDwBlocks, ldl = kDwBlocks * kBlock / 2;
    dlogit_row_pairs(s.t.data(), s.dl.data() + g * kBlock / 2, ldl);
    if (g + 1 < kDwBlocks && blk + 1 < blocks) return;
    outer_grid<kGradRows, kGradVecs>(Outer<uint32_t>{s.dl.data(), 1, ldl, ap.row_pairs.data() + (blk - g) * kBlock / 2 * hp,
                                                     hp, (g + 1) * kBlock / 2, s.dw.data(), hp},
                                     kTileV, hp / kLanes, false);
    return;
  }
#endif
  // dw[k][j] += sum_r ht[k][r] dt[r][j], r in order, dt the dlogit tiles of kDwBlocks row blocks
  // transposed: one GEMM over them, as under dp_bf16
  const int64_t g = blk % kDwBlocks;
  float* dt = s.dt.data() + g * kBlock * kTileV;
  for (int64_t j = 0; j < kTileV; ++j)
    for (int64_t r = 0; r < kBlock; ++r) dt[r * kTileV + j] = s.t[j * kBlock + r];
  if (g + 1 < kDwBlocks && blk + 1 < blocks) return;
  outer_grid<kDwK, kDwVecs>(Outer<float>{ap.t.data() + (blk - g) * kBlock, 1, padded_n(p), s.dt.data(), kTileV,
                                         (g + 1) * kBlock, s.dw.data(), kTileV},
                            p.h, kTileV / kLanes, false);
}

// Pass 2: dW and db of one vocab tile (the forward's tiles: kTileV columns from each chunk's
// first), over all row blocks in order.
void dweight_unit(const Problem& p, const BwdArgs& a, const Panels& ap, int64_t tile, BwdScratch& s) {
  const int64_t tiles_per_chunk = cdiv(p.chunk, kTileV);
  const int64_t c1 = (tile / tiles_per_chunk + 1) * p.chunk;
  const int64_t v0 = tile / tiles_per_chunk * p.chunk + tile % tiles_per_chunk * kTileV;
  const int64_t real_end = std::clamp<int64_t>(p.real_vocab - p.vocab_start, 0, p.v);
  const int64_t rows = std::min(kTileV, c1 - v0);
  const int64_t valid = std::clamp<int64_t>(std::min(real_end, c1) - v0, 0, kTileV);
  std::fill(s.dw.begin(), s.dw.end(), 0.f);
  float db[kTileV] = {};
  if (valid > 0) {
    if (!a.logits) load_logits_weight(p, a.weight, v0, v0 + valid, s.w);
    RowBlock rb;
    TileKind kind;
    const int64_t blocks = cdiv(p.n, kBlock);
    for (int64_t blk = 0; blk < blocks; ++blk) {
      load_row_block(p, a, blk, rb);
      z_tile(p, a, ap, blk, v0, valid, tile, rb, s.w, s.t.data(), kind);
      if (a.keep) keep_tile(p, a.keep, blk * kBlock, v0, valid, s.kt.data());
      dlogit_tile(s.t.data(), p.vocab_start + v0, valid, rb, kind, p.with_entropy, a.keep ? s.kt.data() : nullptr,
                  nullptr);
      float dbb[kTileV] = {};  // the block's sums (r outer: kTileV independent sums in row order), then db + them
      for (int64_t r = 0; r < kBlock; ++r)
        for (int64_t j = 0; j < kTileV; ++j) dbb[j] += s.t[j * kBlock + r];
      for (int64_t j = 0; j < kTileV; ++j) db[j] += dbb[j];
      dw_tile(p, ap, blk, blocks, s);
    }
  }
  for (int64_t j = 0; j < rows; ++j) {
    if (dp_bf16(p)) {
      from_f32(p.dtype, s.dw.data() + j * padded_h(p), p.h, a.dweight, (v0 + j) * p.h);
    } else {
      for (int64_t k = 0; k < p.h; ++k) s.row[k] = s.dw[k * kTileV + j];
      from_f32(p.dtype, s.row.data(), p.h, a.dweight, (v0 + j) * p.h);
    }
    if (a.dbias) a.dbias[v0 + j] = db[j];
  }
}

}  // namespace

Status forward(const Problem& p, const FwdArgs& a) {
  if (p.chunk <= 0 || p.v % p.chunk != 0) return "rlk cpu forward: chunk must divide the local vocab";
  if (a.keep && !a.keep_sum) return "rlk cpu forward: a keep mask needs keep_sum";
  if (p.n == 0) return nullptr;
  Panels ap;
  if (dp_bf16(p)) ap.pairs = pack_hidden_pairs(p, a.hidden);
  else ap.f32 = pack_hidden(p, a.hidden, kPanel);
  const int64_t k = num_chunks(p), units = cdiv(p.n, kBlock) * k;
  const int workers = workers_for(units);
  std::vector<FwdScratch> scratch(static_cast<size_t>(workers));
  for (auto& s : scratch) {
    s.w = weight_tile(p);
    s.t.resize(size_t(kTileV * kBlock));
    if (a.keep) s.kt.resize(size_t(kTileV * kBlock));
  }
  parallel_for(units, workers, [&](int w, int64_t u) { forward_unit(p, a, ap, u / k, u % k, scratch[w]); });
  target_logits(p, a);
  return nullptr;
}

size_t kept_bytes(const Problem& p) {
  if (p.chunk <= 0 || p.v % p.chunk != 0) return 0;
  return size_t(p.n) * size_t(kept_f32(p) ? p.v * 4 : KeptRow(p).bytes);
}

Status combine(const CombineArgs& a) {
  parallel_for(cdiv(a.n, 1024), workers_for(cdiv(a.n, 1024)), [&](int, int64_t u) {
    for (int64_t r = u * 1024; r < std::min(a.n, (u + 1) * 1024); ++r) combine_one(a, r);
  });
  return nullptr;
}

Status backward(const Problem& p, const BwdArgs& a) {
  if (p.chunk <= 0 || p.v % p.chunk != 0) return "rlk cpu backward: chunk must divide the local vocab";
  if (Status s = check_dhidden_dtype(p, a.dhidden_dtype)) return s;
  if (a.keep && !a.log_s_keep) return "rlk cpu backward: a keep mask needs log_s_keep";
  if (p.n == 0) {  // no rows: dW and db are zero
    std::vector<float> zero(size_t(p.h), 0.f);
    for (int64_t j = 0; j < p.v; ++j) from_f32(p.dtype, zero.data(), p.h, a.dweight, j * p.h);
    if (a.dbias) std::fill(a.dbias, a.dbias + p.v, 0.f);
    return nullptr;
  }
  Panels ap;
#if defined(__AVX512BF16__)
  if (dp_bf16(p)) ap.row_pairs = pack_hidden_row_pairs(p, a.hidden);  // dW's operand
#endif
  if (!dp_bf16(p)) ap.t = pack_hidden(p, a.hidden, padded_n(p));  // dW's operand
  if (!a.logits && !dp_bf16(p)) ap.f32 = pack_hidden(p, a.hidden, kPanel);  // lean's logits
  if (!a.logits && dp_bf16(p)) ap.pairs = pack_hidden_pairs(p, a.hidden);  // lean's logits
  const int64_t blocks = cdiv(p.n, kBlock), tiles = num_chunks(p) * cdiv(p.chunk, kTileV);
  auto make = [&](int workers, bool pass1) {
    std::vector<BwdScratch> sc(static_cast<size_t>(workers));
    for (auto& s : sc) {
      s.w = weight_tile(p);
      s.t.resize(size_t((pass1 ? kDhBlocks * (dp_bf16(p) ? 1 : kDhTiles) : 1) * kTileV * kBlock));
      if (a.keep) s.kt.resize(size_t(kTileV * kBlock));
      if (pass1 && !dp_bf16(p) && p.dtype != DType::kF32)  // dH's operand, converted
        s.w.wf.resize(size_t(kDhTiles * kTileV * p.h));
      if (dp_bf16(p)) s.dl.resize(size_t(kTileV * kBlock / 2 * (pass1 ? 1 : kDwBlocks)));
      if (pass1) {
        s.dh.resize(size_t(kDhBlocks * kBlock * dh_stride(p)));
        if (dp_bf16(p)) s.wj.resize(size_t(kTileV / 2 * padded_h(p)));
      } else if (dp_bf16(p)) {
        s.dw.resize(size_t(kTileV * padded_h(p)));
      } else {
        s.dw.resize(size_t(p.h * kTileV));
        s.dt.resize(size_t(kDwBlocks * kBlock * kTileV));
        s.row.resize(size_t(p.h));
      }
    }
    return sc;
  };
  {
    // Units of kDhBlocks row blocks where there are enough for every thread (a unit's blocks get
    // the bits they would get alone).
    const int64_t nb = blocks >= kDhBlocks * num_threads() ? kDhBlocks : 1, units = cdiv(blocks, nb);
    const int workers = workers_for(units);
    auto sc = make(workers, true);
    parallel_for(units, workers, [&](int w, int64_t u) {
      dhidden_unit(p, a, ap, u * nb, std::min(nb, blocks - u * nb), sc[w]);
    });
  }
  {
    const int workers = workers_for(tiles);
    auto sc = make(workers, false);
    parallel_for(tiles, workers, [&](int w, int64_t tile) { dweight_unit(p, a, ap, tile, sc[w]); });
  }
  return nullptr;
}

}  // namespace rlk::cpu::RLK_CPU_ISA
