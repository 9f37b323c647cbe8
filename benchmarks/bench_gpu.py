"""Side-by-side GPU benchmark of linear_logp, one process, every shape of docs/design.md §6.

Per shape, in the same run: the cuBLAS bf16 GEMM of the same shape (the floor, torch matmul), and
every path of PATHS that is installed:
  rlk_xla_fast, rlk_xla_lean          this project through JAX, backward="fast" (keeps the fp16
                                      logits of the forward) or backward="lean" (recomputes them)
  torch_bridge_fast, torch_bridge_lean  the same kernels through PyTorch
  jax_ref, jax_chunked, tokamax       JAX peers (materialized logits; lax.map + remat; Tokamax)
  torch_native, liger, cce            torch peers (materialized logits; Liger FLCE; Cut Cross-Entropy)
The fast and lean paths of one frontend run the same forward: it is measured once and reported
on both rows.

Once per run: the sustained bf16 GEMM rate (SUSTAINED_GEMM, the three-GEMM floor's rate in the
report). Per path: forward and forward+backward (gradients of sum(logp * g) w.r.t. hidden and weight)
median times, peak extra memory of forward+backward, the logp error against float64 on 256
sampled rows, and the dH and dW errors against float64 on the first 512 rows (full vocab).
Results go to OUT/benchmarks.json after every shape, with the table and plots of plot_report.py.

    python benchmarks/bench_gpu.py --out docs
    python benchmarks/bench_gpu.py --shapes T3,L16k --paths rlk_xla_fast,rlk_xla_lean,liger --out $OUT
    python benchmarks/bench_gpu.py --skip-accuracy     # no float64 gradients (faster)
    python benchmarks/bench_gpu.py --repeat 3          # this project's paths timed 3 times in turn: medians

Times: torch paths with triton.testing.do_bench (median of at least 10 timed calls, CUDA events); JAX paths with wall time
per call as the difference between k and 2k calls issued back to back, each ending in one
block_until_ready (median of 10; rlk_xla.cli.time_ms), so that neither frontend's host latency
counts. Python's garbage collector is paused while
timing (no_gc).
Memory: torch: the peak allocated during one fwd+bwd step beyond what was live before it (the inputs, and the previous step's
gradients, which the step frees before making its own); JAX: XLA's compiled temp bytes of the
jitted fwd+bwd (arguments and outputs excluded).
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import gc
import importlib.metadata
import json
import os
import statistics
import sys
import time

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # JAX and torch share the GPU here

import rlk_common as common  # noqa: E402
from rlk_common.progress import Progress  # noqa: E402
import torch  # noqa: E402
from triton.testing import do_bench  # noqa: E402

import plot_report  # noqa: E402  (benchmarks/, next to this script)
from plot_report import is_ours  # noqa: E402

PATHS = ("rlk_xla_fast", "rlk_xla_lean", "torch_bridge_fast", "torch_bridge_lean",
         "jax_ref", "jax_chunked", "tokamax", "torch_native", "liger", "cce")
JAX_PATHS = {"rlk_xla_fast", "rlk_xla_lean", "jax_ref", "jax_chunked", "tokamax"}
SHAPES = {name: common.SHAPES[name] for name in  # docs/design.md §6, in the order the report runs them
          ("T3", "H200-pub", "L16k", "T3-tp1", "T1", "T2", "Q8B-tp4")}
LOGP_ROWS = 256  # sampled rows for the logp error
GRAD_ROWS = 512  # leading rows for the dH / dW errors
VERSIONED = ("jax", "jaxlib", "torch", "triton", "liger-kernel", "cut-cross-entropy", "tokamax", "rlk_xla")


# ---- the paths: name -> (forward fn, fwd+bwd fn), each (hidden, weight, targets) -> logp [n] f32 ----

def fused_paths(prefix, linear_logp, **kw):
    """The fast and lean backward of one frontend's fused op, sharing one forward function."""
    def strategy(backward):
        return lambda h, w, t: linear_logp(h, w, t, mode="strict", backward=backward, **kw)
    forward = strategy("lean")  # the lean forward stores nothing for the backward: the bare forward
    return {f"{prefix}_{b}": (forward, strategy(b)) for b in ("fast", "lean")}


