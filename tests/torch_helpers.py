"""Inputs and autograd helpers for the torch_bridge tests (no jax needed)."""
import pytest

pytest.importorskip("torch", reason="torch is not installed: these tests need it")


import numpy as np
import torch

import _rlk_core

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
# a `device` parameter value: the CUDA case of a test that also runs on the CPU
GPU = pytest.param("cuda", marks=[
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (torch.cuda.is_available() is False)"),
    pytest.mark.skipif(not _rlk_core.has_cuda, reason="this build of _rlk_core has no CUDA backend")])


def saved_z(kept, n, v, device_type):
    """The fp32 operands' kept buffer -> z [n, v]: CUDA keeps it row-major, the CPU by blocks of 64
    rows, each z^T [v, rows] (cpu/saved_logits.h, saved_z)."""
    z = kept.view(torch.float32)
    if device_type != "cpu":
        return z.view(n, v)
    return torch.cat([z[r0 * v:(r0 + nr) * v].view(v, nr).T for r0 in range(0, n, 64) for nr in [min(64, n - r0)]])


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


# Unit roundoff of the kept logits (backward="fast"): fp16 for bf16/fp16 inputs, fp32 for fp32.
KEPT_ROUNDOFF = {"bfloat16": 2.0 ** -11, "float16": 2.0 ** -11, "float32": 2.0 ** -24}


def kept_logits_error(h, w, t, *, dtype, bias=None, temperature=1.0, ignore_index=-100, real_vocab=None, g=None,
                      e=None):
    """Elementwise float64 bounds on what the fast backward's kept logits add to every gradient's
    error (arguments as oracle.linear_logp's). The kept z_hat = z (1 + d), |d| <= u
    (KEPT_ROUNDOFF), is read back with the forward's (fp32, unrounded) lse and entropy, so
      |p_hat - p| = p |exp(z d) - 1| <= q := p (exp(|z| u) - 1)    (~ p |z| u)
      |p_hat z_hat - p z|            <= q |z| (1 + u) + p |z| u
    and dz = g (delta - p) + e p (lse - ent) - e p z is off by at most
      D = |g| q + |e| q |lse - ent| + |e| (q |z| (1 + u) + p |z| u).
    dlogit = dz / T, and the gradients are linear in dlogit: dh = dlogit @ W is off by at most
    (D / T) @ |W|, dw by (D / T)^T @ |h|, db by the column sums of D / T, and dtemp = -sum_j dz z / T
    by sum_j (D |z| (1 + u) + |dz| |z| u) / T."""
    import oracle
    u = KEPT_ROUNDOFF[str(dtype)]
    h, w = oracle.f64(h), oracle.f64(w)
    t = np.asarray(t).reshape(-1).astype(np.int64)
    n, v = h.shape[0], w.shape[0]
    real = v if real_vocab is None else real_vocab
    temp = np.broadcast_to(oracle.f64(temperature), (n,)).astype(np.float64)[:, None]
    z = (h @ w.T + (oracle.f64(bias)[None, :] if bias is not None else 0.0)) / temp
    pad = np.arange(v)[None, :] >= real
    keep = ((t != ignore_index) & (t >= 0) & (t < real))[:, None]
    valid = keep & ~pad
    z = np.where(pad, 0.0, z)
    zm = np.where(pad, -np.inf, z)
    m = zm.max(axis=1, keepdims=True)
    lse = m + np.log(np.exp(zm - m).sum(axis=1, keepdims=True))
    p = np.exp(zm - lse)
    ent = lse - (p * z).sum(axis=1, keepdims=True)
    g = np.zeros((n, 1)) if g is None else oracle.f64(g).reshape(n, 1)
    e = np.zeros((n, 1)) if e is None else oracle.f64(e).reshape(n, 1)
    delta = np.zeros_like(z)
    delta[np.arange(n), np.clip(t, 0, v - 1)] = 1.0
    dz = np.where(valid, g * (delta - p) + e * p * (lse - ent) - e * p * z, 0.0)
    az = np.abs(z)
    q = p * np.expm1(az * u)
    D = np.where(valid, np.abs(g) * q + np.abs(e) * q * np.abs(lse - ent) + np.abs(e) * (q * az * (1 + u) + p * az * u),
                 0.0)
    dl = D / temp
    return dict(dh=dl @ np.abs(w), dw=dl.T @ np.abs(h), db=dl.sum(axis=0),
                dtemp=((D * az * (1 + u) + np.abs(dz) * az * u) / temp).sum(axis=1))


