// CPU backend of the plain API: tiled, streaming log-sum-exp, fp32 throughout, no [n, v] buffer.
//
// Layout of the work. Hidden is packed once per call into fp32 panels of kPanel rows, k-major
// (`Ap[k][r]`), so the logits micro-kernel broadcasts one weight value and multiplies a whole
// vector of rows. Weight tiles of kTileV vocab rows are converted to fp32 in their natural layout
// (`Wf[j][k]`). A logits tile is `T[j][r]` (vocab-major): every epilogue then works on vectors of
// rows, one lane per row, so a row's bits never depend on the other rows in the call.
//
// Order of every reduction is fixed by shapes alone:
//   forward   unit = (row block, chunk); tiles of the chunk from its first column, in order.
//   backward  pass 1 (dH, dT): unit = row block, all tiles in vocab order.
//             pass 2 (dW, db):  unit = vocab tile, all row blocks in row order.
// The lean backward recomputes logits in both passes (four GEMM-equivalents in all), which keeps
// the threads' outputs disjoint with no fp32 [v, h] or [n, v] scratch; the fast one reads them
// from the forward's kept logits instead (two GEMM-equivalents).
#include <algorithm>
#include <cmath>
#include <vector>

#include "parallel.h"
#include "rlk/linear_logp.h"
#include "simd.h"