def jax_chunked(h, w, t, chunk=1024):
    """A chunked JAX baseline: lax.map over row chunks of the reference, with remat."""
    import jax
    import jax.numpy as jnp

    import rlk_xla
    n = h.shape[0]
    pad = (-n) % chunk
    hp, tp = jnp.pad(h, ((0, pad), (0, 0))), jnp.pad(t, (0, pad))
    one = jax.checkpoint(lambda a: rlk_xla.reference.linear_logp(a[0], w, a[1]))
    return jax.lax.map(one, (hp.reshape(-1, chunk, h.shape[1]), tp.reshape(-1, chunk))).reshape(-1)[:n]


def jax_paths():
    import rlk_xla
    paths = fused_paths("rlk_xla", rlk_xla.linear_logp)
    paths["jax_ref"] = (rlk_xla.reference.linear_logp,) * 2
    paths["jax_chunked"] = (jax_chunked,) * 2
    tokamax = _tokamax()
    if tokamax is not None:
        # tokamax takes the head as [H, V]: the transpose (about 0.1 ms here) is inside its timing
        fn = lambda h, w, t: -tokamax.linear_softmax_cross_entropy_loss(h, t, w.T, reduction="none")  # noqa: E731
        paths["tokamax"] = (fn, fn)
    return paths


UNAVAILABLE: dict[str, str] = {}  # path -> why it could not be built here (the report says so)


def _unavailable(path, e):
    UNAVAILABLE[path] = repr(e)[:200]
    print(f"{path} unavailable:", UNAVAILABLE[path])


def _stub_xprof():
    """Tokamax's benchmarking module imports `xprof.cli.tools.get_kernel_stats_tool` (an undeclared
    profiler dependency, unused here): empty stand-in modules let the import succeed."""
    import types
    parent = None
    for name in ("xprof", "xprof.cli", "xprof.cli.tools", "xprof.cli.tools.get_kernel_stats_tool"):
        mod = sys.modules.setdefault(name, types.ModuleType(name))
        mod.__path__ = getattr(mod, "__path__", [])
        if parent is not None:
            setattr(parent, name.rsplit(".", 1)[1], mod)
        parent = mod


def _tokamax():
    """Tokamax, the JAX kernel library (see _stub_xprof)."""
    _stub_xprof()
    try:
        import tokamax
        return tokamax
    except Exception as e:  # noqa: BLE001 - report why and go on without it
        _unavailable("tokamax", e)
        return None


def torch_native(h, w, t):
    return torch.log_softmax((h @ w.t()).float(), -1).gather(-1, t[:, None])[:, 0]


def torch_paths():
    paths = {"torch_native": (torch_native,) * 2}
    try:
        import torch_bridge
        paths.update(fused_paths("torch_bridge", torch_bridge.linear_logp, validate_targets=False))
    except ImportError as e:
        _unavailable("torch_bridge_fast", e)
        _unavailable("torch_bridge_lean", e)
    try:
        from liger_kernel.ops.fused_linear_cross_entropy import LigerFusedLinearCrossEntropyFunction as F

        def liger(h, w, t):
            out = F.apply(h, w, t, None, None, -100, 0.0, 0.0, "none")
            return -(out[0] if isinstance(out, tuple) else out)
        paths["liger"] = (liger, liger)
    except ImportError as e:
        _unavailable("liger", e)
    try:
        from cut_cross_entropy import linear_cross_entropy
        fn = lambda h, w, t: -linear_cross_entropy(h, w, t, reduction="none", filter_eps=None)  # noqa: E731
        paths["cce"] = (fn, fn)
    except ImportError as e:
        _unavailable("cce", e)
    return paths


# ---- the frontends: how a path is timed, weighed and differentiated ----

def bench_ms(fn):
    """do_bench's median over at least 10 timed calls. Its rep is a time (150 ms by default), so a
    95 ms step (L16k) was timed by one call, and the first call of a path is slower than the
    later ones (cuBLASLt's tuning, allocator growth)."""
    fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    one_ms = (time.perf_counter() - t0) * 1e3
    return do_bench(fn, warmup=max(25, 2 * one_ms), rep=max(150, 10 * one_ms), return_mode="median")


