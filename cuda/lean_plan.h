// The lean backward's memory plan (linear_logp_bwd.cu runs it): the workspace's layout, the
// vocab pieces and the dH row sweeps. Host C++ only, no CUDA headers: it builds without nvcc too,
// and tests/test_lean_plan.py checks it on any machine. Everything here depends on the shapes, the
// dtypes and the path (fused or gemm) only.
//
// Memory: all that lean adds to the caller's buffers is its workspace, which lean_layout fits in
// kLeanBudget (lean_plan.cc) whatever n and v (h up to 32768): cuBLAS's part, the dH accumulator rows that
// dhidden cannot hold, the tiles (and the fp32 dW piece accumulator when n takes more than one
// row pass).
// - dH sums over the pieces in fp32: in dhidden itself when it is fp32; when it is 16-bit, its
//   bytes hold the fp32 rows [0, n/2) and the workspace the rest (all of them while they take at
//   most kLeanDhWhole), and the backward (finish_dhidden) rounds them once at the end. No [n, h]
//   fp32 buffer exists beyond half of one (128 MiB at L16k) or 32 MiB.
// - Where that half does not fit (n * h * 2 bytes past about 190 MiB: n > 24k at h = 4096), dH
//   comes in row sweeps (DhSweep). The first sweep is the whole backward (every piece and row:
//   dW, db, dT) but accumulates dH only for the rows that fit, and rounds them. Each next sweep
//   recomputes the dlogit tiles of rows still without dH, for dH alone, in the room the rounded
//   rows left in dhidden plus the workspace's dH rows: the rows left at least halve per sweep,
//   and their recompute is the extra work. Those rows sum dH over the workspace tile's pieces,
//   an order other than the first sweep's but as fixed by the shapes.
// - The pieces are as wide as possible: each fp32 read-modify-write of the dH accumulator costs
//   n * h * 8 bytes of traffic, and wider dW GEMMs run closer to peak. dW's rows past the current
//   piece are not written yet, so a piece's tiles borrow them while they are large enough
//   (lean_next_piece); the workspace tile takes the pieces that are left at the end.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <vector>

#include "lp_geometry.h"
#include "rlk/linear_logp.h"

