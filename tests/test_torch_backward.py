"""torch_bridge.linear_logp's backward strategies (issue #5): "lean" recomputes the logits, "fast"
reads the logits the forward kept, "auto" picks fast within a memory budget. Oracle checks of both
strategies run over the whole case grid in test_torch_linear_logp.py and under TP in
test_torch_tp.py; here: the rule, what is kept and when, the one-backward guard, errors,
the vime provider and Inductor."""
import pytest

pytest.importorskip("torch", reason="torch is not installed: these tests need it")

import numpy as np
import torch

import _rlk_core
import torch_bridge
from torch_bridge import _ops
from torch_bridge._args import DEFAULT_BACKWARD_MEMORY_BUDGET, kept_logits_dtype, resolve_backward
from torch_helpers import make_inputs, value_and_grads

F16, F32 = torch.float16, torch.float32


@pytest.fixture(autouse=True)
def no_budget_env(monkeypatch):
    monkeypatch.delenv("RLK_BACKWARD_MEMORY_BUDGET", raising=False)


def _fast_calls():
    return _rlk_core.route_counts()["cpu"][4]


def _step(d, kw, g, e, **extra):
    """(logp, entropy, grads) of one forward and backward, and whether the backward was the fast one."""
    before = _fast_calls()
    out = value_and_grads(torch_bridge.linear_logp, d, kw, g, e, **extra)
    ran_fast = _fast_calls() - before
    assert ran_fast in (0, 1)
    return out, bool(ran_fast)


# ---- the rule -------------------------------------------------------------------------------------

def test_kept_logits_dtype_rule():
    assert kept_logits_dtype(torch.bfloat16) == F16 and kept_logits_dtype(F16) == F16
    assert kept_logits_dtype(F32) == F32


def test_resolve_backward(monkeypatch):
    n, v = 1000, 3000
    kept16, kept32 = n * v * 2, n * v * 4
    assert resolve_backward("fast", n, v, torch.bfloat16, 0) == "fast"
    assert resolve_backward("lean", n, v, torch.bfloat16, None) == "lean"
    assert resolve_backward("auto", n, v, torch.bfloat16, kept16) == "fast"   # the budget is inclusive
    assert resolve_backward("auto", n, v, torch.bfloat16, kept16 - 1) == "lean"
    assert resolve_backward("auto", n, v, F32, kept16) == "lean"              # fp32 keeps 4 bytes a logit
    assert resolve_backward("auto", n, v, F32, kept32) == "fast"
    assert DEFAULT_BACKWARD_MEMORY_BUDGET == 4 << 30
    big = DEFAULT_BACKWARD_MEMORY_BUDGET // 2 + 1  # n * big * 2 bytes > 4 GiB for n = 1; 4 GiB itself fits
    assert resolve_backward("auto", 1, big, F16, None) == "lean"
    assert resolve_backward("auto", 1, big - 1, F16, None) == "fast"
    monkeypatch.setenv("RLK_BACKWARD_MEMORY_BUDGET", str(kept16))
    assert resolve_backward("auto", n, v, F16, None) == "fast"
    assert resolve_backward("auto", n, v + 1, F16, None) == "lean"
    assert resolve_backward("auto", n, v + 1, F16, kept16 + 2 * n) == "fast"  # the argument wins over the env


@pytest.mark.parametrize("backward,budget,env,exc,match", [
    ("quick", None, None, ValueError, "backward must be one of"),
    (None, None, None, ValueError, "backward must be one of"),
    ("auto", -1, None, ValueError, "backward_memory_budget must be >= 0"),
    ("lean", -1, None, ValueError, "backward_memory_budget must be >= 0"),  # never ignored
    ("auto", 2.5e9, None, TypeError, "backward_memory_budget must be an int"),
    ("auto", True, None, TypeError, "backward_memory_budget must be an int"),
    ("auto", None, "4GiB", ValueError, "env RLK_BACKWARD_MEMORY_BUDGET must be an int"),
    ("auto", None, "-5", ValueError, "env RLK_BACKWARD_MEMORY_BUDGET must be >= 0"),
])
@pytest.mark.parametrize("mode", ["auto", "off"])
def test_bad_strategy_or_budget_is_a_clear_error(monkeypatch, backward, budget, env, exc, match, mode):
    if env is not None:
        monkeypatch.setenv("RLK_BACKWARD_MEMORY_BUDGET", env)
    d, _, _, _ = make_inputs(0, 4, 8, 16, "float32")
    with pytest.raises(exc, match=match):
        torch_bridge.linear_logp(d["hidden"], d["weight"], d["targets"], backward=backward,
                                 backward_memory_budget=budget, mode=mode)