class Torch:
    name = "torch"

    @staticmethod
    def forward(fn, h, w, t):
        """(median ms, logp) of fn without autograd."""
        with torch.no_grad():
            logp = fn(h, w, t).float()
            return bench_ms(lambda: fn(h, w, t)), logp

    @staticmethod
    def fwd_bwd(fn, h, w, t, g):
        """(median ms, peak extra MB allocated, peak extra MB reserved by the caching allocator) of
        one training step."""
        def step():
            h.grad = w.grad = None
            torch.autograd.backward(fn(h, w, t), g)
        step()
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()  # inputs and the previous step's gradients
        base_reserved = torch.cuda.memory_reserved()
        step()
        torch.cuda.synchronize()
        mem_mb = (torch.cuda.max_memory_allocated() - base) / 2 ** 20
        reserved_mb = (torch.cuda.max_memory_reserved() - base_reserved) / 2 ** 20
        return bench_ms(step), mem_mb, reserved_mb

    @staticmethod
    def grads(fn, h, w, t, g):
        h, w = h.detach().requires_grad_(), w.detach().requires_grad_()
        return torch.autograd.grad(fn(h, w, t), (h, w), g)


class Jax:
    name = "jax"

    @staticmethod
    def forward(fn, h, w, t):
        import jax
        f, args = jax.jit(fn), _to_jax(h, w, t.int())
        return _time_ms(f, *args), torch.from_dlpack(f(*args))

    @staticmethod
    def fwd_bwd(fn, h, w, t, g):
        f, args = _jax_grad(fn), _to_jax(h, w, t.int(), g)
        return _time_ms(f, *args), f.lower(*args).compile().memory_analysis().temp_size_in_bytes / 2 ** 20, None

    @staticmethod
    def grads(fn, h, w, t, g):
        return tuple(torch.from_dlpack(d) for d in _jax_grad(fn)(*_to_jax(h, w, t.int(), g)))


def _to_jax(*xs):
    import jax
    jax.devices()  # start JAX's GPU client first: on a multi-GPU host it can leave another device current
    torch.cuda.set_device(xs[0].device)  # for torch's DLPack export and its memory statistics
    return tuple(jax.dlpack.from_dlpack(x.detach()) for x in xs)


def _jax_grad(fn):
    import jax
    import jax.numpy as jnp
    return jax.jit(jax.grad(lambda h, w, t, g: jnp.sum(fn(h, w, t) * g), argnums=(0, 1)))


def _time_ms(f, *args):
    """Device time per call: batches of back to back calls (about 20 ms, and twice that, per
    sample), so that JAX's dispatch and sync latency does not count, as for do_bench's torch timings."""
    from rlk_xla.cli import time_ms
    one = time_ms(f, *args, iters=3)
    return time_ms(f, *args, iters=10, batch=max(1, min(100, int(20 / max(one, 1e-3)))))


def rlk_xla_route(h, w, t):
    """The rlk_xla backend(s) that ran the forward (e.g. cuda_sm90)."""
    import jax

    import rlk_xla
    rlk_xla.reset_route_stats()
    jax.block_until_ready(jax.jit(lambda *a: rlk_xla.linear_logp(*a, mode="strict"))(*_to_jax(h, w, t.int())))
    return ",".join(k for k, v in rlk_xla.route_stats()["backends"].items() if v["fwd_calls"])


# ---- one shape ----

@dataclasses.dataclass
class Case:
    h: torch.Tensor
    w: torch.Tensor
    t: torch.Tensor
    g: torch.Tensor
    sample: torch.Tensor  # rows of the logp error
    logp_ref: torch.Tensor  # float64 logp of those rows
    grad_inputs: tuple | None = None  # (h, w, t, g) of the leading GRAD_ROWS rows
    grad_ref: tuple | None = None  # their float64 (dH, dW)


def logp64(h, w, t):
    return torch.log_softmax(h.double() @ w.double().t(), -1).gather(-1, t[:, None])[:, 0]


def grads64(h, w, t, g):
    h64, w64 = h.double().requires_grad_(), w.double().requires_grad_()
    return torch.autograd.grad(logp64(h64, w64, t), (h64, w64), g.double())


def rel_err(x, ref):
    return float((x.double() - ref).norm() / ref.norm())


