// The Hopper (sm_90a) kernel of linear_logp for bf16/fp16: TMA + wgmma, warp-specialised. It runs
// the forward (statistics, optionally keeping the logits for the fast backward) and the lean
// backward's recompute (dlogit tiles), which differ only in the epilogue (Epi).
//
// Compiled only with -gencode=arch=compute_90a,code=sm_90a and only when RLK_HAVE_SM90 is set.
//
// Structure (after FlashAttention 3's hopper/ split into named pieces):
//   * tile scheduler  - work comes in units of (128-row tile, split): a split is up to
//                       kSplitCols/kBN column tiles walked in order. unit_of() numbers the units
//                       in groups of kGroupRows row tiles, so the CTAs resident at one time share a
//                       few W tiles and a few H tiles and the re-reads hit L2. One CTA per unit
//                       (units differ in length, a chunk's last split is shorter: the hardware
//                       balances them better than a static persistent stride, measured; putting
//                       the short units last did not change T1 or T2, measured). The map only
//                       orders work; what a unit computes never depends on it (nor on the SM
//                       count).
//   * mainloop        - warp-specialised: warpgroup 0 is the producer (one thread issues TMA loads
//                       of a 128x64 H box and a 256x64 W box per stage into a ring of 4 stages,
//                       128-byte swizzle, completion on "full" mbarriers); warpgroups 1 and 2 are
//                       consumers, each owns 64 rows and issues wgmma m64n256k16 (fp32
//                       accumulators in registers) and frees a stage on its "empty" mbarrier once
//                       the wgmma that read it has retired (wait_group 1 keeps one batch in
//                       flight). setmaxnreg moves registers from the producer to the consumers.
//                       No branch may sit around the wgmma issue (e.g. skipping a warpgroup whose
//                       rows lie past n): ptxas then serialises every wgmma (C7518), measured 15%
//                       slower.
//   * epilogue        - scales each 64x256 logit tile in the accumulator registers (1/T, bias,
//                       padding to -inf), then, by kind (Epi):
//                       kStats  folds it into per-row running (m, s, a): a row's 256 values live
//                               in one quad of lanes (64 per lane), so a tile costs a thread-local
//                               pass plus two xor shuffles. Exponentials use ex2 on log2e-scaled
//                               logits; (m, s, a) go back to natural units per tile and are merged
//                               with stats_merge. Logits never leave registers.
//                       kKeep   the same, and stores z as fp16 (the fast backward's kept logits)
//                               through the tile store;
//                       kDlogit turns z into dlogit = dz / T from the row's lse (and entropy and
//                               upstream gradients) and stores it in the operand dtype through the
//                               tile store; sum dz z per (row, split) for dT.
//   * tile store      - stmatrix puts half a tile (64x128, 2-byte values) into a 128-byte-swizzled
//                       staging buffer per consumer warpgroup, and one thread hands it to a TMA
//                       store: the copy to global memory runs while the consumers go on. The
//                       epilogue puts work between the halves (the statistics, or half 1's
//                       dlogit), so the TMA has read half 0 before half 1 overwrites it.
// Per-(row, split) partials go to the workspace; the finalize kernel of linear_logp_cuda.cu merges
// them per chunk exactly as for the portable kernel (kDlogit: the lean backward sums its dz z
// partials per row in split order). Every row goes through the same instruction
// sequence whatever its position in the tile, and the split geometry is relative to the chunk
// start, so results are batch- and TP-invariant. Raw PTX, no CuTe: the build takes seconds.
#if RLK_HAVE_SM90

#include <cuda.h>
#include <cudaTypedefs.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <mutex>
#include <type_traits>

#include "lp_internal.h"

