"""torch_bridge.vime.provider behind vime's side of the ABI (tests/vime_side.py): every mode, the
fused (context) and logits routes, row chunks, the top-p keep mask (in the fused kernels on the CPU,
on the logits route), pre-scaled logits, the
unavailability marker, fail-closed strict/audit checks, the route log and the contract id.
Values against float64 (2e-5), gradients within the dtype's rounding. TP = 2, 4: test_torch_tp.py."""
import logging

import pytest

pytest.importorskip("torch", reason="torch is not installed: these tests need it")

import torch

import oracle
import vime_side
from torch_bridge import vime

F64 = torch.float64
DT = {"bfloat16": torch.bfloat16, "float32": torch.float32}


@pytest.fixture(autouse=True)
def fresh(monkeypatch):
    monkeypatch.delenv("RLK_MODE", raising=False)
    vime.reset_stats()
    yield


def _inputs(seed, n=45, h=40, v=300, dtype="bfloat16", temp=0.7, real=None):
    """Leaves (hidden, weight, bias) in `dtype`, targets, a temperature, upstream grads g, e."""
    gen = torch.Generator().manual_seed(seed)
    dt = DT[dtype]
    hidden = torch.randn(n, h, generator=gen).to(dt)
    weight = (torch.randn(v, h, generator=gen) * 3 / h ** 0.5).to(dt)
    bias = torch.randn(v, generator=gen).to(dt)
    targets = torch.randint(0, real or v, (n,), generator=gen)
    if temp == "tensor":
        temp = torch.rand(n, generator=gen) + 0.5
    g, e = torch.randn(n, generator=gen), torch.randn(n, generator=gen)
    return hidden, weight, bias, targets, temp, g, e


def _leaves(*ts):
    return [t.detach().clone().requires_grad_() for t in ts]


def _logits(hidden, weight, bias, temp):
    """The pre-scaled local logits vime hands over (fp32, divided by the rollout temperature)."""
    z = hidden.float() @ weight.float().T + bias.float()
    return z / (temp[:, None] if isinstance(temp, torch.Tensor) else temp)


def _oracle(hidden, weight, bias, targets, temp, g, e, keep=None, real=None):
    """float64 logp, entropy and gradients (hidden, weight, bias) of sum g logp + e entropy."""
    h, w, b = _leaves(hidden.to(F64), weight.to(F64), bias.to(F64))
    z = _logits(h, w, b, temp.to(F64) if isinstance(temp, torch.Tensor) else temp)
    if real is not None:
        z = z.masked_fill(torch.arange(z.shape[1]) >= real, float("-inf"))
    lp = torch.log_softmax(z, -1)
    ent = -(lp.exp() * lp.nan_to_num(0.0, 0.0, 0.0)).sum(-1)
    zk = z if keep is None else z.masked_fill(~keep, float("-inf"))
    logp = torch.log_softmax(zk, -1).gather(1, targets[:, None])[:, 0]
    loss = (logp.nan_to_num(0.0, 0.0, 0.0) * g.to(F64)).sum() + (ent * e.to(F64)).sum()
    return logp.detach(), ent.detach(), torch.autograd.grad(loss, [h, w, b])


def _keep(seed, targets, v, frac=0.3, x=None):
    """A random nucleus holding each row's target (the sampled token) and, given the inputs x, the
    row's argmax (as top-p does); row 0 keeps everything (no recorded nucleus)."""
    gen = torch.Generator().manual_seed(seed)
    keep = torch.rand(len(targets), v, generator=gen) < frac
    keep[torch.arange(len(targets)), targets] = True
    if x is not None:
        keep[torch.arange(len(targets)), _logits(*x[:3], x[4]).argmax(dim=1)] = True
    keep[0] = True
    return keep


def _check(logp, ent, grads, ref, dtype, what):
    oracle.assert_values(logp.detach().reshape(-1).numpy(), ref[0].numpy(), f"{what} logp")
    oracle.assert_values(ent.detach().numpy(), ref[1].numpy(), f"{what} entropy")
    for name, x, r in zip(("hidden", "weight", "bias"), grads, ref[2]):
        oracle.assert_grad(x.float().numpy(), r.numpy(), dtype, f"{what} d{name}")


