"""The route log (rlk_common.routes): one schema for both frontends and the vime provider (with
its extra keys), the audit's NaN and bitwise rules on hand-made rows, the p99 window's bound, and
reset."""
import importlib

import numpy as np
import pytest

from rlk_common import COUNT_NAMES
from rlk_common.routes import AuditLog, RequestLog, RouteLog, audit_diff

F32_MIN_STEP = float(np.spacing(np.float32(1.0)))
NAN_PAYLOAD = np.array([0x7FC00001], np.uint32).view(np.float32)[0]  # a NaN with other bits than np.nan


class FakeCore:
    """The compiled module's route counters, as _rlk_core returns them."""

    def __init__(self, counts):
        self.counts = counts

    def route_counts(self):
        return self.counts

    def reset_route_counts(self):
        self.counts = {name: (0,) * len(COUNT_NAMES) for name in self.counts}


def _keys(stats: dict) -> dict:
    return {k: sorted(v) if k in ("audit", "reference") else None for k, v in stats.items()}


def _frontend(name: str):
    pytest.importorskip({"rlk_xla": "jax", "torch_bridge": "torch"}[name],
                        reason=f"{name} needs {'jax' if name == 'rlk_xla' else 'torch'}, which is not installed")
    return importlib.import_module(name)


@pytest.mark.parametrize("name", ["rlk_xla", "torch_bridge"])
def test_both_frontends_return_the_common_schema(name):
    fe = _frontend(name)
    fe.reset_route_stats()
    s = fe.route_stats()
    assert _keys(s) == _keys(RouteLog().stats(FakeCore({})))
    assert s["audit"]["p99_abs_dlogp"] == 0.0 and s["backend_id"] is None and s["calls"] == 0
    assert all(sorted(b) == sorted(COUNT_NAMES) for b in s["backends"].values())


def test_the_vime_provider_returns_the_common_schema_and_its_extra_keys():
    _frontend("torch_bridge")
    from torch_bridge import vime
    vime.reset_stats()
    s = vime.stats()
    common = RouteLog().stats(FakeCore({}))
    assert _keys({k: v for k, v in s.items() if k in common}) == _keys(common)
    assert sorted(set(s) - set(common)) == ["backend_ids", "modes", "requests", "route_reasons"]
    assert s["requests"] == {"calls": 0, "tokens": 0} and s["fallback_total"] == 0 and s["backend_id"] is None


@pytest.mark.parametrize("name", ["rlk_xla", "torch_bridge"])
def test_frontends_audit_the_same_rows_alike(name):
    fe = _frontend(name)
    ours, ref = [np.nan, 1.0, 0.0, 2.0], [np.nan, 1.5, -0.0, 2.0]
    fe.reset_route_stats()
    if name == "rlk_xla":
        import jax
        import jax.numpy as jnp
        fe.routes.record_audit(jnp.array(ours, jnp.float32), jnp.array(ref, jnp.float32))
        jax.effects_barrier()
    else:
        import torch
        fe.routes.record_audit(torch.tensor(ours, dtype=torch.bfloat16), torch.tensor(ref, dtype=torch.bfloat16))
    a = fe.route_stats()["audit"]
    fe.reset_route_stats()
    expect = AuditLog()
    expect.record(*audit_diff(ours, ref))
    assert a == expect.summary()
    assert a["equal_rows"] == 2 and a["unequal_rows"] == 2 and a["max_abs_dlogp"] == 0.5


def test_audit_diff_compares_fp32_bits_and_counts_nan_pairs_equal():
    ours = np.array([0.0, -0.0, np.nan, np.nan, 1.0, -np.inf, -np.inf, 1.0, 2.0, 1.0 + 1e-12])
    ref = np.array([0.0, 0.0, NAN_PAYLOAD, 1.0, 1.0 + F32_MIN_STEP, -np.inf, 0.0, np.nan, 2.0, 1.0])
    d, equal = audit_diff(ours, ref)
    # -0 vs 0: other bits; NaN vs NaN (any payload): equal; float64 inputs compare as fp32
    np.testing.assert_array_equal(equal, [True, False, True, False, False, True, False, False, True, True])
    assert d.dtype == np.float64
    np.testing.assert_array_equal(d, [0.0, 0.0, 0.0, np.nan, F32_MIN_STEP, np.nan, np.inf, np.nan, 0.0, 0.0])