namespace rlk::cpu {
namespace {

constexpr int64_t kPanel = 32;           // rows per packed hidden panel (two vectors)
constexpr int64_t kBlock = 2 * kPanel;   // rows per work unit
constexpr int64_t kTileV = 64;           // vocab rows per weight tile
constexpr int64_t kGroupV = 8;           // vocab rows per logits micro-kernel call
constexpr int kRowVecs = kBlock / kLanes;

inline int64_t cdiv(int64_t a, int64_t b) { return (a + b - 1) / b; }

// Hidden [n, h] -> panels Ap[panel][k][kPanel] in fp32, two per row block; rows past n are zero.
std::vector<float> pack_hidden(const Problem& p, const void* hidden) {
  const int64_t panels = 2 * cdiv(p.n, kBlock);
  std::vector<float> ap(size_t(panels * kPanel * p.h), 0.f);
  parallel_for(panels, workers_for(panels), [&](int, int64_t q) {
    std::vector<float> row(size_t(p.h));
    float* dst = ap.data() + q * kPanel * p.h;
    for (int64_t r = 0; r < kPanel && q * kPanel + r < p.n; ++r) {
      to_f32(p.dtype, hidden, (q * kPanel + r) * p.h, p.h, row.data());
      for (int64_t k = 0; k < p.h; ++k) dst[k * kPanel + r] = row[k];
    }
  });
  return ap;
}

// Weight rows [v0, v0 + kTileV) -> wf[kTileV][h] fp32; rows at or past `v_end` are zero.
void load_weight_tile(const Problem& p, const void* weight, int64_t v0, int64_t v_end, float* wf) {
  const int64_t rows = std::max<int64_t>(0, std::min(kTileV, v_end - v0));
  to_f32(p.dtype, weight, v0 * p.h, rows * p.h, wf);
  std::fill(wf + rows * p.h, wf + kTileV * p.h, 0.f);
}

// T[j][r] = sum_k wf[j][k] ap[k][r] for j < kGroupV, r < kPanel. One accumulator chain per
// element, k in order: every logit of the library is computed by this function.
inline void logits_micro(const float* wf, const float* ap, int64_t h, float* t, int64_t ldt) {
  f32x16 acc[kGroupV][2] = {};
  for (int64_t k = 0; k < h; ++k) {
    const f32x16 b0 = load16(ap + k * kPanel), b1 = load16(ap + k * kPanel + kLanes);
    for (int64_t j = 0; j < kGroupV; ++j) {
      const float w = wf[j * h + k];
      acc[j][0] += w * b0;
      acc[j][1] += w * b1;
    }
  }
  for (int64_t j = 0; j < kGroupV; ++j) {
    store16(t + j * ldt, acc[j][0]);
    store16(t + j * ldt + kLanes, acc[j][1]);
  }
}

// Logits tile T[kTileV][kBlock] for the row block starting at panel q0 (two panels).
void logits_tile(const float* wf, const float* ap, int64_t q0, int64_t h, float* t) {
  for (int64_t pq = 0; pq < 2; ++pq)
    for (int64_t j = 0; j < kTileV; j += kGroupV)
      logits_micro(wf + j * h, ap + (q0 + pq) * kPanel * h, h, t + j * kBlock + pq * kPanel, kBlock);
}

// Per-row data of one row block, as vectors of rows.
struct RowBlock {
  f32x16 inv_temp[kRowVecs], lse[kRowVecs], ent[kRowVecs], g[kRowVecs], e[kRowVecs];
  i32x16 target[kRowVecs];
  f32x16 active[kRowVecs];  // 1 for rows that get gradient, else 0
};

// z = (acc + b_j) * inv_temp, in place, for the first `valid` vocab rows of the tile.
void scale_tile(float* t, const float* bias_f, int64_t valid, const f32x16* inv_temp) {
  for (int64_t j = 0; j < valid; ++j)
    for (int rv = 0; rv < kRowVecs; ++rv) {
      float* z = t + j * kBlock + rv * kLanes;
      store16(z, (load16(z) + (bias_f ? bias_f[j] : 0.f)) * inv_temp[rv]);
    }
}

// ---- kept logits (FwdArgs::logits, the fast backward's input): [n, v] in logits_dtype ----------
float kept_value(float z) { return std::clamp(z, -kMaxKeptLogit, kMaxKeptLogit); }

// Tile T[j][r] (columns v0.., rows r0..) -> kept[r][v0 + j] for j < cols (z_of_col(j, r)).
template <class ZOf>
void store_kept(const Problem& p, void* kept, int64_t r0, int64_t v0, int64_t cols, ZOf z_of) {
  const bool f32 = logits_dtype(p.dtype) == DType::kF32;
  for (int64_t r = 0; r < kBlock && r0 + r < p.n; ++r) {
    const int64_t o = (r0 + r) * p.v + v0;
    for (int64_t j = 0; j < cols; ++j) {
      const float z = kept_value(z_of(j, r));
      if (f32) static_cast<float*>(kept)[o + j] = z;
      else static_cast<uint16_t*>(kept)[o + j] = f32_to_f16(z);
    }
  }
}

// kept[r][v0 + j] -> T[j][r] for j < valid; rows past n read as 0 (they get no gradient).
void load_kept(const Problem& p, const void* kept, int64_t r0, int64_t v0, int64_t valid, float* t) {
  const bool f32 = logits_dtype(p.dtype) == DType::kF32;
  for (int64_t r = 0; r < kBlock; ++r) {
    const int64_t o = (r0 + r) * p.v + v0;
    for (int64_t j = 0; j < valid; ++j)
      t[j * kBlock + r] = r0 + r >= p.n ? 0.f
                          : f32         ? static_cast<const float*>(kept)[o + j]
                                        : f16_to_f32(static_cast<const uint16_t*>(kept)[o + j]);
  }
}

// ---- forward ---------------------------------------------------------------------------------

struct FwdScratch {
  std::vector<float> wf, t;
};

void forward_unit(const Problem& p, const FwdArgs& a, const float* ap, int64_t blk, int64_t c,
                  FwdScratch& s) {
  const int64_t r0 = blk * kBlock;
  f32x16 inv_temp[kRowVecs], m[kRowVecs], sum[kRowVecs], acc_a[kRowVecs];
  for (int rv = 0; rv < kRowVecs; ++rv) {
    float tmp[kLanes];
    for (int l = 0; l < kLanes; ++l) {
      const int64_t r = r0 + rv * kLanes + l;
      tmp[l] = r < p.n ? reciprocal(a.temperature[r]) : 1.f;
    }
    inv_temp[rv] = load16(tmp);
    m[rv] = splat(-INFINITY);
    sum[rv] = splat(0.f);
    acc_a[rv] = splat(0.f);
  }
  const int64_t c0 = c * p.chunk, c1 = c0 + p.chunk;
  // Columns at or past `real_end` are padding.
  const int64_t real_end = std::clamp<int64_t>(p.real_vocab - p.vocab_start, 0, p.v);
  for (int64_t v0 = c0; v0 < std::min(c1, real_end); v0 += kTileV) {
    const int64_t valid = std::min({kTileV, c1 - v0, real_end - v0});
    load_weight_tile(p, a.weight, v0, v0 + valid, s.wf.data());
    logits_tile(s.wf.data(), ap, 2 * blk, p.h, s.t.data());
    scale_tile(s.t.data(), p.has_bias ? a.bias + v0 : nullptr, valid, inv_temp);
    if (a.logits)
      store_kept(p, a.logits, r0, v0, valid, [&](int64_t j, int64_t r) { return s.t[j * kBlock + r]; });
    for (int rv = 0; rv < kRowVecs; ++rv) {
      f32x16 mt = m[rv];
      for (int64_t j = 0; j < valid; ++j) mt = vmax(mt, load16(s.t.data() + j * kBlock + rv * kLanes));
      // Rescale the running sums to the new max; rows still at -inf have nothing to rescale.
      const f32x16 d = m[rv] - mt;
      const f32x16 alpha = vexp(d);
      const i32x16 has = sum[rv] > 0.f;  // selects, not products: d is NaN while m = mt = -inf
      acc_a[rv] = has ? alpha * (acc_a[rv] + d * sum[rv]) : splat(0.f);
      sum[rv] = has ? alpha * sum[rv] : splat(0.f);
      m[rv] = mt;
      f32x16 ss = sum[rv], aa = acc_a[rv];
      for (int64_t j = 0; j < valid; ++j) {
        const f32x16 tz = load16(s.t.data() + j * kBlock + rv * kLanes) - mt;
        const f32x16 ez = vexp(tz);
        ss += ez;
        aa += ez * tz;
      }
      sum[rv] = ss;
      acc_a[rv] = aa;
    }
  }
  if (a.logits && real_end < c1) {  // the chunk's padding columns
    const int64_t pad0 = std::max(c0, real_end);
    store_kept(p, a.logits, r0, pad0, c1 - pad0, [](int64_t, int64_t) { return -kMaxKeptLogit; });
  }
  const int64_t k = num_chunks(p);
  for (int rv = 0; rv < kRowVecs; ++rv)
    for (int l = 0; l < kLanes; ++l) {
      const int64_t r = r0 + rv * kLanes + l;
      if (r >= p.n) break;
      float* st = a.stats + (r * k + c) * kStatWidth;
      st[0] = m[rv][l];
      st[1] = sum[rv][l];
      st[2] = p.with_entropy ? acc_a[rv][l] : 0.f;
    }
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
      to_f32(p.dtype, a.hidden, r * p.h, p.h, hrow.data());
      to_f32(p.dtype, a.weight, (t - p.vocab_start) * p.h, p.h, wrow.data());
      float acc = 0.f;
      for (int64_t k = 0; k < p.h; ++k) acc = std::fma(hrow[k], wrow[k], acc);
      const float b = p.has_bias ? a.bias[t - p.vocab_start] : 0.f;
      a.target_logit[r] = (acc + b) * reciprocal(a.temperature[r]);
    }
  });
}