def _serve(hidden, weight, bias, targets, temp, g, e, *, route, vime_mode="auto", keep=None, chunk=-1, real=None):
    """Through vime_side.compute: logp, entropy, (dh, dw, db), the result."""
    h, w, b = _leaves(hidden, weight, bias)
    logits = _logits(h, w, b, temp) if route in ("logits", "both") else None
    ctx = dict(hidden=h, weight=w, bias=b, partition=(0, w.shape[0], real or w.shape[0], w.shape[0])) \
        if route in ("context", "both") else {}
    req = vime_side.request(targets, logits=logits, temperature=temp, keep_mask=keep, chunk_size=chunk,
                            metadata={"logits_are_temperature_scaled": True, "real_vocab_size": real}, **ctx)
    if logits is None:  # not a request vime builds (it always sends logits): our provider's own contract
        res = vime.provider(req, {"auto": None}.get(vime_mode, vime_mode))
        logp, ent = res.logp, res.entropy
    else:
        logp, ent, res = vime_side.compute(req, vime_mode=vime_mode)
    loss = (logp[:, 0].nan_to_num(0.0, 0.0, 0.0) * g).sum() + (ent * e).sum()
    grads = torch.autograd.grad(loss, [h, w, b])
    return logp, ent, grads, res


# ---- every mode, through vime's side -------------------------------------------------------------

@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize("mode", ["auto", "strict", "audit", "off"])
@pytest.mark.parametrize("vime_mode", ["auto", "strict"])
def test_every_mode_behind_vime(monkeypatch, mode, vime_mode, dtype):
    monkeypatch.setenv("RLK_MODE", mode)
    x = _inputs(1, dtype=dtype, temp="tensor", real=290)
    if mode == "off":  # vime's marker: its auto runs the native path, its strict raises
        if vime_mode == "strict":
            with pytest.raises(RuntimeError, match="unavailable"):
                _serve(*x, route="both", vime_mode=vime_mode)
        else:
            logp, ent, grads, res = _serve(*x, route="both", vime_mode=vime_mode)
            assert res is None
            _check(logp, ent, grads, _oracle(*x), dtype, "native")
        assert vime.stats()["fallbacks"] == {"mode off": 1}
        return
    logp, ent, grads, res = _serve(*x, route="both", vime_mode=vime_mode, real=290)
    _check(logp, ent, grads, _oracle(*x, real=290), dtype, mode)
    assert res.backend_id == "rlk.fused.cpu" and res.provenance["route"] == "fused"
    assert res.provenance["tp_rank"] == 0 and res.provenance["cp_rank"] == 0
    assert res.provenance["logits_used"] is False
    s = vime.stats()
    assert s["backend_ids"] == {res.backend_id: 1} and s["backend_id"] == res.backend_id and s["fallback_total"] == 0
    if mode == "audit":
        assert vime.stats()["audit"]["rows"] == 45 and vime.stats()["audit"]["max_abs_dlogp"] < 1e-5


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize("route", ["context", "logits", "masked_logits", "masked_context"])
def test_row_chunks_give_the_same_bits(route, dtype):
    x = _inputs(2, n=61, dtype=dtype, temp="tensor")
    keep = _keep(3, x[3], 300, x=x) if route.startswith("masked") else None
    served = route.removeprefix("masked_")
    runs = [_serve(*x, route=served, keep=keep, chunk=c, vime_mode="strict") for c in (-1, 1024, 7)]
    for logp, ent, _, res in runs[1:]:
        assert torch.equal(logp, runs[0][0]) and torch.equal(ent, runs[0][1])
        assert res.provenance["route"] == ("fused" if served == "context" else "logits")
    assert runs[2][3].provenance["row_chunk"] == (None if served == "context" else 7)
    _check(*runs[2][:3], _oracle(*x, keep=keep), dtype, route)
    # any row split: requests of row slices (of the same logits), concatenated
    hidden, weight, bias, targets, temp = x[:5]
    logits = _logits(*x[:3], temp)
    parts = []
    for i in range(0, 61, 13):
        sl = slice(i, i + 13)
        ctx = dict(hidden=hidden[sl], weight=weight, bias=bias) if served == "context" else {}
        parts.append(vime.provider(vime_side.request(
            targets[sl], logits=None if ctx else logits[sl], temperature=temp[sl],
            keep_mask=None if keep is None else keep[sl], **ctx)))
    assert torch.equal(torch.cat([p.logp for p in parts]), runs[0][0])
    assert torch.equal(torch.cat([p.entropy for p in parts]), runs[0][1])