namespace rlk::cuda::detail {
namespace {

constexpr int kBM = 128, kBN = 256, kBK = 64;
constexpr int kABytes = kBM * kBK * 2, kBBytes = kBN * kBK * 2, kStageBytes = kABytes + kBBytes;
// Shared memory: the stage ring, the tile store's staging (64 rows x 128 2-byte columns per
// consumer warpgroup, as two 64x64 TMA boxes of 8 KB; half a tile, so that four stages still fit in
// the 227 KB an sm_90 block may have) and the mbarriers.
constexpr int kStages = 4;
constexpr int kBoxCols = 64, kBoxBytes = 64 * kBoxCols * 2, kHalfCols = 2 * kBoxCols;
constexpr int kStagingBytes = 2 /*warpgroups*/ * 2 /*boxes*/ * kBoxBytes;
constexpr int kSmemBytes = kStages * kStageBytes + kStagingBytes + 1024 /*alignment*/ + 256 /*barriers*/;
static_assert(kSmemBytes <= 232448, "sm_90 dynamic shared memory per block");
constexpr int kThreads = 384;  // producer warpgroup + 2 consumer warpgroups
constexpr int64_t kGroupRows = 16;
static_assert(kSplitCols % kBN == 0 && kDlogitSplitCols % kBN == 0, "a split is a whole number of column tiles");
static_assert(kSm90HMultiple % kBK == 0, "h multiple covers the K tile");

constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;

// ---- PTX helpers --------------------------------------------------------------------------------
__device__ __forceinline__ uint32_t smem_u32(const void* p) { return static_cast<uint32_t>(__cvta_generic_to_shared(p)); }

__device__ __forceinline__ void mbar_init(uint32_t bar, uint32_t count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(count));
}
__device__ __forceinline__ void mbar_expect_tx(uint32_t bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar), "r"(bytes) : "memory");
}
__device__ __forceinline__ void mbar_arrive(uint32_t bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(bar) : "memory");
}
__device__ __forceinline__ void mbar_wait(uint32_t bar, uint32_t parity) {
  asm volatile(
      "{\n.reg .pred P1;\nWAIT_%=:\n"
      "mbarrier.try_wait.parity.shared::cta.b64 P1, [%0], %1;\n"
      "@!P1 bra WAIT_%=;\n}\n" ::"r"(bar), "r"(parity) : "memory");
}
__device__ __forceinline__ void tma_load_2d(uint32_t dst, const CUtensorMap* map, int32_t c0, int32_t c1, uint32_t bar) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3}], [%4];\n"
      ::"r"(dst), "l"(reinterpret_cast<uint64_t>(map)), "r"(c0), "r"(c1), "r"(bar) : "memory");
}
__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
template <int N> __device__ __forceinline__ void wgmma_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
}
// Shared-memory matrix descriptor: K-major, 128-byte swizzle, 8-row groups 1024 bytes apart.
__device__ __forceinline__ uint64_t smem_desc(uint32_t addr) {
  return uint64_t((addr & 0x3FFFF) >> 4) | (uint64_t(1) << 16) | (uint64_t(1024 >> 4) << 32) | (uint64_t(1) << 62);
}
__device__ __forceinline__ float ex2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}

#define RLK_WGMMA_M64N256K16(TY)                                                        \
  asm volatile(                                                                         \
      "{\n.reg .pred p;\nsetp.ne.b32 p, %130, 0;\n"                                      \
      "wgmma.mma_async.sync.aligned.m64n256k16.f32." TY "." TY " "                      \
      "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, %64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, %80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95, %96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111, %112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127}, "  \
      "%128, %129, p, 1, 1, 0, 0;\n}\n"                                                  \
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63]), "+f"(d[64]), "+f"(d[65]), "+f"(d[66]), "+f"(d[67]), "+f"(d[68]), "+f"(d[69]), "+f"(d[70]), "+f"(d[71]), "+f"(d[72]), "+f"(d[73]), "+f"(d[74]), "+f"(d[75]), "+f"(d[76]), "+f"(d[77]), "+f"(d[78]), "+f"(d[79]), "+f"(d[80]), "+f"(d[81]), "+f"(d[82]), "+f"(d[83]), "+f"(d[84]), "+f"(d[85]), "+f"(d[86]), "+f"(d[87]), "+f"(d[88]), "+f"(d[89]), "+f"(d[90]), "+f"(d[91]), "+f"(d[92]), "+f"(d[93]), "+f"(d[94]), "+f"(d[95]), "+f"(d[96]), "+f"(d[97]), "+f"(d[98]), "+f"(d[99]), "+f"(d[100]), "+f"(d[101]), "+f"(d[102]), "+f"(d[103]), "+f"(d[104]), "+f"(d[105]), "+f"(d[106]), "+f"(d[107]), "+f"(d[108]), "+f"(d[109]), "+f"(d[110]), "+f"(d[111]), "+f"(d[112]), "+f"(d[113]), "+f"(d[114]), "+f"(d[115]), "+f"(d[116]), "+f"(d[117]), "+f"(d[118]), "+f"(d[119]), "+f"(d[120]), "+f"(d[121]), "+f"(d[122]), "+f"(d[123]), "+f"(d[124]), "+f"(d[125]), "+f"(d[126]), "+f"(d[127]) \
      : "l"(da), "l"(db), "r"(scale_d))


