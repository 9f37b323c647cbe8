"""Modes (off / auto / strict / audit), route counters, and the provider contract (torch_bridge.provider)."""
import pytest

pytest.importorskip("torch", reason="torch is not installed: these tests need it")

import dataclasses

import torch

import _rlk_core
import oracle
import torch_bridge
from torch_bridge import provider as P
from torch_helpers import assert_grads, make_inputs, oracle_of, to_np


@pytest.fixture(autouse=True)
def fresh_counters():
    torch_bridge.reset_route_stats()
    P.reset_stats()
    yield
    torch_bridge.reset_route_stats()
    P.reset_stats()


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
    monkeypatch.setattr(_rlk_core, "has_cuda", False)

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


# ---- provider: dataclasses --------------------------------------------------------------------------

def _ctx(n=12, h=16, v=100, dtype="float32", bias=False, real=None, seed=5, requires_grad=False):
    d, kw, g, e = make_inputs(seed, n, h, v, dtype, bias=bias, real_vocab=real)
    hid, w = d["hidden"], d["weight"]
    b = kw.get("bias")
    if requires_grad:
        hid, w = hid.requires_grad_(), w.requires_grad_()
        b = None if b is None else b.requires_grad_()
    ctx = P.LinearLogpContext(hid, P.LinearProjection(w, b), P.VocabPartition(0, v, real or v, v))
    return ctx, d["targets"], g, e


def test_dataclasses_accept_valid_values():
    assert P.TokenLayout() == P.TokenLayout(1, 0, "single")
    P.TokenLayout(4, 3, "zigzag"), P.TokenLayout(2, 0, "allgather")
    ctx, t, _, _ = _ctx(bias=True)
    r = P.LinearLogpRequest(t, context=ctx, temperature=torch.full((12,), 0.7), log_prob_keep_mask=t >= 0,
                            with_entropy=True, with_entropy_grad=True, chunk_size=25, metadata={"step": 3})
    assert r.num_tokens == 12 and r.token_layout.layout == "single"


_w = torch.ones(10, 8)
_t = torch.zeros(4, dtype=torch.int64)
_ctx_ok = P.LinearLogpContext(torch.ones(4, 8), P.LinearProjection(_w), P.VocabPartition(0, 10, 10, 10))


