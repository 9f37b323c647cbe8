// The Hopper kernel's epilogues. Each scales a 64x256 logit tile in the accumulator registers (1/T,
// bias, padding to -inf), then, by kind (Epi):
//   kStats  folds it into per-row running (m, s, a): a row's 256 values live in one quad of lanes
//           (64 per lane), so a tile costs a thread-local pass plus two xor shuffles. Exponentials
//           use ex2 on log2e-scaled logits; (m, s, a) go back to natural units per tile and are
//           merged with stats_merge. Logits never leave registers.
//   kSave   the same, and the fast backward's saved record: q = exp(z - tile max), the exponentials
//           the fold computes anyway, as fp16 through the tile store; the tile max of each row
//           (both 128-column groups of the tile, SavedLayout) and the moment b into the partials;
//   kDlogit turns z into dlogit = dz / T from the row's lse (and entropy and upstream gradients) and
//           stores it in the operand dtype through the tile store; sum dz z per (row, split) for dT.
// The tile store: stmatrix puts half a tile (64x128, 2-byte values) into a 128-byte-swizzled
// staging buffer per consumer warpgroup, and one thread hands it to a TMA store: the copy to global
// memory runs while the consumers go on. The epilogue puts work between the halves (the statistics,
// or half 1's dlogit), so the TMA has read half 0 before half 1 overwrites it.
#pragma once

#include <cuda.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <type_traits>

#include "rlk/linear_logp.h"
#include "sm90/params.cuh"
#include "sm90/ptx.cuh"