// ---- backward --------------------------------------------------------------------------------

void load_row_block(const Problem& p, const BwdArgs& a, int64_t blk, RowBlock& rb) {
  for (int rv = 0; rv < kRowVecs; ++rv)
    for (int l = 0; l < kLanes; ++l) {
      const int64_t r = blk * kBlock + rv * kLanes + l;
      const bool in = r < p.n;
      const int64_t t = in ? a.targets[r] : p.ignore_index;
      const bool act = in && classify_target(t, p.real_vocab, p.ignore_index) == TargetKind::kValid;
      rb.inv_temp[rv][l] = in ? reciprocal(a.temperature[r]) : 1.f;
      rb.lse[rv][l] = act ? a.lse[r] : 0.f;
      rb.ent[rv][l] = act && a.entropy ? a.entropy[r] : 0.f;
      rb.g[rv][l] = act ? a.g[r] : 0.f;
      rb.e[rv][l] = act && a.e ? a.e[r] : 0.f;
      rb.target[rv][l] = int32_t(act ? t : -1);
      rb.active[rv][l] = act ? 1.f : 0.f;
    }
}

// In place: z tile -> dlogit tile (dz * inv_temp); padded vocab rows and inactive rows give 0.
// dzz (may be null) accumulates dz * z per row in vocab order.
void dlogit_tile(float* t, int64_t gid0, int64_t valid, const RowBlock& rb, f32x16* dzz) {
  for (int64_t j = 0; j < kTileV; ++j)
    for (int rv = 0; rv < kRowVecs; ++rv) {
      float* zp = t + j * kBlock + rv * kLanes;
      if (j >= valid) {
        store16(zp, splat(0.f));
        continue;
      }
      const f32x16 z = load16(zp);
      const f32x16 pr = vexp(z - rb.lse[rv]);
      const f32x16 delta = rb.target[rv] == int32_t(gid0 + j) ? splat(1.f) : splat(0.f);
      const f32x16 dz = rb.active[rv] > 0.f ? rb.g[rv] * (delta - pr) + rb.e[rv] * pr * (rb.lse[rv] - rb.ent[rv] - z)
                                            : splat(0.f);
      if (dzz) dzz[rv] += dz * z;
      store16(zp, dz * rb.inv_temp[rv]);
    }
}