@pytest.mark.parametrize("make,match", [
    (lambda: P.TokenLayout(0, 0, "single"), "world_size"),
    (lambda: P.TokenLayout(2, 2, "zigzag"), "rank"),
    (lambda: P.TokenLayout(2, -1, "zigzag"), "rank"),
    (lambda: P.TokenLayout(2, 0, "ring"), "layout"),
    (lambda: P.TokenLayout(2, 0, "single"), "layout"),
    (lambda: P.TokenLayout(1, 0, "zigzag"), "layout"),
    (lambda: P.TokenLayout(1.0, 0, "single"), "world_size"),
    (lambda: P.LinearProjection(torch.ones(10)), "weight"),
    (lambda: P.LinearProjection(torch.ones(10, 8, dtype=torch.int32)), "weight"),
    (lambda: P.LinearProjection("w"), "weight"),
    (lambda: P.LinearProjection(_w, torch.ones(9)), "bias"),
    (lambda: P.LinearProjection(_w, torch.ones(10, dtype=torch.float16)), "bias"),
    (lambda: P.LinearProjection(_w, torch.ones(10, device="meta")), "bias"),
    (lambda: P.VocabPartition(-1, 10, 10, 10), "local_start"),
    (lambda: P.VocabPartition(0, 0, 10, 10), "local_size"),
    (lambda: P.VocabPartition(0, 10, 0, 10), "real_size"),
    (lambda: P.VocabPartition(0, 10, 10, 0), "padded_size"),
    (lambda: P.VocabPartition(5, 10, 10, 10), "local_start \\+ local_size"),
    (lambda: P.VocabPartition(0, 10, 11, 10), "real_size"),
    (lambda: P.VocabPartition(0, 10, 10, 10.0), "padded_size"),
    (lambda: P.LinearLogpContext(torch.ones(4, 9), P.LinearProjection(_w), P.VocabPartition(0, 10, 10, 10)),
     "hidden"),
    (lambda: P.LinearLogpContext(torch.ones(4, 8).half(), P.LinearProjection(_w), P.VocabPartition(0, 10, 10, 10)),
     "hidden dtype"),
    (lambda: P.LinearLogpContext(torch.ones(4, 8, device="meta"), P.LinearProjection(_w),
                                 P.VocabPartition(0, 10, 10, 10)), "hidden is on"),
    (lambda: P.LinearLogpContext(torch.ones(4, 8), P.LinearProjection(_w), P.VocabPartition(0, 5, 10, 10)),
     "local_size"),
    (lambda: P.LinearLogpContext(torch.ones(4, 8), _w, P.VocabPartition(0, 10, 10, 10)), "projection"),
    (lambda: P.LinearLogpContext(torch.ones(4, 8), P.LinearProjection(_w), (0, 10, 10, 10)), "vocab_partition"),
    (lambda: P.LinearLogpRequest(torch.zeros(2, 2, dtype=torch.int64), context=_ctx_ok), "target_ids"),
    (lambda: P.LinearLogpRequest(torch.zeros(4), context=_ctx_ok), "target_ids"),
    (lambda: P.LinearLogpRequest(_t), "logits and context"),
    (lambda: P.LinearLogpRequest(_t, logits=torch.ones(3, 10)), "logits"),
    (lambda: P.LinearLogpRequest(_t, logits=torch.ones(4, 10, dtype=torch.int64)), "logits"),
    (lambda: P.LinearLogpRequest(_t, logits=torch.ones(4, 9), context=_ctx_ok), "logits"),
    (lambda: P.LinearLogpRequest(torch.zeros(5, dtype=torch.int64), context=_ctx_ok), "context.hidden"),
    (lambda: P.LinearLogpRequest(_t, context=_ctx_ok, token_layout=(1, 0, "single")), "token_layout"),
    (lambda: P.LinearLogpRequest(_t, context=_ctx_ok, with_entropy=1), "with_entropy"),
    (lambda: P.LinearLogpRequest(_t, context=_ctx_ok, with_entropy_grad=True), "with_entropy_grad"),
    (lambda: P.LinearLogpRequest(_t, context=_ctx_ok, log_prob_keep_mask=torch.ones(3, dtype=torch.bool)),
     "log_prob_keep_mask"),
    (lambda: P.LinearLogpRequest(_t, context=_ctx_ok, log_prob_keep_mask=torch.ones(4)), "log_prob_keep_mask"),
    (lambda: P.LinearLogpRequest(_t, context=_ctx_ok, temperature=0.0), "temperature"),
    (lambda: P.LinearLogpRequest(_t, context=_ctx_ok, temperature=-2), "temperature"),
    (lambda: P.LinearLogpRequest(_t, context=_ctx_ok, temperature=torch.tensor([1.0, 1.0, 0.0, 1.0])),
     "temperature"),
    (lambda: P.LinearLogpRequest(_t, context=_ctx_ok, temperature=torch.ones(3)), "temperature"),
    (lambda: P.LinearLogpRequest(_t, context=_ctx_ok, temperature=torch.ones(4, dtype=torch.int64)), "temperature"),
    (lambda: P.LinearLogpRequest(_t, context=_ctx_ok, chunk_size=0), "chunk_size"),
    (lambda: P.LinearLogpRequest(_t, context=_ctx_ok, metadata=[]), "metadata"),
    (lambda: P.LinearLogpRequest(_t, context=_ctx_ok, backward="eager"), "backward"),
    (lambda: P.LinearLogpRequest(_t, context=_ctx_ok, backward=None), "backward"),
    (lambda: P.LinearLogpRequest(_t, context=_ctx_ok, tensor_parallel_group=object()), "tensor_parallel_group"),
    (lambda: P.LinearLogpRequest(_t, context=P.LinearLogpContext(torch.ones(4, 8), P.LinearProjection(_w),
                                                                  P.VocabPartition(0, 10, 10, 20))),
     "vocab_partition"),
    (lambda: P.LinearLogpResult(torch.zeros(4), None, "rlk.cpu"), "logp"),
    (lambda: P.LinearLogpResult(torch.zeros(4, 1, dtype=torch.float64), None, "rlk.cpu"), "logp"),
    (lambda: P.LinearLogpResult(torch.zeros(4, 1), torch.zeros(3), "rlk.cpu"), "entropy"),
    (lambda: P.LinearLogpResult(torch.zeros(4, 1), torch.zeros(4).half(), "rlk.cpu"), "entropy"),
    (lambda: P.LinearLogpResult(torch.zeros(4, 1), None, ""), "backend_id"),
    (lambda: P.LinearLogpResult(torch.zeros(4, 1), None, "x", ""), "contract_id"),
    (lambda: P.LinearLogpResult(torch.zeros(4, 1), None, "x", "c", provenance=3), "provenance"),
])
def test_dataclasses_validate_naming_the_field(make, match):
    with pytest.raises(ValueError, match=match):
        make()


