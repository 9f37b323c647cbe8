"""The main job: `check` (is this build right on this machine?) and `bench` (how fast, how lean)."""
from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import numpy as np

import rlk_common as common
from rlk_common.progress import Progress

from . import linear_logp, reference, reset_route_stats, route_stats
from ._core import core, registered_platforms

# docs/design.md §6, after the CPU shape of the core issue.
SHAPES = {"small": (512, 1024, 32000), **common.SHAPES}


def device(name: str):
    """The first JAX device of a platform name ("default": JAX's default); RuntimeError if there is none."""
    return jax.devices()[0] if name == "default" else jax.devices(name)[0]


def parse_shape(text: str) -> tuple[str, tuple[int, int, int]]:
    """A named shape or "N,H,V" (positive integers) -> (name, (n, h, v)); ValueError otherwise."""
    if text in SHAPES:
        return text, SHAPES[text]
    parts = text.split(",")
    if len(parts) != 3 or not all(x.strip().isdigit() and int(x) > 0 for x in parts):
        raise ValueError(f"{text!r} is neither a named shape ({', '.join(SHAPES)}) nor N,H,V of positive integers")
    return text, tuple(int(x) for x in parts)


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
    dev = device(device_name)
    print(f"rlk_xla check: jax {jax.__version__}, device {dev.device_kind} ({dev.platform}); compiled: "
          f"xla_ffi={core.has_xla_ffi} cuda={core.has_cuda} cpu_isa={core.cpu_isa}; FFI targets for {', '.join(registered_platforms())}")
    rows, ok = [], True
    shapes = [(1, 64, 1000), (127, 96, 1000), (1000, 256, 4104)]
    cases = [(s, dt, mode) for s in shapes for dt in ("bfloat16", "float32") for mode in ("strict", "off")]
    bar = Progress(len(cases))
    for i, ((n, h, v), dt, mode) in enumerate(cases):
        bar.set(i, f"{mode} {dt} N={n} V={v}")
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
    bar.set(len(cases), "done")
    _table(("route", "dtype", "NxHxV", "|dlogp| max", "|dent| max", "grad rel err (fast / lean)", "repeat bitwise",
            "batch invariant", "result"), rows)
    print("check:", "PASS" if ok else "FAIL")
    return 0 if ok else 1


def _wall(fn, args, calls: int) -> float:
    t0 = time.perf_counter()
    for _ in range(calls - 1):
        fn(*args)
    jax.block_until_ready(fn(*args))
    return time.perf_counter() - t0


def sample_ms(fn, *args, batch: int = 1) -> float:
    """One timing sample (ms per call) of a JAX callable: `batch` calls back to back then one wait,
    then `2 * batch` calls and one wait; their difference per extra call cancels what a sample pays
    once (the first call's dispatch, the final sync), as CUDA events do for do_bench on the torch side."""
    return (_wall(fn, args, 2 * batch) - _wall(fn, args, batch)) / batch * 1e3


def time_ms(fn, *args, iters: int = 10, batch: int = 1) -> float:
    """Median of `iters` samples (sample_ms) after one warm-up call."""
    jax.block_until_ready(fn(*args))
    return float(np.median([sample_ms(fn, *args, batch=batch) for _ in range(iters)]))


def time_pair(fused, ref, args, iters: int, warmup: int = 2, min_sample_s: float = 0.05, tick=lambda: None):
    """Samples of two callables taken alternately (fused, reference, fused, ...), so that a change in
    the machine's load (shared CPUs) hits both alike. A sample times enough calls back to back (then
    one wait) to last about `min_sample_s`, so the wait's latency is a small part of it. `tick()` after
    each pair. -> (fused ms, reference ms, fused / reference per pair), each a list of `iters`."""
    batch = []
    for fn in (fused, ref):
        for _ in range(warmup):
            jax.block_until_ready(fn(*args))
        batch.append(max(1, int(np.ceil(min_sample_s / _wall(fn, args, 1)))))
    f, r = [], []
    for _ in range(iters):
        f.append(_wall(fused, args, batch[0]) / batch[0] * 1e3)
        r.append(_wall(ref, args, batch[1]) / batch[1] * 1e3)
        tick()
    return f, r, [a / b for a, b in zip(f, r)]