// The z tile of row block `blk` and columns [v0, v0 + valid): from the kept logits (fast) or
// recomputed (lean; needs the weight tile in wf).
void z_tile(const Problem& p, const BwdArgs& a, const float* ap, int64_t blk, int64_t v0, int64_t valid,
            const RowBlock& rb, const float* wf, float* t) {
  if (a.logits) {
    load_kept(p, a.logits, blk * kBlock, v0, valid, t);
    return;
  }
  logits_tile(wf, ap, 2 * blk, p.h, t);
  scale_tile(t, p.has_bias ? a.bias + v0 : nullptr, valid, rb.inv_temp);
}

struct BwdScratch {
  std::vector<float> wf, t, dh;  // pass 1
  std::vector<float> dwt, dt, row;  // pass 2: dW^T [h][kTileV], dlogit^T [kBlock][kTileV], a dW row [h]
};

// Pass 1: dH and dT of one row block, over the whole local vocab in order.
void dhidden_unit(const Problem& p, const BwdArgs& a, const float* ap, int64_t blk, BwdScratch& s) {
  RowBlock rb;
  load_row_block(p, a, blk, rb);
  f32x16 dzz[kRowVecs] = {};
  std::fill(s.dh.begin(), s.dh.end(), 0.f);
  const int64_t real_end = std::clamp<int64_t>(p.real_vocab - p.vocab_start, 0, p.v);
  for (int64_t c0 = 0; c0 < real_end; c0 += p.chunk)
    for (int64_t v0 = c0; v0 < std::min(c0 + p.chunk, real_end); v0 += kTileV) {
      const int64_t valid = std::min({kTileV, c0 + p.chunk - v0, real_end - v0});
      load_weight_tile(p, a.weight, v0, v0 + valid, s.wf.data());
      z_tile(p, a, ap, blk, v0, valid, rb, s.wf.data(), s.t.data());
      dlogit_tile(s.t.data(), p.vocab_start + v0, valid, rb, dzz);
      // dh[r][k] += sum_j dlogit[j][r] wf[j][k]: eight rows by two vectors of k per step.
      for (int64_t r = 0; r < kBlock; r += 8)
        for (int64_t k = 0; k + 2 * kLanes <= p.h; k += 2 * kLanes) {
          f32x16 acc[8][2];
          for (int i = 0; i < 8; ++i) {
            acc[i][0] = load16(&s.dh[(r + i) * p.h + k]);
            acc[i][1] = load16(&s.dh[(r + i) * p.h + k + kLanes]);
          }
          for (int64_t j = 0; j < valid; ++j) {
            const f32x16 w0 = load16(&s.wf[j * p.h + k]), w1 = load16(&s.wf[j * p.h + k + kLanes]);
            const float* d = s.t.data() + j * kBlock + r;
            for (int i = 0; i < 8; ++i) {
              acc[i][0] += d[i] * w0;
              acc[i][1] += d[i] * w1;
            }
          }
          for (int i = 0; i < 8; ++i) {
            store16(&s.dh[(r + i) * p.h + k], acc[i][0]);
            store16(&s.dh[(r + i) * p.h + k + kLanes], acc[i][1]);
          }
        }
      for (int64_t k = p.h - p.h % (2 * kLanes); k < p.h; ++k)  // h tail, same order per element
        for (int64_t r = 0; r < kBlock; ++r) {
          float acc = s.dh[r * p.h + k];
          for (int64_t j = 0; j < valid; ++j) acc += s.t[j * kBlock + r] * s.wf[j * p.h + k];
          s.dh[r * p.h + k] = acc;
        }
    }
  for (int64_t i = 0; i < kBlock; ++i) {
    const int64_t r = blk * kBlock + i;
    if (r >= p.n) break;
    from_f32(a.dhidden_dtype, s.dh.data() + i * p.h, p.h, a.dhidden, r * p.h);
    if (a.dtemp) a.dtemp[r] = -rb.inv_temp[i / kLanes][i % kLanes] * dzz[i / kLanes][i % kLanes];
  }
}