namespace rlk::cuda {

struct LeanTiles {
  int64_t P;      // the workspace tile's piece width
  int64_t P_max;  // the widest piece (sizes dzz; with several passes, the dW accumulator)
  int64_t R;      // rows per pass
  size_t dwacc;   // the fp32 dW piece accumulator (several passes), else 0
};

struct LeanLayout {
  bool fused;
  LeanTiles t;
  int64_t dh_in;  // the first sweep's dH rows accumulated (fp32) inside dhidden
  int64_t dh_ws;  // dH rows the workspace holds (fp32) in each sweep
  size_t off_dh, off_z, off_dlog, off_dzz, off_dwacc, total;  // from the 256-aligned tile base; total: all of it
};

inline size_t align256(size_t x) { return (x + 255) & ~size_t(255); }
inline unsigned char* align256(unsigned char* p) {
  return reinterpret_cast<unsigned char*>(align256(reinterpret_cast<uintptr_t>(p)));
}
inline int64_t ceil_to(int64_t x, int64_t m) { return (x + m - 1) / m * m; }
// dzz's columns per row for a piece of P columns (the sm90 recompute's splits)
inline int64_t dlogit_splits(int64_t P) { return detail::splits_per_chunk(P, detail::kDlogitSplitCols); }

// Tile bytes per row of a pass, for a piece of P columns: z (gemm path) and dlogit.
inline size_t lean_per_row(const Problem& p, bool fused, int64_t P) {
  return size_t(P) * (dtype_bytes(p.dtype) + (fused ? 0 : 4));
}

// One sweep where it fits in one row pass, or in several passes of tiles as large as the sweeps'
// (no recompute then); else row sweeps.
LeanLayout lean_layout(const Problem& p, bool fused, DType dh_dtype);

// The workspace of the lean backward (BwdArgs::saved_logits null). `fused`: the sm90 recompute may run
// (forward_backend is kCudaSm90); backward_lean then still falls back to the gemm path for
// operands that TMA cannot take, so the workspace holds either layout.
size_t lean_workspace_bytes(const Problem& p, bool fused, DType dh_dtype);

// A dH sweep: rows [r0, r1), whose fp32 accumulator holds rows [r0, r0 + in) inside dhidden's
// bytes from row r0's place on, and the others at the workspace's dH rows.
struct DhSweep {
  int64_t r0, in, r1;
};

// f(sweep) in row order; stops at the first error. The first sweep keeps L.dh_in rows inside
// dhidden; each next one as many as the bytes past the rounded rows hold (whole 128-row blocks).
template <class F>
Status for_each_dh_sweep(const Problem& p, const LeanLayout& L, DType dh_dtype, F&& f) {
  const int64_t eb = int64_t(dtype_bytes(dh_dtype));
  for (int64_t r0 = 0, in = L.dh_in; r0 < p.n;) {
    const int64_t r1 = std::min(p.n, r0 + in + L.dh_ws);
    if (Status s = f(DhSweep{r0, std::min(in, r1 - r0), r1})) return s;
    r0 = r1;
    in = eb == 4 ? p.n - r0 : (p.n - r0) * eb / 4 / 128 * 128;
  }
  return nullptr;
}

// A piece: columns [c, c + cols) with tiles of width w (a multiple of 256; cols < w only at the
// end of the vocab), either borrowed from dW's rows past the piece or in the workspace.
struct LeanPiece {
  int64_t c, w, cols;
  bool borrowed;
};

// The piece from column c (`borrow`: while dW is still being written). Depends on the shapes
// only, so every run cuts the vocab alike.
LeanPiece lean_next_piece(const Problem& p, const LeanLayout& L, int64_t c, bool borrow);

// f(piece) for the pieces in vocab order; stops at the first error.
template <class F>
Status for_each_lean_piece(const Problem& p, const LeanLayout& L, bool borrow, F&& f) {
  for (int64_t c = 0; c < p.v;) {
    const LeanPiece pc = lean_next_piece(p, L, c, borrow);
    if (Status s = f(pc)) return s;
    c += pc.cols;
  }
  return nullptr;
}

// Rows finish_dhidden rounds at a time: as many as fit the workspace's dlogit tile.
inline int64_t finish_rows(const Problem& p, const LeanLayout& L) { return L.t.R * L.t.P / p.h; }

// The layout of a sweep: the first's is L itself; a later one's tiles (dH alone, in the workspace
// tile) take as many rows as the sweep has, at most a pass's, so the same bytes hold wider pieces,
// each one fp32 read-modify-write of the sweep's dH rows fewer (L32k's second sweep: 33 pieces
// instead of 149).
LeanLayout sweep_layout(const Problem& p, LeanLayout L, const DhSweep& sw);

// The whole plan, for tests and reports: the layout, how it cuts the vocab into pieces and rows into
// dH sweeps. `fused`: the sm90 recompute, as forward_backend decides on a device
// (lean_workspace_bytes takes the larger of the two layouts there). All zero for n == 0.
struct LeanPiecePlan {
  int64_t col, cols, width;  // columns [col, col + cols), tiles of `width` columns
  bool borrowed;             // tiles in dW's rows past the piece, else in the workspace
  size_t tile_bytes;         // all tiles of one row pass
};
struct DhSweepPlan {
  int64_t r0, in, r1;  // dH rows [r0, r1), of which [r0, r0 + in) accumulate inside dhidden
  int64_t tile_rows, tile_width;  // a later sweep's workspace tile (the first's: rows_per_pass, its pieces)
};
struct LeanPlan {
  LeanLayout layout;    // layout.total: the workspace; layout.t.R: rows per pass
  size_t ws_tile_bytes;  // the workspace tile (z and dlogit) of one row pass
  std::vector<LeanPiecePlan> pieces;   // the first sweep's (later ones take the workspace tile)
  std::vector<DhSweepPlan> dh_sweeps;  // one, unless dH's fp32 accumulator does not fit
};
LeanPlan lean_plan(const Problem& p, bool fused, DType dhidden_dtype);

}  // namespace rlk::cuda
