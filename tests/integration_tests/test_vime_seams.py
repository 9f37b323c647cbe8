"""The vime provider's seams, tried as vime does it (tests/vime_side.py: vime's checks, its load / call /
normalize / validate order, its auto and strict): every request either gets vime's native numbers (or
float64's) or an error that names the field and is not vime's unavailable marker. One test per case
of issue 43's list: temperature, a context that disagrees with the logits, a lost policy gradient, the
nucleus sent as ids, contradicting metadata, malformed context objects, injected bad outputs; then
the route switch, vime's mode names and the seed's stats keys. Sequence parallelism and the nucleus
at TP = 2: test_vime_tp.py."""
import math
from types import SimpleNamespace

import pytest

pytest.importorskip("torch", reason="torch is not installed: these tests need it")

import numpy as np
import torch

import oracle
import vime_side
from torch_bridge import vime

F64 = torch.float64
DT = {"bfloat16": torch.bfloat16, "float32": torch.float32}
MODES = ("auto", "strict", "audit")


@pytest.fixture(autouse=True)
def fresh(monkeypatch):
    for k in ("RLK_MODE", "RL_KERNEL_MODE", "RLK_VIME_ROUTE"):
        monkeypatch.delenv(k, raising=False)
    vime.reset_stats()
    yield


def _megatron(seed, n=37, h=24, v=130, dtype="float32", scale=3.0):
    """Leaves hidden [n, h], weight [v, h], bias [v] in dtype; targets; upstream grads g, e."""
    gen = torch.Generator().manual_seed(seed)
    dt = DT[dtype]
    hidden = torch.randn(n, h, generator=gen).to(dt).requires_grad_()
    weight = (torch.randn(v, h, generator=gen) * scale / h ** 0.5).to(dt).requires_grad_()
    bias = torch.randn(v, generator=gen).to(dt).requires_grad_()
    targets = torch.randint(0, v, (n,), generator=gen)
    return hidden, weight, bias, targets, torch.randn(n, generator=gen), torch.randn(n, generator=gen)


def _output_layer(hidden, weight, bias):
    """Megatron's output layer: the GEMM in the inputs' dtype (bf16 rounds its output), then fp32."""
    return torch.nn.functional.linear(hidden, weight, bias).float()


def _vime_request(x, *, temperature=0.7, scaled=True, hidden=None, **kw):
    """A request as vime's loss builds it: fp32 logits divided by the rollout temperature (scaled),
    the context (the output layer's input and weights)."""
    h, w, b, t = x[:4]
    z = _output_layer(h, w, b)
    meta = {"logits_are_temperature_scaled": scaled, **kw.pop("metadata", {})}
    return vime_side.request(t, logits=z / temperature if scaled else z, hidden=h if hidden is None else hidden,
                             weight=w, bias=b, temperature=temperature, metadata=meta, **kw)


def _loss(logp, ent, g, e):
    return (logp[:, 0].nan_to_num(0.0, 0.0, 0.0) * g).sum() + (ent * e).sum()


def _is_marker(exc):
    return getattr(exc, "linear_logp_provider_unavailable", False)


def _raises_named(req, field, *, modes=MODES, exc=ValueError, monkeypatch=None):
    """In every mode, through vime's auto and strict: `exc` naming `field`, never the marker."""
    for mode in modes:
        for vime_mode in ("auto", "strict"):
            if monkeypatch is not None:
                monkeypatch.setenv("RLK_MODE", mode)
            with pytest.raises(exc, match=field) as info:
                vime_side.compute(req, vime_mode=vime_mode)
            assert not _is_marker(info.value)


# ---- temperature ---------------------------------------------------------------------------------

def test_pre_scaled_logits_with_no_temperature_are_refused(monkeypatch):
    x = _megatron(1)
    # the case: T = 0.7 applied to the logits, the request's temperature left None
    req = _vime_request(x)
    req.temperature = None
    _raises_named(req, r"request\.temperature", monkeypatch=monkeypatch)