namespace rlk::cuda::detail::sm90 {

constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;

// The tile store's staging: 64 rows x 128 2-byte columns per consumer warpgroup, as two 64x64 TMA
// boxes of 8 KB; half a tile, so that four stages still fit in the 227 KB an sm_90 block may have.
constexpr int kBoxCols = 64, kBoxBytes = 64 * kBoxCols * 2, kHalfCols = 2 * kBoxCols;
constexpr int kStagingBytes = 2 /*warpgroups*/ * 2 /*boxes*/ * kBoxBytes;
// Named barrier ids of the consumer warpgroups' staging buffers: kStagingBarrier + cw (id 0 is
// __syncthreads).
constexpr int kStagingBarrier = 1;

// ---- the epilogue's per-kind kernel argument (GradArg) ---------------------------------------------
// A kernel argument of its own, empty for kStats: in Params, kDlogit's 48 bytes made ptxas spill in
// the forward kernels.
// kDlogit's per-row inputs (of this pass), taken from the backward's arguments by grad_rows: a new
// per-row gradient input is a field here, its line in grad_rows and its use in row_grad.
struct GradRows {
  const int32_t* targets;
  const float *m, *log_s, *ent, *g, *e;  // ent, e null: no entropy term
  int64_t ignore_index;
};
inline GradRows grad_rows(const Problem& p, const BwdArgs& a) {
  const bool ent = p.with_entropy && a.e;
  return {a.targets, a.m, a.log_s, ent ? a.entropy : nullptr, a.g, ent ? a.e : nullptr, p.ignore_index};
}
// kSave's: where the group maxima of the saved record go (this pass's rows).
struct SaveRows {
  float* head;  // [rows, layout.floats] the saved record's head
  SavedLayout layout;
};
struct NoGradRows {};
template <Epi kEpi>
using GradArg =
    std::conditional_t<kEpi == Epi::kDlogit, GradRows, std::conditional_t<kEpi == Epi::kSave, SaveRows, NoGradRows>>;

// ---- accumulator layout and the 2-byte packings of the tile store ------------------------------
// Lane l of warp w (in its warpgroup) holds rows w*16 + l/4 (values d[4j], d[4j+1]) and +8
// (d[4j+2], d[4j+3]) at columns 8j + 2(l%4) + {0,1}, j = 0..31. A pack turns two columns into a
// word, the lower column in the low half.
template <bool kBf16> struct PackDtype {  // d holds dlogit (or q, fp16): rounded to the 2-byte dtype (as from_f)
  __device__ __forceinline__ uint32_t operator()(float a, float b) const {
    if constexpr (kBf16) return cvt_bf16x2(b, a);
    else return cvt_f16x2(b, a);
  }
};

// ---- tile store (kSave, kDlogit) ------------------------------------------------------------------
// A consumer warpgroup's staging buffer holds half a tile, 64 rows x 128 columns, as two 64x64
// boxes in TMA's 128-byte swizzle (16-byte chunk c of row r sits at chunk c ^ (r % 8)): stmatrix
// then writes eight rows of one chunk column into eight different bank groups.
__device__ __forceinline__ uint32_t staging_addr(uint32_t buf, int row, int col) {
  const int c = col % kBoxCols;
  return buf + (col / kBoxCols) * kBoxBytes + row * (kBoxCols * 2) + ((((c / 8) ^ (row % 8))) << 4) + (c % 8) * 2;
}
// The named barrier of consumer warpgroup cw.
__device__ __forceinline__ void warpgroup_sync(int cw) { warpgroup_bar_sync(cw + kStagingBarrier); }

// Half `half` (columns 128 half .. +127) of the tile (this warpgroup's 64 rows), packed to 2-byte
// values, through the staging buffer. One thread issues the TMA stores, which clip at the tensor's
// edge (rows past the pass, columns past P.cols). A tile that ends inside the next chunk's columns
// (chunk % kBN != 0), or an output that TMA cannot address (unaligned), goes out by plain bounded
// stores instead. The staging buffer holds one half: before it is rewritten, the TMA must have read
// the previous half, so the epilogues put other work between the two halves.
template <class Pack>
__device__ __forceinline__ void store_half(const float* d, Pack pack, int half, int64_t t0, int64_t col_end,
                                           const Params& P, const CUtensorMap* tmO, uint32_t buf, int cw,
                                           int64_t row0) {
  const int tid = threadIdx.x % 128, warp = tid / 32, lane = tid % 32;
  const bool tma = P.out_tma && (t0 + kBN <= col_end || col_end == P.cols);
  if (tid == 0) tma_store_wait_read();
  warpgroup_sync(cw);
  // stmatrix: matrix k = lane / 8 of column groups (j, j + 1) x row halves; lane gives row lane % 8
  const int k = lane / 8, srow = warp * 16 + (k % 2) * 8 + lane % 8;
#pragma unroll
  for (int jj = 0; jj < 16; jj += 2) {
    const int j = 16 * half + jj;
    stmatrix_x4(staging_addr(buf, srow, 8 * (jj + k / 2)), pack(d[4 * j], d[4 * j + 1]),
                pack(d[4 * j + 2], d[4 * j + 3]), pack(d[4 * j + 4], d[4 * j + 5]), pack(d[4 * j + 6], d[4 * j + 7]));
  }
  const int64_t c0 = t0 + half * kHalfCols;
  if (tma) {
    fence_async_smem();
    warpgroup_sync(cw);
    if (tid == 0) {
      for (int b = 0; b < 2; ++b)
        if (c0 + b * kBoxCols < P.cols)
          tma_store_2d(tmO, buf + b * kBoxBytes, int32_t(c0 + b * kBoxCols), int32_t(row0));
      tma_store_commit();
    }
  } else {
    warpgroup_sync(cw);
    const int lim = int(min(col_end - t0, int64_t(kBN)));  // columns of this tile to write
    const unsigned char* sbuf = static_cast<const unsigned char*>(__cvta_shared_to_generic(buf));
    for (int i = tid; i < 64 * kHalfCols / 8; i += 128) {
      const int r = i / (kHalfCols / 8), c = (i % (kHalfCols / 8)) * 8;
      if (row0 + r >= P.rows) continue;
      const uint4 w = *reinterpret_cast<const uint4*>(sbuf + (staging_addr(buf, r, c) - buf));
      const uint16_t* hw = reinterpret_cast<const uint16_t*>(&w);
      uint16_t* out = P.out + (row0 + r) * P.ldo + c0;
      for (int e = 0; e < 8; ++e)
        if (half * kHalfCols + c + e < lim) out[c + e] = hw[e];
    }
  }
}

// ---- epilogue: scale one 64x256 accumulator tile to z * log2e in place ----------------------------
// Bias and 1/T (itA, itB: rows A and B, times log2e); padding columns (past the chunk's end or the
// real vocab) become -inf. mx: the lane's maximum of each row (in the same pass: fewer live registers).
template <bool kMask>
__device__ __forceinline__ void scale_tile(float* d, int64_t t0, int64_t col_end, const Params& P, float itA, float itB,
                                           float (&mx)[2]) {
  const int cq = 2 * (threadIdx.x % 4);
  mx[0] = mx[1] = -INFINITY;
#pragma unroll
  for (int j = 0; j < 32; ++j) {
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      const int64_t col = t0 + 8 * j + cq + e;
      bool live = true;
      if constexpr (kMask) live = col < col_end && P.vocab_start + col < P.real_vocab;
      const float b = (P.bias != nullptr && (!kMask || col < col_end)) ? P.bias[col] : 0.f;
      d[4 * j + e] = live ? (d[4 * j + e] + b) * itA : -INFINITY;
      d[4 * j + 2 + e] = live ? (d[4 * j + 2 + e] + b) * itB : -INFINITY;
      mx[0] = fmaxf(mx[0], d[4 * j + e]);
      mx[1] = fmaxf(mx[1], d[4 * j + 2 + e]);
    }
  }
}

