"""Modes (off / auto / strict / audit) and route counters, counted when the program runs."""
import pytest

pytest.importorskip("jax", reason="jax is not installed: these tests need it")

import jax
import jax.numpy as jnp
import numpy as np

import rlk_xla
from jax_helpers import make_inputs


@pytest.fixture(autouse=True)
def fresh_counters():
    rlk_xla.reset_route_stats()
    yield
    rlk_xla.reset_route_stats()


def test_counts_happen_at_run_time_not_trace_time():
    d, _, _, _ = make_inputs(0, 40, 32, 300)
    f = jax.jit(lambda h, w, t: rlk_xla.linear_logp(h, w, t))
    f.lower(d["hidden"], d["weight"], d["targets"])  # tracing alone counts nothing
    assert rlk_xla.route_stats()["backends"]["cpu"]["fwd_calls"] == 0
    for _ in range(3):
        jax.block_until_ready(f(d["hidden"], d["weight"], d["targets"]))
    s = rlk_xla.route_stats()
    assert s["backends"]["cpu"]["fwd_calls"] == 3 and s["backends"]["cpu"]["fwd_tokens"] == 120
    assert s["fallback_total"] == 0 and s["reference"]["calls"] == 0
    jax.block_until_ready(jax.grad(lambda h: rlk_xla.linear_logp(h, d["weight"], d["targets"]).sum())(d["hidden"]))
    assert rlk_xla.route_stats()["backends"]["cpu"]["bwd_calls"] == 1


def test_off_runs_the_reference(monkeypatch):
    d, _, _, _ = make_inputs(1, 10, 16, 100)
    out = rlk_xla.linear_logp(d["hidden"], d["weight"], d["targets"], mode="off")
    np.testing.assert_array_equal(out, rlk_xla.reference.linear_logp(d["hidden"], d["weight"], d["targets"]))
    monkeypatch.setenv("RLK_MODE", "off")
    rlk_xla.linear_logp(d["hidden"], d["weight"], d["targets"]).block_until_ready()
    s = rlk_xla.route_stats()
    assert s["reference"] == {"calls": 2, "tokens": 20} and s["fallback_total"] == 0
    assert s["backends"]["cpu"]["fwd_calls"] == 0


def test_auto_falls_back_with_a_reason_and_strict_refuses():
    jax.config.update("jax_enable_x64", True)
    try:
        d, _, _, _ = make_inputs(2, 12, 16, 100, "float32")
        h, w = d["hidden"].astype(jnp.float64), d["weight"].astype(jnp.float64)
        out = rlk_xla.linear_logp(h, w, d["targets"], mode="auto")
        assert out.dtype == jnp.float32 or out.dtype == jnp.float64
        s = rlk_xla.route_stats()
        assert s["fallback_total"] == 1 and any("float64" in r for r in s["fallbacks"])
        with pytest.raises(RuntimeError, match="strict"):
            rlk_xla.linear_logp(h, w, d["targets"], mode="strict")
    finally:
        jax.config.update("jax_enable_x64", False)


def test_strict_runs_the_kernels():
    d, _, _, _ = make_inputs(3, 12, 16, 100)
    rlk_xla.linear_logp(d["hidden"], d["weight"], d["targets"], mode="strict").block_until_ready()
    assert rlk_xla.route_stats()["backends"]["cpu"]["fwd_calls"] == 1


def test_audit_returns_fused_and_records_the_difference():
    d, _, _, _ = make_inputs(4, 64, 32, 500, "float32", ignore_frac=0.2)
    ours = rlk_xla.linear_logp(d["hidden"], d["weight"], d["targets"])
    audited = jax.jit(lambda h, w, t: rlk_xla.linear_logp(h, w, t, mode="audit"))(d["hidden"], d["weight"], d["targets"])
    np.testing.assert_array_equal(np.asarray(ours), np.asarray(audited))
    a = rlk_xla.route_stats()["audit"]
    assert a["calls"] == 1 and a["rows"] == 64 and a["equal_rows"] + a["unequal_rows"] == 64
    assert 0 <= a["max_abs_dlogp"] < 1e-4 and a["mean_abs_dlogp"] <= a["p99_abs_dlogp"] + 1e-12
    assert a["p99_abs_dlogp"] <= a["max_abs_dlogp"]
    assert a["equal_rows"] >= int((np.asarray(d["targets"]) == -100).sum())  # ignored rows: both exactly 0