@pytest.mark.parametrize("wrong", [1.0, 0.5, "tensor"])
def test_a_temperature_that_disagrees_with_the_logits_is_refused(monkeypatch, wrong):
    x = _megatron(2)
    req = _vime_request(x)
    req.temperature = torch.full((37,), 0.9) if wrong == "tensor" else wrong
    _raises_named(req, "disagree with request.context", monkeypatch=monkeypatch)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_right_temperature_gives_vimes_native_numbers(monkeypatch, mode, dtype):
    monkeypatch.setenv("RLK_MODE", mode)
    x = _megatron(3, dtype=dtype)
    req = _vime_request(x)
    logp, ent, res = vime_side.compute(req, vime_mode="strict")
    assert res.provenance["route"] == "fused"
    ref_lp, ref_ent = vime_side.native(req)
    # bf16: Megatron's logits carry the bf16 rounding of z (2^-9 |z|), ours are fp32 from the same inputs
    tol = 2e-5 if dtype == "float32" else 2 * 2.0 ** -9 * float(req.logits.detach().abs().max())
    np.testing.assert_allclose(logp.detach().numpy(), ref_lp.detach().numpy(), atol=tol, rtol=0)
    np.testing.assert_allclose(ent.detach().numpy(), ref_ent.detach().numpy(), atol=tol, rtol=0)


# ---- a context that disagrees with the logits ----------------------------------------------------

@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_context_that_disagrees_with_the_logits_is_refused(monkeypatch, dtype):
    x = _megatron(4, dtype=dtype)
    bad = (x[0] * 1.05).detach().requires_grad_()  # a capture bug: not the tensor the logits came from
    _raises_named(_vime_request(x, hidden=bad), "disagree with request.context", monkeypatch=monkeypatch)
    # one bad row among many: auto and strict sample rows (first, last, a stride), audit sees every row
    big = _megatron(5, n=300, dtype=dtype)
    hb = big[0].detach().clone()
    hb[151] *= 1.05
    req = _vime_request(big, hidden=hb.requires_grad_())
    assert 151 not in vime._sample(300).tolist()
    monkeypatch.setenv("RLK_MODE", "strict")
    vime_side.compute(req, vime_mode="strict")  # strict: the sampled rows agree
    monkeypatch.setenv("RLK_MODE", "audit")
    with pytest.raises(ValueError, match="row 151"):
        vime_side.compute(req, vime_mode="auto")
    hb = big[0].detach().clone()
    hb[299] *= 1.05  # the last row: always sampled
    monkeypatch.setenv("RLK_MODE", "auto")
    with pytest.raises(ValueError, match="row 299"):
        vime_side.compute(_vime_request(big, hidden=hb.requires_grad_()), vime_mode="auto")


def test_bf16_logits_from_the_same_context_agree():
    """Megatron's bf16 GEMM rounds each logit to bf16; the tolerance follows that rounding."""
    x = _megatron(6, n=200, h=64, v=301, dtype="bfloat16", scale=20.0)
    vime.check_agreement(vime._read(_vime_request(x)))  # every row: no error
    vime.check_agreement(vime._read(_vime_request(x, temperature=1e-3)))


# ---- a lost policy gradient ----------------------------------------------------------------------

@pytest.mark.parametrize("mode", MODES)
def test_a_detached_context_under_logits_that_require_grad_is_refused(monkeypatch, mode):
    monkeypatch.setenv("RLK_MODE", mode)
    x = _megatron(7)
    req = _vime_request(x)
    req.context.hidden = req.context.hidden.detach()
    req.context.projection.weight = req.context.projection.weight.detach()
    req.context.projection.bias = req.context.projection.bias.detach()
    _raises_named(req, "policy gradient", modes=(mode,))
    req.metadata["rlk_route"] = "reuse"  # the fix the error names: the logits' own graph
    logp, ent, res = vime_side.compute(req, vime_mode="strict")
    assert logp.requires_grad and res.provenance["route"] == "logits"
    with torch.no_grad():  # nothing asks for a gradient: served from the context
        assert vime.provider(_vime_request(x), mode).provenance["route"] == "fused"


