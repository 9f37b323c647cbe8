"""Property-based test (hypothesis) of issue 44's rules, both frontends: temperature arrays with
invalid entries (negative, 0, +inf, NaN: NaN rows, the other rows exact), hidden size 0 (logp from
the bias alone, exact) and ids of every width (numpy's int64 included: beyond int32 or negative a
NaN row, ignore_index 0, no warning). The TP shape checks' property runs on gloo in
test_torch_tp_checks.py. Derandomized, no example database, bounded examples (seconds)."""
import warnings

import numpy as np
import pytest

pytest.importorskip("hypothesis", reason="hypothesis is not installed: the property test needs it")
torch = pytest.importorskip("torch", reason="torch is not installed: these tests need it")
jax = pytest.importorskip("jax", reason="jax is not installed: these tests need it")
from hypothesis import HealthCheck, given, settings, strategies as st  # noqa: E402

import jax.numpy as jnp  # noqa: E402

import rlk_xla  # noqa: E402
import torch_bridge  # noqa: E402

SETTINGS = dict(derandomize=True, database=None, deadline=None, max_examples=20,
                suppress_health_check=[HealthCheck.too_slow])
DTYPES = ["float32", "bfloat16", "float16"]
BAD_TEMPS = [-1.0, -1e-3, 0.0, float("inf"), float("nan")]


def _oracle(hidden, weight, bias, temp, ids, ignore_index=-100):
    """float64 logp of fp32-exact inputs; NaN for an id outside [0, V), 0 for ignore_index."""
    z = hidden.astype(np.float64) @ weight.astype(np.float64).T
    if bias is not None:
        z = z + bias.astype(np.float64)
    z = z / np.asarray(temp, np.float64).reshape(-1, 1)
    m = z.max(axis=1, keepdims=True)
    lse = (m + np.log(np.exp(z - m).sum(axis=1, keepdims=True)))[:, 0]
    out = np.full(len(ids), np.nan)
    for i, t in enumerate(ids):
        out[i] = 0.0 if t == ignore_index else z[i, t] - lse[i] if 0 <= t < z.shape[1] else np.nan
    return out


def _both(hidden, weight, ids, dtype, **kw):
    """logp of rlk_xla and torch_bridge (float64 numpy) for numpy inputs taken as `dtype`."""
    jd, td = jnp.dtype(dtype), getattr(torch, dtype)
    jkw = {k: (jnp.asarray(v, jd if k == "bias" else jnp.float32) if isinstance(v, np.ndarray) else v)
           for k, v in kw.items()}
    tkw = {k: (torch.tensor(v).to(td if k == "bias" else torch.float32) if isinstance(v, np.ndarray) else v)
           for k, v in kw.items()}
    j = rlk_xla.linear_logp(jnp.asarray(hidden, jd), jnp.asarray(weight, jd), ids, **jkw)
    t = torch_bridge.linear_logp(torch.tensor(hidden).to(td), torch.tensor(weight).to(td), torch.as_tensor(ids),
                                 validate_targets=False, **tkw)
    return np.asarray(j, np.float64), t.double().numpy()


def _as(dtype, x):
    """x rounded to `dtype`, back in float32 (the values the kernels see)."""
    return torch.tensor(x, dtype=torch.float32).to(getattr(torch, dtype)).float().numpy()


@settings(**SETTINGS)
@given(n=st.integers(1, 12), v=st.integers(1, 80), h=st.integers(1, 20), dtype=st.sampled_from(DTYPES),
       bad=st.lists(st.sampled_from([None] * 3 + BAD_TEMPS), min_size=12, max_size=12), seed=st.integers(0, 999))
def test_temperature_arrays(n, v, h, dtype, bad, seed):
    rng = np.random.default_rng(seed)
    hidden, weight = _as(dtype, rng.standard_normal((n, h))), _as(dtype, rng.standard_normal((v, h)))
    temp = rng.uniform(0.3, 2.0, n).astype(np.float32)
    invalid = np.array([b is not None for b in bad[:n]])
    temp[invalid] = [b for b in bad[:n] if b is not None]
    ids = rng.integers(0, v, n)
    want = _oracle(hidden, weight, None, np.where(invalid, 1.0, temp), ids)
    for got in _both(hidden, weight, ids, dtype, temperature=temp):
        assert np.isnan(got[invalid]).all()
        np.testing.assert_allclose(got[~invalid], want[~invalid], rtol=2e-5, atol=2e-5)


@settings(**SETTINGS)
@given(n=st.integers(1, 12), v=st.integers(1, 80), dtype=st.sampled_from(DTYPES), bias=st.booleans(),
       temp=st.sampled_from(["scalar", "array"]), seed=st.integers(0, 999))
def test_hidden_size_zero(n, v, dtype, bias, temp, seed):
    rng = np.random.default_rng(seed)
    b = _as(dtype, rng.standard_normal(v) * 4) if bias else None
    T = float(rng.uniform(0.3, 2.0)) if temp == "scalar" else rng.uniform(0.3, 2.0, n).astype(np.float32)
    ids = rng.integers(0, v, n)
    empty_h, empty_w = np.zeros((n, 0), np.float32), np.zeros((v, 0), np.float32)
    want = _oracle(empty_h, empty_w, b, np.broadcast_to(np.float32(T), (n,)), ids)
    kw = dict(temperature=T) | (dict(bias=b) if bias else {})
    for got in _both(empty_h, empty_w, ids, dtype, **kw):
        np.testing.assert_allclose(got, want, rtol=0, atol=4e-6)


ID_KINDS = ["valid"] * 4 + ["ignore", "negative", "past_vocab", "past_int32", "past_uint32"]


@settings(**SETTINGS)
@given(kinds=st.lists(st.sampled_from(ID_KINDS), min_size=1, max_size=10),
       id_dtype=st.sampled_from(["int64", "int32", "int16", "uint8", "uint32"]), seed=st.integers(0, 999))
def test_id_widths(kinds, id_dtype, seed):
    rng = np.random.default_rng(seed)
    n, v, h = len(kinds), 37, 8
    hidden, weight = rng.standard_normal((n, h)).astype(np.float32), rng.standard_normal((v, h)).astype(np.float32)
    info = np.iinfo(id_dtype)
    ids = []
    for k in kinds:
        x = {"valid": int(rng.integers(0, min(v, info.max))), "ignore": -100, "negative": -int(rng.integers(1, 99)),
             "past_vocab": v + int(rng.integers(0, 99)), "past_int32": 2 ** 31 + 7, "past_uint32": 2 ** 32 + 5}[k]
        ids.append(x if info.min <= x <= info.max else int(info.max))
    t = np.array(ids, dtype=id_dtype)
    want = _oracle(hidden, weight, None, np.ones(n), ids)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no dtype warning from our code on numpy ids (int64 included)
        got_j, got_t = _both(hidden, weight, t, "float32")
    for got in (got_j, got_t):
        np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
        np.testing.assert_allclose(got[~np.isnan(want)], want[~np.isnan(want)], rtol=2e-5, atol=2e-5)