// Pass 2: dW and db of one vocab tile, over all row blocks in order.
void dweight_unit(const Problem& p, const BwdArgs& a, const float* ap, int64_t tile, BwdScratch& s) {
  const int64_t v0 = tile * kTileV;
  const int64_t real_end = std::clamp<int64_t>(p.real_vocab - p.vocab_start, 0, p.v);
  const int64_t valid = std::clamp<int64_t>(real_end - v0, 0, kTileV);
  const int64_t rows = std::min(kTileV, p.v - v0);
  std::fill(s.dwt.begin(), s.dwt.end(), 0.f);  // dwt[k][j]
  float db[kTileV] = {};
  if (valid > 0) {
    if (!a.logits) load_weight_tile(p, a.weight, v0, v0 + valid, s.wf.data());
    RowBlock rb;
    std::vector<float>& dt = s.dt;  // dlogit transposed: dt[r][j]
    for (int64_t blk = 0; blk < cdiv(p.n, kBlock); ++blk) {
      load_row_block(p, a, blk, rb);
      z_tile(p, a, ap, blk, v0, valid, rb, s.wf.data(), s.t.data());
      dlogit_tile(s.t.data(), p.vocab_start + v0, valid, rb, nullptr);
      for (int64_t j = 0; j < kTileV; ++j)
        for (int64_t r = 0; r < kBlock; ++r) {
          dt[r * kTileV + j] = s.t[j * kBlock + r];
          db[j] += s.t[j * kBlock + r];
        }
      // dwt[k][j] += sum_r ap[k][r] dt[r][j]: four k by four vectors of j per step.
      for (int64_t pq = 0; pq < 2; ++pq) {
        const float* apq = ap + (2 * blk + pq) * kPanel * p.h;
        const float* dtq = dt.data() + pq * kPanel * kTileV;
        for (int64_t k = 0; k < p.h; k += 4) {
          const int kk = int(std::min<int64_t>(4, p.h - k));
          f32x16 acc[4][4];
          for (int i = 0; i < kk; ++i)
            for (int jv = 0; jv < 4; ++jv) acc[i][jv] = load16(&s.dwt[(k + i) * kTileV + jv * kLanes]);
          for (int64_t r = 0; r < kPanel; ++r) {
            f32x16 d[4];
            for (int jv = 0; jv < 4; ++jv) d[jv] = load16(dtq + r * kTileV + jv * kLanes);
            for (int i = 0; i < kk; ++i) {
              const float hv = apq[(k + i) * kPanel + r];
              for (int jv = 0; jv < 4; ++jv) acc[i][jv] += hv * d[jv];
            }
          }
          for (int i = 0; i < kk; ++i)
            for (int jv = 0; jv < 4; ++jv) store16(&s.dwt[(k + i) * kTileV + jv * kLanes], acc[i][jv]);
        }
      }
    }
  }
  float* row = s.row.data();
  for (int64_t j = 0; j < rows; ++j) {
    for (int64_t k = 0; k < p.h; ++k) row[k] = s.dwt[k * kTileV + j];
    from_f32(p.dtype, row, p.h, a.dweight, (v0 + j) * p.h);
    if (a.dbias) a.dbias[v0 + j] = db[j];
  }
}

}  // namespace