# ---- the nucleus sent as ids ---------------------------------------------------------------------

def _sparse(seed, targets, v, k=9, outside=()):
    """[T, K] kept global ids, -1 padded, ragged (row r keeps r % k + 1 ids, its target among them
    unless r is in `outside`); row 3 keeps nothing recorded (all -1: no nucleus)."""
    gen = torch.Generator().manual_seed(seed)
    n = len(targets)
    ids = torch.full((n, k), -1, dtype=torch.int64)
    for r in range(n):
        m = r % k + 1
        row = torch.randperm(v, generator=gen)[:m]
        row = row[row != targets[r]][:m - 1]
        if r not in outside:
            row = torch.cat([targets[r:r + 1], row])
        ids[r, :len(row)] = row[torch.randperm(len(row), generator=gen)]
    ids[3] = -1
    return ids


def _sparse_oracle(x, temperature, ids):
    """float64: logp renormalized over the kept ids (all ids for a row of only -1; -inf for a target
    outside), the unmasked entropy, and the gradients of sum g logp + e entropy."""
    h, w, b = (t.detach().to(F64).requires_grad_() for t in x[:3])
    z = (h @ w.T + b) / temperature
    z.retain_grad()
    keep = torch.zeros_like(z, dtype=torch.bool)
    for r in range(z.shape[0]):
        kept = ids[r][ids[r] >= 0]
        keep[r, kept] = True
        if kept.numel() == 0:
            keep[r] = True
    logp = torch.log_softmax(z.masked_fill(~keep, -math.inf), -1).gather(1, x[3][:, None])[:, 0]
    lp = torch.log_softmax(z, -1)
    ent = -(lp.exp() * lp).sum(-1)
    loss = (logp.nan_to_num(0.0, 0.0, 0.0) * x[4].to(F64)).sum() + (ent * x[5].to(F64)).sum()
    *grads, dz = torch.autograd.grad(loss, [h, w, b, z])
    with torch.no_grad():
        # |dlogit| and, for the fast backward's fp16 kept logits, its bound on the dlogit error
        # (oracle.KEPT_RTOL): (|g| + |e| (1 + |lse - ent - z|)) max(p, p_kept) (2^-11 |z| + 2^-24)
        p = torch.maximum(lp.exp(), torch.softmax(z.masked_fill(~keep, -math.inf), -1))
        g, e = x[4].to(F64)[:, None].abs(), x[5].to(F64)[:, None].abs()
        lse = torch.logsumexp(z, -1, keepdim=True)
        kept = (g + e * (1 + (lse - ent[:, None] - z).abs())) * p * (oracle.KEPT_RTOL * z.abs() + oracle.KEPT_ATOL)
        mags = [(d @ w.abs(), d.T @ h.abs(), d.sum(0)) for d in (dz.abs() / temperature, kept / temperature)]
    return logp.detach(), ent.detach(), grads, mags


def _assert_grads(grads, ref, dtype, what):
    """Norm-relative: one ulp of the dtype, plus the fp32 accumulation and the CPU bf16 backward's
    dlogit rounding carried into the magnitude sums, plus the fast backward's kept-logits bound
    (tests/oracle.py's tolerances)."""
    for i, (name, x, r) in enumerate(zip(("hidden", "weight", "bias"), grads, ref[2])):
        x, den = x.float().double(), float(r.norm())
        err = float((x - r).norm()) / den
        tol = oracle.GRAD_RTOL[dtype] + ((oracle.ACCUM_RTOL + oracle.DLOGIT_ROUNDING[dtype]) * float(
            ref[3][0][i].norm()) + float(ref[3][1][i].norm())) / den
        assert err <= tol, f"{what} d{name}: relative error {err:.3g} > {tol:.3g}"