# ---- which strategy runs --------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_auto_is_fast_within_the_budget_and_lean_over_it(monkeypatch, dtype):
    n, v = 37, 300
    kept = n * v * kept_logits_dtype(getattr(torch, dtype)).itemsize
    d, kw, g, e = make_inputs(1, n, 24, v, dtype, bias=True, temp="array")
    assert _step(d, kw, g, e)[1]                                                   # default 4 GiB
    assert _step(d, kw, g, e, backward_memory_budget=kept)[1]
    assert not _step(d, kw, g, e, backward_memory_budget=kept - 1)[1]
    monkeypatch.setenv("RLK_BACKWARD_MEMORY_BUDGET", str(kept - 1))
    assert not _step(d, kw, g, e)[1]
    assert _step(d, kw, g, e, backward="fast")[1] and not _step(d, kw, g, e, backward="lean")[1]


def test_logits_are_kept_only_when_a_backward_can_run(monkeypatch):
    kept = []
    forward = _rlk_core.forward

    def spy(*args):
        kept.append(args[7] is not None)  # core.forward's `logits`
        return forward(*args)

    monkeypatch.setattr(_ops.core, "forward", spy)
    d, kw, _, _ = make_inputs(2, 20, 16, 100, "bfloat16", bias=True, temp="array")
    h, w, t = d["hidden"], d["weight"], d["targets"]
    hg = h.clone().requires_grad_()
    torch_bridge.linear_logp(hg, w, t, backward="fast")                    # a gradient is wanted: kept
    torch_bridge.linear_logp(h, w, t, backward="fast")                     # no input requires grad
    with torch.no_grad():
        torch_bridge.linear_logp(hg, w, t, backward="fast")                # grad mode off
    torch_bridge.linear_logp(h, w, t, temperature=kw["temperature"].requires_grad_(), backward="fast")  # T only
    torch_bridge.linear_logp(hg, w, t, backward="lean")
    assert kept == [True, False, False, True, False]


def test_fast_changes_no_forward_bit():
    d, kw, g, e = make_inputs(3, 129, 40, 520, "bfloat16", bias=True, temp="array", ignore_frac=0.2, real_vocab=517)
    (lp_f, ent_f, _), ran_fast = _step(d, kw, g, e, backward="fast")
    (lp_l, ent_l, _), ran_lean = _step(d, kw, g, e, backward="lean")
    assert ran_fast and not ran_lean
    assert torch.equal(lp_f, lp_l) and torch.equal(ent_f, ent_l)


# ---- the kept logits ------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
def test_kept_logits_are_the_scaled_logits_and_fill_the_buffer(dtype):
    """The forward writes z = (h.W + b) / T, rounded to the kept dtype, into every element of the
    caller's [n, v] buffer (padding columns too: none is left as it was)."""
    d, kw, _, _ = make_inputs(4, 45, 32, 300, dtype, bias=True, temp="array", real_vocab=290)
    h, w, T = d["hidden"], d["weight"], kw["temperature"]
    b, t = kw["bias"].float(), d["targets"].int()
    want = kept_logits_dtype(h.dtype)
    logits = torch.full((45, 300), float("nan"), dtype=want)
    _rlk_core.forward(h, w, b, t, T.float(), torch.empty((45, 4, 3)), torch.empty(45), logits, None, 0,
                      290, 75, -100, False, 0)
    assert not torch.isnan(logits).any()
    z = (h.double() @ w.double().T + b.double()) / T.double()[:, None]
    # fp32 arithmetic (a few ulps of the summed magnitudes) then the rounding to the kept dtype
    mag = (h.double().abs() @ w.double().abs().T + b.double().abs()) / T.double()[:, None]
    tol = 1e-6 * mag + z.abs() * (2.0 ** -11 if want == F16 else 2.0 ** -24)
    assert ((logits[:, :290].double() - z[:, :290]).abs() <= tol[:, :290]).all()
    # the op allocates it alike; with keep_logits=False it carries an empty [0]
    for keep, shape in ((True, (45, 300)), (False, (0,))):
        out = torch.ops.rlk.linear_logp(h, w, b, t, T, 290, 75, -100, False, keep)[3]
        assert out.dtype == want and tuple(out.shape) == shape
    assert torch.equal(torch.ops.rlk.linear_logp(h, w, b, t, T, 290, 75, -100, False, True)[3], logits)


def test_cpu_fast_backward_only_reads_the_kept_logits():
    """The CPU backward reads the kept logits (CUDA overwrites them: test_torch_gpu.py)."""
    d, kw, g, e = make_inputs(5, 30, 16, 200, "bfloat16", bias=True, temp="array")
    h, w, b, t, T = d["hidden"], d["weight"], kw["bias"].float(), d["targets"].int(), kw["temperature"]
    logp, ent, lse, logits = torch.ops.rlk.linear_logp(h, w, b, t, T, 200, 200, -100, True, True)
    before = logits.clone()
    fast = torch.ops.rlk.linear_logp_backward(h, w, b, t, T, lse, ent, g, e, logits, 0, 200, 200, -100, False)
    assert torch.equal(logits, before)
    lean = torch.ops.rlk.linear_logp_backward(h, w, b, t, T, lse, ent, g, e, torch.zeros(0), 0, 200, 200, -100, False)
    assert all(x.shape == y.shape and x.dtype == y.dtype for x, y in zip(fast, lean))