Status forward(const Problem& p, const FwdArgs& a) {
  if (p.chunk <= 0 || p.v % p.chunk != 0) return "rlk cpu forward: chunk must divide the local vocab";
  if (p.n == 0) return nullptr;
  const std::vector<float> ap = pack_hidden(p, a.hidden);
  const int64_t k = num_chunks(p), units = cdiv(p.n, kBlock) * k;
  const int workers = workers_for(units);
  std::vector<FwdScratch> scratch(static_cast<size_t>(workers));
  for (auto& s : scratch) {
    s.wf.resize(size_t(kTileV * p.h));
    s.t.resize(size_t(kTileV * kBlock));
  }
  parallel_for(units, workers, [&](int w, int64_t u) { forward_unit(p, a, ap.data(), u / k, u % k, scratch[w]); });
  target_logits(p, a);
  return nullptr;
}

Status combine(const CombineArgs& a) {
  parallel_for(cdiv(a.n, 1024), workers_for(cdiv(a.n, 1024)), [&](int, int64_t u) {
    for (int64_t r = u * 1024; r < std::min(a.n, (u + 1) * 1024); ++r) {
      const RowResult res = combine_row(a.stats + r * a.k * kStatWidth, a.k, a.target_logit[r], a.targets[r],
                                        a.real_vocab, a.ignore_index);
      a.logp[r] = res.logp;
      a.lse[r] = res.lse;
      a.entropy[r] = res.entropy;
    }
  });
  return nullptr;
}

Status backward(const Problem& p, const BwdArgs& a) {
  if (p.chunk <= 0 || p.v % p.chunk != 0) return "rlk cpu backward: chunk must divide the local vocab";
  if (Status s = check_dhidden_dtype(p, a.dhidden_dtype)) return s;
  if (p.n == 0) {  // no rows: dW and db are zero
    std::vector<float> zero(size_t(p.h), 0.f);
    for (int64_t j = 0; j < p.v; ++j) from_f32(p.dtype, zero.data(), p.h, a.dweight, j * p.h);
    if (a.dbias) std::fill(a.dbias, a.dbias + p.v, 0.f);
    return nullptr;
  }
  const std::vector<float> ap = pack_hidden(p, a.hidden);
  const int64_t blocks = cdiv(p.n, kBlock), tiles = cdiv(p.v, kTileV);
  auto make = [&](int workers, bool pass1) {
    std::vector<BwdScratch> sc(static_cast<size_t>(workers));
    for (auto& s : sc) {
      s.wf.resize(size_t(kTileV * p.h));
      s.t.resize(size_t(kTileV * kBlock));
      if (pass1) {
        s.dh.resize(size_t(kBlock * p.h));
      } else {
        s.dwt.resize(size_t(p.h * kTileV));
        s.dt.resize(size_t(kBlock * kTileV));
        s.row.resize(size_t(p.h));
      }
    }
    return sc;
  };
  {
    const int workers = workers_for(blocks);
    auto sc = make(workers, true);
    parallel_for(blocks, workers, [&](int w, int64_t blk) { dhidden_unit(p, a, ap.data(), blk, sc[w]); });
  }
  {
    const int workers = workers_for(tiles);
    auto sc = make(workers, false);
    parallel_for(tiles, workers, [&](int w, int64_t tile) { dweight_unit(p, a, ap.data(), tile, sc[w]); });
  }
  return nullptr;
}

}  // namespace rlk::cpu