# ---- provider: modes --------------------------------------------------------------------------------

@pytest.mark.parametrize("backward", ["lean", "fast"])
@pytest.mark.parametrize("mode", P.MODES)
def test_every_mode_gives_the_oracle_values_and_gradients(mode, backward):
    ctx, t, g, e = _ctx(n=33, v=300, dtype="bfloat16", bias=True, real=290, requires_grad=True)
    temp = torch.linspace(0.5, 2.0, 33).requires_grad_()
    req = P.LinearLogpRequest(t, context=ctx, with_entropy=True, with_entropy_grad=True, temperature=temp,
                              backward=backward)
    r = P.compute_linear_logp(req, mode)
    assert r.logp.shape == (33, 1) and r.logp.dtype == torch.float32 and r.entropy.shape == (33,)
    assert r.contract_id == P.CONTRACT_ID and r.provenance["mode"] == mode
    assert r.provenance["backward"] == backward
    assert r.backend_id == ("native" if mode == "off" else "rlk.cpu")
    ((r.logp[:, 0] * g).sum() + (r.entropy * e).sum()).backward()
    fast = backward == "fast" and mode != "off"  # the native path ignores the strategy
    ref = oracle_of(dict(hidden=ctx.hidden, weight=ctx.projection.weight, targets=t),
                    dict(bias=ctx.projection.bias, temperature=temp.detach()), g, e, real_vocab=290,
                    kept_dtype="bfloat16" if fast else None)
    oracle.assert_values(to_np(r.logp[:, 0]), ref["logp"], "logp")
    oracle.assert_values(to_np(r.entropy), ref["entropy"], "entropy")
    assert_grads(dict(hidden=ctx.hidden.grad, weight=ctx.projection.weight.grad, bias=ctx.projection.bias.grad,
                      temperature=temp.grad), ref, "bfloat16")
    s = P.stats()
    assert s["calls"] == 1 and s["tokens"] == 33 and s["fallback_total"] == 0 and s["modes"] == {mode: 1}
    assert s["backend_ids"] == {r.backend_id: 1}
    cpu = torch_bridge.route_stats()["backends"]["cpu"]
    if mode != "off":  # our route ran our kernels, with the strategy asked for
        assert cpu["fwd_calls"] == 1 and cpu["bwd_calls"] == 1 and cpu["bwd_fast_calls"] == int(fast)


