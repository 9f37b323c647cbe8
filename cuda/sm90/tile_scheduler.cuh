// The Hopper kernel's tile scheduler. Work comes in units of (128-row tile, split): a split is up to
// split_cols / kBN column tiles of one canonical chunk, walked in order (lp_geometry.h). unit_of()
// numbers the units in groups of kGroupRows row tiles, so the CTAs resident at one time share a few
// W tiles and a few H tiles and the re-reads hit L2. One CTA per unit (units differ in length, a
// chunk's last split is shorter: the hardware balances them better than a static persistent
// stride, measured; putting the short units last did not change T1 or T2, measured). The map only
// orders work; what a unit computes never depends on it (nor on the SM count).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "lp_geometry.h"
#include "sm90/params.cuh"

namespace rlk::cuda::detail::sm90 {

constexpr int64_t kGroupRows = 16;
static_assert(kSplitCols % kBN == 0 && kDlogitSplitCols % kBN == 0, "a split is a whole number of column tiles");

// One unit of work: a (row tile, split) pair; a split walks up to kSplitCols/kBN column tiles.
struct Unit {
  int64_t rt, cu, r0, col0, col_end;  // row tile, split number, first row, columns [col0, col_end)
  int ntiles;                         // column tiles of the split
};

// Grouped raster: units are numbered so that kGroupRows row tiles sweep the column units
// together; CTAs that run at the same time then share H and W tiles in L2.
__device__ __forceinline__ Unit unit_of(int64_t L, const Params& P) {
  const int64_t per_group = kGroupRows * P.nsplit;
  const int64_t group = L / per_group;
  const int64_t first = group * kGroupRows;
  const int64_t gsize = min(kGroupRows, P.row_tiles - first);
  const int64_t rem = L - group * per_group;
  Unit u;
  u.rt = first + rem % gsize;
  u.cu = rem / gsize;
  u.r0 = u.rt * kBM;
  const int64_t c = u.cu / P.spc, sp = u.cu % P.spc;
  u.col0 = c * P.chunk + sp * P.split_cols;
  u.col_end = min(u.col0 + P.split_cols, (c + 1) * P.chunk);
  u.ntiles = int((u.col_end - u.col0 + kBN - 1) / kBN);
  return u;
}

}  // namespace rlk::cuda::detail::sm90
