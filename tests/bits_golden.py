"""Bit-equality harness: a fixed set of calls through both frontends on the CPU, each call's outputs
reduced to a sha256 digest and compared with tests/golden/bits.json (tests/test_bits_golden.py).

A refactor that must not change a single output bit (issue 46) runs it before and after. The golden
file keeps the 16-bit operands' digests ("half") apart from the float32 ones ("fp32"), so a change
that legitimately moves only one family (e.g. the CPU's fp32 accumulation) refreshes only that part:

    PYTHONPATH=$PWD python3 tests/bits_golden.py --write fp32     # or: half, all

The calls: forward (logp, entropy) with bias, per-token temperature, ignored rows and padded vocab;
the fast and the lean backward (every gradient); a vmapped call (the FFI's batch folding); a
tensor-parallel-shaped pair of shards (stats at a vocab offset, their combine, each shard's backward);
the torch-only nucleus (keep_mask) and its gradients; the rollout scorer's single rows. Odd shapes:
n = 1, 3, 127; V = 1000 (not a multiple of any tile) with 997 real ids; H = 72, and H = 264 (past
the CPU's 128-step fp32 chains) for a forward and both backwards.
"""
from __future__ import annotations

import hashlib
import json
import os
import pathlib
import sys

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import numpy as np

GOLDEN = pathlib.Path(__file__).with_name("golden") / "bits.json"
DTYPES = ("bfloat16", "float16", "float32")
PARTS = {"half": ("bfloat16", "float16"), "fp32": ("float32",)}
N, H, V, REAL = 127, 72, 1000, 997
WIDE_H = 264


def part_of(dtype: str) -> str:
    return next(p for p, ds in PARTS.items() if dtype in ds)


def _bytes(x) -> bytes:
    """The raw bits of an array (jax, torch or numpy), 16-bit floats as their uint16 words."""
    if hasattr(x, "detach"):  # torch
        import torch
        t = x.detach().contiguous().cpu()
        if t.dtype in (torch.bfloat16, torch.float16):
            t = t.view(torch.int16)
        a = t.numpy()
    else:
        a = np.asarray(x)
        if a.dtype.itemsize == 2 and a.dtype.kind not in "iu":
            a = a.view(np.uint16)
    return f"{a.dtype.str}{a.shape}".encode() + np.ascontiguousarray(a).tobytes()


def digest(*outputs) -> str:
    h = hashlib.sha256()
    for x in outputs:
        h.update(_bytes(x))
    return h.hexdigest()


def _inputs(seed: int, n: int, dtype: str, h: int = H):
    """numpy inputs: hidden [n, H], weight [V, H], bias [V], targets [n] (some ignored), temperature [n]
    (some small), g, e [n]; and a nucleus keep [n, V] (top 60% of a random score per row)."""
    rng = np.random.default_rng(seed)
    hidden = rng.standard_normal((n, h)).astype(np.float32)
    weight = (rng.standard_normal((V, h)) * 4.0 / np.sqrt(h)).astype(np.float32)
    bias = rng.standard_normal(V).astype(np.float32)
    targets = rng.integers(0, REAL, size=n).astype(np.int32)
    targets[rng.random(n) < 0.1] = -100
    temperature = rng.uniform(0.3, 2.0, size=n).astype(np.float32)
    temperature[::17] = 1e-2
    g = rng.standard_normal(n).astype(np.float32)
    e = rng.standard_normal(n).astype(np.float32)
    score = rng.random((n, V))
    keep = score < np.quantile(score, 0.6, axis=1, keepdims=True)
    keep[np.arange(n), np.where(targets >= 0, targets, 0)] |= rng.random(n) < 0.8
    return dict(hidden=hidden, weight=weight, bias=bias, targets=targets, temperature=temperature, g=g, e=e,
                keep=keep)