@pytest.mark.parametrize("route", ["recompute", "reuse"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_sparse_nucleus_ids_against_float64(route, dtype):
    """vime's sparse replay: unscaled logits, the temperature, metadata["top_p_sparse_token_ids"],
    log_prob_keep_mask None. Row 5's target is outside its nucleus: -inf, as vime's native path."""
    x = _megatron(8, n=41, v=130, dtype=dtype)
    ids = _sparse(9, x[3], 130, outside=(5,))
    req = _vime_request(x, temperature=0.8, scaled=False, metadata={"top_p_sparse_token_ids": ids,
                                                                  "rlk_route": route})
    logp, ent, res = vime_side.compute(req, vime_mode="strict")
    assert res.provenance["top_p"] == "ids" and "topp=ids" in res.contract_id
    assert logp[5, 0] == -math.inf
    ref = _sparse_oracle(x, 0.8, ids)
    if dtype == "float32" or route == "recompute":  # reuse of bf16-rounded logits: native's numbers, below
        oracle.assert_values(logp.detach()[:, 0].numpy(), ref[0].numpy(), "sparse logp")
        oracle.assert_values(ent.detach().numpy(), ref[1].numpy(), "sparse entropy")
        _assert_grads(torch.autograd.grad(_loss(logp, ent, x[4], x[5]), x[:3]), ref, dtype, "sparse")
    nat = vime_side.native(req)[0].detach()
    tol = 2e-5 if dtype == "float32" else 2 * 2.0 ** -9 * float(req.logits.detach().abs().max()) / 0.8
    fin = torch.isfinite(nat[:, 0])
    assert torch.equal(fin, torch.isfinite(logp[:, 0]))
    np.testing.assert_allclose(logp.detach()[fin].numpy(), nat[fin].numpy(), atol=tol, rtol=0)


def test_sparse_nucleus_ids_malformed():
    x = _megatron(10)
    for bad, what in ((torch.zeros(37, 2), "integer"), (torch.full((36, 2), 1), r"\[T = 37, K\]"),
                      (torch.full((37, 2), 130), "outside"), (torch.full((37, 2), -2), "outside")):
        req = _vime_request(x, scaled=False, metadata={"top_p_sparse_token_ids": bad})
        _raises_named(req, what, modes=("auto",))
    req = _vime_request(x, scaled=False, metadata={"top_p_sparse_token_ids": torch.zeros(37, 1, dtype=torch.long)},
                        keep_mask=torch.ones(37, 130, dtype=torch.bool))
    _raises_named(req, "both set", modes=("auto",))
    req = _vime_request(x, metadata={"top_k": 5})  # a field that changes the math and is not served
    _raises_named(req, "top_k", modes=("auto",))


# ---- contradicting metadata ----------------------------------------------------------------------

@pytest.mark.parametrize("meta,field", [
    ({"real_vocab_size": 120}, "real_vocab_size"),
    ({"padded_vocab_size": 256}, "padded_vocab_size"),
    ({"tp_rank": 1}, "tp_rank"),
    ({"tp_world_size": 2}, "tp_world_size"),
    ({"cp_world_size": 2}, "cp_world_size"),
    ({"cp_layout": "zigzag"}, "cp_layout"),
])
def test_metadata_that_contradicts_the_request_is_refused(monkeypatch, meta, field):
    x = _megatron(11)
    _raises_named(_vime_request(x, metadata=meta), field, monkeypatch=monkeypatch)


def test_real_vocab_size_beyond_the_logits_is_refused_on_the_logits_route():
    """Issue 44: an id with no logit column got a finite logp on the logits route; the fused route
    refused it. Both refuse now (the logits route by the same rule, rlk_common.real_vocab)."""
    from torch_bridge.logits import logp_from_logits
    x = _megatron(12)
    req = _vime_request(x, metadata={"real_vocab_size": 140})
    req.context = None
    _raises_named(req, "real_vocab_size")
    with pytest.raises(ValueError, match="real_vocab_size"):
        logp_from_logits(req.logits, torch.tensor([135] * 37), real_vocab=140)


def test_token_layout_must_describe_ownership():
    x = _megatron(13)
    req = _vime_request(x)
    req.token_layout = SimpleNamespace(world_size=2, rank=0, layout="single")
    with pytest.raises(ValueError, match="token_layout"):
        vime.provider(req)


# ---- malformed context objects: named, never AttributeError --------------------------------------

@pytest.mark.parametrize("case", ["no_vocab_partition", "bare_projection", "layout_without_layout",
                                  "projection_without_weight", "metadata_not_mapping"])
def test_malformed_request_objects_name_the_field(case):
    x = _megatron(14)
    req = _vime_request(x)
    exc, field = ValueError, None
    if case == "no_vocab_partition":
        req.context = SimpleNamespace(hidden=req.context.hidden, projection=req.context.projection)
        field = r"context\.vocab_partition"
    elif case == "bare_projection":
        req.context.projection = req.context.projection.weight
        exc, field = TypeError, r"context\.projection is a bare tensor"
    elif case == "layout_without_layout":
        req.token_layout = SimpleNamespace(world_size=1, rank=0)
        field = r"token_layout\.layout"
    elif case == "projection_without_weight":
        req.context.projection = SimpleNamespace(bias=None)
        field = r"context\.projection\.weight"
    else:
        req.metadata = [("logits_are_temperature_scaled", True)]
        exc, field = TypeError, r"request\.metadata must be a mapping"
    with pytest.raises(exc, match=field) as info:
        vime.provider(req)
    assert not isinstance(info.value, AttributeError) and not _is_marker(info.value)


# ---- injected bad outputs ------------------------------------------------------------------------

@pytest.mark.parametrize("inject", ["nan", "plus_0.01", "plus_1", "positive", "entropy_negative",
                                    "entropy_above_log_v"])
@pytest.mark.parametrize("route", ["fused", "logits"])
def test_strict_and_audit_refuse_injected_bad_outputs(monkeypatch, inject, route):
    step = "_fused" if route == "fused" else "_from_logits"
    real = getattr(vime, step)

    def bad(r, sl):
        logp, ent = real(r, sl)
        if inject == "nan":
            logp = logp.clone().index_fill(0, torch.tensor([len(logp) // 2]), float("nan"))
        elif inject.startswith("plus"):
            logp = logp + float(inject.split("_")[1])
        elif inject == "positive":
            logp = logp.clone().index_fill(0, torch.tensor([len(logp) // 2]), 0.25)
        elif inject == "entropy_negative":
            ent = ent - 2 * ent.detach()
        else:
            ent = ent + math.log(130)
        return logp, ent
    monkeypatch.setattr(vime, step, bad)
    x = _megatron(15)
    req = _vime_request(x, metadata={"rlk_route": "recompute" if route == "fused" else "reuse"})
    for mode in ("strict", "audit"):
        monkeypatch.setenv("RLK_MODE", mode)
        with pytest.raises(RuntimeError, match=f"({mode}|strict): row") as info:
            vime_side.compute(req, vime_mode="auto")
        assert not _is_marker(info.value)


# ---- the route: a stated choice ------------------------------------------------------------------

def test_route_follows_reuse_local_logits_and_the_switch(monkeypatch):
    x = _megatron(16)
    req = _vime_request(x)
    res = vime_side.compute(req, vime_mode="strict")[2]
    assert res.provenance["route"] == "fused" and res.provenance["route_switch_source"] == "default"
    assert "recompute" in res.provenance["route_reason"]
    req.context.reuse_local_logits = True  # RL-Kernel's flag, with the request's logits
    res = vime_side.compute(req, vime_mode="strict")[2]
    assert res.provenance["route"] == "logits" and "context.reuse_local_logits" in res.provenance["route_reason"]
    assert res.backend_id == "rlk.logits.cpu"
    monkeypatch.setenv("RLK_VIME_ROUTE", "recompute")  # the env var forces either
    assert vime_side.compute(req, vime_mode="strict")[2].provenance["route"] == "fused"
    req.metadata["rlk_route"] = "reuse"  # the request's metadata wins over the env
    res = vime_side.compute(req, vime_mode="strict")[2]
    assert res.provenance["route"] == "logits" and res.provenance["route_switch_source"] == "metadata['rlk_route']"
    s = vime.stats()
    assert s["backend_ids"] == {"rlk.fused.cpu": 2, "rlk.logits.cpu": 2}
    assert sum(s["route_reasons"].values()) == 4 and all(k.split(":")[0] in ("fused", "logits")
                                                         for k in s["route_reasons"])
    assert any("context.reuse_local_logits" in k for k in s["route_reasons"])
    req.metadata["rlk_route"] = "fast"
    with pytest.raises(ValueError, match="rlk_route"):
        vime.provider(req)
    req.metadata["rlk_route"] = "recompute"
    req.context = None
    with pytest.raises(ValueError, match="recompute"):
        vime.provider(req)


def test_reuse_reads_context_local_logits_and_gives_their_gradient():
    """context.local_logits (the LM head's own, before the temperature) over the request's logits;
    the policy gradient flows through them."""
    x = _megatron(17)
    req = _vime_request(x)
    local = _output_layer(*x[:3])
    req.context.local_logits, req.context.reuse_local_logits = local, True
    req.logits = req.logits.detach()  # the request's copy: not the one used
    res = vime.provider(req, "strict")
    assert "context.local_logits" in res.provenance["route_reason"]
    ref = _sparse_oracle(x, 0.7, torch.full((37, 1), -1))
    oracle.assert_values(res.logp.detach()[:, 0].numpy(), ref[0].numpy(), "local logits logp")
    _assert_grads(torch.autograd.grad(_loss(res.logp, res.entropy, x[4], x[5]), x[:3]), ref, "float32",
                  "local logits")


# ---- vime's own words ----------------------------------------------------------------------------

def test_rl_kernel_mode_is_read_where_rlk_mode_is_unset(monkeypatch):
    x = _megatron(18)
    monkeypatch.setenv("RL_KERNEL_MODE", "off")  # vime's launcher's native control
    logp, ent, res = vime_side.compute(_vime_request(x), vime_mode="auto")
    assert res is None and vime.stats()["fallbacks"] == {"mode off": 1}
    with pytest.raises(RuntimeError, match="unavailable"):
        vime_side.compute(_vime_request(x), vime_mode="strict")
    monkeypatch.setenv("RL_KERNEL_MODE", "strict")
    assert vime_side.compute(_vime_request(x))[2].provenance["mode"] == "strict"
    monkeypatch.setenv("RLK_MODE", "audit")  # ours wins
    assert vime_side.compute(_vime_request(x))[2].provenance["mode"] == "audit"
    monkeypatch.setenv("RLK_MODE", "")
    monkeypatch.setenv("RL_KERNEL_MODE", "loose")
    with pytest.raises(ValueError, match="mode"):
        vime.provider(_vime_request(x))


def test_dlogp_stats_carry_the_seeds_key_names():
    from torch_bridge.diagnostics import dlogp_stats
    a = torch.tensor([-1.0, -2.0, -3.0])
    d = dlogp_stats(a, a + torch.tensor([0.0, 0.5, 0.0])).as_dict()
    assert d["rlk_dlogp_mismatch_count"] == 1 and d["rlk_dlogp_max_abs_diff"] == 0.5
    d = dlogp_stats(a, a).as_dict(prefix="train/")
    assert d["train/mismatch_count"] == 0 and d["train/max_abs_diff"] == 0.0


def test_vime_side_refuses_what_vime_refuses():
    x = _megatron(19)
    req = _vime_request(x)
    with pytest.raises(ValueError, match="auto' or 'strict"):
        vime_side.compute(req, vime_mode="audit")
    req.logits = None
    with pytest.raises(ValueError, match="logits"):
        vime_side.compute(req)
