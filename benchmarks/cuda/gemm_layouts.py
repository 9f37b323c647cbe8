"""The three GEMMs of a fast fwd+bwd, each timed alone through torch (cuBLAS), with cuBLAS and
with cuBLASLt as torch's backend: forward z = H W^T (NT), dH = D W (NN), dW = D^T H (TN), bf16 in
and out, on one GPU. Says whether the backward's two GEMMs run as fast as the forward's, and
whether the Lt heuristics pick faster kernels than cublasGemmEx does.
    python3 benchmarks/cuda/gemm_layouts.py [--shapes L16k,H200-pub,T3]
"""
import argparse
import os
import sys

import torch
from triton.testing import do_bench

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
from rlk_common import SHAPES  # noqa: E402

ap = argparse.ArgumentParser()
ap.add_argument("--shapes", default="L16k,H200-pub,T3")
args = ap.parse_args()
print("| shape | backend | z = H W^T ms | dH = D W ms | dW = D^T H ms | (dH + dW) / 2z |")
print("|---|---|---|---|---|---|")
for name in args.shapes.split(","):
    n, h, v = SHAPES[name]
    H = torch.randn(n, h, device="cuda", dtype=torch.bfloat16)
    W = torch.randn(v, h, device="cuda", dtype=torch.bfloat16)
    D = torch.randn(n, v, device="cuda", dtype=torch.bfloat16)
    for lib in ("cublas", "cublaslt"):
        torch.backends.cuda.preferred_blas_library(lib)
        t = [do_bench(f, warmup=10, rep=100, return_mode="median")
             for f in (lambda: H @ W.t(), lambda: D @ W, lambda: D.t() @ H)]  # noqa: F821 (ruff: the del below)
        print(f"| {name} | {lib} | {t[0]:.3f} | {t[1]:.3f} | {t[2]:.3f} | {(t[1] + t[2]) / (2 * t[0]):.3f} |", flush=True)
    del H, W, D
    torch.cuda.empty_cache()