def _spread(xs) -> str:
    """median, then min-max and the spread (max - min) / median in percent."""
    med = float(np.median(xs))
    return f"{med:.2f} ({min(xs):.2f}-{max(xs):.2f}, {100 * (max(xs) - min(xs)) / med:.0f}%)"


def _temp_mb(fn, *args) -> float:
    return fn.lower(*args).compile().memory_analysis().temp_size_in_bytes / 2 ** 20


RATIO_NOTE = ("fused/ref = fused ms / reference ms of samples taken back to back (alternating), median over "
              "the pairs (min-max); lower is better, < 1 means the fused op is faster. Times: median (min-max, "
              "spread = (max - min) / median). reference = rlk_xla.reference.linear_logp (plain XLA) under jit.")


def bench(shapes, device_name: str, dtype: str, iters: int) -> int:
    """Fused vs reference: forward and forward+backward time and XLA temp memory; the bare GEMM for scale."""
    dev = device(device_name)
    print(f"rlk_xla bench: jax {jax.__version__}, {dev.device_kind} ({dev.platform}), {dtype}, "
          f"{iters} samples each after 2 warm-up calls")
    parsed = [parse_shape(s) for s in shapes]
    rows = []
    bar = Progress(len(parsed) * 3)  # per shape: the GEMM, fwd, fwd+bwd; each advanced sample by sample
    for i, (name, (n, h, v)) in enumerate(parsed):
        hh, ww, tt = _inputs(n, h, v, jnp.dtype(dtype), device=dev)
        bar.set(3 * i, f"{name}: gemm")
        gemm = jax.jit(lambda a, b: jnp.dot(a, b.T, preferred_element_type=jnp.float32))
        gemm_iters = 1 + iters // 2
        gemm_ms = time_pair(gemm, gemm, (hh, ww), gemm_iters,
                            tick=lambda: bar.advance(1 / gemm_iters, f"{name}: gemm"))[0]
        for j, (label, wrap) in enumerate((("fwd", jax.jit), ("fwd+bwd", None))):
            bar.set(3 * i + 1 + j, f"{name}: {label}")
            if wrap:
                fused, ref = (jax.jit(lambda a, b, fn=fn: fn(a, b, tt)) for fn in (linear_logp, reference.linear_logp))
            else:
                fused, ref = (jax.jit(jax.grad(lambda a, b, fn=fn: jnp.sum(fn(a, b, tt)), argnums=(0, 1)))
                              for fn in (linear_logp, reference.linear_logp))
            f, r, ratio = time_pair(fused, ref, (hh, ww), iters,
                                    tick=lambda label=label: bar.advance(1 / iters, f"{name}: {label}"))
            mem = (f"{_temp_mb(fused, hh, ww):.1f}", f"{_temp_mb(ref, hh, ww):.1f}")
            rows.append((name, f"{n}x{h}x{v}", label, _spread(gemm_ms) if j == 0 else "", _spread(f), _spread(r),
                         f"{np.median(ratio):.2f} ({min(ratio):.2f}-{max(ratio):.2f})", *mem))
    bar.set(3 * len(parsed), "done")
    _table(("shape", "NxHxV", "pass", "GEMM ms", "fused ms", "reference ms", "fused/ref (lower is better)",
            "fused temp MB", "ref temp MB"), rows)
    print(RATIO_NOTE)
    print("GEMM = XLA's jnp.dot(hidden, weight.T) of the same shape and dtype with fp32 accumulation "
          "(preferred_element_type=float32): one forward matmul, no softmax, for scale. "
          "temp MB = XLA's temp allocation of the jitted call.")
    return 0


def _table(header, rows) -> None:
    widths = [max(len(str(x)) for x in col) for col in zip(header, *rows)]
    line = lambda r: "| " + " | ".join(str(x).ljust(w) for x, w in zip(r, widths)) + " |"
    print(line(header))
    print("|" + "|".join("-" * (w + 2) for w in widths) + "|")
    for r in rows:
        print(line(r))