// ---- epilogue (kStats, kSave): fold the scaled tile into the two rows' running statistics -------
// A row's 256 values live in one quad of lanes (64 per lane): a thread-local pass plus two xor
// shuffles. Exponentials use ex2 on the log2e-scaled logits; (m, s, a) are converted back to natural
// units per tile and merged with stats_merge (kSave: with b, by moments_merge: the same (m, s, a)).
struct TileSums {  // the tile's sums of the thread's two rows, in log2 units
  float s[2] = {0.f, 0.f}, a[2] = {0.f, 0.f}, b[2] = {0.f, 0.f};
};

// The quad's row maxima, and the reference the exponentials are taken from (0 for an empty row).
__device__ __forceinline__ void row_max(float (&mx)[2], float (&mref)[2]) {
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xffffffffu, mx[r], 1));
    mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xffffffffu, mx[r], 2));
    mref[r] = mx[r] > -INFINITY ? mx[r] : 0.f;
  }
}

// Half `half` of the lane's values into the sums, in column order; kSave also accumulates b and
// leaves q = ex2(z log2e - mref) in d for the tile store.
template <bool kSave>
__device__ __forceinline__ void fold_half(float* d, int half, const float (&mref)[2], TileSums& t) {
#pragma unroll
  for (int jj = 0; jj < 16; ++jj) {
    const int j = 16 * half + jj;
#pragma unroll
    for (int q = 0; q < 4; ++q) {
      const int r = q >> 1;
      float x = d[4 * j + q] - mref[r];
      const float ex = ex2(x);
      x = ex > 0.f ? x : 0.f;  // -inf logits (masked, padding, or a -inf bias): 0, not -inf * 0
      t.s[r] += ex;
      t.a[r] = fmaf(ex, x, t.a[r]);
      if constexpr (kSave) {
        t.b[r] = fmaf(ex * x, x, t.b[r]);
        d[4 * j + q] = ex;
      }
    }
  }
}

// The quad's sums of the tile, merged into the rows' running statistics (natural units).
template <int W>
__device__ __forceinline__ void merge_tile(TileSums& t, const float (&mx)[2], float (&run)[2][W]) {
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    t.s[r] += __shfl_xor_sync(0xffffffffu, t.s[r], 1);
    t.a[r] += __shfl_xor_sync(0xffffffffu, t.a[r], 1);
    t.s[r] += __shfl_xor_sync(0xffffffffu, t.s[r], 2);
    t.a[r] += __shfl_xor_sync(0xffffffffu, t.a[r], 2);
    if constexpr (W == 4) {
      t.b[r] += __shfl_xor_sync(0xffffffffu, t.b[r], 1);
      t.b[r] += __shfl_xor_sync(0xffffffffu, t.b[r], 2);
    }
    if (mx[r] == -INFINITY) continue;
    if constexpr (W == 4) {
      moments_merge(mx[r] * kLn2, t.s[r], t.a[r] * kLn2, t.b[r] * (kLn2 * kLn2), run[r][0], run[r][1], run[r][2],
                    run[r][3]);
    } else {
      stats_merge(mx[r] * kLn2, t.s[r], t.a[r] * kLn2, run[r][0], run[r][1], run[r][2]);
    }
  }
}

