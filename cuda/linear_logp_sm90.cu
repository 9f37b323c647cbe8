// The Hopper (sm_90a) kernel of linear_logp for bf16/fp16: TMA + wgmma, warp-specialised. It runs
// the forward (statistics, optionally keeping the logits for the fast backward) and the lean
// backward's recompute (dlogit tiles), which differ only in the epilogue (Epi).
//
// Compiled only with -gencode=arch=compute_90a,code=sm_90a and only when RLK_HAVE_SM90 is set.
//
// Assembled, after FlashAttention 3's hopper/, from the pieces in sm90/:
//   params.cuh          the tile shape, the epilogue kinds (Epi) and the kernel's arguments;
//   tile_scheduler.cuh  which (128-row tile, split) unit a CTA computes, in an L2-friendly order;
//   mainloop.cuh        the producer (TMA into a ring of stages) and the consumers (wgmma into
//                       fp32 registers), synchronised by "full" and "empty" mbarriers;
//   epilogue.cuh        what becomes of each logit tile: statistics, the saved record or dlogit, and
//                       the tile store (stmatrix + TMA store) of the 2-byte outputs;
//   ptx.cuh             the inline-PTX instructions they use.
// Per-(row, split) partials go to the workspace; the finalize kernel of linear_logp_cuda.cu merges
// them per chunk exactly as for the portable kernel (kDlogit: the lean backward sums its dz z
// partials per row in split order). Every row goes through the same instruction
// sequence whatever its position in the tile, and the split geometry is relative to the chunk
// start, so results are batch- and TP-invariant.
#if RLK_HAVE_SM90

#include <cuda.h>
#include <cudaTypedefs.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <mutex>

#include "linear_logp_cuda.h"
#include "lp_internal.h"
#include "sm90/epilogue.cuh"
#include "sm90/mainloop.cuh"
#include "sm90/params.cuh"
#include "sm90/ptx.cuh"
#include "sm90/tile_scheduler.cuh"