@pytest.mark.parametrize("route", ["logits", "context", "both"])
def test_top_p_mask(route):
    """On the CPU the nucleus goes into the fused kernels whenever the context is there (no [T, V]
    float buffer), else the logits route takes it; logp over the nucleus, entropy unmasked."""
    x = _inputs(4, dtype="float32", temp=0.8)
    keep = _keep(5, x[3], 300, x=x)
    logp, ent, grads, res = _serve(*x, route=route, keep=keep, vime_mode="strict")
    _check(logp, ent, grads, _oracle(*x, keep=keep), "float32", f"masked {route}")
    assert res.provenance["route"] == ("logits" if route == "logits" else "fused") and res.provenance["top_p_mask"]
    assert res.provenance["logits_used"] is (route == "logits")
    assert "topp=mask" in res.contract_id
    # the target outside its nucleus: -inf, as vime's native path
    keep[1, x[3][1]] = False
    logp, *_ = _serve(*x, route=route, keep=keep)
    assert logp[1, 0] == float("-inf") and torch.isfinite(logp[2:]).all()


@pytest.mark.parametrize("mode", ["auto", "strict", "audit"])
def test_top_p_mask_with_only_the_context_is_served_fused(monkeypatch, mode):
    """A masked request with the context and no logits (unavailable before the kernels took the
    mask): every mode serves it, in vime's auto and strict alike."""
    monkeypatch.setenv("RLK_MODE", mode)
    x = _inputs(6, n=33, dtype="bfloat16", temp="tensor")
    keep = _keep(7, x[3], 300, x=x)
    for vime_mode in ("auto", "strict"):
        logp, ent, grads, res = _serve(*x, route="context", keep=keep, vime_mode=vime_mode)
        _check(logp, ent, grads, _oracle(*x, keep=keep), "bfloat16", f"{mode} masked context")
        assert res.backend_id == "rlk.fused.cpu"
    assert vime.stats()["fallback_total"] == 0


def test_vime_auto_falls_back_on_the_marker_only():
    x = _inputs(8, dtype="float32")
    h, w, b = _leaves(*x[:3])
    # a vocab shard that is not Megatron's (rank 0 starting at 10): no route of ours takes it
    req = vime_side.request(x[3], hidden=h, weight=w, bias=b, logits=_logits(h, w, b, 1.0), temperature=1.0,
                            partition=(10, 300, 310, 310))
    sentinel = (torch.zeros(45, 1), torch.zeros(45))
    logp, ent, res = vime_side.compute(req, vime_mode="auto", native=lambda r: sentinel)
    assert res is None and logp is sentinel[0]
    s = vime.stats()
    assert s["fallback_total"] == 1 and "vocab partition" in next(iter(s["fallbacks"]))
    assert s["requests"] == {"calls": 1, "tokens": 45} and s["backend_ids"] == {} and s["reference"]["calls"] == 0
    with pytest.raises(RuntimeError, match="unavailable"):
        vime_side.compute(req, vime_mode="strict")
    req.context = None  # the logits alone: the logits route serves it
    assert vime_side.compute(req, vime_mode="strict")[2].backend_id == "rlk.logits.cpu"


@pytest.mark.parametrize("temp", [0.7, "tensor"])
def test_pre_scaled_logits_and_the_context_agree(temp):
    x = _inputs(9, dtype="float32", temp=temp)
    ref = _oracle(*x)
    fused = _serve(*x, route="context")
    scaled = _serve(*x, route="logits")
    _check(*fused[:3], ref, "float32", "context")
    _check(*scaled[:3], ref, "float32", "pre-scaled logits")
    # raw logits, marked so: divided here once
    h, w, b = _leaves(*x[:3])
    req = vime_side.request(x[3], logits=_logits(h, w, b, 1.0), temperature=x[4],
                            metadata={"logits_are_temperature_scaled": False})
    logp, ent, res = vime_side.compute(req, vime_mode="strict")
    oracle.assert_values(logp.detach()[:, 0].numpy(), ref[0].numpy(), "raw logits logp")
    assert "temperature=divided" in res.contract_id


