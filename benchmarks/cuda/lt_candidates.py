"""cuBLASLt's candidate algorithms for the backward's GEMMs, each timed and named.

    python benchmarks/cuda/lt_candidates.py [--count 12] [--out FILE.md] [--l16k | --rows]

For each GEMM of the backward that matters to the split-K question (docs/benchmarks.md §5)
it asks cuBLASLt's heuristic for up to --count algorithms twice, with reduction scheme NONE only
(no split-K) and with any scheme, then runs every candidate: its config (tile id, split-k count,
reduction scheme, stages), the heuristic's waves, the kernel's name (torch.profiler) and its median
time (triton's do_bench), and whether its output has the same bits as the first candidate's
(the one cuda/blas.cc runs: same summation order). Row-major C[m, n] (+)= A[m, k] @ B[k, n] is called
as cuBLASLt's column-major C^T = B^T A^T, as cuda/blas.cc does. Needs a GPU, torch and cuBLASLt.

--rows: the fast path's dH at several row counts, run with cuBLASLt's first no-split pick for that
row count and with the first pick for a fixed reference row count (one algorithm for every row
count, what makes dH batch invariant: cuda/blas.h), timed, and whether the pinned algorithm's rows
have the bits of the same rows of a full-size run.
"""
from __future__ import annotations

import argparse
import ctypes
import glob
import sys

import torch
from triton.testing import do_bench

# (name, m, n, k, output dtype, beta[, layout]): the calls of cuda/linear_logp_bwd.cu at the shapes in
# question. layout: "A^T" when A is stored [k, m] (dW = dlogit^T H), "B^T" when B is stored [n, k].
GEMMS = [
    ("T1 lean dH, half the rows (fp32 acc)", 398, 2048, 75968, torch.float32, 0.0),
    ("T1 lean dH, all rows (fp32 acc)", 796, 2048, 75968, torch.float32, 0.0),
    ("796-row dH piece (fp32 acc)", 796, 2048, 38144, torch.float32, 1.0),
    ("T1 fast dH", 796, 2048, 75968, torch.bfloat16, 0.0),
    ("tiny dH h=64 (fp32)", 127, 64, 7013, torch.float32, 0.0),
    ("T2 lean dH piece (fp32 acc)", 1820, 2048, 16384, torch.float32, 1.0),
    ("T3 lean dH piece (fp32 acc)", 6827, 2048, 16384, torch.float32, 1.0),
]
# The fast path's two gradient GEMMs at L16k, and dW with H transposed first (H^T stored [h, n]:
# its k = n axis contiguous), the forward's layout for comparison (z = H W^T: both k-contiguous).
L16K = [
    ("L16k fast dH = D W", 16384, 4096, 151936, torch.bfloat16, 0.0, ""),
    ("L16k fast dW = D^T H", 151936, 4096, 16384, torch.bfloat16, 0.0, "A^T"),
    ("L16k fast dW = D^T (H^T)^T", 151936, 4096, 16384, torch.bfloat16, 0.0, "A^T B^T"),
    ("L16k z = H W^T", 16384, 151936, 4096, torch.bfloat16, 0.0, "B^T"),
]
CUDA_TYPE = {torch.float32: 0, torch.float16: 2, torch.bfloat16: 14}
COMPUTE_32F, OP_N, OP_T = 68, 0, 1
WS_BYTES = 32 << 20
SZ = ctypes.c_size_t  # size_t arguments must go as 64-bit values


class Heuristic(ctypes.Structure):
    _fields_ = [("algo", ctypes.c_uint64 * 8), ("workspace", ctypes.c_size_t), ("state", ctypes.c_int),
                ("waves", ctypes.c_float), ("reserved", ctypes.c_int * 4)]


def load_lt():
    paths = sorted(f for p in sys.path for f in glob.glob(p + "/nvidia/*/lib/libcublasLt.so.1*"))
    return ctypes.CDLL(paths[0] if paths else "libcublasLt.so")


def check(status, what):
    if status != 0:
        raise RuntimeError(f"cuBLASLt {what}: status {status}")


