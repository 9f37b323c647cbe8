// The CPU backend's saved logits (FwdArgs::saved_logits, BwdArgs::saved_logits): the record the
// forward writes for the fast backward, its layout and its stores and loads (an internal header
// of cpu/, after gemm.h).
#pragma once

#include "gemm.h"

namespace rlk::cpu::RLK_CPU_ISA {  // one namespace per ISA level (cpu/dispatch.h)
namespace {

// fp32 operands: z fp32, as the forward computed it (what lean recomputes, bit for bit), by row
// block: the nr = min(kBlock, n - r0) rows of the block at row r0 keep z^T [v][nr] from float
// r0 v on (saved_z), so a (row block, vocab tile) piece is one contiguous run in the tiles' own
// T[j][r] order, moved with no transpose; n v floats in all.
// 16-bit operands, one record per row (row_bytes):
//   float moments[chunks][6]   the chunk's (m, s, a, b, s_keep, a_keep), b = sum_j exp(z_j - m)
//                              (z_j - m)^2, s_keep and a_keep the sums of s and a over the nucleus
//                              (FwdArgs::keep; 0 without)
//   float tile_max[chunks * tiles_per_chunk]   mt: the running row max after each tile
//   float z_target             the forward's target_logit
//   fp16  q[v (even)]          q_j = exp(z_j - mt) of the column's tile, in [0, 1]
// so p_j = q_j exp((mt - m) - log_s) has fp16's uniform relative error at every |z|, and dT, an
// fp32 output, comes from the fp32 moments (see saved_dzz) instead of from q.
constexpr int64_t kMoments = 6;
struct SavedRow {
  int64_t chunks, tiles_per_chunk, floats, bytes;
  explicit SavedRow(const Problem& p)
      : chunks(num_chunks(p)), tiles_per_chunk(cdiv(p.chunk, kTileV)),
        floats(chunks * kMoments + chunks * tiles_per_chunk + 1), bytes(floats * 4 + 2 * (p.v + p.v % 2)) {}
  float* moments(void* saved, int64_t r) const {
    return reinterpret_cast<float*>(static_cast<char*>(saved) + r * bytes);
  }
  float* tile_max(void* saved, int64_t r) const { return moments(saved, r) + chunks * kMoments; }
  float* z_target(void* saved, int64_t r) const { return tile_max(saved, r) + chunks * tiles_per_chunk; }
  uint16_t* q(void* saved, int64_t r) const {
    return reinterpret_cast<uint16_t*>(static_cast<char*>(saved) + r * bytes + floats * 4);
  }
};

bool saved_f32(const Problem& p) { return p.dtype == DType::kF32; }

// Rows of the row block that starts at row r0.
int64_t block_rows(const Problem& p, int64_t r0) { return std::min(kBlock, p.n - r0); }

// The fp32 record's z of column col for the rows of the block at row r0 (contiguous, block_rows).
float* saved_z(const Problem& p, const void* saved, int64_t r0, int64_t col) {
  return const_cast<float*>(static_cast<const float*>(saved)) + r0 * p.v + col * block_rows(p, r0);
}

// Tile T[j][r] (columns v0.., rows r0..) -> the saved logits for j < cols: z (fp32) or q (16-bit).
void store_saved(const Problem& p, void* saved, int64_t r0, int64_t v0, int64_t cols, const float* t) {
  const int64_t nr = block_rows(p, r0);
  if (saved_f32(p)) {
    for (int64_t j = 0; j < cols; ++j) std::copy_n(t + j * kBlock, nr, saved_z(p, saved, r0, v0 + j));
    return;
  }
  const SavedRow row(p);
  for (int64_t r = 0; r < nr; ++r) {
    uint16_t* q = row.q(saved, r0 + r) + v0;
    for (int64_t j = 0; j < cols; ++j) q[j] = f32_to_f16(t[j * kBlock + r]);
  }
}

// Every byte of the saved logits is written: chunk c's padding columns [pad0, c1) of rows r0.. get
// z = -inf (fp32) or q = 0 and tile maxima -inf (16-bit; also the odd v's spare q slot).
void fill_saved_padding(const Problem& p, void* saved, int64_t r0, int64_t c, int64_t pad0) {
  const SavedRow row(p);
  const int64_t c0 = c * p.chunk, c1 = c0 + p.chunk;
  if (saved_f32(p)) {
    if (pad0 < c1) std::fill(saved_z(p, saved, r0, pad0), saved_z(p, saved, r0, c1), -INFINITY);
    return;
  }
  for (int64_t r = r0; r < r0 + block_rows(p, r0); ++r) {
    std::fill(row.q(saved, r) + pad0, row.q(saved, r) + c1 + (c1 == p.v ? p.v % 2 : 0), uint16_t(0));
    float* tmax = row.tile_max(saved, r) + c * row.tiles_per_chunk;
    std::fill(tmax + cdiv(pad0 - c0, kTileV), tmax + row.tiles_per_chunk, -INFINITY);
  }
}

// The saved logits -> T[j][r] for j < valid (z or q); rows past n read as 0 (they get no gradient).
void load_saved(const Problem& p, const void* saved, int64_t r0, int64_t v0, int64_t valid, float* t) {
  const int64_t nr = block_rows(p, r0);
  if (saved_f32(p)) {
    for (int64_t j = 0; j < valid; ++j) {
      std::copy_n(saved_z(p, saved, r0, v0 + j), nr, t + j * kBlock);
      std::fill(t + j * kBlock + nr, t + (j + 1) * kBlock, 0.f);
    }
    return;
  }
  const SavedRow row(p);
  for (int64_t r = 0; r < kBlock; ++r) {
    if (r >= nr) {
      for (int64_t j = 0; j < valid; ++j) t[j * kBlock + r] = 0.f;
    } else {
      const uint16_t* q = row.q(const_cast<void*>(saved), r0 + r) + v0;
      for (int64_t j = 0; j < valid; ++j) t[j * kBlock + r] = f16_to_f32(q[j]);
    }
  }
}

}  // namespace
}  // namespace rlk::cpu::RLK_CPU_ISA
