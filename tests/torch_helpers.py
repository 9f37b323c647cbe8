"""Inputs and autograd helpers for the torch_bridge tests (no jax needed)."""
import pytest

pytest.importorskip("torch", reason="torch is not installed: these tests need it")


import numpy as np
import torch

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def make_inputs(seed, n, h, v, dtype="bfloat16", *, bias=False, temp="scalar", ignore_frac=0.0, real_vocab=None,
                scale=3.0, leading=None, device="cpu"):
    """Fresh random inputs (never zeros): hidden ~ N(0, 1), weight ~ N(0, scale^2 / h)."""
    rng = np.random.default_rng(seed)
    dt = DTYPES[dtype]
    real = v if real_vocab is None else real_vocab
    shape = (n,) if leading is None else tuple(leading)
    t = rng.integers(0, real, size=shape)
    if ignore_frac:
        t = np.where(rng.random(shape) < ignore_frac, -100, t)
    d = dict(hidden=torch.tensor(rng.standard_normal(shape + (h,)), dtype=dt, device=device),
             weight=torch.tensor(rng.standard_normal((v, h)) * scale / np.sqrt(h), dtype=dt, device=device),
             targets=torch.tensor(t, dtype=torch.int64, device=device))
    kw = {}
    if bias:
        kw["bias"] = torch.tensor(rng.standard_normal(v), dtype=dt, device=device)
    if temp == "array":
        kw["temperature"] = torch.tensor(rng.uniform(0.5, 2.0, size=shape), dtype=torch.float32, device=device)
    elif temp == "scalar":
        kw["temperature"] = float(rng.uniform(0.6, 1.6))
    if real_vocab is not None:
        kw["real_vocab_size"] = real_vocab
    g = torch.tensor(rng.standard_normal(shape), dtype=torch.float32, device=device)
    e = torch.tensor(rng.standard_normal(shape), dtype=torch.float32, device=device)
    return d, kw, g, e


def grad_names(kw):
    return ["hidden", "weight"] + [k for k in ("bias", "temperature") if isinstance(kw.get(k), torch.Tensor)]


def value_and_grads(fn, d, kw, g, e, with_entropy=True, **extra):
    """(logp, entropy, grads dict) of loss = sum g*logp + sum e*entropy through fn (NaN rows masked)."""
    names = grad_names(kw)
    leaves = {k: (d[k] if k in d else kw[k]).detach().clone().requires_grad_(True) for k in names}
    kwargs = {**kw, **{k: leaves[k] for k in names[2:]}, **extra}
    out = fn(leaves["hidden"], leaves["weight"], d["targets"], return_entropy=with_entropy, **kwargs)
    logp, ent = out if with_entropy else (out, torch.zeros_like(out))
    loss = (torch.where(torch.isnan(logp), 0.0, logp) * g).sum()
    if with_entropy:
        loss = loss + (torch.where(torch.isnan(ent), 0.0, ent) * e).sum()
    grads = torch.autograd.grad(loss, [leaves[k] for k in names], allow_unused=True)
    grads = {k: (torch.zeros_like(leaves[k]) if gr is None else gr) for k, gr in zip(names, grads)}
    return logp.detach(), ent.detach(), grads


def to_np(x):
    return x.detach().float().cpu().numpy()


def check_against_oracle(fn, n, h, v, dtype, o, seed=0, device="cpu"):
    import oracle
    d, kw, g, e = make_inputs(seed, n, h, v, dtype, bias=o["bias"], temp=o["temp"], ignore_frac=o["ignore_frac"],
                              real_vocab=o["real_vocab"], device=device)
    ent_on = o["entropy"]
    logp, ent, grads = value_and_grads(fn, d, kw, g, e, with_entropy=ent_on)
    temp = kw.get("temperature", 1.0)
    ref = oracle.linear_logp(to_np(d["hidden"]), to_np(d["weight"]), d["targets"].cpu().numpy(),
                             bias=None if "bias" not in kw else to_np(kw["bias"]),
                             temperature=to_np(temp) if isinstance(temp, torch.Tensor) else temp,
                             real_vocab=o["real_vocab"], g=g.cpu().numpy(), e=e.cpu().numpy() if ent_on else None)
    assert logp.dtype == torch.float32 and logp.shape == d["targets"].shape
    oracle.assert_values(to_np(logp), ref["logp"], "logp")
    if ent_on:
        oracle.assert_values(to_np(ent), ref["entropy"], "entropy")
    assert grads["hidden"].dtype == d["hidden"].dtype and grads["weight"].dtype == d["weight"].dtype
    oracle.assert_grad(to_np(grads["hidden"]), ref["dh"], dtype, "d hidden", ref["dh_abs"])
    oracle.assert_grad(to_np(grads["weight"]), ref["dw"], dtype, "d weight", ref["dw_abs"])
    if "bias" in grads:
        assert grads["bias"].dtype == kw["bias"].dtype
        oracle.assert_grad(to_np(grads["bias"]), ref["db"], dtype, "d bias", ref["db_abs"])
    if "temperature" in grads:
        oracle.assert_grad(to_np(grads["temperature"]), ref["dtemp"], "float32", "d temperature", ref["dtemp_abs"])


def save_inputs(path, d, kw, g, e, dtype, real_vocab):
    """The inputs of one case as an npz that jax_side reads (the same values, in float32/int)."""
    z = dict(hidden=to_np(d["hidden"]), weight=to_np(d["weight"]), targets=d["targets"].cpu().numpy(),
             g=g.cpu().numpy(), e=e.cpu().numpy(), dtype=dtype, real_vocab=real_vocab)
    if "bias" in kw:
        z["bias"] = to_np(kw["bias"])
    if isinstance(kw.get("temperature"), torch.Tensor):
        z["temperature"] = to_np(kw["temperature"])
    elif "temperature" in kw:
        z["temperature_scalar"] = kw["temperature"]
    np.savez(path, **z)


def jax_side(path_in, path_out):
    """rlk_xla's logp, entropy and gradients for the inputs saved in path_in (npz), written to
    path_out: run in a subprocess by the GPU parity test, so that a crash of the JAX side is a test
    failure rather than the end of the test session."""
    import os
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    import jax
    import jax.numpy as jnp
    import rlk_xla
    z = dict(np.load(path_in))
    dtype = getattr(jnp, str(z.pop("dtype")))
    names = [k for k in ("hidden", "weight", "bias", "temperature") if k in z]
    args = [jnp.asarray(z[k]).astype(jnp.float32 if k == "temperature" else dtype) for k in names]
    kw = dict(real_vocab_size=int(z["real_vocab"]))
    if "temperature_scalar" in z:
        kw["temperature"] = float(z["temperature_scalar"])
    t, g, e = jnp.asarray(z["targets"].astype(np.int32)), jnp.asarray(z["g"]), jnp.asarray(z["e"])

    def loss(*a):
        p = dict(zip(names, a))
        logp, ent = rlk_xla.linear_logp(p["hidden"], p["weight"], t, return_entropy=True,
                                        **{**kw, **{k: p[k] for k in names[2:]}})
        return jnp.sum(logp * g) + jnp.sum(ent * e), (logp, ent)

    (_, (logp, ent)), grads = jax.value_and_grad(loss, argnums=tuple(range(len(names))), has_aux=True)(*args)
    out = {"logp": logp, "ent": ent, **dict(zip(names, grads))}
    np.savez(path_out, backend=jax.default_backend(),
             **{k: np.asarray(v.astype(jnp.float32)) for k, v in out.items()})