class Gemm:
    def __init__(self, lt, handle, m, n, k, out_dtype, layout="", a=None, b=None):
        self.lt, self.handle = lt, handle
        ta, tb = "A^T" in layout, "B^T" in layout
        self.a = torch.randn(*((k, m) if ta else (m, k)), device="cuda", dtype=torch.bfloat16) if a is None else a
        self.b = torch.randn(*((n, k) if tb else (k, n)), device="cuda", dtype=torch.bfloat16) if b is None else b
        self.c = torch.zeros(m, n, device="cuda", dtype=out_dtype)
        self.ws = torch.empty(WS_BYTES, device="cuda", dtype=torch.uint8)
        self.desc, self.lx, self.ly, self.lc = (ctypes.c_void_p() for _ in range(4))
        check(lt.cublasLtMatmulDescCreate(ctypes.byref(self.desc), COMPUTE_32F, 0), "desc")
        # column-major C^T[n, m] = X Y with X = B^T, Y = A^T as stored (cuda/blas.cc)
        for attr, t in ((3, tb), (4, ta)):
            op = ctypes.c_int(OP_T if t else OP_N)
            check(lt.cublasLtMatmulDescSetAttribute(self.desc, attr, ctypes.byref(op), SZ(4)), "trans")
        bf16 = CUDA_TYPE[torch.bfloat16]
        u64, i64 = ctypes.c_uint64, ctypes.c_int64
        xr, xc = (k, n) if tb else (n, k)
        yr, yc = (m, k) if ta else (k, m)
        check(lt.cublasLtMatrixLayoutCreate(ctypes.byref(self.lx), bf16, u64(xr), u64(xc), i64(xr)), "layout B")
        check(lt.cublasLtMatrixLayoutCreate(ctypes.byref(self.ly), bf16, u64(yr), u64(yc), i64(yr)), "layout A")
        check(lt.cublasLtMatrixLayoutCreate(ctypes.byref(self.lc), CUDA_TYPE[out_dtype], u64(n), u64(m), i64(n)),
              "layout C")

    def candidates(self, mask, count):
        pref = ctypes.c_void_p()
        check(self.lt.cublasLtMatmulPreferenceCreate(ctypes.byref(pref)), "pref")
        ws, m = ctypes.c_uint64(WS_BYTES), ctypes.c_uint32(mask)
        check(self.lt.cublasLtMatmulPreferenceSetAttribute(pref, 1, ctypes.byref(ws), SZ(8)), "pref ws")
        check(self.lt.cublasLtMatmulPreferenceSetAttribute(pref, 3, ctypes.byref(m), SZ(4)), "pref mask")
        results, found = (Heuristic * count)(), ctypes.c_int(0)
        check(self.lt.cublasLtMatmulAlgoGetHeuristic(self.handle, self.desc, self.lx, self.ly, self.lc, self.lc,
                                                      pref, count, results, ctypes.byref(found)), "heuristic")
        self.lt.cublasLtMatmulPreferenceDestroy(pref)
        return [results[i] for i in range(found.value) if results[i].state == 0]

    def config(self, h):
        out = []
        for attr in (1, 2, 3, 6):  # TILE_ID, SPLITK_NUM, REDUCTION_SCHEME, STAGES_ID
            v, written = ctypes.c_uint32(0), ctypes.c_size_t(0)
            self.lt.cublasLtMatmulAlgoConfigGetAttribute(ctypes.byref(h.algo), attr, ctypes.byref(v), SZ(4),
                                                         ctypes.byref(written))
            out.append(v.value)
        return out

    def run(self, h, beta):
        alpha, b = ctypes.c_float(1.0), ctypes.c_float(beta)
        stream = ctypes.c_void_p(torch.cuda.current_stream().cuda_stream)
        check(self.lt.cublasLtMatmul(self.handle, self.desc, ctypes.byref(alpha), ctypes.c_void_p(self.b.data_ptr()),
                                     self.lx, ctypes.c_void_p(self.a.data_ptr()), self.ly, ctypes.byref(b),
                                     ctypes.c_void_p(self.c.data_ptr()), self.lc, ctypes.c_void_p(self.c.data_ptr()),
                                     self.lc, ctypes.byref(h.algo), ctypes.c_void_p(self.ws.data_ptr()),
                                     ctypes.c_size_t(WS_BYTES), stream), "matmul")

    def same_bits(self, h, beta, first):
        """Runs once from C = 1 (so beta's term counts) and says whether C has the bits of `first`."""
        self.c.fill_(1.0)
        self.run(h, beta)
        return "-" if first is None else "yes" if torch.equal(self.c, first) else "no"

    def fits(self, h):
        out = Heuristic()
        return self.lt.cublasLtMatmulAlgoCheck(self.handle, self.desc, self.lx, self.ly, self.lc, self.lc,
                                               ctypes.byref(h.algo), ctypes.byref(out)) == 0

    def time_ms(self, h, beta):
        return do_bench(lambda: self.run(h, beta), warmup=10, rep=50, return_mode="median")

    def kernel_name(self, h, beta):
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            self.run(h, beta)
            torch.cuda.synchronize()
        names = [e.name for e in prof.events() if getattr(e, "device_type", None) == torch.autograd.DeviceType.CUDA]
        return " + ".join(names)[:90] or "?"