def test_audit_log_sums_rows_and_leaves_nan_out_of_the_figures():
    log = AuditLog()
    call = log.record(np.array([0.0, 1.0, np.nan, 3.0]), np.array([True, False, False, False]))
    assert call == {"rows": 4, "max_abs_dlogp": 3.0, "mean_abs_dlogp": 4.0 / 3.0,
                    "p99_abs_dlogp": float(np.quantile([0.0, 1.0, 3.0], 0.99)),
                    "bitwise_equal_count": 1, "mismatch_count": 3}
    log.record(np.array([np.nan]), np.array([False]))  # no |dlogp| at all: a row, unequal, no figure
    s = log.summary()
    assert (s["calls"], s["rows"], s["equal_rows"], s["unequal_rows"]) == (2, 5, 1, 4)
    assert (s["bitwise_equal_count"], s["mismatch_count"]) == (1, 4)
    assert (s["sum_abs_dlogp"], s["max_abs_dlogp"], s["mean_abs_dlogp"]) == (4.0, 3.0, 4.0 / 5)
    assert s["p99_abs_dlogp"] == call["p99_abs_dlogp"]


def test_p99_is_over_the_most_recent_window_rows():
    log = AuditLog()
    log.WINDOW = 4
    log.record(np.full(3, 100.0), np.zeros(3, bool))
    log.record(np.full(4, 1.0), np.zeros(4, bool))  # pushes the older call out of the window
    s = log.summary()
    assert s["p99_abs_dlogp"] == 1.0 and s["max_abs_dlogp"] == 100.0 and s["rows"] == 7
    log.record(np.array([100.0, 2.0, 2.0, 2.0, 2.0]), np.zeros(5, bool))  # one call above the window: its last rows
    assert log.summary()["p99_abs_dlogp"] == 2.0 and log._window_rows == 5


def test_route_log_counts_and_reset():
    core = FakeCore({"cpu": (2, 20, 1, 20, 0)})
    log = RouteLog()
    log.count_reference(5, "dtype float64")
    log.count_reference(3, None)  # mode off: no fallback
    log.count_reference(2, "")    # torch's op passes "" for none
    log.note_backend("cpu")
    log.record_audit(np.array([1.0]), np.array([1.0]))
    s = log.stats(core)
    assert (s["calls"], s["tokens"], s["backend_id"]) == (5, 30, "cpu")
    assert s["reference"] == {"calls": 3, "tokens": 10}
    assert s["fallbacks"] == {"dtype float64": 1} and s["fallback_total"] == 1
    assert s["backends"] == {"cpu": dict(zip(COUNT_NAMES, (2, 20, 1, 20, 0)))}
    assert s["audit"]["calls"] == 1 and s["audit"]["equal_rows"] == 1
    log.reset(core)
    s = log.stats(core)
    assert (s["calls"], s["tokens"], s["backend_id"], s["fallbacks"], s["fallback_total"]) == (0, 0, None, {}, 0)
    assert s["reference"] == {"calls": 0, "tokens": 0} and s["backends"]["cpu"]["fwd_calls"] == 0
    assert s["audit"] == AuditLog().summary()


def test_request_log_counts_requests_on_the_common_keys_and_resets():
    core = FakeCore({"cpu": (1, 7, 0, 0, 0)})
    log = RequestLog()
    log.count_request("auto", 7, "rlk.fused.cpu")
    log.count_fallback("no context")  # a request none of our routes served
    log.count_request("auto", 4, None)
    log.count_reference(3, None)      # mode off
    log.count_request("off", 3, "rlk.reference.cpu")
    s = log.stats(core)
    assert s["requests"] == {"calls": 3, "tokens": 14} and s["modes"] == {"auto": 2, "off": 1}
    assert s["backend_ids"] == {"rlk.fused.cpu": 1, "rlk.reference.cpu": 1} and s["backend_id"] == "rlk.reference.cpu"
    assert s["fallbacks"] == {"no context": 1} and s["fallback_total"] == 1
    assert s["reference"] == {"calls": 1, "tokens": 3} and (s["calls"], s["tokens"]) == (2, 10)
    log.reset(core)
    assert log.stats(core) == RequestLog().stats(core)
    assert log.stats(core)["requests"] == {"calls": 0, "tokens": 0} and log.stats(core)["calls"] == 0
