"""The float64 oracle (numpy): values and every gradient, from the math in docs/design.md §1.

Operands are taken exactly as the kernels see them (their dtype's values, widened to float64),
so the only differences left are the kernels' fp32 arithmetic and output rounding.
"""
import itertools

import numpy as np

# Tolerances from the dtype of what is compared:
# - logp / entropy are fp32 results of fp32 accumulation over H products: a few fp32 ulps of the
#   largest terms, so |err| <= 2e-5 * (1 + |ref|) holds with margin for H <= 4096.
# - gradients are rounded to the input dtype at the end: norm-relative error within one ulp
#   (2^-8 bf16, 2^-11 fp16; 1e-5 for fp32 outputs) of the gradient, plus the fp32 accumulation
#   error, which is relative to the sum of the magnitudes of the terms, not to their (possibly
#   cancelling) sum: ACCUM_RTOL * || |dlogit| @ |W| || and alike.
# - the fast backward reads z from fp16 kept logits (16-bit operands): |dz error| <= (|g| + |e|
#   (1 + |lse - ent - z|)) p |dz_in| with |dz_in| <= 2^-11 |z| (+ 2^-24 below fp16's normal range),
#   the bound carried elementwise into the same magnitude sums (KEPT_RTOL).
VALUE_ATOL, VALUE_RTOL = 2e-5, 2e-5
GRAD_RTOL = {"bfloat16": 2.0 ** -8, "float16": 2.0 ** -10, "float32": 1e-5}
ACCUM_RTOL = 1e-5
KEPT_RTOL, KEPT_ATOL = 2.0 ** -11, 2.0 ** -24
# - the CUDA backward rounds dlogit to the operand dtype before its GEMMs, the CPU backward bf16
#   dlogit (vdpbf16ps, on a CPU with AVX512-BF16): |error| <= u |dlogit|, u the dtype's unit
#   roundoff (DLOGIT_ROUNDING), carried into the same magnitude sums.
DLOGIT_ROUNDING = {"bfloat16": 2.0 ** -9, "float16": 2.0 ** -11, "float32": 0.0}


def cpu_dlogit_dtype(dtype):
    """linear_logp's dlogit_dtype for the CPU backward: bf16 for bf16 operands (a bound, also where
    the CPU lacks AVX512-BF16 and keeps dlogit fp32), else None."""
    return "bfloat16" if str(dtype) == "bfloat16" else None


def f64(x):
    return np.asarray(np.asarray(x, dtype=np.float32), dtype=np.float64)


