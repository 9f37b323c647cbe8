"""The main job: `check` (is this build right on this machine?) and `bench` (how fast, how lean)."""
from __future__ import annotations

import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

import rlk_common as common

from . import linear_logp, reference, reset_route_stats, route_stats
from ._core import core, registered_platforms

# docs/design.md §6, after the CPU shape of the core issue.
SHAPES = {"small": (512, 1024, 32000), **common.SHAPES}


def progress(i: int, total: int, label: str) -> None:
    """A one-line progress bar on stderr."""
    width = 30
    done = int(width * i / max(total, 1))
    sys.stderr.write(f"\r[{'#' * done}{'.' * (width - done)}] {i}/{total} {label[:40]:<40}")
    if i == total:
        sys.stderr.write("\n")
    sys.stderr.flush()


def _device(name: str):
    return jax.devices()[0] if name == "default" else jax.devices(name)[0]


def _inputs(n, h, v, dtype, seed=0, device=None):
    r = np.random.default_rng(seed)
    put = lambda x: jax.device_put(x, device)
    return (put(jnp.asarray(r.standard_normal((n, h)), dtype)),
            put(jnp.asarray(r.standard_normal((v, h)) * 3 / np.sqrt(h), dtype)),
            put(jnp.asarray(np.where(r.random(n) < 0.1, -100, r.integers(0, v, n)), jnp.int32)))


def _oracle64(h, w, t):
    """float64 logp and entropy from the operands' exact values."""
    h64, w64 = np.asarray(h, np.float64), np.asarray(w, np.float64)
    z = h64 @ w64.T
    m = z.max(1, keepdims=True)
    lse = (m + np.log(np.exp(z - m).sum(1, keepdims=True)))[:, 0]
    p = np.exp(z - lse[:, None])
    t = np.asarray(t)
    keep = t != -100
    logp = np.where(keep, z[np.arange(len(t)), np.where(keep, t, 0)] - lse, 0.0)
    return logp, np.where(keep, lse - (p * z).sum(1), 0.0)


def _grad_err(h, w, t, mode, backward, ref_grads) -> float:
    """Largest norm-relative error of d(sum logp)/d(hidden, weight) against ref_grads."""
    g = jax.grad(lambda a, b: jnp.sum(linear_logp(a, b, t, mode=mode, backward=backward)), argnums=(0, 1))(h, w)
    return max(float(np.linalg.norm(np.asarray(a, np.float32) - np.asarray(b, np.float32)) /
                     np.linalg.norm(np.asarray(b, np.float32))) for a, b in zip(g, ref_grads))