def test_off_from_logits_and_from_context_agree():
    ctx, t, g, _ = _ctx(n=20, v=128)
    logits = (ctx.hidden @ ctx.projection.weight.T).requires_grad_()
    r1 = P.compute_linear_logp(P.LinearLogpRequest(t, logits=logits, temperature=1.5), "off")
    r2 = P.compute_linear_logp(P.LinearLogpRequest(t, context=ctx, temperature=1.5), "off")
    torch.testing.assert_close(r1.logp, r2.logp, rtol=0, atol=1e-5)
    (r1.logp[:, 0] * g).sum().backward()  # gradient to the caller's logits: (onehot - p) / T
    p = torch.softmax(logits.detach() / 1.5, -1)
    want = (torch.nn.functional.one_hot(t, 128) - p) * g[:, None] / 1.5
    torch.testing.assert_close(logits.grad, want, rtol=1e-5, atol=1e-6)
    assert torch_bridge.route_stats()["backends"]["cpu"]["fwd_calls"] == 0  # nothing of ours ran


def test_auto_without_context_falls_back_with_reason_strict_refuses():
    ctx, t, _, _ = _ctx()
    logits = ctx.hidden @ ctx.projection.weight.T
    r = P.compute_linear_logp(P.LinearLogpRequest(t, logits=logits), "auto")
    assert r.backend_id == "native" and r.provenance["fallback_reason"] == "no context"
    assert P.stats()["fallbacks"] == {"no context": 1} and P.stats()["fallback_total"] == 1
    with pytest.raises(P.ProviderUnavailable, match="no context"):
        P.compute_linear_logp(P.LinearLogpRequest(t, logits=logits), "strict")
    r = P.compute_linear_logp(P.LinearLogpRequest(t, logits=logits), "audit")  # nothing to audit: native, counted
    assert r.backend_id == "native" and P.stats()["fallback_total"] == 2


def test_auto_unsupported_dtype_and_chunk_size_fall_back():
    ctx, t, _, _ = _ctx()
    c64 = P.LinearLogpContext(ctx.hidden.double(), P.LinearProjection(ctx.projection.weight.double()),
                              ctx.vocab_partition)
    r = P.compute_linear_logp(P.LinearLogpRequest(t, context=c64), "auto")
    assert r.backend_id == "native" and "float64" in r.provenance["fallback_reason"]
    r = P.compute_linear_logp(P.LinearLogpRequest(t, context=ctx, chunk_size=7), "auto")
    assert r.backend_id == "native" and "chunk_size 7" in r.provenance["fallback_reason"]
    assert P.unavailable_reason(P.LinearLogpRequest(t, context=ctx, chunk_size=25)) is None  # 100 / 4
    assert P.stats()["fallback_total"] == 2
    for req in (P.LinearLogpRequest(t, context=c64), P.LinearLogpRequest(t, context=ctx, chunk_size=7)):
        with pytest.raises(P.ProviderUnavailable):
            P.compute_linear_logp(req, "strict")


@pytest.mark.parametrize("mode", ["auto", "strict", "audit"])
def test_provider_kernel_bug_propagates(monkeypatch, mode):
    ctx, t, _, _ = _ctx()
    monkeypatch.setattr(_rlk_core, "forward", _boom)
    with pytest.raises(RuntimeError, match="simulated kernel bug"):
        P.compute_linear_logp(P.LinearLogpRequest(t, context=ctx, logits=ctx.hidden @ ctx.projection.weight.T), mode)
    assert P.stats()["fallback_total"] == 0 and P.stats()["calls"] == 0


