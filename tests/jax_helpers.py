import pytest

pytest.importorskip("jax", reason="jax is not installed: these tests need it")


import functools
import re

import jax
import jax.numpy as jnp
import numpy as np

import oracle

DTYPES = {"bfloat16": jnp.bfloat16, "float16": jnp.float16, "float32": jnp.float32}


def make_inputs(seed, n, h, v, dtype="bfloat16", *, bias=False, temp="scalar", ignore_frac=0.0, real_vocab=None,
                scale=3.0, leading=None):
    """Fresh random inputs (never zeros): hidden ~ N(0, 1), weight ~ N(0, scale^2 / h)."""
    rng = np.random.default_rng(seed)
    dt = DTYPES[dtype]
    real = v if real_vocab is None else real_vocab
    shape = (n,) if leading is None else tuple(leading)
    d = dict(
        hidden=jnp.asarray(rng.standard_normal(shape + (h,)), dt),
        weight=jnp.asarray(rng.standard_normal((v, h)) * scale / np.sqrt(h), dt),
        targets=rng.integers(0, real, size=shape).astype(np.int32),
    )
    if ignore_frac:
        d["targets"] = np.where(rng.random(shape) < ignore_frac, -100, d["targets"]).astype(np.int32)
    d["targets"] = jnp.asarray(d["targets"])
    kw = {}
    if bias:
        kw["bias"] = jnp.asarray(rng.standard_normal(v), dt)
    if temp == "array":
        kw["temperature"] = jnp.asarray(rng.uniform(0.5, 2.0, size=shape), jnp.float32)
    elif temp == "scalar":
        kw["temperature"] = float(rng.uniform(0.6, 1.6))
    if real_vocab is not None:
        kw["real_vocab_size"] = real_vocab
    g = jnp.asarray(rng.standard_normal(shape), jnp.float32)
    e = jnp.asarray(rng.standard_normal(shape), jnp.float32)
    return d, kw, g, e


def value_and_grads(fn, d, kw, g, e, with_entropy=True):
    """(logp, entropy, grads dict) of loss = sum g*logp + sum e*entropy through fn."""
    names = ["hidden", "weight"] + [k for k in ("bias", "temperature") if k in kw and not isinstance(kw[k], float)]

    def loss(*args):
        p = dict(zip(names, args))
        kwargs = {**kw, **{k: p[k] for k in names[2:]}}
        out = fn(p["hidden"], p["weight"], d["targets"], return_entropy=with_entropy, **kwargs)
        logp, ent = out if with_entropy else (out, jnp.zeros_like(out))
        return jnp.sum(jnp.where(jnp.isnan(logp), 0.0, logp) * g) + jnp.sum(jnp.where(jnp.isnan(ent), 0.0, ent) * e), (logp, ent)

    args = [d["hidden"], d["weight"]] + [kw[k] for k in names[2:]]
    (_, (logp, ent)), grads = jax.value_and_grad(loss, argnums=tuple(range(len(args))), has_aux=True)(*args)
    return logp, ent, dict(zip(names, grads))


def run_op(fn, seed, n, h, v, dtype, o, device, backward):
    """oracle.check_against_oracle's JAX adapter (the CPU only): make_inputs with o's options, fn's
    values and gradients (backward= passed when given) as numpy, with the inputs and dtype names."""
    assert device == "cpu", f"the JAX adapter runs on the CPU, not {device!r}"
    d, kw, g, e = make_inputs(seed, n, h, v, dtype, bias=o["bias"], temp=o["temp"], ignore_frac=o["ignore_frac"],
                              real_vocab=o["real_vocab"])
    op = fn if backward is None else (lambda *a, **k: fn(*a, backward=backward, **k))
    logp, ent, grads = value_and_grads(op, d, kw, g, e, with_entropy=o["entropy"])
    x = dict(hidden=np.asarray(d["hidden"]), weight=np.asarray(d["weight"]), targets=np.asarray(d["targets"]),
             bias=np.asarray(kw["bias"]) if "bias" in kw else None,
             temperature=np.asarray(kw.get("temperature", 1.0)), g=np.asarray(g), e=np.asarray(e))
    y = dict(logp=np.asarray(logp), entropy=np.asarray(ent), grads={k: np.asarray(gr) for k, gr in grads.items()},
             dtypes=dict(logp=str(logp.dtype), **{k: str(gr.dtype) for k, gr in grads.items()}))
    return x, y


# The tolerances these tests had before the check was shared (oracle.check_against_oracle's
# kept_bound and dlogit_rounding say how they differ from the torch tests').
check_against_oracle = functools.partial(oracle.check_against_oracle, run_op, kept_bound="fp16", dlogit_rounding=True)


def collectives(hlo: str) -> list:
    """(op, its result shapes such as "f32[512,32]") for every collective of a compiled HLO module's
    text (all-reduce, all-gather, reduce-scatter, all-to-all, collective-permute; async -start forms
    too)."""
    out = []
    for line in hlo.splitlines():
        m = re.search(r"=\s*(.*?)\s(all-reduce|all-gather|reduce-scatter|all-to-all|collective-permute)(-start)?\(", line)
        if m:
            out.append((m.group(2), re.findall(r"\w+\[[\d,]*\]", m.group(1))))
    return out