# ---- fail-closed checks --------------------------------------------------------------------------

def _request(requires_grad=True):
    x = _inputs(10, n=12, v=100, dtype="float32")
    h, w, b = _leaves(*x[:3]) if requires_grad else x[:3]
    return vime_side.request(x[3], hidden=h, weight=w, bias=b, logits=_logits(h, w, b, 1.0), temperature=1.0)


@pytest.mark.parametrize("mode", ["auto", "strict", "audit"])
def test_every_mode_checks_rows_and_device(monkeypatch, mode):
    monkeypatch.setattr(vime, "_fused", lambda r, sl: (torch.zeros(r.n - 1), torch.zeros(r.n - 1)))
    with pytest.raises(RuntimeError, match="rows"):
        vime.provider(_request(), mode)


@pytest.mark.parametrize("mode", ["auto", "strict", "audit"])
def test_detached_output_fails_every_mode(monkeypatch, mode):
    real = vime._fused
    monkeypatch.setattr(vime, "_fused", lambda r, sl: tuple(t.detach() for t in real(r, sl)))
    with pytest.raises(RuntimeError, match="detached"):
        vime.provider(_request(), mode)


def test_strict_and_audit_fail_on_a_wrong_value(monkeypatch):
    real = vime._fused
    monkeypatch.setattr(vime, "_fused", lambda r, sl: (real(r, sl)[0] + 0.01, real(r, sl)[1]))
    vime.provider(_request(), "auto")  # auto does not compare
    with pytest.raises(RuntimeError, match="strict: row 0"):
        vime.provider(_request(), "strict")
    with pytest.raises(RuntimeError, match="audit: row 0"):
        vime.provider(_request(), "audit")


def test_strict_rejects_malformed_entropy_dtype_and_route(monkeypatch):
    real = vime._fused
    monkeypatch.setattr(vime, "_fused", lambda r, sl: (real(r, sl)[0], real(r, sl)[1][:3]))
    with pytest.raises(RuntimeError, match="entropy"):
        vime.provider(_request(), "auto")
    monkeypatch.setattr(vime, "_fused", lambda r, sl: (real(r, sl)[0].double(), real(r, sl)[1]))
    with pytest.raises(RuntimeError, match="float32"):
        vime.provider(_request(), "strict")
    monkeypatch.setattr(vime, "_fused", real)
    monkeypatch.setattr(vime, "_kernel_ran", lambda before, after: "cuda_sm90")
    with pytest.raises(RuntimeError, match="route mismatch"):
        vime.provider(_request(), "strict")
    with torch.no_grad():  # no gradient asked for: a detached result is right
        vime.provider(_request(), "auto")


@pytest.mark.parametrize("mode", ["auto", "strict", "audit"])
def test_kernel_errors_propagate(monkeypatch, mode):
    import _rlk_core

    def boom(*a, **k):
        raise RuntimeError("rlk: simulated kernel bug")
    monkeypatch.setattr(_rlk_core, "forward", boom)
    monkeypatch.setenv("RLK_MODE", mode)
    with pytest.raises(RuntimeError, match="simulated"):
        vime_side.compute(_request(), vime_mode="auto")
    assert vime.stats()["fallback_total"] == 0


def test_entropy_flags_and_provenance():
    req = _request()
    req.with_entropy_grad = False
    r = vime.provider(req)
    assert r.logp.requires_grad and not r.entropy.requires_grad
    req.with_entropy = False
    assert vime.provider(req).entropy is None
    req.token_layout.world_size, req.token_layout.rank, req.token_layout.layout = 2, 1, "zigzag"
    p = vime.provider(req).provenance
    assert (p["cp_rank"], p["cp_size"], p["cp_layout"], p["tp_rank"], p["tp_size"]) == (1, 2, "zigzag", 0, 1)
    assert "cp=zigzagx2" in vime.provider(req).contract_id