def assert_grad(x, ref, dtype, what, ref_abs, kept_err=None):
    """oracle.assert_grad's tolerance (the lean backward's), plus, for the fast backward, the norm
    of the kept-logits bound relative to the gradient's (|fast - ref| <= |lean-like error| + bound
    elementwise, so the norms add)."""
    import oracle
    den = max(np.linalg.norm(ref), 1e-300)
    tol = oracle.GRAD_RTOL[str(dtype)] + oracle.ACCUM_RTOL * np.linalg.norm(ref_abs) / den
    if kept_err is not None:
        tol += np.linalg.norm(kept_err) / den
    err = oracle.rel_err(x, ref)
    assert np.all(np.isfinite(oracle.f64(x))), f"{what}: non-finite gradient"
    assert err <= tol, f"{what}: relative error {err:.3g} > {tol:.3g}"


def oracle_of(d, kw, g, e, real_vocab=None, with_entropy=True, kept_dtype=None):
    """oracle.linear_logp of make_inputs' values; with kept_dtype (backward="fast") also the
    kept-logits error bounds, as ref["kept"] (else None)."""
    import oracle
    temp = kw.get("temperature", 1.0)
    args = (to_np(d["hidden"]), to_np(d["weight"]), d["targets"].cpu().numpy())
    opts = dict(bias=None if "bias" not in kw else to_np(kw["bias"]),
                temperature=to_np(temp) if isinstance(temp, torch.Tensor) else temp, real_vocab=real_vocab,
                g=g.cpu().numpy(), e=e.cpu().numpy() if with_entropy else None)
    ref = oracle.linear_logp(*args, **opts)
    ref["kept"] = None if kept_dtype is None else kept_logits_error(*args, dtype=kept_dtype, **opts)
    return ref


def assert_grads(grads, ref, dtype, prefix=""):
    """Every gradient in `grads` (hidden, weight[, bias][, temperature]) against oracle_of's ref."""
    kept = ref["kept"] or {}
    for name, key, dt in (("hidden", "dh", dtype), ("weight", "dw", dtype), ("bias", "db", dtype),
                          ("temperature", "dtemp", "float32")):
        if name in grads:
            assert_grad(to_np(grads[name]), ref[key], dt, f"{prefix}d {name}", ref[key + "_abs"], kept.get(key))


def check_against_oracle(fn, n, h, v, dtype, o, seed=0, device="cpu", backward=None):
    """fn's values and gradients against the float64 oracle. backward: passed to fn when given;
    "fast" widens the gradient tolerance by the kept logits' rounding bound (kept_logits_error)."""
    import oracle
    d, kw, g, e = make_inputs(seed, n, h, v, dtype, bias=o["bias"], temp=o["temp"], ignore_frac=o["ignore_frac"],
                              real_vocab=o["real_vocab"], device=device)
    ent_on = o["entropy"]
    extra = {} if backward is None else dict(backward=backward)
    logp, ent, grads = value_and_grads(fn, d, kw, g, e, with_entropy=ent_on, **extra)
    ref = oracle_of(d, kw, g, e, real_vocab=o["real_vocab"], with_entropy=ent_on,
                    kept_dtype=dtype if backward == "fast" else None)
    assert logp.dtype == torch.float32 and logp.shape == d["targets"].shape
    oracle.assert_values(to_np(logp), ref["logp"], "logp")
    if ent_on:
        oracle.assert_values(to_np(ent), ref["entropy"], "entropy")
    assert grads["hidden"].dtype == d["hidden"].dtype and grads["weight"].dtype == d["weight"].dtype
    if "bias" in grads:
        assert grads["bias"].dtype == kw["bias"].dtype
    assert_grads(grads, ref, dtype)


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


def torch_fast_side(path_in, path_out):
    """torch_bridge's logp, entropy, dH and dW with backward="fast" for the inputs saved in path_in
    (npz, no bias or temperature array), written to path_out: run in a subprocess with another
    environment (RLK_BLAS_TUNE) by the GPU test of the tuned GEMM pick."""
    import torch_bridge
    z = dict(np.load(path_in))
    dt = DTYPES[str(z["dtype"])]
    d = {k: torch.tensor(z[k], dtype=dt, device="cuda") for k in ("hidden", "weight")}
    d["targets"] = torch.tensor(z["targets"], device="cuda")
    g, e = (torch.tensor(z[k], device="cuda") for k in ("g", "e"))
    logp, ent, grads = value_and_grads(torch_bridge.linear_logp, d, dict(real_vocab_size=int(z["real_vocab"])), g, e,
                                       backward="fast")
    np.savez(path_out, **{k: to_np(x) for k, x in dict(logp=logp, ent=ent, **grads).items()})


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
