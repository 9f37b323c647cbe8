"""Gradient error of backward="fast" and backward="lean" against float64 (torch_bridge, CPU or GPU).

For each dtype, logit std and temperature: random hidden [n, h] and weight [V, h] scaled so that
hidden @ weight.T has the given std, a bias, per-token temperatures, entropy on; the loss
sum(g logp + e entropy) with random g, e. Reports ||grad - grad64|| / ||grad64|| of dH, dW, db
and dT for both strategies (grad64: autograd of torch_bridge.reference in float64 on the same
inputs, on the same device), and, with --time, the forward+backward time of each strategy at
--time-shape.

  PYTHONPATH=$PWD:$PWD/build/dev python benchmarks/grad_error.py [--device cuda] [--time]
"""
from __future__ import annotations

import argparse
import sys
import time

import torch

import torch_bridge
from torch_bridge import reference

STDS = (1.0, 8.0, 32.0)
TEMPS = (1.0, 0.7, 0.1, 1e-3)
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def inputs(n, h, v, dtype, std, temp, device, seed=0):
    g = torch.Generator().manual_seed(seed)
    hid = torch.randn(n, h, generator=g)
    w = torch.randn(v, h, generator=g) * (std / h ** 0.5)
    b = torch.randn(v, generator=g) * 0.1 * std
    t = torch.randint(0, v, (n,), generator=g)
    temp = torch.full((n,), temp) * (1 + 0.1 * torch.rand(n, generator=g))
    gl, ge = torch.randn(n, generator=g), torch.randn(n, generator=g)
    return [x.to(device, dtype) for x in (hid, w, b)] + [x.to(device) for x in (t, temp, gl, ge)]


def grads(fn, hid, w, b, t, temp, gl, ge, dtype):
    leaves = [x.detach().to(dtype).requires_grad_() for x in (hid, w, b)]
    tl = temp.detach().clone().requires_grad_()
    logp, ent = fn(leaves[0], leaves[1], t, bias=leaves[2], temperature=tl, return_entropy=True)
    ((logp * gl.to(logp.dtype)).sum() + (ent * ge.to(ent.dtype)).sum()).backward()
    return [x.grad.double() for x in leaves] + [tl.grad.double()]


def rel(a, b):
    return float((a - b).norm() / b.norm().clamp_min(1e-300))


def errors(n, h, v, dtype, std, temp, device):
    x = inputs(n, h, v, dtype, std, temp, device)
    ref = grads(reference.linear_logp, *x, torch.float64)
    out = {}
    for strategy in ("fast", "lean"):
        fn = lambda *a, **k: torch_bridge.linear_logp(*a, mode="strict", backward=strategy, **k)  # noqa: E731
        out[strategy] = [rel(o, r) for o, r in zip(grads(fn, *x, dtype), ref)]
    return out


def timing(n, h, v, dtype, device, repeat=5):
    x = inputs(n, h, v, dtype, 8.0, 0.7, device)
    out = {}
    for strategy in ("fast", "lean"):
        fn = lambda *a, **k: torch_bridge.linear_logp(*a, mode="strict", backward=strategy, **k)  # noqa: E731
        grads(fn, *x, dtype)  # warm-up
        best = float("inf")
        for _ in range(repeat):
            t0 = time.perf_counter()
            grads(fn, *x, dtype)
            if device == "cuda":
                torch.cuda.synchronize()
            best = min(best, time.perf_counter() - t0)
        out[strategy] = best
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="256,256,4000", help="n,h,V of the error table")
    ap.add_argument("--time", action="store_true", help="also time fwd+bwd at --time-shape")
    ap.add_argument("--time-shape", default="512,512,8000")
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"), help="where both strategies and the float64 reference run")
    args = ap.parse_args()
    n, h, v = map(int, args.shape.split(","))
    cases = [(d, s, t) for d in DTYPES for s in STDS for t in TEMPS]
    print(f"| dtype | std | T | fast dH | lean dH | fast dW | lean dW | fast db | lean db | fast dT | lean dT |"
          f"  (n, h, V) = {(n, h, v)}, {args.device}")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for i, (d, s, t) in enumerate(cases):
        e = errors(n, h, v, DTYPES[d], s, t, args.device)
        cells = " | ".join(f"{e['fast'][k]:.2e} | {e['lean'][k]:.2e}" for k in range(4))
        print(f"| {d} | {s:g} | {t:g} | {cells} |", flush=True)
        print(f"  [{i + 1}/{len(cases)}]", end="\r", file=sys.stderr, flush=True)
    if args.time:
        n, h, v = map(int, args.time_shape.split(","))
        for d, dt in DTYPES.items():
            tm = timing(n, h, v, dt, args.device)
            print(f"fwd+bwd {d} {(n, h, v)}: fast {tm['fast'] * 1e3:.1f} ms, lean {tm['lean'] * 1e3:.1f} ms")


if __name__ == "__main__":
    main()