template <bool kBf16> __device__ __forceinline__ void wgmma_tile(float* d, uint64_t da, uint64_t db, int scale_d) {
  if constexpr (kBf16) { RLK_WGMMA_M64N256K16("bf16"); }
  else { RLK_WGMMA_M64N256K16("f16"); }
}


// What the epilogue does with each logit tile (the kernel's template parameter).
//   kStats   the forward: fold the tile into per-row (m, s, a); logits never leave registers;
//   kKeep    the same, and also store z as fp16 (the fast backward's kept logits);
//   kDlogit  the lean backward's recompute: dlogit = dz * inv_temp from the row's lse (and entropy
//            and upstream gradients), stored in the operand dtype; with a dT, sum_j dz z per
//            (row, split).
enum class Epi { kStats, kKeep, kDlogit };

struct Params {
  int64_t rows;       // valid rows of hidden (this pass)
  int64_t row_tiles;
  int32_t kblocks;    // K tiles: h / kBK
  int64_t chunk, spc, nsplit;  // the split walk (lp_internal.h)
  int64_t split_cols;          // kSplitCols (forward) or kDlogitSplitCols
  int64_t vocab_start, real_vocab;
  const float* bias;  // f32, of local column 0, or null
  const float* temperature;
  float* part;        // kStats, kKeep: [rows, nsplit, kStatWidth]; kDlogit: [rows, nsplit] sum dz z, or null
  uint16_t* out;      // [rows, ldo] 2-byte tile output: kept logits (kKeep) or dlogit (kDlogit)
  int64_t ldo, cols;  // its row stride and width (columns past `cols` are not written)
  bool out_tma;       // the output goes out by TMA (16-byte aligned rows and tile starts)
};

// kDlogit's per-row inputs (of this pass). A separate kernel argument, empty for the other kinds:
// in Params, these 48 bytes made ptxas spill in the forward kernels.
struct GradRows {
  const int32_t* targets;
  const float *m, *log_s, *ent, *g, *e;  // ent, e may be null (no entropy term)
  int64_t ignore_index;
};
struct NoGradRows {};
template <Epi kEpi> using GradArg = std::conditional_t<kEpi == Epi::kDlogit, GradRows, NoGradRows>;

// ---- accumulator layout and the 2-byte packings of the tile store ------------------------------
// Lane l of warp w (in its warpgroup) holds rows w*16 + l/4 (values d[4j], d[4j+1]) and +8
// (d[4j+2], d[4j+3]) at columns 8j + 2(l%4) + {0,1}, j = 0..31. A pack turns two columns into a
// word, the lower column in the low half.
struct PackKept {  // d holds z * log2e: fp16 of z; satfinite maps |z| past fp16 (and -inf) to +-kMaxKeptLogit
  __device__ __forceinline__ uint32_t operator()(float a, float b) const {
    uint32_t w;
    asm("cvt.rn.satfinite.f16x2.f32 %0, %1, %2;\n" : "=r"(w) : "f"(b * kLn2), "f"(a * kLn2));
    return w;
  }
};
template <bool kBf16> struct PackDtype {  // d holds dlogit: rounded to the operand dtype (as from_f)
  __device__ __forceinline__ uint32_t operator()(float a, float b) const {
    uint32_t w;
    if constexpr (kBf16) asm("cvt.rn.bf16x2.f32 %0, %1, %2;\n" : "=r"(w) : "f"(b), "f"(a));
    else asm("cvt.rn.f16x2.f32 %0, %1, %2;\n" : "=r"(w) : "f"(b), "f"(a));
    return w;
  }
};

