"""Vocab-parallel linear_logp on real GPUs (JAX): TP = all visible GPUs vs TP = 1, same inputs.

Checks bitwise logp/entropy equality across TP degrees, gradients against float64 on sampled
rows, and times TP forward and forward+backward per shape with the share of the statistics
exchange (the collectives alone, same sizes, same mesh). NVLink multicast stays off.

    python benchmarks/tp_jax.py --out $OUT            # writes tp_jax.json
"""
from __future__ import annotations

import argparse
import json
import os
import sys

for k, v in (("NCCL_NVLS_ENABLE", "0"), ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"), ("NVSHMEM_DISABLE_NVLS", "1"),
             ("XLA_PYTHON_CLIENT_PREALLOCATE", "false")):
    os.environ[k] = v

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P  # noqa: E402

import rlk_xla  # noqa: E402
from rlk_xla._compat import shard_map  # noqa: E402
from rlk_xla.cli import time_ms  # noqa: E402

# (name, tokens, hidden, global vocab); each of the TP ranks holds V / TP rows: T3 is docs/design.md §6's T3 at
# TP = 2 and T3-tp1 sharded at TP = 8; Q8B is Q8B-tp4 at TP = 4.
OUT_DIR = "."
SHAPES = {"T3": (6827, 2048, 151936), "Q8B": (4096, 4096, 151936)}


def timeit(f, *a):
    return time_ms(f, *a, iters=20)


def run_shape(name, n, hd, v, tp, mesh):
    v_local = v // tp
    r = np.random.default_rng(0)
    h = jnp.asarray(r.standard_normal((n, hd)), jnp.bfloat16)
    w = jnp.asarray(r.standard_normal((v, hd)) / np.sqrt(hd), jnp.bfloat16)
    t = jnp.asarray(np.where(r.random(n) < 0.05, -100, r.integers(0, v, n)), jnp.int32)
    g = jnp.asarray(r.standard_normal(n), jnp.float32)
    gpu0 = jax.devices()[0]
    h1, w1, t1, g1 = (jax.device_put(x, gpu0) for x in (h, w, t, g))
    rep = NamedSharding(mesh, P())
    hs, ts_, gs = (jax.device_put(x, rep) for x in (h, t, g))
    ws = jax.device_put(w, NamedSharding(mesh, P("tp")))

    one = lambda h, w: rlk_xla.linear_logp(h, w, t1, return_entropy=True, mode="strict")
    par = lambda h, w: rlk_xla.vocab_parallel_linear_logp(h, w, ts_, mesh=mesh, return_entropy=True, mode="strict")
    out = dict(shape=name, n=n, h=hd, v_local=v_local, v_global=v, tp=tp)
    lp1, en1 = jax.jit(one)(h1, w1)
    lpp, enp = jax.jit(par)(hs, ws)
    out["logp_bitwise_tp1_vs_tp"] = bool(np.array_equal(np.asarray(lp1), np.asarray(lpp)))
    np.save(os.path.join(OUT_DIR, f"tp_jax_{name}_logp.npy"), np.asarray(lpp))
    out["entropy_bitwise_tp1_vs_tp"] = bool(np.array_equal(np.asarray(en1), np.asarray(enp)))

    loss1 = lambda h, w: jnp.sum(one(h, w)[0] * g1)
    lossp = lambda h, w: jnp.sum(par(h, w)[0] * gs)
    dh, dw = jax.jit(jax.grad(lossp, argnums=(0, 1)))(hs, ws)
    rows = np.sort(np.random.default_rng(1).choice(n, 128, replace=False))
    h64, w64 = np.asarray(h, np.float64)[rows], np.asarray(w, np.float64)
    z = h64 @ w64.T
    p = np.exp(z - z.max(1, keepdims=True))
    p /= p.sum(1, keepdims=True)
    tt = np.asarray(t)[rows]
    keep = tt != -100
    delta = np.zeros_like(p)
    delta[np.arange(len(rows))[keep], tt[keep]] = 1
    dz = np.where(keep[:, None], np.asarray(g)[rows][:, None] * (delta - p), 0.0)
    dh_ref = dz @ w64
    out["dh_rel_err"] = float(np.linalg.norm(np.asarray(dh, np.float64)[rows] - dh_ref) / np.linalg.norm(dh_ref))
    logp_ref = np.where(keep, np.log(p[np.arange(len(rows)), np.where(keep, tt, 0)]), 0.0)
    out["logp_rel_err"] = float(np.linalg.norm(np.asarray(lpp)[rows] - logp_ref) / np.linalg.norm(logp_ref))
    del dw

    out["tp1_fwd_ms"] = timeit(jax.jit(lambda h, w: one(h, w)[0]), h1, w1)
    out["tp1_fb_ms"] = timeit(jax.jit(jax.grad(loss1, argnums=(0, 1))), h1, w1)
    out["tp_fwd_ms"] = timeit(jax.jit(lambda h, w: par(h, w)[0]), hs, ws)
    out["tp_fb_ms"] = timeit(jax.jit(jax.grad(lossp, argnums=(0, 1))), hs, ws)
    # The exchange alone: the forward's statistics and target-logit all-reduces and the backward's
    # partial-dH all-reduce, at the sizes the op uses, on the same mesh.
    k = v // rlk_xla._core.core.canonical_chunk(v)
    stats = jax.device_put(jnp.ones((tp, n, k, 3), jnp.float32), NamedSharding(mesh, P("tp")))
    dh_part = jax.device_put(jnp.ones((tp, n, hd), jnp.float32), NamedSharding(mesh, P("tp")))
    fwd_x = jax.jit(shard_map(lambda s: jax.lax.psum(s, "tp"), mesh=mesh, in_specs=P("tp"), out_specs=P()))
    bwd_x = jax.jit(shard_map(lambda d: jax.lax.psum(d, "tp"), mesh=mesh, in_specs=P("tp"), out_specs=P()))
    out["exchange_fwd_ms"] = timeit(fwd_x, stats)
    out["exchange_bwd_dh_ms"] = timeit(bwd_x, dh_part)
    out["exchange_share_of_fb"] = (2 * out["exchange_fwd_ms"] + out["exchange_bwd_dh_ms"]) / out["tp_fb_ms"]
    # the statistics exchange alone (what vocab parallelism adds; the dH all-reduce is every TP head's)
    out["stats_exchange_share_of_fb"] = out["exchange_fwd_ms"] / out["tp_fb_ms"]
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=".")
    ap.add_argument("--shapes", default=",".join(SHAPES))
    args = ap.parse_args()
    global OUT_DIR
    OUT_DIR = args.out
    devs = jax.devices()
    tp = len(devs)
    mesh = Mesh(np.array(devs), ("tp",))
    print(f"{tp} x {devs[0].device_kind}, jax {jax.__version__}", file=sys.stderr)
    rows = [run_shape(s, *SHAPES[s], tp, mesh) for s in args.shapes.split(",")]
    for r in rows:
        print(json.dumps(r), flush=True)
    with open(os.path.join(args.out, "tp_jax.json"), "w") as f:
        json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