def test_backward_op_rejects_logits_that_are_not_the_kept_ones():
    d, kw, g, _ = make_inputs(5, 10, 16, 100, "bfloat16")
    h, w, t, T = d["hidden"], d["weight"], d["targets"].int(), torch.ones(10)
    lse = torch.zeros(10)
    for bad in (torch.zeros((10, 99), dtype=F16), torch.zeros((10, 100), dtype=torch.bfloat16), torch.zeros(3)):
        with pytest.raises(ValueError, match="logits must be the kept logits"):
            torch.ops.rlk.linear_logp_backward(h, w, None, t, T, lse, None, g, None, bad, 0, 100, 100, -100, True)


# ---- one backward per forward ---------------------------------------------------------------------

def _leaves_and_loss(d, kw, g, backward):
    h, w = d["hidden"].clone().requires_grad_(), d["weight"].clone().requires_grad_()
    logp = torch_bridge.linear_logp(h, w, d["targets"], bias=kw["bias"], backward=backward)
    return h, w, (logp * g).sum()


def test_second_backward_through_kept_logits_raises():
    d, kw, g, _ = make_inputs(6, 33, 24, 200, "bfloat16", bias=True)
    h, w, loss = _leaves_and_loss(d, kw, g, "fast")
    loss.backward(retain_graph=True)
    once = h.grad.clone(), w.grad.clone()
    with pytest.raises(RuntimeError, match="second backward.*backward='fast'.*backward='lean'"):
        loss.backward()
    assert torch.equal(h.grad, once[0]) and torch.equal(w.grad, once[1])  # nothing was accumulated
    h2, w2, loss2 = _leaves_and_loss(d, kw, g, "fast")  # the first backward itself was a normal one
    loss2.backward()
    assert torch.equal(h2.grad, once[0]) and torch.equal(w2.grad, once[1])


def test_lean_backpropagates_twice():
    d, kw, g, _ = make_inputs(6, 33, 24, 200, "bfloat16", bias=True)
    h, w, loss = _leaves_and_loss(d, kw, g, "lean")
    loss.backward(retain_graph=True)
    once = h.grad.clone()
    loss.backward()
    assert torch.equal(h.grad, once * 2)  # x + x is exact


# ---- the vime provider: backward "auto" within the env budget --------------------------------------

@pytest.mark.parametrize("budget,fast", [("0", False), (None, True)])
def test_vime_provider_follows_the_env_budget(monkeypatch, budget, fast):
    import vime_side
    from torch_bridge import vime
    if budget is not None:
        monkeypatch.setenv("RLK_BACKWARD_MEMORY_BUDGET", budget)
    d, _, g, _ = make_inputs(7, 24, 16, 200, "bfloat16")
    h = d["hidden"].clone().requires_grad_()
    before = _fast_calls()
    r = vime.provider(vime_side.request(d["targets"], hidden=h, weight=d["weight"]), "strict")
    (r.logp[:, 0] * g).sum().backward()
    assert _fast_calls() - before == int(fast)


# ---- torch.compile with Inductor (the lean backward passes an empty tensor, not None: see _ops) --------

@pytest.mark.parametrize("backward", ["lean", "fast"])
def test_inductor_forward_and_backward_equal_eager(backward):
    torch._dynamo.reset()
    d, kw, g, e = make_inputs(8, 37, 32, 500, "bfloat16", bias=True, temp="array", ignore_frac=0.2, real_vocab=480)

    def f(h, w, b, T, t):
        logp, ent = torch_bridge.linear_logp(h, w, t, bias=b, temperature=T, real_vocab_size=480,
                                             return_entropy=True, backward=backward)
        return (logp * g).sum() + (ent * e).sum(), logp, ent

    def run(fn):
        leaves = [x.detach().clone().requires_grad_() for x in (d["hidden"], d["weight"], kw["bias"],
                                                                 kw["temperature"])]
        before = _fast_calls()
        loss, logp, ent = fn(*leaves, d["targets"])
        out = [logp, ent, *torch.autograd.grad(loss, leaves)]
        return out, _fast_calls() - before

    eager, eager_fast = run(f)
    compiled, compiled_fast = run(torch.compile(f, fullgraph=True))
    assert eager_fast == compiled_fast == int(backward == "fast")
    for a, b in zip(eager, compiled):
        np.testing.assert_array_equal(a.detach().float().numpy(), b.detach().float().numpy())
