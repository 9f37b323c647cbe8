// The CPU backend's forward (per-(row, chunk) statistics, the target logit, the saved logits) and
// combine. Order of every reduction is fixed by shapes alone: unit = (row block, chunk); tiles of
// the chunk from its first column, in order.
#include "gemm.h"
#include "saved_logits.h"

namespace rlk::cpu::RLK_CPU_ISA {  // one namespace per ISA level (cpu/dispatch.h)
namespace {

struct FwdScratch {
  WeightTile w;
  std::vector<float> t, kt;  // logits, nucleus (FwdArgs::keep)
};

void forward_unit(const Problem& p, const FwdArgs& a, const Panels& ap, int64_t blk, int64_t c, FwdScratch& s) {
  const int64_t r0 = blk * kBlock;
  const bool save_q = a.saved_logits && !saved_f32(p);  // the 16-bit saved record: q, tile maxima, moments
  const SavedRow row(p);
  // sk, ak: s and a over the nucleus (with a.keep; ak only for the saved record)
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
    if (a.saved_logits && !save_q) store_saved(p, a.saved_logits, r0, v0, valid, s.t.data());
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
        tb += ez * tz * tz;  // also without save_q: the same arithmetic, so the same bits, either way
        if (a.keep) {
          const ivec kept = vload(s.kt.data() + j * kBlock + rv * kLanes) != 0.f;
          tsk += kept ? ez : splat(0.f);
          tak += kept ? ez * tz : splat(0.f);
        }
        if (save_q) vstore(zp, ez);
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
      if (save_q)
        for (int l = 0; l < kLanes && r0 + rv * kLanes + l < p.n; ++l)
          row.tile_max(a.saved_logits, r0 + rv * kLanes + l)[c * row.tiles_per_chunk + (v0 - c0) / kTileV] = mt[l];
    }
    if (save_q) store_saved(p, a.saved_logits, r0, v0, valid, s.t.data());
  }
  if (a.saved_logits) fill_saved_padding(p, a.saved_logits, r0, c, std::clamp(real_end, c0, c1));
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
      if (save_q) {
        float* mom = row.moments(a.saved_logits, r) + c * kMoments;
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
    if (Pairwise(b, chains).merge([&](int l) { acc = stack[l] + acc; }, [&](int l) { stack[l] = acc; })) sum = acc;
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
  if (a.saved_logits && !saved_f32(p)) {
    const SavedRow row(p);
    for (int64_t r = 0; r < p.n; ++r) *row.z_target(a.saved_logits, r) = a.target_logit[r];
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

size_t saved_logits_bytes(const Problem& p) {
  if (p.chunk <= 0 || p.v % p.chunk != 0) return 0;
  return size_t(p.n) * size_t(saved_f32(p) ? p.v * 4 : SavedRow(p).bytes);
}

Status combine(const CombineArgs& a) {
  parallel_for(cdiv(a.n, 1024), workers_for(cdiv(a.n, 1024)), [&](int, int64_t u) {
    for (int64_t r = u * 1024; r < std::min(a.n, (u + 1) * 1024); ++r) combine_one(a, r);
  });
  return nullptr;
}

}  // namespace rlk::cpu::RLK_CPU_ISA