// ---- tile store (kKeep, kDlogit) ------------------------------------------------------------------
// A consumer warpgroup's staging buffer holds half a tile, 64 rows x 128 columns, as two 64x64
// boxes in TMA's 128-byte swizzle (16-byte chunk c of row r sits at chunk c ^ (r % 8)): stmatrix
// then writes eight rows of one chunk column into eight different bank groups.
__device__ __forceinline__ uint32_t staging_addr(uint32_t buf, int row, int col) {
  const int c = col % kBoxCols;
  return buf + (col / kBoxCols) * kBoxBytes + row * (kBoxCols * 2) + ((((c / 8) ^ (row % 8))) << 4) + (c % 8) * 2;
}
__device__ __forceinline__ void stmatrix_x4(uint32_t addr, uint32_t r0, uint32_t r1, uint32_t r2, uint32_t r3) {
  asm volatile("stmatrix.sync.aligned.m8n8.x4.shared.b16 [%0], {%1, %2, %3, %4};\n" ::"r"(addr), "r"(r0), "r"(r1),
               "r"(r2), "r"(r3) : "memory");
}
__device__ __forceinline__ void tma_store_2d(const CUtensorMap* map, uint32_t src, int32_t c0, int32_t c1) {
  asm volatile("cp.async.bulk.tensor.2d.global.shared::cta.bulk_group [%0, {%1, %2}], [%3];\n"
               ::"l"(reinterpret_cast<uint64_t>(map)), "r"(c0), "r"(c1), "r"(src) : "memory");
}
__device__ __forceinline__ void tma_store_commit() { asm volatile("cp.async.bulk.commit_group;\n" ::: "memory"); }
// The staging buffer may be rewritten once the stores issued from it have read it.
__device__ __forceinline__ void tma_store_wait_read() { asm volatile("cp.async.bulk.wait_group.read 0;\n" ::: "memory"); }
__device__ __forceinline__ void tma_store_wait_all() { asm volatile("cp.async.bulk.wait_group 0;\n" ::: "memory"); }
// Generic-proxy writes to shared memory made visible to the TMA (async proxy) that reads them.
__device__ __forceinline__ void fence_async_smem() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }
// Named barrier of one consumer warpgroup (ids 1, 2; id 0 is __syncthreads).
__device__ __forceinline__ void warpgroup_sync(int cw) { asm volatile("bar.sync %0, 128;\n" ::"r"(cw + 1) : "memory"); }

// Half `half` (columns 128 half .. +127) of the tile (this warpgroup's 64 rows), packed to 2-byte
// values, through the staging buffer. One thread issues the TMA stores, which clip at the tensor's
// edge (rows past the pass, columns past P.cols). A tile that ends inside the next chunk's columns
// (chunk % kBN != 0), or an output that TMA cannot address (unaligned), goes out by plain bounded
// stores instead. The staging buffer holds one half: before it is rewritten, the TMA must have read
// the previous half, so the epilogues put other work between the two halves.
template <class Pack>
__device__ __forceinline__ void store_half(const float* d, Pack pack, int half, int64_t t0, int64_t col_end,
                                           const Params& P, const CUtensorMap* tmO, uint32_t buf, int cw, int64_t row0) {
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
        if (c0 + b * kBoxCols < P.cols) tma_store_2d(tmO, buf + b * kBoxBytes, int32_t(c0 + b * kBoxCols), int32_t(row0));
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
__device__ __forceinline__ void scale_tile(float* d, int64_t t0, int64_t col_end, const Params& P, float itA,
                                           float itB, float (&mx)[2]) {
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

// ---- epilogue (kStats, kKeep): fold the scaled tile into the two rows' running statistics -------
// A row's 256 values live in one quad of lanes (64 per lane): a thread-local pass plus two xor
// shuffles. Exponentials use ex2 on the log2e-scaled logits; (m, s, a) are converted back to natural
// units per tile and merged with stats_merge.
__device__ __forceinline__ void fold_stats(const float* d, float (&mx)[2], float (&run)[2][3]) {
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xffffffffu, mx[r], 1));
    mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xffffffffu, mx[r], 2));
  }
  float s[2] = {0.f, 0.f}, a[2] = {0.f, 0.f};
  const float mref[2] = {mx[0] > -INFINITY ? mx[0] : 0.f, mx[1] > -INFINITY ? mx[1] : 0.f};