namespace rlk::cuda::detail {
namespace {
using namespace sm90;

static_assert(SavedLayout::kGroupCols * 2 == kBN, "a tile's max serves both saved groups of the tile");

// Shared memory: the stage ring, the tile store's staging and the mbarriers.
constexpr int kSmemBytes = kStages * kStageBytes + kStagingBytes + 1024 /*alignment*/ + 256 /*barriers*/;
static_assert(kSmemBytes <= 232448, "sm_90 dynamic shared memory per block");
constexpr int kThreads = 384;  // producer warpgroup + 2 consumer warpgroups

// One CTA per unit (blockIdx.x = unit number).
template <bool kBf16, Epi kEpi>
__global__ void __launch_bounds__(kThreads, 1)
    sm90_forward_kernel(const __grid_constant__ CUtensorMap tmA, const __grid_constant__ CUtensorMap tmB,
                        const __grid_constant__ CUtensorMap tmO, const Params P, const GradArg<kEpi> G) {
  extern __shared__ __align__(1024) unsigned char smem_raw[];
  unsigned char* smem =
      reinterpret_cast<unsigned char*>((reinterpret_cast<uintptr_t>(smem_raw) + 1023) & ~uintptr_t(1023));
  const uint32_t sbase = smem_u32(smem);
  const uint32_t staging = sbase + kStages * kStageBytes;  // 1024-aligned, as the swizzle needs
  const uint32_t bar_full = staging + kStagingBytes;  // kStages x 8 bytes
  const Pipeline pl{sbase, bar_full, bar_full + kStages * 8};
  const int KB = P.kblocks;

  const int wg = threadIdx.x / 128;
  if (threadIdx.x == 0) init_barriers(pl, unit_of(blockIdx.x, P), P.rows);
  __syncthreads();

  if (wg == 0) {
    // ---- producer ----
    setmaxnreg_dec<40>();  // registers go to the consumers' 128 fp32 accumulators per thread
    if (threadIdx.x == 0) load_unit(pl, &tmA, &tmB, unit_of(blockIdx.x, P), KB);
  } else {
    // ---- consumers ----
    setmaxnreg_inc<232>();
    const int cw = wg - 1;  // consumer warpgroup: rows cw*64 .. cw*64+63
    const int warp = (threadIdx.x / 32) % 4, lane = threadIdx.x % 32;
    float d[128];
    const Unit u = unit_of(blockIdx.x, P);
    if (idle_warpgroup(u, cw, P.rows)) return;
    const int64_t row0 = u.r0 + cw * 64, rowA = row0 + warp * 16 + lane / 4, rowB = rowA + 8;
    const uint32_t buf = staging + cw * 2 * kBoxBytes;
    const float itA = (rowA < P.rows ? reciprocal(P.temperature[rowA]) : 1.f) * kLog2e;
    const float itB = (rowB < P.rows ? reciprocal(P.temperature[rowB]) : 1.f) * kLog2e;
    RowState<kEpi> st;
    if constexpr (kEpi == Epi::kSave)  // row A's group maxima from the unit's first group
      if (rowA < P.rows) {
        const int64_t c = u.cu / P.spc;
        st.gmax = G.head + rowA * G.layout.floats + G.layout.group_max_at() + G.layout.group(c, u.col0, P.chunk);
      }
    mma_unit<kBf16>(pl, u.ntiles, d, cw, lane, KB, [&](int t) {
      // ---- epilogue: a tile inside the chunk and the real vocab needs no padding mask ----
      const int64_t t0 = u.col0 + int64_t(t) * kBN;
      if (t0 + kBN <= u.col_end && P.vocab_start + t0 + kBN <= P.real_vocab)
        epilogue<kBf16, kEpi, false>(d, t, t0, u.col_end, P, G, itA, itB, &tmO, buf, cw, row0, st);
      else epilogue<kBf16, kEpi, true>(d, t, t0, u.col_end, P, G, itA, itB, &tmO, buf, cw, row0, st);
    });
    store_partials(st, P, lane, rowA, rowB, u.cu);
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
// K-major (inner = K, box_inner = kBK); the saved record's q is [rows, v] (box 64 x 64).
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
  if (!make_map(ma, map_type(p), hidden, p.h, rows, p.h, kBK, kBM) ||
      !make_map(mb, map_type(p), weight, p.h, p.v, p.h, kBK, kBN))
    return "rlk cuda: tensor map encoding failed";
  *P = Params{};
  P->rows = rows;
  P->chunk = p.chunk;
  P->split_cols = split_cols;
  P->spc = splits_per_chunk(p.chunk, split_cols);
  P->nsplit = num_chunks(p) * P->spc;
  P->vocab_start = p.vocab_start;
  P->real_vocab = p.real_vocab;
  P->row_tiles = (rows + kBM - 1) / kBM;
  P->kblocks = int32_t(p.h / kBK);
  P->bias = p.has_bias ? bias : nullptr;
  P->temperature = temperature;
  return nullptr;
}

// The 2-byte tile output [rows, cols] with row stride ld: by TMA when its base and row stride are
// 16-byte aligned and every tile starts on a 16-byte boundary (chunk-relative tile starts: chunk %
// 8 == 0), else by plain stores.
void set_out(Params* P, CUtensorMap* mo, CUtensorMapDataType type, void* out, int64_t cols, int64_t ld, int64_t chunk) {
  P->out = static_cast<uint16_t*>(out);
  P->ldo = ld;
  P->cols = cols;
  P->out_tma = chunk % 8 == 0 && ld % 8 == 0 && (reinterpret_cast<uintptr_t>(out) & 15) == 0 &&
               make_map(mo, type, out, cols, P->rows, ld, kBoxCols, 64);
}
}  // namespace

const char* sm90_forward_partials(const Problem& p, const void* hidden, int64_t rows, const void* weight,
                                  const float* bias, const float* temperature, float* part, void* saved_q,
                                  float* saved_head, cudaStream_t stream) {
  CUtensorMap ma, mb, mo{};
  Params P;
  if (const char* e = setup(p, hidden, rows, weight, bias, temperature, kSplitCols, &ma, &mb, &P)) return e;
  P.part = part;
  const int64_t units = P.row_tiles * P.nsplit;
  if (!saved_head) return launch<Epi::kStats>(p.dtype == DType::kBF16, ma, mb, mo, P, {}, units, stream);
  set_out(&P, &mo, CU_TENSOR_MAP_DATA_TYPE_FLOAT16, saved_q, p.v, p.v, p.chunk);
  const SaveRows K{saved_head, SavedLayout(p)};
  return launch<Epi::kSave>(p.dtype == DType::kBF16, ma, mb, mo, P, K, units, stream);
}

const char* sm90_dlogit(const Problem& p, const BwdArgs& a, int64_t rows, void* dlog, int64_t ldd, float* dzz,
                        cudaStream_t stream) {
  CUtensorMap ma, mb, mo{};
  Params P;
  if (const char* e = setup(p, a.hidden, rows, a.weight, a.bias, a.temperature, kDlogitSplitCols, &ma, &mb, &P))
    return e;
  P.part = dzz;
  set_out(&P, &mo, map_type(p), dlog, p.v, ldd, p.chunk);
  return launch<Epi::kDlogit>(p.dtype == DType::kBF16, ma, mb, mo, P, grad_rows(p, a), P.row_tiles * P.nsplit, stream);
}

}  // namespace rlk::cuda::detail

#endif  // RLK_HAVE_SM90