// kSave: the rows' max of the unit's tile t (natural units) as the group max of both 128-column
// groups of the tile that lie inside the unit's columns (SavedLayout). gmax: row A's entry for the
// unit's first group (null past the pass's rows); row B's lies 8 head rows further.
__device__ __forceinline__ void store_group_max(const float (&mx)[2], int t, bool second, bool row_b, float* gmax,
                                                const SaveRows& K) {
  if (threadIdx.x % 4 != 0 || gmax == nullptr) return;
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    if (r == 1 && !row_b) return;
    float* gm = gmax + r * 8 * K.layout.floats + 2 * t;
    gm[0] = mx[r] * kLn2;
    if (second) gm[1] = mx[r] * kLn2;
  }
}

// ---- epilogue (kDlogit): the scaled tile to dlogit in place ---------------------------------------
// What one row needs (include/rlk/linear_logp.h's dz_of, in log2 units where that saves a multiply):
// p = ex2(z log2e - lse log2e), dz = g (delta_jt - p) + e p (lse - ent - z), dlogit = dz / T.
// A row without a valid target has g = e = 0 and lse2 = +inf (p = 0): its dlogit is 0.
struct RowGrad {
  float lse2, g, e, c, it;  // c = lse - ent
  int64_t target;           // global id
};
__device__ __forceinline__ RowGrad row_grad(const Params& P, const GradRows& G, int64_t row) {
  RowGrad r{INFINITY, 0.f, 0.f, 0.f, 1.f, -1};
  if (row >= P.rows) return r;
  r.it = reciprocal(P.temperature[row]);
  r.target = G.targets[row];
  if (classify_target(r.target, P.real_vocab, G.ignore_index) != TargetKind::kValid) return r;
  const float lse = G.m[row] + G.log_s[row];
  r.lse2 = lse * kLog2e;
  // a row with non-finite statistics (a NaN row) gets NaN in every real column, -inf logits too
  r.g = isfinite(G.m[row]) && isfinite(G.log_s[row]) ? G.g[row] : NAN;
  if (G.e) {
    r.e = G.e[row];
    r.c = lse - G.ent[row];
  }
  return r;
}
// Row r (0: A, 1: B) of the lane's values in half `half` of the tile to dlogit in place; dzz
// accumulates sum_j dz_j z_j of the lane's columns (for dT), in column order.
__device__ __forceinline__ void dlogit_row(float* d, int r, int half, int64_t t0, int64_t col_end, const Params& P,
                                           const RowGrad& g, float& dzz) {
  const int64_t rel = g.target - (P.vocab_start + t0 + 2 * (threadIdx.x % 4));
  const int tcol = rel >= 0 && rel < kBN ? int(rel) : -1;  // the target in this lane's numbering 8j + e, or -1
#pragma unroll
  for (int jj = 0; jj < 16; ++jj) {
    const int j = 16 * half + jj;
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      const int q = 4 * j + 2 * r + e;
      const float zl = d[q];
      const float p = ex2(zl - g.lse2), z = zl * kLn2;
      float dz = fmaf(g.e * p, g.c - z, g.g * ((8 * j + e == tcol ? 1.f : 0.f) - p));
      // -inf: padding, or a logit of probability 0 (a -inf bias), no gradient; in a NaN row a real
      // column's is NaN (the CPU backend's rule). NaN logits stay live.
      const bool live = !(zl == -INFINITY);
      if (!live) {
        const int64_t col = t0 + 8 * j + 2 * (threadIdx.x % 4) + e;
        dz = g.g != g.g && col < col_end && P.vocab_start + col < P.real_vocab ? NAN : 0.f;
      }
      dzz = fmaf(dz, live ? z : 0.f, dzz);
      d[q] = dz * g.it;
    }
  }
}

// ---- epilogue: one tile, by kind ------------------------------------------------------------------
// What a consumer thread carries across the tiles of its unit for its two rows (A, B).
template <Epi kEpi> struct RowState {  // kStats: the running (m, s, a)
  float run[2][3] = {{-INFINITY, 0.f, 0.f}, {-INFINITY, 0.f, 0.f}};
};
template <> struct RowState<Epi::kSave> {  // kSave: the running (m, s, a, b), and where the group
  float run[2][4] = {{-INFINITY, 0.f, 0.f, 0.f}, {-INFINITY, 0.f, 0.f, 0.f}};  // maxima go (store_group_max)
  float* gmax = nullptr;
};
template <> struct RowState<Epi::kDlogit> {  // sum dz z (the rows' gradient inputs are re-read per
  float dzz[2] = {0.f, 0.f};                  // tile, L1 hits: kept in registers across the
};                                            // mainloop, they made ptxas spill)