#pragma unroll
  for (int j = 0; j < 32; ++j) {
#pragma unroll
    for (int q = 0; q < 4; ++q) {
      const int r = q >> 1;
      float t = d[4 * j + q] - mref[r];
      const float ex = ex2(t);
      t = ex > 0.f ? t : 0.f;  // -inf logits (masked, padding, or a -inf bias): 0, not -inf * 0
      s[r] += ex;
      a[r] = fmaf(ex, t, a[r]);
    }
  }
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    s[r] += __shfl_xor_sync(0xffffffffu, s[r], 1);
    a[r] += __shfl_xor_sync(0xffffffffu, a[r], 1);
    s[r] += __shfl_xor_sync(0xffffffffu, s[r], 2);
    a[r] += __shfl_xor_sync(0xffffffffu, a[r], 2);
    if (!(mx[r] == -INFINITY)) stats_merge(mx[r] * kLn2, s[r], a[r] * kLn2, run[r][0], run[r][1], run[r][2]);
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
  if (G.e) { r.e = G.e[row]; r.c = lse - G.ent[row]; }
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
template <Epi kEpi> struct RowState {  // kStats, kKeep: the running (m, s, a)
  float run[2][3] = {{-INFINITY, 0.f, 0.f}, {-INFINITY, 0.f, 0.f}};
};
template <> struct RowState<Epi::kDlogit> {  // sum dz z (the rows' gradient inputs are re-read per
  float dzz[2] = {0.f, 0.f};                  // tile, L1 hits: kept in registers across the
};                                            // mainloop, they made ptxas spill)

template <bool kBf16, Epi kEpi, bool kMask>
__device__ __forceinline__ void epilogue(float* d, int64_t t0, int64_t col_end, const Params& P, const GradArg<kEpi>& G,
                                         float itA, float itB, const CUtensorMap* tmO, uint32_t buf, int cw,
                                         int64_t row0, RowState<kEpi>& st) {
  float mx[2];
  scale_tile<kMask>(d, t0, col_end, P, itA, itB, mx);
  if constexpr (kEpi == Epi::kDlogit) {
    // half 1's dlogit is computed while the TMA reads half 0 out of the staging buffer. The rows'
    // gradient inputs are loaded per half (L1 hits): held across the first store, they made ptxas spill.
    const int64_t rowA = row0 + (threadIdx.x % 128) / 32 * 16 + (threadIdx.x % 32) / 4;
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      dlogit_row(d, 0, half, t0, col_end, P, row_grad(P, G, rowA), st.dzz[0]);
      dlogit_row(d, 1, half, t0, col_end, P, row_grad(P, G, rowA + 8), st.dzz[1]);
      store_half(d, PackDtype<kBf16>{}, half, t0, col_end, P, tmO, buf, cw, row0);
    }
  } else {
    // the statistics are folded while the TMA reads half 0 out of the staging buffer
    if constexpr (kEpi == Epi::kKeep) store_half(d, PackKept{}, 0, t0, col_end, P, tmO, buf, cw, row0);
    fold_stats(d, mx, st.run);
    if constexpr (kEpi == Epi::kKeep) store_half(d, PackKept{}, 1, t0, col_end, P, tmO, buf, cw, row0);
  }
}