# --rows: (name, h, v), the row counts, and the reference row counts whose first pick is pinned
ROWS_SHAPES = [("T1", 2048, 75968), ("H200-pub", 4096, 128256), ("L16k", 4096, 151936)]
ROWS = (1, 127, 796, 1820, 4096, 6827, 16384)
REF_ROWS = (1024, 4096, 16384)


def rows_table(lt, handle):
    """dH = D[n, v] W[v, h] (bf16 out) per row count: the per-count first pick against pinned ones."""
    lines = ["| shape | rows | own pick: tile, ms | " + " | ".join(f"pinned at {r}: tile, ms, bits" for r in REF_ROWS)
             + " |", "|---" * (3 + len(REF_ROWS)) + "|"]
    for name, h, v in ROWS_SHAPES:
        d = torch.randn(max(ROWS), v, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(v, h, device="cuda", dtype=torch.bfloat16)
        full = Gemm(lt, handle, max(ROWS), h, v, torch.bfloat16, a=d, b=w)
        pinned = [Gemm(lt, handle, r, h, v, torch.bfloat16, a=d[:r], b=w).candidates(0, 1)[0] for r in REF_ROWS]
        full_out = []
        for h_ in pinned:
            full.run(h_, 0.0)
            full_out.append(full.c.clone())
        for n in ROWS:
            g = Gemm(lt, handle, n, h, v, torch.bfloat16, a=d[:n], b=w)
            own = g.candidates(0, 1)[0]
            row = f"| {name} | {n} | {g.config(own)[0]}, {g.time_ms(own, 0.0):.3f} |"
            for h_, ref in zip(pinned, full_out):
                if not g.fits(h_):
                    row += " does not fit |"
                    continue
                g.run(h_, 0.0)
                same = "same" if torch.equal(g.c, ref[:n]) else "DIFFER"
                row += f" {g.config(h_)[0]}, {g.time_ms(h_, 0.0):.3f}, {same} |"
            lines.append(row)
            print(row, flush=True)
        del d, w, full, full_out
        torch.cuda.empty_cache()
    return lines


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--count", type=int, default=12)
    ap.add_argument("--out", default=None)
    ap.add_argument("--l16k", action="store_true", help="the fast path's GEMMs at L16k instead (mask NONE only)")
    ap.add_argument("--rows", action="store_true", help="dH with one algorithm for every row count (see above)")
    args = ap.parse_args()
    lt = load_lt()
    handle = ctypes.c_void_p()
    check(lt.cublasLtCreate(ctypes.byref(handle)), "create")
    lines = [f"# cuBLASLt candidates ({torch.cuda.get_device_name()}, torch {torch.__version__})", ""]
    if args.rows:
        lines += rows_table(lt, handle)
    for name, m, n, k, dt, beta, *layout in [] if args.rows else L16K if args.l16k else GEMMS:
        g = Gemm(lt, handle, m, n, k, dt, *layout)
        flop = 2.0 * m * n * k
        lines += [f"## {name}: C[{m}, {n}] {str(dt)[6:]} (+)= A[{m}, {k}] B[{k}, {n}], beta {beta}", "",
                  "| mask | # | tile | splitk | red | stages | waves | ws MB | ms | TFLOP/s | bits = #0 | kernel |",
                  "|---|---|---|---|---|---|---|---|---|---|---|---|"]
        first = None  # the output of the first candidate of mask NONE (what cuda/blas.cc runs)
        for mask in (0,) if args.l16k else (0, 7):
            for i, h in enumerate(g.candidates(mask, args.count)):
                tile, splitk, red, stages = g.config(h)
                head = f"| {mask} | {i} | {tile} | {splitk} | {red} | {stages} | {h.waves:.2f} | {h.workspace / 2**20:.1f} |"
                try:
                    same = g.same_bits(h, beta, first)
                    if first is None:
                        first = g.c.clone()
                    ms = g.time_ms(h, beta)
                    lines.append(f"{head} {ms:.3f} | {flop / ms * 1e-9:.0f} | {same} | {g.kernel_name(h, beta)} |")
                except RuntimeError as err:
                    lines.append(f"{head} - | - | - | {err} |")
                print(lines[-1], flush=True)
        lines.append("")
        del g
        torch.cuda.empty_cache()
    text = "\n".join(lines) + "\n"
    if args.out:
        open(args.out, "w").write(text)
    print(text)


if __name__ == "__main__":
    main()
