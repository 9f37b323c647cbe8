// The CPU backend's backward, lean (recomputes the logits in both passes: four GEMM-equivalents,
// the threads' outputs disjoint, no fp32 [v, h] or [n, v] scratch) and fast (reads them from the
// saved logits: two GEMM-equivalents). Order of every reduction is fixed by shapes alone:
//   pass 1 (dH, dT): unit = kDhBlocks row blocks (one where there are few), each over all tiles
//                    in vocab order; the blocks share the weight's reads.
//   pass 2 (dW, db): unit = vocab tile, all row blocks in row order.
#include "gemm.h"
#include "saved_logits.h"

namespace rlk::cpu::RLK_CPU_ISA {  // one namespace per ISA level (cpu/dispatch.h)
namespace {

// Per-row data of one row block, as vectors of rows.
struct RowBlock {
  fvec inv_temp[kRowVecs], m[kRowVecs], log_s[kRowVecs], c[kRowVecs], g[kRowVecs], e[kRowVecs];  // c = log_s - ent
  fvec log_s_keep[kRowVecs];  // the nucleus's (BwdArgs::keep)
  ivec target[kRowVecs];
  fvec active[kRowVecs];  // 1 for rows that get gradient, else 0
};

void load_row_block(const Problem& p, const BwdArgs& a, int64_t blk, RowBlock& rb) {
  for (int rv = 0; rv < kRowVecs; ++rv)
    for (int l = 0; l < kLanes; ++l) {
      const int64_t r = blk * kBlock + rv * kLanes + l;
      const bool in = r < p.n;
      const int64_t t = in ? a.targets[r] : p.ignore_index;
      const bool act = in && classify_target(t, p.real_vocab, p.ignore_index) == TargetKind::kValid;
      // A row with non-finite statistics (a NaN row; with a nucleus, also an empty one) gets NaN in
      // every column, -inf logits too.
      const bool nan_row =
          act && !(std::isfinite(a.m[r]) && std::isfinite(a.log_s[r]) && (!a.keep || std::isfinite(a.log_s_keep[r])));
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

// What a backward tile holds: z (lean; fast with fp32 operands), or q of the 16-bit saved record
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
      const fvec dz = rb.active[rv] > 0.f
                          ? rb.g[rv] * (delta - pk) + rb.e[rv] * (live ? pr * (rb.c[rv] - zm) : splat(0.f))
                          : splat(0.f);
      if (dzz) dzz[rv] += live ? dz * zm : splat(0.f);
      vstore(zp, dz * rb.inv_temp[rv]);
    }
}

// The tile of row block `blk` and columns [v0, v0 + valid) (forward tile `tile` of the row): from
// the saved logits (fast) or recomputed (lean; needs the logits' weight tile in w).
void z_tile(const Problem& p, const BwdArgs& a, const Panels& ap, int64_t blk, int64_t v0, int64_t valid, int64_t tile,
            const RowBlock& rb, WeightTile& w, float* t, TileKind& kind) {
  kind.q = a.saved_logits && !saved_f32(p);
  if (!a.saved_logits) {
    tile_logits(p, ap, w, blk, t);
    scale_tile(t, p.has_bias ? a.bias + v0 : nullptr, valid, rb.inv_temp);
    return;
  }
  load_saved(p, a.saved_logits, blk * kBlock, v0, valid, t);
  if (!kind.q) return;
  const SavedRow row(p);
  for (int rv = 0; rv < kRowVecs; ++rv) {
    float mt[kLanes];
    for (int l = 0; l < kLanes; ++l) {
      const int64_t r = blk * kBlock + rv * kLanes + l;
      mt[l] = rb.active[rv][l] > 0.f ? row.tile_max(a.saved_logits, r)[tile] : 0.f;
    }
    kind.d[rv] = vload(mt) - rb.m[rv];
    kind.w[rv] = vexp(kind.d[rv] - rb.log_s[rv]);
    kind.wk[rv] = vexp(kind.d[rv] - rb.log_s_keep[rv]);
  }
}

// sum_j dz_j (z_j - m) of this shard's columns for the rows of rb, from the 16-bit saved record's
// fp32 chunk moments (m_c, s_c, a_c, b_c, sk_c, ak_c; moments_dzz, with a nucleus kept_moments_dzz)
// and the target, when it is a column of this shard (and, with a nucleus, kept), g (z_t - m).
void saved_dzz(const Problem& p, const BwdArgs& a, int64_t blk, const RowBlock& rb, fvec* dzz) {
  const SavedRow row(p);
  const int64_t real_end = std::clamp<int64_t>(p.real_vocab - p.vocab_start, 0, p.v);
  for (int rv = 0; rv < kRowVecs; ++rv)
    for (int l = 0; l < kLanes; ++l) {
      const int64_t r = blk * kBlock + rv * kLanes + l;
      if (!(rb.active[rv][l] > 0.f)) continue;
      const float m = rb.m[rv][l], log_s = rb.log_s[rv][l], g = rb.g[rv][l], e = rb.e[rv][l], c = rb.c[rv][l];
      const float* mom = row.moments(a.saved_logits, r);
      float acc = 0.f;
      for (int64_t k = 0; k < row.chunks; ++k, mom += kMoments)
        acc += a.keep ? kept_moments_dzz(mom, m, log_s, rb.log_s_keep[rv][l], c, g, e)
                      : moments_dzz(mom, m, log_s, c, g, e);
      const int64_t t = rb.target[rv][l] - p.vocab_start;
      if (t >= 0 && t < real_end && (!a.keep || a.keep[r * p.v + t])) acc += g * (*row.z_target(a.saved_logits, r) - m);
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
          Outer<uint32_t>{s.dl.data() + r, kBlock, 1, s.wj.data(), hp, cdiv(rows, 2), dh + r * hp, hp}, kGradRows,
          hp / kLanes, false);
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
    if (a.saved_logits && !saved_f32(p)) saved_dzz(p, a, blk0 + b, rb[b], dzz[b]);
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
      if (!a.saved_logits) load_logits_weight(p, a.weight, v0, v0 + valid, s.w);  // lean's logits
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
    outer_grid<kGradRows, kGradVecs>(
        Outer<uint32_t>{s.dl.data(), 1, ldl, ap.row_pairs.data() + (blk - g) * kBlock / 2 * hp, hp,
                        (g + 1) * kBlock / 2, s.dw.data(), hp},
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
    if (!a.saved_logits) load_logits_weight(p, a.weight, v0, v0 + valid, s.w);
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
  if (!a.saved_logits && !dp_bf16(p)) ap.f32 = pack_hidden(p, a.hidden, kPanel);  // lean's logits
  if (!a.saved_logits && dp_bf16(p)) ap.pairs = pack_hidden_pairs(p, a.hidden);  // lean's logits
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
    parallel_for(units, workers,
                 [&](int w, int64_t u) { dhidden_unit(p, a, ap, u * nb, std::min(nb, blocks - u * nb), sc[w]); });
  }
  {
    const int workers = workers_for(tiles);
    auto sc = make(workers, false);
    parallel_for(tiles, workers, [&](int w, int64_t tile) { dweight_unit(p, a, ap, tile, sc[w]); });
  }
  return nullptr;
}

}  // namespace rlk::cpu::RLK_CPU_ISA