def check(device_name: str = "default") -> int:
    """Each route against float64 on a few odd shapes, plus determinism and batch invariance."""
    dev = _device(device_name)
    print(f"rlk_xla check: jax {jax.__version__}, device {dev.device_kind} ({dev.platform}); compiled: "
          f"xla_ffi={core.has_xla_ffi} cuda={core.has_cuda}; FFI targets for {', '.join(registered_platforms())}")
    rows, ok = [], True
    shapes = [(1, 64, 1000), (127, 96, 1000), (1000, 256, 4104)]
    cases = [(s, dt, mode) for s in shapes for dt in ("bfloat16", "float32") for mode in ("strict", "off")]
    for i, ((n, h, v), dt, mode) in enumerate(cases):
        progress(i, len(cases), f"{mode} {dt} N={n} V={v}")
        hh, ww, tt = _inputs(n, h, v, jnp.dtype(dt), seed=i, device=dev)
        f = jax.jit(lambda a, b, c, mode=mode: linear_logp(a, b, c, return_entropy=True, mode=mode))
        reset_route_stats()
        lp, ent = f(hh, ww, tt)
        lp2, _ = f(hh, ww, tt)
        sub = slice(n // 3, n // 3 + max(1, n // 4))
        lp_sub, _ = f(hh[sub], ww, tt[sub])
        ref_lp, ref_ent = _oracle64(hh.astype(jnp.float32), ww.astype(jnp.float32), tt)
        gr = jax.grad(lambda a, b: jnp.sum(reference.linear_logp(a.astype(jnp.float32), b.astype(jnp.float32), tt)),
                      argnums=(0, 1))(hh, ww)
        fused = mode != "off"  # the consistency promises are the fused kernels'; the reference is shown
        # the fused op's gradient with each backward strategy (the reference has one)
        err_g = {b: _grad_err(hh, ww, tt, mode, b, gr) for b in (("fast", "lean") if fused else ("lean",))}
        err_lp = float(np.max(np.abs(np.asarray(lp) - ref_lp)))
        err_ent = float(np.max(np.abs(np.asarray(ent) - ref_ent)))
        det = bool(np.array_equal(np.asarray(lp), np.asarray(lp2)))
        inv = bool(np.array_equal(np.asarray(lp_sub), np.asarray(lp)[sub]))
        stats = route_stats()
        route = "reference" if mode == "off" else ",".join(k for k, c in stats["backends"].items() if c["fwd_calls"])
        # Gradients are compared with the fp32 reference's: both carry the output dtype's rounding
        # (bf16 2^-8) and fp32 accumulation in different orders.
        grad_tol = 2.0 ** -7 if dt == "bfloat16" else 1e-3
        passed = (err_lp < 1e-4 and err_ent < 1e-4 and max(err_g.values()) < grad_tol and stats["fallback_total"] == 0
                  and (det and inv or not fused))
        ok &= passed
        yes_no = lambda b: "yes" if b else ("NO" if fused else "no")
        rows.append((route, dt, f"{n}x{h}x{v}", f"{err_lp:.1e}", f"{err_ent:.1e}",
                     " / ".join(f"{e:.1e}" for e in err_g.values()),
                     yes_no(det), yes_no(inv), "PASS" if passed else "FAIL"))
    progress(len(cases), len(cases), "done")
    _table(("route", "dtype", "NxHxV", "|dlogp| max", "|dent| max", "grad rel err (fast / lean)", "repeat bitwise",
            "batch invariant", "result"), rows)
    print("check:", "PASS" if ok else "FAIL")
    return 0 if ok else 1


def time_ms(fn, *args, iters: int = 10, batch: int = 1) -> float:
    """Median time (ms) per call of a JAX callable, after one warm-up call. Each of `iters` samples
    issues `batch` calls back to back and waits once, then `2 * batch` calls and waits once: their
    difference per extra call cancels what a sample pays once (the first call's dispatch, the final
    sync), as CUDA events do for do_bench on the torch side. (One call per sample, as before, counted
    that latency in every call of 10 ms or more.)"""
    jax.block_until_ready(fn(*args))

    def wall(calls: int) -> float:
        t0 = time.perf_counter()
        for _ in range(calls - 1):
            fn(*args)
        jax.block_until_ready(fn(*args))
        return time.perf_counter() - t0

    ts = [(wall(2 * batch) - wall(batch)) / batch for _ in range(iters)]
    return float(np.median(ts)) * 1e3


def _temp_mb(fn, *args) -> float:
    return fn.lower(*args).compile().memory_analysis().temp_size_in_bytes / 2 ** 20


def bench(shapes, device_name: str, dtype: str, iters: int) -> int:
    """Fused vs reference: forward and forward+backward time (median ms) and XLA temp memory."""
    dev = _device(device_name)
    print(f"rlk_xla bench: jax {jax.__version__}, {dev.device_kind} ({dev.platform}), {dtype}, median of {iters}")
    parsed = []
    for s in shapes:
        parsed.append((s, SHAPES[s]) if s in SHAPES else (s, tuple(int(x) for x in s.split(","))))
    rows, steps = [], len(parsed) * 5
    step = 0
    for name, (n, h, v) in parsed:
        hh, ww, tt = _inputs(n, h, v, jnp.dtype(dtype), device=dev)
        res = {}
        progress(step, steps, f"{name}: gemm")
        res["gemm"] = time_ms(jax.jit(lambda a, b: a @ b.T), hh, ww, iters=iters)
        step += 1
        for label, fn in (("fused", linear_logp), ("reference", reference.linear_logp)):
            fwd = jax.jit(lambda a, b, fn=fn: fn(a, b, tt))
            fb = jax.jit(jax.grad(lambda a, b, fn=fn: jnp.sum(fn(a, b, tt)), argnums=(0, 1)))
            progress(step, steps, f"{name}: {label} fwd")
            res[label, "fwd"] = time_ms(fwd, hh, ww, iters=iters)
            step += 1
            progress(step, steps, f"{name}: {label} fwd+bwd")
            res[label, "fb"] = time_ms(fb, hh, ww, iters=iters)
            res[label, "mem"] = _temp_mb(fb, hh, ww)
            step += 1
        rows.append((name, f"{n}x{h}x{v}", f"{res['gemm']:.2f}",
                     f"{res['fused', 'fwd']:.2f}", f"{res['reference', 'fwd']:.2f}",
                     f"{res['fused', 'fwd'] / res['reference', 'fwd']:.2f}",
                     f"{res['fused', 'fb']:.2f}", f"{res['reference', 'fb']:.2f}",
                     f"{res['fused', 'fb'] / res['reference', 'fb']:.2f}",
                     f"{res['fused', 'mem']:.1f}", f"{res['reference', 'mem']:.1f}"))
    progress(steps, steps, "done")
    _table(("shape", "NxHxV", "GEMM ms", "fused fwd ms", "ref fwd ms", "fwd ratio", "fused f+b ms", "ref f+b ms",
            "f+b ratio", "fused f+b temp MB", "ref f+b temp MB"), rows)
    return 0


def _table(header, rows) -> None:
    widths = [max(len(str(x)) for x in col) for col in zip(header, *rows)]
    line = lambda r: "| " + " | ".join(str(x).ljust(w) for x, w in zip(r, widths)) + " |"
    print(line(header))
    print("|" + "|".join("-" * (w + 2) for w in widths) + "|")
    for r in rows:
        print(line(r))