def jax_cases(dtype: str) -> dict[str, str]:
    import jax
    import jax.numpy as jnp
    from jax.sharding import Mesh

    import rlk_xla
    from rlk_xla import rollout

    dt = jnp.dtype(dtype)
    out = {}
    x = _inputs(1, N, dtype)
    hidden, weight = jnp.asarray(x["hidden"], dt), jnp.asarray(x["weight"], dt)
    bias, targets = jnp.asarray(x["bias"], dt), jnp.asarray(x["targets"])
    temp, g, e = jnp.asarray(x["temperature"]), jnp.asarray(x["g"]), jnp.asarray(x["e"])
    kw = dict(bias=bias, temperature=temp, real_vocab_size=REAL, return_entropy=True, mode="strict")

    out["jax.forward"] = digest(*rlk_xla.linear_logp(hidden, weight, targets, **kw))
    for bwd in ("fast", "lean"):
        def loss(hd, w, b, t, bwd=bwd):
            lp, en = rlk_xla.linear_logp(hd, w, targets, **{**kw, "bias": b, "temperature": t}, backward=bwd)
            return jnp.sum(lp * g) + jnp.sum(en * e)
        out[f"jax.grad_{bwd}"] = digest(*jax.grad(loss, argnums=(0, 1, 2, 3))(hidden, weight, bias, temp))
    # vmap: a batch of 2 over the rows (batch folding in the FFI handlers), forward and lean grad.
    hb, tb = hidden[:126].reshape(2, 63, H), targets[:126].reshape(2, 63)
    f = jax.vmap(lambda hd, t: rlk_xla.linear_logp(hd, weight, t, bias=bias, real_vocab_size=REAL,
                                                   return_entropy=True, mode="strict"))
    out["jax.vmap_forward"] = digest(*f(hb, tb))
    gv = jax.vmap(jax.grad(lambda hd, w, t: jnp.sum(rlk_xla.linear_logp(hd, w, t, real_vocab_size=REAL,
                                                                       mode="strict", backward="lean")),
                           argnums=(0, 1)), in_axes=(0, None, 0))
    out["jax.vmap_grad_lean"] = digest(*gv(hb, weight, tb))
    # Two vocab shards over a mesh (stats at a vocab offset, the combine, each shard's backward).
    mesh = Mesh(np.array(jax.devices()[:2]), ("tp",))
    for bwd in ("fast", "lean"):
        def tp_loss(hd, w, b, bwd=bwd):
            lp, en = rlk_xla.vocab_parallel_linear_logp(hd, w, targets, mesh=mesh, bias=b, temperature=temp,
                                                        real_vocab_size=REAL, return_entropy=True, mode="strict",
                                                        backward=bwd)
            return jnp.sum(lp * g) + jnp.sum(en * e), (lp, en)
        (_, fw), grads = jax.value_and_grad(tp_loss, argnums=(0, 1, 2), has_aux=True)(hidden, weight, bias)
        out[f"jax.tp2_{bwd}"] = digest(*fw, *grads)
    for n in (1, 3):
        r = _inputs(2 + n, n, dtype)
        lp, en = rollout.score_sampled(jnp.asarray(r["hidden"], dt), weight, jnp.asarray(r["targets"]),
                                       temperature=jnp.asarray(r["temperature"]), bias=bias,
                                       real_vocab_size=REAL, return_entropy=True)
        out[f"jax.rollout_n{n}"] = digest(lp, en)
    w = _inputs(9, 33, dtype, WIDE_H)
    hw, ww, tw = jnp.asarray(w["hidden"], dt), jnp.asarray(w["weight"], dt), jnp.asarray(w["targets"])
    for bwd in ("fast", "lean"):
        def wide(hd, wt, bwd=bwd):
            lp, en = rlk_xla.linear_logp(hd, wt, tw, real_vocab_size=REAL, return_entropy=True, mode="strict",
                                         backward=bwd)
            return jnp.sum(lp) + jnp.sum(en), (lp, en)
        (_, fw), grads = jax.value_and_grad(wide, argnums=(0, 1), has_aux=True)(hw, ww)
        out[f"jax.wide_h_{bwd}"] = digest(*fw, *grads)
    return out


