import pytest

pytest.importorskip("jax", reason="jax is not installed: these tests need it")


import jax
import jax.numpy as jnp
import numpy as np

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
