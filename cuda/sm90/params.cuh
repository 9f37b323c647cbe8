// What every part of the Hopper kernel reads: the tile shape, the epilogue kinds and the kernel's
// arguments.
#pragma once

#include <cstdint>

#include "linear_logp_cuda.h"  // SavedLayout

namespace rlk::cuda::detail::sm90 {

// A CTA computes 128x256 logit tiles (two consumer warpgroups of 64 rows) over K tiles of 64.
constexpr int kBM = 128, kBN = 256, kBK = 64;

// What the epilogue does with each logit tile (the kernel's template parameter).
//   kStats   the forward: fold the tile into per-row (m, s, a); logits never leave registers;
//   kSave    the same, and also the fast backward's saved record: q = exp(z - tile max) as fp16,
//            the tile maxima and the moment b (linear_logp_cuda.h, SavedLayout);
//   kDlogit  the lean backward's recompute: dlogit = dz * inv_temp from the row's lse (and entropy
//            and upstream gradients), stored in the operand dtype; with a dT, sum_j dz z per
//            (row, split).
enum class Epi { kStats, kSave, kDlogit };

struct Params {
  int64_t rows;       // valid rows of hidden (this pass)
  int64_t row_tiles;
  int32_t kblocks;    // K tiles: h / kBK
  int64_t chunk, spc, nsplit;  // the split walk (lp_geometry.h)
  int64_t split_cols;          // kSplitCols (forward) or kDlogitSplitCols
  int64_t vocab_start, real_vocab;
  const float* bias;  // f32, of local column 0, or null
  const float* temperature;
  float* part;        // kStats, kSave: [rows, nsplit, kPartWidth]; kDlogit: [rows, nsplit] sum dz z, or null
  uint16_t* out;      // [rows, ldo] 2-byte tile output: q (kSave) or dlogit (kDlogit)
  int64_t ldo, cols;  // its row stride and width (columns past `cols` are not written)
  bool out_tma;       // the output goes out by TMA (16-byte aligned rows and tile starts)
};

}  // namespace rlk::cuda::detail::sm90