def make_case(n, hd, v, accuracy):
    torch.manual_seed(0)
    h = torch.randn(n, hd, device="cuda").bfloat16().requires_grad_()
    w = (torch.randn(v, hd, device="cuda") * hd ** -0.5).bfloat16().requires_grad_()
    t = torch.randint(0, v, (n,), device="cuda")
    g = torch.randn(n, device="cuda")
    sample = torch.randperm(n, device="cuda")[:LOGP_ROWS]
    with torch.no_grad():
        case = Case(h, w, t, g, sample, logp64(h[sample], w, t[sample]))
    if accuracy:
        m = min(GRAD_ROWS, n)
        case.grad_inputs = (h[:m].detach(), w.detach(), t[:m], g[:m])
        case.grad_ref = grads64(*case.grad_inputs)
    return case


@contextlib.contextmanager
def no_gc():
    """Python's garbage collector paused, as timeit does: this process holds every peer's modules
    and compiled functions, so a collection that a call happens to trigger costs far more here than
    in a training loop, and lands on whichever path is being timed."""
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


def measure(frontend, fwd, train, case, fwd_cache, stage=lambda what: None):
    """One path's numbers (timed with the garbage collector paused). A failing stage is recorded
    under "error" and ends the path; what was measured before it stays. `stage(what)` after each of
    its three stages (forward, forward+backward, gradients), whether it ran or was skipped."""
    r = dict(frontend=frontend.name)
    try:
        if fwd not in fwd_cache:
            with no_gc():
                ms, logp = frontend.forward(fwd, case.h, case.w, case.t)
            fwd_cache[fwd] = dict(fwd_ms=ms, logp_rel=rel_err(logp[case.sample], case.logp_ref))
        r.update(fwd_cache[fwd])
        stage("fwd")
        with no_gc():
            r["fb_ms"], r["fb_mem_mb"], r["fb_reserved_mb"] = frontend.fwd_bwd(train, case.h, case.w, case.t,
                                                                               case.g)
        stage("fwd+bwd")
        if case.grad_ref is not None:
            dh, dw = frontend.grads(train, *case.grad_inputs)
            r.update(dh_rel=rel_err(dh, case.grad_ref[0]), dw_rel=rel_err(dw, case.grad_ref[1]))
    except Exception as e:  # noqa: BLE001 - one broken path must not hide the rest
        r["error"] = repr(e)[:300]
    return r


def retime(frontend, fwd, train, case, fwd_cache):
    """One more (fwd ms, fwd+bwd ms) of a path, the forward shared as in measure."""
    with no_gc():
        if fwd not in fwd_cache:
            fwd_cache[fwd] = frontend.forward(fwd, case.h, case.w, case.t)[0]
        return fwd_cache[fwd], frontend.fwd_bwd(train, case.h, case.w, case.t, case.g)[0]


def bench_shape(name, paths, accuracy, progress, repeat=1):
    """One shape: every path once; with repeat > 1 this project's paths are timed repeat - 1 more
    times, in turn (so that a slow spell of the machine spreads over all of them), and their times
    are the medians, with the ranges kept."""
    n, hd, v = SHAPES[name]
    case = make_case(n, hd, v, accuracy)
    with torch.no_grad():
        gemm_ms = bench_ms(lambda: case.h @ case.w.t())
    results, fwd_cache = {}, {}
    for label, (frontend, fwd, train) in paths.items():
        start = progress.done  # a path is one unit: a third after its forward, two after its fwd+bwd
        results[label] = measure(frontend, fwd, train, case, fwd_cache,
                                 stage=lambda what, label=label: progress.advance(1 / 3, f"{name} {label} {what}"))
        torch.cuda.empty_cache()
        progress.set(start + 1, f"{name} {label}")
    ours = [k for k in paths if is_ours(k) and "error" not in results[k]]
    for k in ours:
        results[k]["fwd_ms_all"], results[k]["fb_ms_all"] = [results[k]["fwd_ms"]], [results[k]["fb_ms"]]
    for _ in range(repeat - 1):
        fwd_cache = {}
        for k in ours:
            fwd_ms, fb_ms = retime(*paths[k], case, fwd_cache)
            results[k]["fwd_ms_all"].append(fwd_ms)
            results[k]["fb_ms_all"].append(fb_ms)
            torch.cuda.empty_cache()
            progress.advance(1, f"{name} {k} again")
    for r in results.values():
        for key in ("fwd", "fb"):
            if key + "_ms_all" in r:
                r[key + "_ms"] = float(statistics.median(r[key + "_ms_all"]))
            if key + "_ms" in r:
                r[key + "_x_gemm"] = r[key + "_ms"] / gemm_ms
    rlk_rows = [results[k] for k in results if k.startswith("rlk_xla")]
    if rlk_rows:
        try:
            route = rlk_xla_route(case.h, case.w, case.t)
        except Exception as e:  # noqa: BLE001
            route = "unknown: " + repr(e)[:100]
        for r in rlk_rows:
            r["route"] = route
    return dict(shape=name, n=n, h=hd, v=v, gemm_ms=gemm_ms, gemm_tflops=2.0 * n * hd * v / gemm_ms / 1e9,
                paths=results)