def torch_cases(dtype: str) -> dict[str, str]:
    import torch

    import torch_bridge
    from torch_bridge import rollout

    dt = getattr(torch, dtype)
    out = {}
    x = _inputs(1, N, dtype)

    def leaf(a, dtype_=dt):
        return torch.tensor(a).to(dtype_).requires_grad_(True)

    targets, g, e = torch.tensor(x["targets"]), torch.tensor(x["g"]), torch.tensor(x["e"])
    keep = torch.tensor(x["keep"])
    kw = dict(real_vocab_size=REAL, return_entropy=True, mode="strict")
    for bwd in ("fast", "lean"):
        for nucleus in (False, True):
            hd, w, b, t = leaf(x["hidden"]), leaf(x["weight"]), leaf(x["bias"]), leaf(x["temperature"], torch.float32)
            lp, en = torch_bridge.linear_logp(hd, w, targets, bias=b, temperature=t, backward=bwd,
                                              keep_mask=keep if nucleus else None, **kw)
            (torch.sum(lp * g) + torch.sum(en * e)).backward()
            name = ("torch.keep_" if nucleus else "torch.") + bwd
            out[name] = digest(lp, en, hd.grad, w.grad, b.grad, t.grad)
    # Two vocab shards as the TP path runs them (the low-level ops): each shard's stats at its vocab
    # offset, placed at its chunks' offset, one combine, each shard's backward (dhidden f32 partial).
    hd = torch.tensor(x["hidden"]).to(dt)
    w, b32 = torch.tensor(x["weight"]).to(dt), torch.tensor(x["bias"])
    temp = torch.tensor(x["temperature"])
    chunk, half = V // 8, V // 2
    for fast in (True, False):
        shards = [torch.ops.rlk.forward_stats(hd, w[s:s + half], b32[s:s + half], targets, temp, s, REAL, chunk,
                                              -100, True, fast) for s in (0, half)]
        stats = torch.cat([st for st, *_ in shards], dim=1)
        tl = sum(t_ for _, t_, *_ in shards)
        lp, en, m, log_s, _ = torch.ops.rlk.combine(stats, tl, targets, REAL, -100)
        grads = []
        for s, (_, _, kept, _) in zip((0, half), shards):
            grads += torch.ops.rlk.linear_logp_backward(hd, w[s:s + half], b32[s:s + half], targets, temp, m, log_s,
                                                        en, g, e, kept, s, REAL, chunk, -100, True)
        out[f"torch.tp2_{'fast' if fast else 'lean'}"] = digest(stats, tl, lp, en, m, log_s, *grads)
    for n in (1, 3):
        r = _inputs(2 + n, n, dtype)
        lp, en = rollout.score_sampled(torch.tensor(r["hidden"]).to(dt), w, torch.tensor(r["targets"]),
                                       temperature=torch.tensor(r["temperature"]), bias=b32.to(dt),
                                       real_vocab_size=REAL, return_entropy=True)
        out[f"torch.rollout_n{n}"] = digest(lp, en)
    w = _inputs(9, 33, dtype, WIDE_H)
    for bwd in ("fast", "lean"):
        hd, wt = leaf(w["hidden"]), leaf(w["weight"])
        lp, en = torch_bridge.linear_logp(hd, wt, torch.tensor(w["targets"]), backward=bwd, **kw)
        (lp.sum() + en.sum()).backward()
        out[f"torch.wide_h_{bwd}"] = digest(lp, en, hd.grad, wt.grad)
    return out


def compute(dtypes=DTYPES, frontends=("jax", "torch")) -> dict[str, dict[str, str]]:
    """{part: {"<dtype>/<frontend>.<call>": digest}} for the given dtypes."""
    out: dict[str, dict[str, str]] = {}
    for dtype in dtypes:
        for fe in frontends:
            cases = jax_cases(dtype) if fe == "jax" else torch_cases(dtype)
            out.setdefault(part_of(dtype), {}).update({f"{dtype}/{k}": v for k, v in cases.items()})
    return out


def load() -> dict[str, dict[str, str]]:
    return json.loads(GOLDEN.read_text())


def write(parts) -> None:
    golden = load() if GOLDEN.exists() else {}
    fresh = compute([d for p in parts for d in PARTS[p]])
    golden.update({p: dict(sorted(fresh[p].items())) for p in parts})
    GOLDEN.parent.mkdir(exist_ok=True)
    GOLDEN.write_text(json.dumps(golden, indent=1, sort_keys=True) + "\n")
    print(f"wrote {', '.join(parts)} of {GOLDEN}")


if __name__ == "__main__":
    args = sys.argv[1:]
    if len(args) != 2 or args[0] != "--write" or args[1] not in ("half", "fp32", "all"):
        sys.exit("usage: PYTHONPATH=$PWD python3 tests/bits_golden.py --write half|fp32|all")
    write(list(PARTS) if args[1] == "all" else [args[1]])