// One unit of work: a (row tile, split) pair; a split walks up to kSplitCols/kBN column tiles.
struct Unit {
  int64_t rt, cu, r0, col0, col_end;
  int ntiles;
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

// One CTA per unit (blockIdx.x = unit number).
template <bool kBf16, Epi kEpi>
__global__ void __launch_bounds__(kThreads, 1)
    sm90_forward_kernel(const __grid_constant__ CUtensorMap tmA, const __grid_constant__ CUtensorMap tmB,
                        const __grid_constant__ CUtensorMap tmO, const Params P, const GradArg<kEpi> G) {
  extern __shared__ __align__(1024) unsigned char smem_raw[];
  unsigned char* smem = reinterpret_cast<unsigned char*>((reinterpret_cast<uintptr_t>(smem_raw) + 1023) & ~uintptr_t(1023));
  const uint32_t sbase = smem_u32(smem);
  const uint32_t staging = sbase + kStages * kStageBytes;  // 1024-aligned, as the swizzle needs
  const uint32_t bar_full = staging + kStagingBytes;  // kStages x 8 bytes
  const uint32_t bar_empty = bar_full + kStages * 8;
  const int KB = P.kblocks;

  const int wg = threadIdx.x / 128;
  if (threadIdx.x == 0) {
    for (int s = 0; s < kStages; ++s) {
      mbar_init(bar_full + 8 * s, 1);
      mbar_init(bar_empty + 8 * s, 8);  // one arrival per consumer warp
    }
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
  }
  __syncthreads();

  if (wg == 0) {
    // ---- producer ----
    asm volatile("setmaxnreg.dec.sync.aligned.u32 40;\n");
    if (threadIdx.x == 0) {
      int stage = 0;
      uint32_t phase = 0;
      const Unit u = unit_of(blockIdx.x, P);
      for (int t = 0; t < u.ntiles; ++t) {
        const int32_t tc = int32_t(u.col0 + int64_t(t) * kBN);
        for (int kb = 0; kb < KB; ++kb) {
          mbar_wait(bar_empty + 8 * stage, phase ^ 1);
          mbar_expect_tx(bar_full + 8 * stage, kStageBytes);
          const uint32_t sa = sbase + stage * kStageBytes;
          tma_load_2d(sa, &tmA, kb * kBK, int32_t(u.r0), bar_full + 8 * stage);
          tma_load_2d(sa + kABytes, &tmB, kb * kBK, tc, bar_full + 8 * stage);
          if (++stage == kStages) { stage = 0; phase ^= 1; }
        }
      }
    }
  } else {
    // ---- consumers ----
    asm volatile("setmaxnreg.inc.sync.aligned.u32 232;\n");
    const int cw = wg - 1;  // consumer warpgroup: rows cw*64 .. cw*64+63
    const int warp = (threadIdx.x / 32) % 4, lane = threadIdx.x % 32;
    int stage = 0, prev = 0;
    uint32_t phase = 0;
    float d[128];
    const Unit u = unit_of(blockIdx.x, P);
    const int64_t row0 = u.r0 + cw * 64, rowA = row0 + warp * 16 + lane / 4, rowB = rowA + 8;
    const uint32_t buf = staging + cw * 2 * kBoxBytes;
    const float itA = (rowA < P.rows ? reciprocal(P.temperature[rowA]) : 1.f) * kLog2e;
    const float itB = (rowB < P.rows ? reciprocal(P.temperature[rowB]) : 1.f) * kLog2e;
    RowState<kEpi> st;
    for (int t = 0; t < u.ntiles; ++t) {
      for (int kb = 0; kb < KB; ++kb) {
        mbar_wait(bar_full + 8 * stage, phase);
        const uint32_t sa = sbase + stage * kStageBytes;
        const uint64_t da = smem_desc(sa + cw * 64 * 128);
        const uint64_t db = smem_desc(sa + kABytes);
        wgmma_fence();
#pragma unroll
        for (int k = 0; k < kBK / 16; ++k) wgmma_tile<kBf16>(d, da + 2 * k, db + 2 * k, (kb | k) != 0);
        wgmma_commit();
        if (kb > 0) {
          wgmma_wait<1>();
          if (lane == 0) mbar_arrive(bar_empty + 8 * prev);
        }
        prev = stage;
        if (++stage == kStages) { stage = 0; phase ^= 1; }
      }
      wgmma_wait<0>();
      if (lane == 0) mbar_arrive(bar_empty + 8 * prev);
      // ---- epilogue ----
      const int64_t t0 = u.col0 + int64_t(t) * kBN;
      if (t0 + kBN <= u.col_end && P.vocab_start + t0 + kBN <= P.real_vocab)
        epilogue<kBf16, kEpi, false>(d, t0, u.col_end, P, G, itA, itB, &tmO, buf, cw, row0, st);
      else
        epilogue<kBf16, kEpi, true>(d, t0, u.col_end, P, G, itA, itB, &tmO, buf, cw, row0, st);
    }
    if (kEpi != Epi::kStats && threadIdx.x % 128 == 0) tma_store_wait_all();  // staging stays live until read
    if constexpr (kEpi == Epi::kDlogit) {
      if (P.part == nullptr) return;
#pragma unroll
      for (int r = 0; r < 2; ++r) {  // the quad's four column sets, in a fixed butterfly
        st.dzz[r] += __shfl_xor_sync(0xffffffffu, st.dzz[r], 1);
        st.dzz[r] += __shfl_xor_sync(0xffffffffu, st.dzz[r], 2);
      }
      if ((lane & 3) == 0) {
        if (rowA < P.rows) P.part[rowA * P.nsplit + u.cu] = st.dzz[0];
        if (rowB < P.rows) P.part[rowB * P.nsplit + u.cu] = st.dzz[1];
      }
    } else if ((lane & 3) == 0) {
      if (rowA < P.rows) {
        float* o = P.part + (rowA * P.nsplit + u.cu) * kStatWidth;
        o[0] = st.run[0][0]; o[1] = st.run[0][1]; o[2] = st.run[0][2];
      }
      if (rowB < P.rows) {
        float* o = P.part + (rowB * P.nsplit + u.cu) * kStatWidth;
        o[0] = st.run[1][0]; o[1] = st.run[1][1]; o[2] = st.run[1][2];
      }
    }
  }
}

PFN_cuTensorMapEncodeTiled_v12000 g_encode = nullptr;
std::once_flag g_encode_once;

}  // namespace

