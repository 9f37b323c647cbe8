"""Property-based test (hypothesis): random shapes (n from 0, V from 1, H from 1), dtypes, options,
modes, backward strategies and id kinds (ignored, out of range, beyond int32, unsigned) against the
float64 oracle and the NaN/error contract, for rlk_xla and torch_bridge; the same on a GPU under
-m gpu. Derandomized, no example database: the same examples in every run (about a minute in all
on two CPU cores).

test_special_values_* hold the NaN/Inf/overflow contract: a row whose inputs are not finite, or
whose statistics overflow, is NaN, never a finite wrong number.
"""
import numpy as np
import pytest

hypothesis = pytest.importorskip("hypothesis", reason="hypothesis is not installed: the property test needs it")
from hypothesis import HealthCheck, Phase, given, settings, strategies as st  # noqa: E402

import oracle  # noqa: E402

SETTINGS = dict(derandomize=True, database=None, deadline=None, print_blob=True,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
IGNORES = (-100, -1, 0, 2 ** 40, -(2 ** 40))


@st.composite
def cases(draw, id_dtypes):
    n = draw(st.integers(0, 24))
    v = draw(st.integers(1, 70))
    return dict(
        n=n, v=v, h=draw(st.integers(1, 24)),
        dtype=draw(st.sampled_from(["bfloat16", "float16", "float32"])),
        bias=draw(st.booleans()), temp=draw(st.sampled_from(["scalar", "array", "none"])),
        entropy=draw(st.booleans()), ignore_index=draw(st.sampled_from(IGNORES)),
        real=draw(st.integers(1, v)) if draw(st.booleans()) else None,
        mode=draw(st.sampled_from(["auto", "auto", "strict", "off", "audit"])),
        backward=draw(st.sampled_from(["auto", "fast", "lean"])),
        id_dtype=draw(st.sampled_from(id_dtypes)),
        kinds=draw(st.lists(st.sampled_from(["valid"] * 6 + ["ignore", "negative", "past_vocab", "past_int32"]),
                            min_size=n, max_size=n)),
        seed=draw(st.integers(0, 2 ** 16)),
    )


def make(c, special=None):
    """numpy inputs of case c: (hidden f32 values of c's dtype, weight, bias, temperature, ids as
    Python ints, oracle ids, loss weights g, e)."""
    rng = np.random.default_rng(c["seed"])
    n, v, h = c["n"], c["v"], c["h"]
    real = c["real"] or v
    hidden = rng.standard_normal((n, h))
    weight = rng.standard_normal((v, h)) * 3 / np.sqrt(h)
    bias = rng.standard_normal(v) if c["bias"] else None
    temp = {"scalar": float(rng.uniform(0.5, 2.0)), "array": rng.uniform(0.5, 2.0, n).astype(np.float32),
            "none": 1.0}[c["temp"]]
    info = np.iinfo(c["id_dtype"])
    ig = c["ignore_index"]
    ids, ref_ids = [], []
    for k in c["kinds"]:
        x = {"valid": int(rng.integers(0, real)), "ignore": ig, "negative": -int(rng.integers(1, 1000)),
             "past_vocab": real + int(rng.integers(0, 1000)), "past_int32": 2 ** 31 + int(rng.integers(0, 2 ** 31))}[k]
        if not info.min <= x <= info.max:  # this id dtype cannot hold it: its own largest id instead
            x = int(info.max)
        ids.append(x)
        ref_ids.append(x if x == ig or 0 <= x < real else (-1 if ig != -1 else -2))
    if special == "nan_hidden" and n:
        hidden[rng.integers(0, n), rng.integers(0, h)] = np.nan
    elif special == "inf_hidden" and n:
        hidden[rng.integers(0, n), rng.integers(0, h)] = np.inf
    elif special == "nan_weight":
        weight[rng.integers(0, v), rng.integers(0, h)] = np.nan
    elif special == "nan_bias":
        bias = rng.standard_normal(v)
        bias[rng.integers(0, v)] = np.nan
    elif special == "huge_logits":
        hidden *= 1e4 if c["dtype"] != "float32" else 1e30
    elif special == "tiny_temperature":
        temp = 1e-40  # 1 / T overflows fp32
    g, e = rng.standard_normal(n), rng.standard_normal(n)
    return hidden, weight, bias, temp, ids, np.asarray(ref_ids, np.int64), g, e


def check(c, got, hidden, weight, bias, temp, ref_ids, g, e, contract_only=False):
    """got: dict logp, entropy (or None) and grads {name: array}; compared with the float64 oracle
    of the values the op saw (hidden, weight, bias rounded to c's dtype)."""
    ref = oracle.linear_logp(hidden, weight, ref_ids, bias=bias, temperature=temp,
                             ignore_index=c["ignore_index"], real_vocab=c["real"], g=g,
                             e=e if c["entropy"] else None,
                             kept_fp16=c["backward"] != "lean" and c["dtype"] != "float32",
                             dlogit_dtype=oracle.cpu_dlogit_dtype(c["dtype"]))
    outs = [("logp", got["logp"], ref["logp"])] + ([("entropy", got["entropy"], ref["entropy"])] if c["entropy"] else [])
    for what, x, r in outs:
        x = oracle.f64(x)
        if contract_only:  # every row: NaN, or the oracle's (finite) value; a NaN oracle row is NaN
            assert np.isnan(x[np.isnan(r)]).all(), f"{what}: a finite value where the oracle is NaN"
            ok = np.isnan(x) | (np.abs(x - r) <= oracle.VALUE_ATOL + 1e-4 * np.abs(r))
            assert ok.all(), f"{what}: finite and wrong: {x[~ok][:4]} vs {r[~ok][:4]}"
        else:
            oracle.assert_values(x, r, what)
    if contract_only:
        return
    oracle.assert_grads(got["grads"], ref, c["dtype"])


# ---- rlk_xla ------------------------------------------------------------------------------------

def run_jax(c, hidden, weight, bias, temp, ids, g, e, device):
    import jax
    import jax.numpy as jnp
    import rlk_xla
    dt = jnp.dtype(c["dtype"])
    with jax.default_device(device):
        hj, wj = jnp.asarray(hidden, dt), jnp.asarray(weight, dt)
        bj = None if bias is None else jnp.asarray(bias, dt)
        tj = jnp.asarray(np.asarray(ids, dtype=c["id_dtype"]).reshape(c["n"]))
        Tj = jnp.asarray(temp) if isinstance(temp, np.ndarray) else temp
        diff = {"hidden": hj, "weight": wj}
        if bj is not None:
            diff["bias"] = bj
        if isinstance(temp, np.ndarray):
            diff["temperature"] = Tj

        def loss(p):
            kw = dict(bias=p.get("bias"), temperature=p.get("temperature", Tj), ignore_index=c["ignore_index"],
                      real_vocab_size=c["real"], mode=c["mode"], backward=c["backward"], return_entropy=True)
            lp, ent = rlk_xla.linear_logp(p["hidden"], p["weight"], tj, **kw)
            ent = ent if c["entropy"] else jnp.zeros_like(ent)
            return (jnp.sum(jnp.where(jnp.isnan(lp), 0, lp) * g) + jnp.sum(jnp.where(jnp.isnan(ent), 0, ent) * e),
                    (lp, ent))

        (_, (lp, ent)), grads = jax.value_and_grad(loss, has_aux=True)(diff)
        seen = {k: np.asarray(x.astype(jnp.float32)) for k, x in diff.items()}
    return dict(logp=np.asarray(lp), entropy=np.asarray(ent),
                grads={k: np.asarray(x.astype(jnp.float32)) for k, x in grads.items()}), seen


def _jax_device(kind):
    jax = pytest.importorskip("jax", reason="jax is not installed: its half of the property test needs it")
    if kind == "cpu":
        return jax.devices("cpu")[0]
    try:
        return jax.devices("gpu")[0]
    except RuntimeError:
        pytest.skip("needs a GPU visible to jax")


JAX_IDS = [np.int32, np.int8, np.uint8, np.int16, np.uint16, np.uint32]
DEVICES = ["cpu", pytest.param("gpu", marks=pytest.mark.gpu)]


def _jax_case(c, device, special=None):
    hidden, weight, bias, temp, ids, ref_ids, g, e = make(c, special)
    try:
        got, seen = run_jax(c, hidden, weight, bias, temp, ids, g, e, device)
    except RuntimeError as err:  # strict on a path the kernels do not take is an error, not a number
        assert c["mode"] == "strict", err
        return
    check(c, got, seen["hidden"], seen["weight"], seen.get("bias"), temp, ref_ids, g, e,
          contract_only=special is not None)


@pytest.mark.parametrize("kind", DEVICES)
def test_jax_against_oracle(kind):
    device = _jax_device(kind)

    @settings(max_examples=12, **SETTINGS)
    @given(cases(JAX_IDS))
    def prop(c):
        _jax_case(c, device)
    prop()


SPECIALS = ["nan_hidden", "inf_hidden", "nan_weight", "nan_bias", "tiny_temperature", "huge_logits"]
# The special-value tests do not shrink a failing example (shrinking would take minutes).
SPECIAL_SETTINGS = dict(SETTINGS, max_examples=3, phases=[Phase.explicit, Phase.generate])


@pytest.mark.parametrize("kind", DEVICES)
@pytest.mark.parametrize("special", SPECIALS)
def test_special_values_jax(kind, special):
    device = _jax_device(kind)

    @settings(**SPECIAL_SETTINGS)
    @given(cases([np.int32]))
    def prop(c):
        _jax_case(dict(c, bias=True) if special == "nan_bias" else c, device, special)
    prop()


# ---- torch_bridge -------------------------------------------------------------------------------

def run_torch(c, hidden, weight, bias, temp, ids, g, e, device, validate):
    import torch
    import torch_bridge
    dt = getattr(torch, c["dtype"])
    th = torch.tensor(hidden, dtype=dt, device=device, requires_grad=True)
    tw = torch.tensor(weight, dtype=dt, device=device, requires_grad=True)
    tb = None if bias is None else torch.tensor(bias, dtype=dt, device=device, requires_grad=True)
    tT = torch.tensor(temp, device=device, requires_grad=True) if isinstance(temp, np.ndarray) else temp
    tt = torch.from_numpy(np.asarray(ids, dtype=c["id_dtype"]).reshape(c["n"])).to(device)
    lp, ent = torch_bridge.linear_logp(th, tw, tt, bias=tb, temperature=tT, ignore_index=c["ignore_index"],
                                       real_vocab_size=c["real"], mode=c["mode"], backward=c["backward"],
                                       return_entropy=True, validate_targets=validate)
    ent = ent if c["entropy"] else torch.zeros_like(ent)
    gt, et = (torch.tensor(x, dtype=torch.float32, device=device) for x in (g, e))
    loss = (torch.nan_to_num(lp, nan=0.0) * gt).sum() + (torch.nan_to_num(ent, nan=0.0) * et).sum()
    named = {"hidden": th, "weight": tw, "bias": tb, "temperature": tT}
    named = {k: x for k, x in named.items() if isinstance(x, torch.Tensor)}
    grads = torch.autograd.grad(loss, list(named.values()), allow_unused=True) if loss.requires_grad else ()
    out = {k: (torch.zeros_like(x) if gr is None else gr).float().cpu().numpy() for (k, x), gr in zip(named.items(), grads)}
    seen = {k: x.detach().float().cpu().numpy() for k, x in named.items()}
    return dict(logp=lp.detach().cpu().numpy(), entropy=ent.detach().cpu().numpy(), grads=out), seen


def _torch_device(kind):
    torch = pytest.importorskip("torch", reason="torch is not installed: its half of the property test needs it")
    if kind == "gpu" and not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU (torch.cuda.is_available() is False)")
    return "cuda" if kind == "gpu" else "cpu"


TORCH_IDS = [np.int64, np.int32, np.int16, np.uint8, np.uint16, np.uint32, np.uint64]


def _torch_case(c, device, special=None):
    hidden, weight, bias, temp, ids, ref_ids, g, e = make(c, special)
    validate = c["seed"] % 2 == 0 and special is None
    real = c["real"] or c["v"]
    out_of_range = any(x != c["ignore_index"] and not 0 <= x < real for x in ids)
    try:
        got, seen = run_torch(c, hidden, weight, bias, temp, ids, g, e, device, validate)
    except ValueError as err:  # validate_targets: only, and always, for an out-of-range id
        assert validate and out_of_range and "is outside" in str(err), err
        return
    except RuntimeError as err:
        assert c["mode"] == "strict", err
        return
    assert not (validate and out_of_range), "validate_targets let an out-of-range id through"
    check(c, got, seen["hidden"], seen["weight"], seen.get("bias"), temp, ref_ids, g, e,
          contract_only=special is not None)


@pytest.mark.parametrize("kind", DEVICES)
def test_torch_against_oracle(kind):
    device = _torch_device(kind)

    @settings(max_examples=60, **SETTINGS)
    @given(cases(TORCH_IDS))
    def prop(c):
        _torch_case(c, device)
    prop()


@pytest.mark.parametrize("kind", DEVICES)
@pytest.mark.parametrize("special", SPECIALS)
def test_special_values_torch(kind, special):
    device = _torch_device(kind)

    @settings(**SPECIAL_SETTINGS)
    @given(cases([np.int64]))
    def prop(c):
        _torch_case(dict(c, bias=True) if special == "nan_bias" else c, device, special)
    prop()
