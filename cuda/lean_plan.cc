// The lean backward's planner: lean_plan.h says what it plans and promises; the budget and
// the choices behind it are here.
#include "lean_plan.h"

#include <algorithm>

namespace rlk::cuda {
namespace {

constexpr size_t kLeanBudget = size_t(250) << 20;  // 256 MiB, less room for the frontends' [n] vectors
constexpr size_t kLeanLimit = kLeanBudget + (size_t(6) << 20);  // the promise (256 MiB); one sweep wherever it holds
constexpr size_t kLeanTileMax = size_t(144) << 20;  // larger workspace tiles gain little
constexpr size_t kLeanTileMin = size_t(32) << 20;   // the floor where n * h takes the budget
constexpr int64_t kLeanMinPiece = 1024;             // narrower workspace pieces: take more row passes
constexpr int64_t kLeanMaxPiece = 16384;            // borrowed pieces, one pass (bounds dzz)
constexpr size_t kLeanDhWhole = size_t(32) << 20;   // dH's fp32 accumulator all in the workspace up to this

// The tiles of R rows and P columns: z (gemm path), dlogit, and dzz (fused).
int64_t lean_tile_bytes(const Problem& p, bool fused, int64_t R, int64_t P) {
  return R * int64_t(lean_per_row(p, fused, P)) + (fused ? R * dlogit_splits(P) * 4 : 0);
}

// The tiles in about `tiles` bytes. Depends on the shapes, the dtype and the path only.
LeanTiles lean_tiles(const Problem& p, bool fused, size_t tiles) {
  auto tile_bytes = [&](int64_t R, int64_t P) { return lean_tile_bytes(p, fused, R, P); };
  const int64_t v256 = ceil_to(p.v, 256);
  // One row pass, the common case: dW goes straight to the dtype.
  const int64_t R = ceil_to(p.n, 128);
  int64_t P = int64_t(tiles) / R / int64_t(lean_per_row(p, fused, 1)) / 256 * 256;
  P = P < v256 ? P : v256;
  while (P > 0 && tile_bytes(R, P) > int64_t(tiles)) P -= 256;
  if (P >= std::min(kLeanMinPiece, v256)) return {P, std::max(P, kLeanMaxPiece), R, 0};
  // More passes over pieces of at most 8192 columns, through an fp32 dW piece accumulator of at
  // most 64 MiB that leaves the tiles room for 128 rows.
  P = std::min(std::clamp<int64_t>((int64_t(16) << 20) / p.h / 256 * 256, 256, 8192), v256);
  auto acc_bytes = [&](int64_t P) { return align256(size_t(P) * p.h * 4); };
  while (P > 256 && int64_t(acc_bytes(P)) + tile_bytes(128, P) > int64_t(tiles)) P -= 256;
  const size_t dwacc = acc_bytes(P);
  int64_t rmax = (int64_t(tiles) - int64_t(dwacc)) / tile_bytes(1, P) / 128 * 128;
  rmax = rmax > 128 ? rmax : 128;
  const int64_t passes = (p.n + rmax - 1) / rmax;
  return {P, P, ceil_to((p.n + passes - 1) / passes, 128), dwacc};  // equal passes: a fuller last wave
}

// Places the workspace's parts for L.t and L.dh_ws.
void lean_place(const Problem& p, LeanLayout& L) {
  const LeanTiles& t = L.t;
  size_t o = 0;
  L.off_dh = o;
  o += align256(size_t(L.dh_ws) * p.h * 4);
  if (!L.fused) {
    L.off_z = o;
    o += align256(size_t(t.R) * t.P * 4);
  }
  L.off_dlog = o;
  o += align256(size_t(t.R) * t.P * dtype_bytes(p.dtype));
  if (L.fused) {
    L.off_dzz = o;
    o += align256(size_t(t.R) * dlogit_splits(t.P_max) * 4);
  }
  L.off_dwacc = o;
  o += t.dwacc;
  L.total = blas::kWorkspaceAlloc + 256 /*tile base alignment*/ + o;
}

// The fp32 dH rows the first sweep keeps inside dhidden's own bytes: all of an fp32 dhidden;
// of a 16-bit one, the half it holds, or none while the whole accumulator is small. Halving the
// rows only saves memory, and a small n's dH GEMM of n/2 rows fills less than a wave of the GPU
// (T1, 796 rows: cuBLAS then needs split-K to keep its speed).
int64_t dh_inside(const Problem& p, DType dh_dtype) {
  if (dtype_bytes(dh_dtype) == 4) return p.n;
  return size_t(p.n) * p.h * 4 <= kLeanDhWhole ? 0 : p.n * int64_t(dtype_bytes(dh_dtype)) / 4;
}

// One sweep: the workspace holds every dH row that dhidden cannot, the tiles what is left.
size_t one_sweep_tiles(const Problem& p, DType dh_dtype) {
  const size_t dh = blas::kWorkspaceAlloc + 256 + align256(size_t(p.n - dh_inside(p, dh_dtype)) * p.h * 4);
  return std::clamp(kLeanBudget > dh ? kLeanBudget - dh : 0, kLeanTileMin, kLeanTileMax);
}
LeanLayout one_sweep_layout(const Problem& p, bool fused, DType dh_dtype) {
  LeanLayout L{};
  L.fused = fused;
  L.dh_in = dh_inside(p, dh_dtype);
  L.dh_ws = p.n - L.dh_in;
  L.t = lean_tiles(p, fused, one_sweep_tiles(p, dh_dtype));
  lean_place(p, L);
  return L;
}

// Row sweeps of dH. The tiles take the least room that keeps one row pass with pieces of
// kLeanMinPiece columns: most pieces then borrow dW's rows and dW needs no fp32 accumulator.
// Smaller tiles would leave more dH rows to the first sweep but cost far more than the rows'
// recompute (L32k: many row passes of small pieces took twice one pass's time; docs/benchmarks.md
// §3). Where one pass does not fit (n past about 120k rows at bf16), the tiles take half
// the budget in several passes. The workspace's dH rows take what is left (no more than dhidden
// cannot hold), in whole 128-row blocks: every sweep's fp32 rows inside dhidden then start
// 256-byte aligned.
LeanLayout sweeps_layout(const Problem& p, bool fused, DType dh_dtype) {
  const size_t row4 = size_t(p.h) * 4;
  LeanLayout L{};
  L.fused = fused;
  L.t = lean_tiles(p, fused, lean_tile_bytes(p, fused, ceil_to(p.n, 128), std::min(kLeanMinPiece, ceil_to(p.v, 256))));
  lean_place(p, L);
  if (L.t.dwacc > 0 || L.total + align256(128 * row4) > kLeanBudget) {
    L.t = lean_tiles(p, fused, kLeanBudget / 2);
    lean_place(p, L);
  }
  L.dh_in = dh_inside(p, dh_dtype);
  if (L.dh_in < p.n) L.dh_in = L.dh_in / 128 * 128;  // (an fp32 dhidden holds all its rows itself)
  const int64_t room = int64_t((kLeanBudget > L.total ? kLeanBudget - L.total : 0) / row4) / 128 * 128;
  L.dh_ws = std::clamp<int64_t>(room, 128, std::max<int64_t>(128, ceil_to(p.n - L.dh_in, 128)));
  lean_place(p, L);
  return L;
}

}  // namespace

LeanLayout lean_layout(const Problem& p, bool fused, DType dh_dtype) {
  const LeanLayout one = one_sweep_layout(p, fused, dh_dtype);
  if (one.total <= kLeanLimit && (one.t.dwacc == 0 || one_sweep_tiles(p, dh_dtype) >= kLeanBudget / 2)) return one;
  return sweeps_layout(p, fused, dh_dtype);
}

// The workspace of the lean backward (BwdArgs::saved_logits null). `fused`: the sm90 recompute may run
// (forward_backend is kCudaSm90); backward_lean then still falls back to the gemm path for
// operands that TMA cannot take, so the workspace holds either layout.
size_t lean_workspace_bytes(const Problem& p, bool fused, DType dh_dtype) {
  const size_t g = lean_layout(p, false, dh_dtype).total;
  if (!fused) return g;
  const size_t f = lean_layout(p, true, dh_dtype).total;
  return f > g ? f : g;
}

LeanPiece lean_next_piece(const Problem& p, const LeanLayout& L, int64_t c, bool borrow) {
  const int64_t rest = p.v - c, eb = int64_t(dtype_bytes(p.dtype)), R = L.t.R, P = L.t.P;
  if (borrow) {
    // borrowed: R rows of tiles + 256 (alignment) <= dW's rows [c + w, v), solved for w (tiles
    // grow linearly in w)
    const int64_t row_bytes = int64_t(lean_per_row(p, L.fused, 1));
    int64_t w = ((rest * p.h * eb - 256) / (R * row_bytes + p.h * eb)) / 256 * 256;
    w = w < L.t.P_max ? w : L.t.P_max;
    if (w > P && w < rest) return {c, w, w, true};
  }
  // the workspace tile: the rest in equal pieces
  const int64_t pieces = (rest + P - 1) / P;
  const int64_t w = ceil_to((rest + pieces - 1) / pieces, 256);
  return {c, w, w < rest ? w : rest, false};
}

LeanLayout sweep_layout(const Problem& p, LeanLayout L, const DhSweep& sw) {
  if (sw.r0 == 0) return L;
  const int64_t R = std::min(L.t.R, ceil_to(sw.r1 - sw.r0, 128));
  const int64_t P = std::min({L.t.R * L.t.P / R / 256 * 256, ceil_to(p.v, 256), kLeanMaxPiece});
  L.t.P = std::max(L.t.P, P);
  L.t.R = R;
  return L;
}

LeanPlan lean_plan(const Problem& p, bool fused, DType dhidden_dtype) {
  if (p.n <= 0 || p.v <= 0 || p.h <= 0) return {};  // nothing to plan: the backward has no lean work
  const LeanLayout L = lean_layout(p, fused, dhidden_dtype);
  LeanPlan plan{L, size_t(L.t.R) * lean_per_row(p, fused, L.t.P), {}, {}};
  for_each_lean_piece(p, L, true, [&](const LeanPiece& pc) -> Status {
    plan.pieces.push_back({pc.c, pc.cols, pc.w, pc.borrowed, size_t(L.t.R) * lean_per_row(p, fused, pc.w)});
    return nullptr;
  });
  for_each_dh_sweep(p, L, dhidden_dtype, [&](const DhSweep& sw) -> Status {
    const LeanLayout Ls = sweep_layout(p, L, sw);
    plan.dh_sweeps.push_back({sw.r0, sw.in, sw.r1, Ls.t.R, Ls.t.P});
    return nullptr;
  });
  return plan;
}

}  // namespace rlk::cuda
