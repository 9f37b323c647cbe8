"""Modes (off / auto / strict / audit) and route counters of torch_bridge.linear_logp (the vime provider's modes: test_vime.py)."""
import pytest

pytest.importorskip("torch", reason="torch is not installed: these tests need it")

import torch

import _rlk_core
import oracle
import torch_bridge
from torch_helpers import make_inputs, to_np


@pytest.fixture(autouse=True)
def fresh_counters():
    torch_bridge.reset_route_stats()
    yield
    torch_bridge.reset_route_stats()


def _boom(*args, **kwargs):
    raise RuntimeError("rlk: simulated kernel bug")


# ---- linear_logp modes ----------------------------------------------------------------------------

def test_counters_calls_tokens_backends_and_reset():
    d, _, _, _ = make_inputs(0, 40, 32, 300)
    h = d["hidden"].clone().requires_grad_()
    for _ in range(3):
        out = torch_bridge.linear_logp(h, d["weight"], d["targets"])
    out.sum().backward()
    s = torch_bridge.route_stats()
    # backward="auto" at 40 x 300 keeps the logits: the backward is the fast one
    assert s["backends"]["cpu"] == {"fwd_calls": 3, "fwd_tokens": 120, "bwd_calls": 1, "bwd_tokens": 40,
                                    "bwd_fast_calls": 1}
    assert s["calls"] == 3 and s["tokens"] == 120 and s["backend_id"] == "cpu"
    assert s["fallback_total"] == 0 and s["reference"] == {"calls": 0, "tokens": 0}
    torch_bridge.reset_route_stats()
    s = torch_bridge.route_stats()
    assert s["calls"] == 0 and s["backends"]["cpu"]["fwd_calls"] == 0 and s["backend_id"] is None


def test_off_runs_the_reference(monkeypatch):
    d, _, _, _ = make_inputs(1, 10, 16, 100)
    out = torch_bridge.linear_logp(d["hidden"], d["weight"], d["targets"], mode="off")
    assert torch.equal(out, torch_bridge.reference.linear_logp(d["hidden"], d["weight"], d["targets"]))
    monkeypatch.setenv("RLK_MODE", "off")
    torch_bridge.linear_logp(d["hidden"], d["weight"], d["targets"])
    s = torch_bridge.route_stats()
    assert s["reference"] == {"calls": 2, "tokens": 20} and s["fallback_total"] == 0
    assert s["backends"]["cpu"]["fwd_calls"] == 0 and s["backend_id"] == "reference"
    monkeypatch.setenv("RLK_MODE", "nonsense")
    with pytest.raises(ValueError, match="RLK_MODE"):
        torch_bridge.linear_logp(d["hidden"], d["weight"], d["targets"])


def test_auto_falls_back_with_a_reason_and_strict_refuses():
    d, _, g, _ = make_inputs(2, 12, 16, 100, "float32")
    h = d["hidden"].double().requires_grad_()
    w = d["weight"].double()
    out = torch_bridge.linear_logp(h, w, d["targets"], mode="auto")
    assert out.dtype == torch.float32
    (out * g).sum().backward()  # the fallback is differentiable too
    ref = oracle.linear_logp(to_np(d["hidden"]), to_np(d["weight"]), d["targets"].numpy(), g=g.numpy())
    oracle.assert_values(to_np(out), ref["logp"], "logp")
    oracle.assert_grad(h.grad.numpy(), ref["dh"], "float32", "d hidden", ref["dh_abs"])
    s = torch_bridge.route_stats()
    assert s["fallback_total"] == 1 and list(s["fallbacks"]) == ["dtype float64 (supported: bfloat16, float16, float32)"]
    assert s["reference"] == {"calls": 1, "tokens": 12} and s["backends"]["cpu"]["fwd_calls"] == 0
    with pytest.raises(RuntimeError, match="strict.*float64"):
        torch_bridge.linear_logp(h, w, d["targets"], mode="strict")


def test_unsupported_device_and_build_reasons(monkeypatch):
    from torch_bridge._args import unsupported
    assert unsupported(torch.empty(1, device="meta")) == "device meta (supported: cpu, cuda)"
    assert unsupported(torch.empty(1)) is None
    import torch_bridge._args as args  # a build without the CUDA backend, whatever this one has
    cuda = dict(args.PLATFORMS["cuda"], supported=False,
                reason="this build of _rlk_core has no CUDA backend (built without nvcc, or with RLK_CUDA=OFF)")
    monkeypatch.setattr(args, "PLATFORMS", dict(args.PLATFORMS, cuda=cuda))
    monkeypatch.setattr(args, "_KERNEL_DEVICES", args._KERNEL_DEVICES - {"cuda"})  # derived at import

    class FakeCuda:
        dtype = torch.float32
        device = torch.device("cuda", 0)
    assert "no CUDA backend" in unsupported(FakeCuda())


def test_strict_runs_the_kernels():
    d, _, _, _ = make_inputs(3, 12, 16, 100)
    torch_bridge.linear_logp(d["hidden"], d["weight"], d["targets"], mode="strict")
    assert torch_bridge.route_stats()["backends"]["cpu"]["fwd_calls"] == 1


@pytest.mark.parametrize("mode", ["auto", "strict", "audit"])
def test_a_kernel_bug_is_raised_never_swallowed(monkeypatch, mode):
    d, _, _, _ = make_inputs(4, 12, 16, 100)
    monkeypatch.setattr(_rlk_core, "forward", _boom)
    with pytest.raises(RuntimeError, match="simulated kernel bug"):
        torch_bridge.linear_logp(d["hidden"], d["weight"], d["targets"], mode=mode)
    assert torch_bridge.route_stats()["fallback_total"] == 0


def test_audit_returns_fused_and_records_the_difference():
    d, _, _, _ = make_inputs(4, 64, 32, 500, "float32", ignore_frac=0.2)
    ours = torch_bridge.linear_logp(d["hidden"], d["weight"], d["targets"])
    audited = torch_bridge.linear_logp(d["hidden"], d["weight"], d["targets"], mode="audit")
    assert torch.equal(ours, audited)
    a = torch_bridge.route_stats()["audit"]
    assert a["calls"] == 1 and a["rows"] == 64 and a["bitwise_equal_count"] + a["mismatch_count"] == 64
    assert 0 <= a["max_abs_dlogp"] < 1e-4 and a["mean_abs_dlogp"] <= a["p99_abs_dlogp"] + 1e-12
    assert a["p99_abs_dlogp"] <= a["max_abs_dlogp"]
    assert a["bitwise_equal_count"] >= int((d["targets"] == -100).sum())  # ignored rows: both exactly 0
    assert torch_bridge.route_stats()["reference"]["calls"] == 0  # the audit's reference is not a route