# ---- the run ----

def select_paths(names):
    """name -> (frontend, forward fn, fwd+bwd fn) of the wanted paths that are installed, in PATHS order."""
    found = {}
    for frontend, build, own in ((Jax, jax_paths, JAX_PATHS), (Torch, torch_paths, set(PATHS) - JAX_PATHS)):
        if own & set(names):  # import a frontend's libraries only when one of its paths is wanted
            found.update({k: (frontend, *fns) for k, fns in build().items() if k in names})
    return {k: found[k] for k in PATHS if k in found}


SUSTAINED_GEMM = 8192  # a square bf16 GEMM of this size runs at the chip's sustained rate


def sustained_tflops():
    """The sustained bf16 GEMM rate of this GPU: a large square torch matmul, do_bench's median."""
    a = torch.randn(SUSTAINED_GEMM, SUSTAINED_GEMM, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(SUSTAINED_GEMM, SUSTAINED_GEMM, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        ms = bench_ms(lambda: a @ b)
    return 2.0 * SUSTAINED_GEMM ** 3 / ms / 1e9


def run_meta(accuracy, wanted):
    versions = {}
    for dist in VERSIONED:
        try:
            versions[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            versions[dist] = None
    return dict(date=datetime.datetime.now().isoformat(timespec="minutes"), gpu=torch.cuda.get_device_name(),
                versions=versions, command=" ".join(["python"] + sys.argv),
                logp_rows=LOGP_ROWS, grad_rows=GRAD_ROWS if accuracy else None,
                sustained=dict(tflops=sustained_tflops(), gemm=f"{SUSTAINED_GEMM}^3 bf16 torch matmul"),
                unavailable={k: why for k, why in UNAVAILABLE.items() if k in wanted})


def parse_args():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shapes", default=",".join(SHAPES), help="comma list of " + ",".join(SHAPES))
    ap.add_argument("--paths", default=",".join(PATHS), help="comma list of " + ",".join(PATHS))
    ap.add_argument("--out", default="docs", help="folder for benchmarks.json, the table and the plots")
    ap.add_argument("--repeat", type=int, default=1,
                    help="time this project's paths this many times in turn and report medians (and ranges)")
    ap.add_argument("--skip-accuracy", action="store_true", help="skip the float64 dH / dW comparison")
    args = ap.parse_args()
    for arg, known in ((args.shapes, SHAPES), (args.paths, PATHS)):
        unknown = set(arg.split(",")) - set(known)
        if unknown:
            ap.error(f"unknown: {','.join(sorted(unknown))}")
    return args


def main():
    args = parse_args()
    os.makedirs(args.out, exist_ok=True)
    wanted = args.paths.split(",")
    paths = select_paths(wanted)
    shapes = args.shapes.split(",")
    meta = run_meta(not args.skip_accuracy, wanted)
    progress = Progress(len(shapes) * (len(paths) + (args.repeat - 1) * sum(map(is_ours, paths))))
    rows = []
    for name in shapes:
        rows.append(bench_shape(name, paths, not args.skip_accuracy, progress, args.repeat))
        torch.cuda.empty_cache()
        data = dict(meta=meta, rows=rows)
        with open(os.path.join(args.out, "benchmarks.json"), "w") as f:
            json.dump(data, f, indent=1)
        plot_report.write_report(data, args.out)  # after every shape: a run cut short still leaves its results
        print(plot_report.shape_table(rows[-1], plot_report.sustained_rate(meta)), flush=True)


if __name__ == "__main__":
    main()
