// The Hopper kernel's mainloop: warp-specialised. Warpgroup 0 is the producer: one thread issues TMA
// loads of a 128x64 H box and a 256x64 W box per stage into a ring of kStages stages (128-byte
// swizzle, completion on the stage's "full" mbarrier). Warpgroups 1 and 2 are consumers: each owns
// 64 rows and issues wgmma m64n256k16 (fp32 accumulators in registers) and frees a stage on its
// "empty" mbarrier once the wgmma that read it has retired (wait_group 1 keeps one batch in flight).
// setmaxnreg moves registers from the producer to the consumers (the kernel's entry).
// No branch may sit around the wgmma issue: ptxas then serialises every wgmma (C7518), measured 15%
// slower. A warpgroup with no real row skips its whole unit instead (idle_warpgroup), by returning
// before its mainloop.
#pragma once

#include <cuda.h>

#include <cstdint>

#include "lp_internal.h"
#include "sm90/params.cuh"
#include "sm90/ptx.cuh"
#include "sm90/tile_scheduler.cuh"

namespace rlk::cuda::detail::sm90 {

constexpr int kABytes = kBM * kBK * 2, kBBytes = kBN * kBK * 2, kStageBytes = kABytes + kBBytes;
constexpr int kStages = 4;
constexpr int kConsumerWarps = 8;  // two consumer warpgroups; each warp arrives on "empty" once
static_assert(kSm90HMultiple % kBK == 0, "h multiple covers the K tile");

// The stage ring in shared memory and its mbarriers (8 bytes each): full(s) completes when stage
// s's TMA loads have landed, empty(s) when every consumer warp's wgmmas have read it. A walk over
// the ring keeps (stage, phase): the slot, and the parity of the pass over the ring that mbar_wait
// waits for.
struct Pipeline {
  uint32_t sbase, bar_full, bar_empty;
  __device__ __forceinline__ uint32_t stage(int s) const { return sbase + s * kStageBytes; }
  __device__ __forceinline__ uint32_t full(int s) const { return bar_full + 8 * s; }
  __device__ __forceinline__ uint32_t empty(int s) const { return bar_empty + 8 * s; }
};

// A consumer warpgroup whose 64 rows all lie past the last real row (the second half of a last
// row tile of at most 64 rows) sits the unit out: the other one then has the tensor cores to
// itself, and "empty" counts only the busy warps' arrivals.
__device__ __forceinline__ bool idle_warpgroup(const Unit& u, int cw, int64_t rows) { return u.r0 + cw * 64 >= rows; }

// One thread, before the CTA's __syncthreads.
__device__ __forceinline__ void init_barriers(const Pipeline& pl, const Unit& u, int64_t rows) {
  const int busy_warps = idle_warpgroup(u, 1, rows) ? kConsumerWarps / 2 : kConsumerWarps;
  for (int s = 0; s < kStages; ++s) {
    mbar_init(pl.full(s), 1);
    mbar_init(pl.empty(s), busy_warps);
  }
  fence_mbar_init();
}

// The producer thread: the H and W boxes of every K tile of every column tile of the unit.
__device__ __forceinline__ void load_unit(const Pipeline& pl, const CUtensorMap* tmA, const CUtensorMap* tmB,
                                          const Unit& u, int KB) {
  int stage = 0;
  uint32_t phase = 0;
  for (int t = 0; t < u.ntiles; ++t) {
    const int32_t tc = int32_t(u.col0 + int64_t(t) * kBN);
    for (int kb = 0; kb < KB; ++kb) {
      mbar_wait(pl.empty(stage), phase ^ 1);
      mbar_expect_tx(pl.full(stage), kStageBytes);
      const uint32_t sa = pl.stage(stage);
      tma_load_2d(sa, tmA, kb * kBK, int32_t(u.r0), pl.full(stage));
      tma_load_2d(sa + kABytes, tmB, kb * kBK, tc, pl.full(stage));
      if (++stage == kStages) {
        stage = 0;
        phase ^= 1;
      }
    }
  }
}

// Consumer warpgroup cw (rows cw*64 .. cw*64+63 of a tile): for each of the unit's ntiles column
// tiles, the 64x256 logit tile into the accumulators d over the KB K tiles, every stage it read
// freed, then epilogue(t) on it. The tile loop is here and the epilogue passed in, rather than a
// per-tile call from the kernel with the ring position by reference: this form compiles to the
// same machine code as the loop written in the kernel body, the other reorders the forward's.
template <bool kBf16, class Epilogue>
__device__ __forceinline__ void mma_unit(const Pipeline& pl, int ntiles, float* d, int cw, int lane, int KB,
                                         Epilogue&& epilogue) {
  int stage = 0, prev = 0;
  uint32_t phase = 0;
  for (int t = 0; t < ntiles; ++t) {
    for (int kb = 0; kb < KB; ++kb) {
      mbar_wait(pl.full(stage), phase);
      const uint32_t sa = pl.stage(stage);
      const uint64_t da = smem_desc(sa + cw * 64 * 128);
      const uint64_t db = smem_desc(sa + kABytes);
      wgmma_fence();
#pragma unroll
      for (int k = 0; k < kBK / 16; ++k) wgmma_tile<kBf16>(d, da + 2 * k, db + 2 * k, (kb | k) != 0);
      wgmma_commit();
      if (kb > 0) {
        wgmma_wait<1>();
        if (lane == 0) mbar_arrive(pl.empty(prev));
      }
      prev = stage;
      if (++stage == kStages) {
        stage = 0;
        phase ^= 1;
      }
    }
    wgmma_wait<0>();
    if (lane == 0) mbar_arrive(pl.empty(prev));
    epilogue(t);
  }
}

}  // namespace rlk::cuda::detail::sm90