def linear_logp(h, w, t, *, bias=None, temperature=1.0, ignore_index=-100, real_vocab=None, g=None, e=None,
                kept_fp16=False, dlogit_dtype=None, nucleus=None):
    """Returns dict(logp, entropy, dh, dw, db, dtemp) in float64 for loss = sum g*logp + sum e*entropy,
    and the magnitudes *_abs that scale the gradients' tolerances. kept_fp16: the gradients were
    computed from fp16 kept logits (the fast backward on 16-bit operands); dlogit_dtype: dlogit
    was rounded to this dtype before the gradient GEMMs (the CUDA backward; cpu_dlogit_dtype). nucleus: a top-p keep mask
    [n, v] bool: logp over it (-inf for a target outside it, NaN for an empty one), the entropy
    unmasked, the logp gradient g kept (delta - p_kept)."""
    h, w = f64(h), f64(w)
    t = np.asarray(t).reshape(-1).astype(np.int64)
    n, v = h.shape[0], w.shape[0]
    real = v if real_vocab is None else real_vocab
    temp = np.broadcast_to(f64(temperature), (n,)).astype(np.float64)
    logits = h @ w.T + (f64(bias)[None, :] if bias is not None else 0.0)
    z = logits / temp[:, None]
    pad = np.arange(v)[None, :] >= real
    z = np.where(pad, -np.inf, z)
    m = z.max(axis=1, keepdims=True)
    lse = (m + np.log(np.exp(z - m).sum(axis=1, keepdims=True)))[:, 0]
    p = np.exp(z - lse[:, None])
    zs = np.where(pad, 0.0, z)
    ent = lse - (p * zs).sum(axis=1)
    ignored = t == ignore_index
    invalid = ~ignored & ((t < 0) | (t >= real))
    keep = ~(ignored | invalid)
    zt = np.where(keep, zs[np.arange(n), np.clip(t, 0, v - 1)], 0.0)
    delta = np.zeros_like(z)
    delta[np.arange(n)[keep], t[keep]] = 1.0
    # the logp term's distribution: the whole row's, or the nucleus's
    p_g, lse_g = p, lse
    if nucleus is not None:
        nucleus = np.asarray(nucleus, bool) & ~pad
        zk = np.where(nucleus, z, -np.inf)
        with np.errstate(invalid="ignore", divide="ignore"):
            mk = zk.max(axis=1, keepdims=True)
            lse_g = (mk + np.log(np.exp(zk - mk).sum(axis=1, keepdims=True)))[:, 0]
            p_g = np.where(nucleus, np.exp(zk - lse_g[:, None]), 0.0)
        zt = np.where(nucleus[np.arange(n), np.clip(t, 0, v - 1)], zt, -np.inf)
        delta = delta * nucleus
    with np.errstate(invalid="ignore"):
        logp = np.where(keep, zt - lse_g, np.where(invalid, np.nan, 0.0))
    ent = np.where(keep, ent, np.where(invalid, np.nan, 0.0))
    out = dict(logp=logp, entropy=ent)
    g = np.zeros(n) if g is None else f64(g).reshape(-1)
    e = np.zeros(n) if e is None else f64(e).reshape(-1)
    dz = g[:, None] * (delta - p_g) + e[:, None] * p * (lse - np.where(keep, ent, 0.0))[:, None] - e[:, None] * p * zs
    dz = np.where(pad | ~keep[:, None], 0.0, dz)
    dlogit = dz / temp[:, None]
    out.update(dh=dlogit @ w, dw=dlogit.T @ h, db=dlogit.sum(axis=0), dtemp=-(dz * zs).sum(axis=1) / temp)
    # Magnitudes of the summed terms, for the fp32 part of the tolerance: each dz carries the error
    # of z - lse and lse - ent - z, i.e. a few ulps of |z|, |lse| and |ent|.
    ent_abs = np.abs(np.where(keep, ent, 0.0))[:, None]
    mag = (np.abs(g)[:, None] * p_g * (1 + np.abs(lse_g)[:, None] + ent_abs + np.abs(zs))
           + np.abs(e)[:, None] * p * (1 + np.abs(lse)[:, None] + ent_abs + np.abs(zs)))
    mag = np.where(pad | ~keep[:, None], 0.0, mag)
    ad = np.abs(dlogit) + mag / temp[:, None]
    adt = np.abs(dz * zs)
    if kept_fp16:  # in units of ACCUM_RTOL, so that assert_grad's tolerance adds the bound
        dz_in = KEPT_RTOL * np.abs(zs) + KEPT_ATOL
        ad = ad + mag * dz_in / temp[:, None] / ACCUM_RTOL
        adt = adt + (mag * np.abs(zs) + np.abs(dz)) * dz_in / ACCUM_RTOL
    if dlogit_dtype is not None:  # dH, dW, db only: dzz is summed from the fp32 dz
        ad = ad + DLOGIT_ROUNDING[str(dlogit_dtype)] * np.abs(dlogit) / ACCUM_RTOL
    out.update(dh_abs=ad @ np.abs(w), dw_abs=ad.T @ np.abs(h), db_abs=ad.sum(axis=0),
               dtemp_abs=adt.sum(axis=1) / temp)
    return out


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
    u = KEPT_ROUNDOFF[str(dtype)]
    h, w = f64(h), f64(w)
    t = np.asarray(t).reshape(-1).astype(np.int64)
    n, v = h.shape[0], w.shape[0]
    real = v if real_vocab is None else real_vocab
    temp = np.broadcast_to(f64(temperature), (n,)).astype(np.float64)[:, None]
    z = (h @ w.T + (f64(bias)[None, :] if bias is not None else 0.0)) / temp
    pad = np.arange(v)[None, :] >= real
    keep = ((t != ignore_index) & (t >= 0) & (t < real))[:, None]
    valid = keep & ~pad
    z = np.where(pad, 0.0, z)
    zm = np.where(pad, -np.inf, z)
    m = zm.max(axis=1, keepdims=True)
    lse = m + np.log(np.exp(zm - m).sum(axis=1, keepdims=True))
    p = np.exp(zm - lse)
    ent = lse - (p * z).sum(axis=1, keepdims=True)
    g = np.zeros((n, 1)) if g is None else f64(g).reshape(n, 1)
    e = np.zeros((n, 1)) if e is None else f64(e).reshape(n, 1)
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


def rel_err(x, ref):
    x, ref = f64(x), np.asarray(ref, np.float64)
    den = np.linalg.norm(ref)
    return float(np.linalg.norm(x - ref) / (den if den > 0 else 1.0))


def assert_values(x, ref, what):
    x, ref = f64(x), np.asarray(ref, np.float64)
    assert np.array_equal(np.isnan(x), np.isnan(ref)), f"{what}: NaN pattern differs"
    with np.errstate(invalid="ignore"):  # -inf where -inf is due (a target outside its nucleus)
        ok = np.isnan(ref) | (x == ref) | (np.abs(x - ref) <= VALUE_ATOL + VALUE_RTOL * np.abs(ref))
    bad = np.argwhere(~ok)
    assert bad.size == 0, f"{what}: {bad.shape[0]} elements off, first {bad[0]}: {x[tuple(bad[0])]} vs {ref[tuple(bad[0])]}"