const char* const kSm90Misaligned = "rlk cuda: sm90 operands not 16-byte aligned";

namespace {
const char* ensure_encode() {
  std::call_once(g_encode_once, [] {
    void* fn = nullptr;
    cudaDriverEntryPointQueryResult q;
    if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &fn, 12000, cudaEnableDefault, &q) == cudaSuccess &&
        q == cudaDriverEntryPointSuccess)
      g_encode = reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(fn);
  });
  return g_encode ? nullptr : "rlk cuda: cuTensorMapEncodeTiled unavailable";
}

// A row-major 2-D tensor of 2-byte elements: `outer` rows of `inner` elements, row stride ld
// elements, moved in boxes of box_inner x box_outer with the 128-byte swizzle. The operands are
// K-major (inner = K, box_inner = kBK); the kept logits are [rows, v] (box 64 x 64).
bool make_map(CUtensorMap* m, CUtensorMapDataType type, const void* ptr, int64_t inner, int64_t outer, int64_t ld,
              uint32_t box_inner, uint32_t box_outer) {
  const cuuint64_t dims[2] = {cuuint64_t(inner), cuuint64_t(outer)};
  const cuuint64_t strides[1] = {cuuint64_t(ld) * 2};
  const cuuint32_t box[2] = {box_inner, box_outer};
  const cuuint32_t es[2] = {1, 1};
  return g_encode(m, type, 2, const_cast<void*>(ptr), dims, strides, box, es, CU_TENSOR_MAP_INTERLEAVE_NONE,
                  CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                  CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) == CUDA_SUCCESS;
}

template <Epi kEpi>
const char* launch(bool bf16, const CUtensorMap& ma, const CUtensorMap& mb, const CUtensorMap& mo, const Params& P,
                   const GradArg<kEpi>& G, int64_t units, cudaStream_t stream) {
  const auto kern = bf16 ? sm90_forward_kernel<true, kEpi> : sm90_forward_kernel<false, kEpi>;
  // Set on every call (host-only, legal under stream capture): the attribute is per device.
  if (cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmemBytes) != cudaSuccess)
    return "rlk cuda: cudaFuncSetAttribute failed (sm90)";
  if (units > 0) kern<<<unsigned(units), kThreads, kSmemBytes, stream>>>(ma, mb, mo, P, G);
  if (cudaGetLastError() != cudaSuccess) return "rlk cuda: sm90 kernel launch failed";
  return nullptr;
}

