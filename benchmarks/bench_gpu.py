"""Side-by-side GPU benchmark of linear_logp, one process, every shape of DESIGN.md section 6.

Per shape, in the same run: the cuBLAS bf16 GEMM of the same shape (the floor, torch matmul), the
JAX reference (materialized logits), rlk_xla (fused), and the torch rows: native torch,
torch_bridge, Liger FLCE and Cut Cross-Entropy when installed. Forward and forward+backward
(gradients of sum(logp * g) w.r.t. hidden and weight), median times, peak extra memory, and the
logp error against float64 on sampled rows.

    python benchmarks/bench_gpu.py --out docs            # all shapes -> docs/benchmarks.{json,md,png}
    python benchmarks/bench_gpu.py --shapes T3,L16k --out $OUT

Times: torch rows with triton.testing.do_bench (median, CUDA events); JAX rows with wall time
around block_until_ready (median) as in ../shared/anchors. Memory: torch peak allocated delta;
JAX: XLA's compiled temp bytes.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import sys

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # JAX and torch share the GPU here

import numpy as np  # noqa: E402
import torch  # noqa: E402
from triton.testing import do_bench  # noqa: E402

ORDER = ("rlk_xla", "torch_bridge", "jax_ref", "jax_chunked", "tokamax", "torch_native", "liger", "cce")
SHAPES = {"T3": (6827, 2048, 75968), "H200-pub": (4096, 4096, 128256), "L16k": (16384, 4096, 151936),
          "T3-tp1": (6827, 2048, 151936), "T1": (796, 2048, 75968), "T2": (1820, 2048, 75968),
          "Q8B-tp4": (4096, 4096, 37984)}


def jax_rows(h_t, w_t, t_t, g_t, iters=10):
    import jax
    import jax.numpy as jnp

    import rlk_xla

    h, w, t, g = (jax.dlpack.from_dlpack(x.detach()) for x in (h_t, w_t, t_t.int(), g_t))

    from rlk_xla.cli import time_ms
    timeit = lambda f, *a: time_ms(f, *a, iters=iters)

    def chunked(h, w, t, chunk=1024):  # the anchors' chunked baseline: lax.map over rows + remat
        n = h.shape[0]
        pad = (-n) % chunk
        hp, tp_ = jnp.pad(h, ((0, pad), (0, 0))), jnp.pad(t, (0, pad))
        one = jax.checkpoint(lambda a: rlk_xla.reference.linear_logp(a[0], w, a[1]))
        return jax.lax.map(one, (hp.reshape(-1, chunk, h.shape[1]), tp_.reshape(-1, chunk))).reshape(-1)[:n]

    paths = [("jax_ref", rlk_xla.reference.linear_logp), ("jax_chunked", chunked),
             ("rlk_xla", lambda *a: rlk_xla.linear_logp(*a, mode="strict"))]
    tokamax = _tokamax()
    if tokamax is not None:
        # tokamax takes the head as [H, V]: the transpose (about 0.1 ms here) is inside its timing
        paths.append(("tokamax", lambda h, w, t: -tokamax.linear_softmax_cross_entropy_loss(
            h, t, w.T, reduction="none")))
    out = {}
    for label, fn in paths:
        fwd = jax.jit(lambda h, w, fn=fn: fn(h, w, t))
        fb = jax.jit(jax.grad(lambda h, w, fn=fn: jnp.sum(fn(h, w, t) * g), argnums=(0, 1)))
        try:
            out[label] = dict(fwd_ms=timeit(fwd, h, w), fb_ms=timeit(fb, h, w),
                              fb_mem_mb=fb.lower(h, w).compile().memory_analysis().temp_size_in_bytes / 2 ** 20,
                              logp=torch.from_dlpack(fwd(h, w)))
        except Exception as e:  # report and keep going: one broken path must not hide the rest
            out[label] = dict(error=repr(e)[:300])
    rlk_xla.reset_route_stats()
    jax.block_until_ready(jax.jit(lambda h, w: rlk_xla.linear_logp(h, w, t, mode="strict"))(h, w))
    out["rlk_xla"]["route"] = ",".join(k for k, v in rlk_xla.route_stats()["backends"].items() if v["fwd_calls"])
    return out


def _tokamax():
    """Tokamax, the JAX kernel library (its wheel imports an undeclared `xprof`: a stub stands in)."""
    import types
    sys.modules.setdefault("xprof", types.ModuleType("xprof"))
    try:
        import tokamax
        return tokamax
    except Exception as e:  # noqa: BLE001 - report why and go on without it
        print("tokamax unavailable:", repr(e)[:200])
        return None


def torch_fns():
    fns = {"torch_native": lambda h, w, t: torch.log_softmax((h @ w.t()).float(), -1).gather(-1, t[:, None])[:, 0]}
    try:
        import torch_bridge
        fns["torch_bridge"] = lambda h, w, t: torch_bridge.linear_logp(h, w, t, mode="strict", validate_targets=False)
    except ImportError as e:
        print("torch_bridge unavailable:", e)
    try:
        from liger_kernel.ops.fused_linear_cross_entropy import LigerFusedLinearCrossEntropyFunction as F

        def liger(h, w, t):
            out = F.apply(h, w, t, None, None, -100, 0.0, 0.0, "none")
            return -(out[0] if isinstance(out, tuple) else out)
        fns["liger"] = liger
    except ImportError as e:
        print("liger unavailable:", e)
    try:
        from cut_cross_entropy import linear_cross_entropy
        fns["cce"] = lambda h, w, t: -linear_cross_entropy(h, w, t, reduction="none", filter_eps=None)
    except ImportError as e:
        print("cce unavailable:", e)
    return fns


def torch_row(fn, h, w, t, g):
    def run(train):
        if train:
            h.grad = None
            w.grad = None
            torch.autograd.backward(fn(h, w, t), g)
        else:
            with torch.no_grad():
                fn(h, w, t)
    res = {}
    for train, key in ((False, "fwd"), (True, "fb")):
        run(train)
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        run(train)
        torch.cuda.synchronize()
        # Peak allocated beyond what was live before the call (the reserved delta read 0 MB for
        # every fused path on 2026-11-30: the caching allocator served them from its cache).
        res[key + "_mem_mb"] = (torch.cuda.max_memory_allocated() - base) / 2 ** 20
        res[key + "_ms"] = do_bench(lambda: run(train), warmup=25, rep=150, return_mode="median")
    with torch.no_grad():
        res["logp"] = fn(h, w, t).float()
    return res


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--out", default="docs")
    ap.add_argument("--no-torch", action="store_true")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    try:
        from tqdm import tqdm
    except ImportError:  # pragma: no cover
        tqdm = lambda x, **k: x
    torch.manual_seed(0)
    rows = []
    fns = {} if args.no_torch else torch_fns()
    for name in tqdm(args.shapes.split(","), desc="shapes", file=sys.stderr):
        n, hd, v = SHAPES[name]
        h = torch.randn(n, hd, device="cuda").bfloat16().requires_grad_()
        w = (torch.randn(v, hd, device="cuda") * hd ** -0.5).bfloat16().requires_grad_()
        t = torch.randint(0, v, (n,), device="cuda")
        g = torch.randn(n, device="cuda")
        sample = torch.randperm(n, device="cuda")[:256]
        with torch.no_grad():
            gemm_ms = do_bench(lambda: h @ w.t(), warmup=50, rep=300, return_mode="median")
            ref = torch.log_softmax(h[sample].double() @ w.double().t(), -1).gather(-1, t[sample, None])[:, 0]
        row = dict(shape=name, n=n, h=hd, v=v, gemm_ms=gemm_ms, gemm_tflops=2.0 * n * hd * v / gemm_ms / 1e9, paths={})
        results = jax_rows(h, w, t, g)
        for label, fn in fns.items():
            try:
                results[label] = torch_row(fn, h, w, t, g)
            except Exception as e:  # report and keep going: one broken peer must not hide the rest
                results[label] = dict(error=repr(e)[:300])
            torch.cuda.empty_cache()
        for label, r in results.items():
            lp = r.pop("logp", None)
            if lp is not None:
                r["rel_err"] = float((lp[sample].double() - ref).norm() / ref.norm())
            for k in ("fwd_ms", "fb_ms"):
                if k in r:
                    r[k.replace("_ms", "_x_gemm")] = r[k] / gemm_ms
            row["paths"][label] = r
        rows.append(row)
        print(json.dumps(row), flush=True)
        del h, w, t, g
        torch.cuda.empty_cache()
        write_all(rows, args.out)  # after every shape: a run cut short still leaves its results


def write_all(rows, out):
    meta = dict(date=datetime.date.today().isoformat(), gpu=torch.cuda.get_device_name(),
                torch=torch.__version__, command=" ".join(["python"] + sys.argv))
    try:
        import jax
        meta["jax"] = jax.__version__
    except ImportError:
        pass
    with open(os.path.join(out, "benchmarks.json"), "w") as f:
        json.dump(dict(meta=meta, rows=rows), f, indent=1)
    write_markdown(meta, rows, os.path.join(out, "benchmarks_table.md"))
    plot(rows, os.path.join(out, "benchmarks.png"))


def write_markdown(meta, rows, path):
    """Four small tables (forward, forward+backward, memory, accuracy): shapes down, paths across."""
    labels = [l for l in ORDER if any(l in r["paths"] for r in rows)]
    lines = [f"Measured {meta['date']} on {meta['gpu']} (torch {meta['torch']}, jax {meta.get('jax', '-')}); "
             f"command: `{meta['command']}`.", ""]

    def table(title, cell):
        out = [f"**{title}**", "", "| shape | GEMM ms | " + " | ".join(labels) + " |",
               "|" + "---|" * (2 + len(labels))]
        for r in rows:
            cells = [f"{r['shape']} ({r['n']}x{r['h']}x{r['v']})", f"{r['gemm_ms']:.2f}"]
            for l in labels:
                p = r["paths"].get(l)
                cells.append("-" if p is None else ("error" if "error" in p else cell(p)))
            out.append("| " + " | ".join(cells) + " |")
        return out + [""]

    lines += table("Forward, ms (x cuBLAS GEMM of the same shape)", lambda p: f"{p['fwd_ms']:.2f} ({p['fwd_x_gemm']:.2f}x)")
    lines += table("Forward+backward, ms (x GEMM)", lambda p: f"{p['fb_ms']:.2f} ({p['fb_x_gemm']:.2f}x)")
    lines += table("Peak extra memory, forward+backward, MB (torch: allocated delta; JAX: XLA temp)",
                   lambda p: f"{p.get('fb_mem_mb', float('nan')):.0f}")
    lines += table("logp relative error vs float64 (256 sampled rows)", lambda p: f"{p.get('rel_err', float('nan')):.1e}")
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))


def plot(rows, path):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    labels = [l for l in ORDER if any(l in r["paths"] and "fb_ms" in r["paths"][l] for r in rows)]
    fig, axes = plt.subplots(1, 2, figsize=(13, 4.5))
    x = np.arange(len(rows))
    wdt = 0.8 / max(len(labels), 1)
    for i, l in enumerate(labels):
        fb = [r["paths"].get(l, {}).get("fb_x_gemm", np.nan) for r in rows]
        mem = [r["paths"].get(l, {}).get("fb_mem_mb", np.nan) for r in rows]
        axes[0].bar(x + i * wdt, fb, wdt, label=l)
        axes[1].bar(x + i * wdt, mem, wdt, label=l)
    for ax, title in ((axes[0], "forward+backward time / cuBLAS GEMM time (lower is better)"),
                      (axes[1], "peak extra memory, fwd+bwd, MB (log)")):
        ax.set_xticks(x + 0.4 - wdt / 2)
        ax.set_xticklabels([f"{r['shape']}\n{r['n']}x{r['h']}x{r['v']}" for r in rows], fontsize=7)
        ax.set_title(title, fontsize=9)
        ax.legend(fontsize=7)
    axes[1].set_yscale("log")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