def assert_grad(x, ref, dtype, what, ref_abs=None, kept_err=None):
    """x against the float64 gradient ref to the dtype's GRAD_RTOL, plus the accumulation bound
    ref_abs (ACCUM_RTOL units) and, for the fast backward, the norm of the kept-logits error bound
    kept_err (kept_logits_error: |fast - ref| <= |lean-like error| + bound
    elementwise, so the norms add), each relative to the gradient's norm."""
    err = rel_err(x, ref)
    den = max(np.linalg.norm(ref), 1e-300)
    tol = GRAD_RTOL[str(dtype)] + (ACCUM_RTOL * np.linalg.norm(ref_abs) / den if ref_abs is not None else 0.0)
    if kept_err is not None:
        tol += np.linalg.norm(kept_err) / den
    assert np.all(np.isfinite(f64(x))), f"{what}: non-finite gradient"
    assert err <= tol, f"{what}: relative error {err:.3g} > {tol:.3g}"


def assert_grads(grads, ref, dtype, prefix=""):
    """Every gradient in grads (numpy: hidden, weight[, bias][, temperature]) against the oracle's
    ref, with ref["kept"] (kept_logits_error's bounds) where given."""
    kept = ref.get("kept") or {}
    for name, key, dt in (("hidden", "dh", dtype), ("weight", "dw", dtype), ("bias", "db", dtype),
                          ("temperature", "dtemp", "float32")):
        if name in grads:
            assert_grad(grads[name], ref[key], dt, f"{prefix}d {name}", ref[key + "_abs"], kept.get(key))


def check_against_oracle(run, fn, n, h, v, dtype, o, seed=0, device="cpu", backward=None, *, kept_bound,
                         dlogit_rounding):
    """fn's values and gradients against the float64 oracle, for either frontend: each binds run, its
    adapter, and the two tolerance choices below (torch_helpers.check_against_oracle,
    jax_helpers.check_against_oracle). o: the options of a case_grid case. backward: passed to fn when
    given.
    run(fn, seed, n, h, v, dtype, o, device, backward) -> (x, y), numpy: x the inputs (hidden, weight,
    targets, bias or None, temperature, g, e), y logp, entropy, grads {hidden, weight[, bias][,
    temperature]} and dtypes {logp and each gradient: its dtype's name} of loss = sum g*logp + sum
    e*entropy (entropy left out of the loss where o["entropy"] is off).
    The fast backward's kept-logits allowance: kept_bound "elementwise" (kept_logits_error, every
    dtype) or "fp16" (linear_logp's kept_fp16, 16-bit operands); dlogit_rounding: the CPU backward's
    bf16 dlogit (cpu_dlogit_dtype) in the accumulation bound."""
    x, y = run(fn, seed, n, h, v, dtype, o, device, backward)
    fast, ent_on = backward == "fast", o["entropy"]
    opts = dict(bias=x["bias"], temperature=x["temperature"], real_vocab=o["real_vocab"], g=x["g"],
                e=x["e"] if ent_on else None)
    args = (x["hidden"], x["weight"], x["targets"])
    ref = linear_logp(*args, kept_fp16=kept_bound == "fp16" and fast and dtype != "float32",
                      dlogit_dtype=cpu_dlogit_dtype(dtype) if dlogit_rounding else None, **opts)
    ref["kept"] = kept_logits_error(*args, dtype=dtype, **opts) if kept_bound == "elementwise" and fast else None
    assert y["dtypes"]["logp"] == "float32" and y["logp"].shape == np.shape(x["targets"])
    assert_values(y["logp"], ref["logp"], "logp")
    if ent_on:
        assert_values(y["entropy"], ref["entropy"], "entropy")
    assert all(y["dtypes"][k] == dtype for k in ("hidden", "weight", "bias") if k in y["grads"]), y["dtypes"]
    assert_grads(y["grads"], ref, dtype)


DTYPE_NAMES = ("bfloat16", "float16", "float32")


def case_grid():
    """Odd shapes x dtypes x options, options rotating so each appears with every dtype."""
    opts = itertools.cycle([
        dict(bias=True, temp="scalar", ignore_frac=0.2, real_vocab=None, entropy=True),
        dict(bias=False, temp="array", ignore_frac=0.0, real_vocab="pad", entropy=True),
        dict(bias=True, temp="array", ignore_frac=0.3, real_vocab="pad", entropy=False),
        dict(bias=False, temp=None, ignore_frac=0.1, real_vocab=None, entropy=True),
    ])
    cases = []
    for n, h, v in itertools.product((1, 3, 127, 1000), (8, 96, 256), (1000, 517)):
        if n == 1000 and h == 256 and v == 517:
            continue
        for dtype in DTYPE_NAMES:
            o = dict(next(opts))
            o["real_vocab"] = v - 37 if o["real_vocab"] == "pad" else None
            cases.append((n, h, v, dtype, o))
    return cases