template <bool kBf16, Epi kEpi, bool kMask>
__device__ __forceinline__ void epilogue(float* d, int t, int64_t t0, int64_t col_end, const Params& P,
                                         const GradArg<kEpi>& G, float itA, float itB, const CUtensorMap* tmO,
                                         uint32_t buf, int cw, int64_t row0, RowState<kEpi>& st) {
  float mx[2];
  scale_tile<kMask>(d, t0, col_end, P, itA, itB, mx);
  const int64_t rowA = row0 + (threadIdx.x % 128) / 32 * 16 + (threadIdx.x % 32) / 4;
  if constexpr (kEpi == Epi::kDlogit) {
    // half 1's dlogit is computed while the TMA reads half 0 out of the staging buffer. The rows'
    // gradient inputs are loaded per half (L1 hits): held across the first store, they made ptxas spill.
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      dlogit_row(d, 0, half, t0, col_end, P, row_grad(P, G, rowA), st.dzz[0]);
      dlogit_row(d, 1, half, t0, col_end, P, row_grad(P, G, rowA + 8), st.dzz[1]);
      store_half(d, PackDtype<kBf16>{}, half, t0, col_end, P, tmO, buf, cw, row0);
    }
  } else {
    float mref[2];
    row_max(mx, mref);
    TileSums sums;
    constexpr bool kSave = kEpi == Epi::kSave;
    fold_half<kSave>(d, 0, mref, sums);
    // half 1 is folded while the TMA reads half 0's q out of the staging buffer
    if constexpr (kSave) {
      store_half(d, PackDtype<false>{}, 0, t0, col_end, P, tmO, buf, cw, row0);
      store_group_max(mx, t, t0 + kBN / 2 < col_end, rowA + 8 < P.rows, st.gmax, G);
    }
    fold_half<kSave>(d, 1, mref, sums);
    if constexpr (kSave) store_half(d, PackDtype<false>{}, 1, t0, col_end, P, tmO, buf, cw, row0);
    merge_tile(sums, mx, st.run);
  }
}

// After the unit's last tile: the per-(row, split) partials of the thread's two rows (A, B) to
// P.part, once per quad (kStats, kSave: (m, s, a); kDlogit: sum dz z, when P.part is set).
template <Epi kEpi>
__device__ __forceinline__ void store_partials(RowState<kEpi>& st, const Params& P, int lane, int64_t rowA,
                                               int64_t rowB, int64_t cu) {
  if (kEpi != Epi::kStats && threadIdx.x % 128 == 0) tma_store_wait_all();  // staging stays live until read
  if constexpr (kEpi == Epi::kDlogit) {
    if (P.part == nullptr) return;
#pragma unroll
    for (int r = 0; r < 2; ++r) {  // the quad's four column sets, in a fixed butterfly
      st.dzz[r] += __shfl_xor_sync(0xffffffffu, st.dzz[r], 1);
      st.dzz[r] += __shfl_xor_sync(0xffffffffu, st.dzz[r], 2);
    }
    if ((lane & 3) == 0) {
      if (rowA < P.rows) P.part[rowA * P.nsplit + cu] = st.dzz[0];
      if (rowB < P.rows) P.part[rowB * P.nsplit + cu] = st.dzz[1];
    }
  } else if ((lane & 3) == 0) {
    const int64_t rows[2] = {rowA, rowB};
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      if (rows[r] >= P.rows) continue;
      float* o = P.part + (rows[r] * P.nsplit + cu) * kPartWidth;
      o[0] = st.run[r][0];
      o[1] = st.run[r][1];
      o[2] = st.run[r][2];
      if constexpr (kEpi == Epi::kSave) o[3] = st.run[r][3];
      else o[3] = 0.f;
    }
  }
}

}  // namespace rlk::cuda::detail::sm90