def test_strict_rejects_malformed_output_detached_gradients_and_route_mismatch(monkeypatch):
    ctx, t, _, _ = _ctx(requires_grad=True)
    req = P.LinearLogpRequest(t, context=ctx, with_entropy=True, with_entropy_grad=True)
    good = P._ours
    monkeypatch.setattr(P, "_ours", lambda r: (good(r)[0][:-1], good(r)[1]))
    with pytest.raises(RuntimeError, match="malformed logp"):
        P.compute_linear_logp(req, "strict")
    monkeypatch.setattr(P, "_ours", lambda r: (good(r)[0], good(r)[1][:3]))
    with pytest.raises(RuntimeError, match="malformed entropy"):
        P.compute_linear_logp(req, "strict")
    monkeypatch.setattr(P, "_ours", lambda r: (good(r)[0].double(), good(r)[1]))
    with pytest.raises(RuntimeError, match="malformed logp"):
        P.compute_linear_logp(req, "strict")
    monkeypatch.setattr(P, "_ours", lambda r: (good(r)[0].detach(), good(r)[1]))
    with pytest.raises(RuntimeError, match="detached"):
        P.compute_linear_logp(req, "strict")
    monkeypatch.setattr(P, "_ours", lambda r: (good(r)[0], good(r)[1].detach()))
    with pytest.raises(RuntimeError, match="detached"):
        P.compute_linear_logp(req, "strict")
    with torch.no_grad():  # no grad asked for: a detached output is right
        monkeypatch.setattr(P, "_ours", lambda r: (good(r)[0].detach(), good(r)[1].detach()))
        P.compute_linear_logp(req, "strict")
    monkeypatch.setattr(P, "_ours", good)
    monkeypatch.setattr(P, "_kernel_ran", lambda before, after: "cuda_sm90")
    with pytest.raises(RuntimeError, match="route mismatch"):
        P.compute_linear_logp(req, "strict")
    monkeypatch.setattr(P, "_kernel_ran", lambda before, after: None)
    with pytest.raises(RuntimeError, match="route mismatch"):
        P.compute_linear_logp(req, "strict")


def test_audit_records_dlogp_against_native():
    ctx, t, _, _ = _ctx(n=64, v=500)
    keep = torch.arange(64) % 5 != 0
    req = P.LinearLogpRequest(t, context=ctx, log_prob_keep_mask=keep)
    ours = P.compute_linear_logp(req, "auto")
    audited = P.compute_linear_logp(req, "audit")
    assert torch.equal(ours.logp, audited.logp) and audited.backend_id == "rlk.cpu"
    a = P.stats()["audit"]
    assert a["calls"] == 1 and a["rows"] == 64 and a["mismatch_count"] + a["bitwise_equal_count"] == 64
    assert a["bitwise_equal_count"] >= int((~keep).sum())  # masked rows are exactly 0 on both routes
    assert 0 <= a["mean_abs_dlogp"] and a["p99_abs_dlogp"] <= a["max_abs_dlogp"] < 1e-4
    assert audited.provenance["audit"]["rows"] == 64
    P.reset_stats()
    assert P.stats()["audit"]["calls"] == 0 and P.stats()["calls"] == 0


def test_keep_mask_and_entropy_grad_semantics():
    ctx, t, g, e = _ctx(requires_grad=True)
    keep = torch.tensor([True, False] * 6)
    r = P.compute_linear_logp(P.LinearLogpRequest(t, context=ctx, log_prob_keep_mask=keep, with_entropy=True), "auto")
    assert (r.logp[~keep] == 0).all() and (r.entropy[~keep] == 0).all() and (r.logp[keep] < 0).all()
    assert r.logp.requires_grad and not r.entropy.requires_grad  # with_entropy_grad=False: entropy detached
    (r.logp[:, 0] * g).sum().backward()
    assert (ctx.hidden.grad[~keep] == 0).all() and (ctx.hidden.grad[keep] != 0).any()
    r = P.compute_linear_logp(P.LinearLogpRequest(t, context=ctx, with_entropy=False), "auto")
    assert r.entropy is None


def test_provenance_and_token_layout():
    ctx, t, _, _ = _ctx()
    req = P.LinearLogpRequest(t, context=ctx, token_layout=P.TokenLayout(2, 1, "zigzag"), metadata={"step": 7})
    r = P.compute_linear_logp(req, "strict")
    p = r.provenance
    assert p["route"] == "rlk" and p["kernel"] == "cpu" and p["token_layout"] == (2, 1, "zigzag")
    assert p["metadata"] == {"step": 7} and p["chunk"] == 25 and p["tp_size"] == 1 and p["fallback_reason"] is None
    assert dataclasses.is_dataclass(r)