def test_malformed_requests_name_the_field():
    req = _request()
    req.chunk_size = 0
    with pytest.raises(ValueError, match="chunk_size"):
        vime.provider(req)
    req = _request()
    req.log_prob_keep_mask = torch.ones(12, dtype=torch.bool)
    with pytest.raises(ValueError, match="log_prob_keep_mask"):
        vime.provider(req)


# ---- identity and logging ------------------------------------------------------------------------

def test_route_logged_once_per_change(caplog, monkeypatch):
    monkeypatch.setattr(vime, "_logged", set())  # a fresh process's log
    caplog.set_level(logging.INFO, logger="rlk")
    for _ in range(3):
        vime.provider(_request())
    req = _request()
    req.context = None
    vime.provider(req)
    vime.provider(req)
    lines = [r.getMessage() for r in caplog.records if r.name == "rlk"]
    assert len(lines) == 2 and "route=fused" in lines[0] and "route=logits" in lines[1]


def test_contract_id_names_the_numeric_contract():
    a = vime.provider(_request())
    x = _inputs(10, n=12, v=100, dtype="bfloat16")
    b = vime.provider(vime_side.request(x[3], hidden=x[0], weight=x[1], bias=x[2], temperature=1.0))
    assert a.contract_id != b.contract_id
    for part in ("route=fused", "kernel=cpu", "tp=1", "cp=singlex1", "vocab=100/100", "chunk=25"):
        assert part in a.contract_id
    assert "dtype=float32" in a.contract_id and "dtype=bfloat16" in b.contract_id


def test_a_partition_that_is_not_megatrons_is_unavailable():
    req = _request()
    vp = req.context.vocab_partition
    vp.local_start, vp.real_size, vp.padded_size = 10, 110, 110  # not rank 0's shard
    with pytest.raises(vime.ProviderUnavailable, match="vocab partition"):
        vime.provider(req)
    vp.local_start = 20  # beyond the padded vocab: malformed
    with pytest.raises(ValueError, match="vocab_partition"):
        vime.provider(req)
    vp.local_start, vp.local_size = 10, 90
    with pytest.raises(ValueError, match="local_size"):
        vime.provider(req)


@pytest.mark.parametrize("masked", [False, True])
def test_logits_route_row_blocks_give_the_same_bits(monkeypatch, masked):
    """torch_bridge.logits runs its [rows, V_local] temporaries in row blocks (bounded memory): blocks
    of 7 rows give one pass's bits, values and gradients, with padding and a nucleus."""
    from torch_bridge import logits as lg
    x = _inputs(11, n=40, dtype="float32", temp=0.9, real=290)
    keep = _keep(12, x[3], 300, x=x) if masked else None
    runs = []
    for elements in (lg.ROW_BLOCK_ELEMENTS, 7 * 300):
        monkeypatch.setattr(lg, "ROW_BLOCK_ELEMENTS", elements)
        runs.append(_serve(*x, route="logits", keep=keep, real=290, vime_mode="strict"))
    for a, b in zip(runs[0][:2], runs[1][:2]):
        assert torch.equal(a, b)
    for a, b in zip(runs[0][2], runs[1][2]):
        assert torch.equal(a, b)
    _check(*runs[1][:3], _oracle(*x, keep=keep, real=290), "float32", "row blocks")


def test_the_moved_modules_keep_their_public_paths():
    """vime configs name torch_bridge.vime.provider: the old path is the very same module, without a
    warning; torch_bridge.megatron / torch_bridge.rollout still work for one release, with a
    DeprecationWarning naming the new path."""
    import importlib
    import warnings

    import torch_bridge
    from torch_bridge.integrations import megatron as new_megatron, rollout as new_rollout, vime as new_vime

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert importlib.import_module("torch_bridge.vime") is new_vime is torch_bridge.vime
    for name, new in (("megatron", new_megatron), ("rollout", new_rollout)):
        with pytest.warns(DeprecationWarning, match=f"torch_bridge.integrations.{name}"):
            assert getattr(torch_bridge, name) is new