CUtensorMapDataType map_type(const Problem& p) {
  return p.dtype == DType::kBF16 ? CU_TENSOR_MAP_DATA_TYPE_BFLOAT16 : CU_TENSOR_MAP_DATA_TYPE_FLOAT16;
}

// The operand maps and the shape part of Params: rows [0, rows) of hidden against p.v rows of weight.
const char* setup(const Problem& p, const void* hidden, int64_t rows, const void* weight, const float* bias,
                  const float* temperature, int64_t split_cols, CUtensorMap* ma, CUtensorMap* mb, Params* P) {
  if ((reinterpret_cast<uintptr_t>(hidden) | reinterpret_cast<uintptr_t>(weight)) & 15) return kSm90Misaligned;
  if (const char* e = ensure_encode()) return e;
  if (!make_map(ma, map_type(p), hidden, p.h, rows, p.h, kBK, kBM) || !make_map(mb, map_type(p), weight, p.h, p.v, p.h, kBK, kBN))
    return "rlk cuda: tensor map encoding failed";
  *P = Params{};
  P->rows = rows; P->chunk = p.chunk; P->split_cols = split_cols;
  P->spc = splits_per_chunk(p.chunk, split_cols); P->nsplit = num_chunks(p) * P->spc;
  P->vocab_start = p.vocab_start; P->real_vocab = p.real_vocab; P->row_tiles = (rows + kBM - 1) / kBM;
  P->kblocks = int32_t(p.h / kBK); P->bias = p.has_bias ? bias : nullptr; P->temperature = temperature;
  return nullptr;
}

// The 2-byte tile output [rows, cols] with row stride ld: by TMA when its base and row stride are
// 16-byte aligned and every tile starts on a 16-byte boundary (chunk-relative tile starts: chunk %
// 8 == 0), else by plain stores.
void set_out(Params* P, CUtensorMap* mo, CUtensorMapDataType type, void* out, int64_t cols, int64_t ld, int64_t chunk) {
  P->out = static_cast<uint16_t*>(out); P->ldo = ld; P->cols = cols;
  P->out_tma = chunk % 8 == 0 && ld % 8 == 0 && (reinterpret_cast<uintptr_t>(out) & 15) == 0 &&
               make_map(mo, type, out, cols, P->rows, ld, kBoxCols, 64);
}
}  // namespace

const char* sm90_forward_partials(const Problem& p, const void* hidden, int64_t rows, const void* weight,
                                  const float* bias, const float* temperature, float* part, void* kept,
                                  cudaStream_t stream) {
  CUtensorMap ma, mb, mo{};
  Params P;
  if (const char* e = setup(p, hidden, rows, weight, bias, temperature, kSplitCols, &ma, &mb, &P)) return e;
  P.part = part;
  const int64_t units = P.row_tiles * P.nsplit;
  if (!kept) return launch<Epi::kStats>(p.dtype == DType::kBF16, ma, mb, mo, P, {}, units, stream);
  set_out(&P, &mo, CU_TENSOR_MAP_DATA_TYPE_FLOAT16, kept, p.v, p.v, p.chunk);
  return launch<Epi::kKeep>(p.dtype == DType::kBF16, ma, mb, mo, P, {}, units, stream);
}

const char* sm90_dlogit(const Problem& p, const BwdArgs& a, int64_t rows, void* dlog, int64_t ldd, float* dzz,
                        cudaStream_t stream) {
  CUtensorMap ma, mb, mo{};
  Params P;
  if (const char* e = setup(p, a.hidden, rows, a.weight, a.bias, a.temperature, kDlogitSplitCols, &ma, &mb, &P)) return e;
  P.part = dzz;
  set_out(&P, &mo, map_type(p), dlog, p.v, ldd, p.chunk);
  GradRows G{a.targets, a.m, a.log_s, nullptr, a.g, nullptr, p.ignore_index};
  if (p.with_entropy && a.e) { G.ent = a.entropy; G.e = a.e; }
  return launch<Epi::kDlogit>(p.dtype == DType::kBF16, ma, mb, mo, P, G, P.row_tiles * P.nsplit, stream);
}

}  // namespace rlk::cuda::detail

#endif  // RLK_HAVE_SM90
