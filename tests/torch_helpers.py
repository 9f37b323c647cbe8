"""Inputs and autograd helpers for the torch_bridge tests (no jax needed)."""
import pytest

pytest.importorskip("torch", reason="torch is not installed: these tests need it")


import functools

import numpy as np
import torch

import _rlk_core
import oracle

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


def oracle_of(d, kw, g, e, real_vocab=None, with_entropy=True, kept_dtype=None):
    """oracle.linear_logp of make_inputs' values; with kept_dtype (backward="fast") also the
    kept-logits error bounds, as ref["kept"] (else None)."""
    temp = kw.get("temperature", 1.0)
    args = (to_np(d["hidden"]), to_np(d["weight"]), d["targets"].cpu().numpy())
    opts = dict(bias=None if "bias" not in kw else to_np(kw["bias"]),
                temperature=to_np(temp) if isinstance(temp, torch.Tensor) else temp, real_vocab=real_vocab,
                g=g.cpu().numpy(), e=e.cpu().numpy() if with_entropy else None)
    ref = oracle.linear_logp(*args, **opts)
    ref["kept"] = None if kept_dtype is None else oracle.kept_logits_error(*args, dtype=kept_dtype, **opts)
    return ref


def run_op(fn, seed, n, h, v, dtype, o, device, backward):
    """oracle.check_against_oracle's torch adapter: make_inputs with o's options on `device`, fn's
    values and gradients (backward= passed when given) as numpy, with the inputs and dtype names."""
    d, kw, g, e = make_inputs(seed, n, h, v, dtype, bias=o["bias"], temp=o["temp"], ignore_frac=o["ignore_frac"],
                              real_vocab=o["real_vocab"], device=device)
    extra = {} if backward is None else dict(backward=backward)
    logp, ent, grads = value_and_grads(fn, d, kw, g, e, with_entropy=o["entropy"], **extra)
    temp = kw.get("temperature", 1.0)
    x = dict(hidden=to_np(d["hidden"]), weight=to_np(d["weight"]), targets=d["targets"].cpu().numpy(),
             bias=to_np(kw["bias"]) if "bias" in kw else None,
             temperature=to_np(temp) if isinstance(temp, torch.Tensor) else temp, g=g.cpu().numpy(), e=e.cpu().numpy())
    name = lambda t: str(t.dtype).removeprefix("torch.")
    y = dict(logp=to_np(logp), entropy=to_np(ent), grads={k: to_np(gr) for k, gr in grads.items()},
             dtypes=dict(logp=name(logp), **{k: name(gr) for k, gr in grads.items()}))
    return x, y


# The tolerances these tests had before the check was shared (oracle.check_against_oracle's
# kept_bound and dlogit_rounding say how they differ from the JAX tests').
check_against_oracle = functools.partial(oracle.check_against_oracle, run_op, kept_bound="elementwise",
                                         dlogit_rounding=False)


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
