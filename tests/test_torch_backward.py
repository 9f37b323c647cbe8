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
from torch_bridge._args import DEFAULT_BACKWARD_MEMORY_BUDGET, saved_logits_bytes, resolve_backward
from torch_helpers import saved_z, make_inputs, value_and_grads

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

CPU = torch.device("cpu")


def _cpu_row_bytes(v, chunk):
    """One row of the CPU backend's 16-bit kept record: 6 fp32 moments per chunk, one fp32 max per
    64-column tile of each chunk, the fp32 target logit, then fp16 q for the v columns (even)."""
    chunks, tiles = v // chunk, -(-chunk // 64)
    return 4 * (6 * chunks + chunks * tiles + 1) + 2 * (v + v % 2)


def _cuda_row_bytes(v, chunk):
    """One row of the CUDA backend's 16-bit kept record: the fp32 head (6 moments per chunk, one max
    per 128-column group of each chunk, the target logit, zeros up to a multiple of 64 floats),
    then fp16 q for the v columns."""
    chunks, groups = v // chunk, -(-chunk // 128)
    return 4 * (-(-(6 * chunks + chunks * groups + 1) // 64) * 64) + 2 * v


def test_kept_bytes_rule():
    n, v, chunk = 7, 300, 75
    assert saved_logits_bytes(n, v, chunk, F32, CPU) == n * v * 4                   # z fp32, as the forward computed it
    for dt in (torch.bfloat16, F16):
        assert saved_logits_bytes(n, v, chunk, dt, CPU) == n * _cpu_row_bytes(v, chunk)
    assert saved_logits_bytes(n, 301, 301, torch.bfloat16, CPU) == n * _cpu_row_bytes(301, 301)
    assert saved_logits_bytes(n, v, chunk, torch.float64, CPU) == 0                 # the reference runs: nothing kept
    if _rlk_core.has_cuda:
        assert saved_logits_bytes(n, v, chunk, F32, torch.device("cuda")) == n * v * 4
        assert saved_logits_bytes(n, v, chunk, F16, torch.device("cuda")) == n * _cuda_row_bytes(v, chunk)


def test_resolve_backward(monkeypatch):
    n, v, c = 1000, 3000, 375
    kept16, kept32 = saved_logits_bytes(n, v, c, F16, CPU), n * v * 4
    assert kept16 < kept32
    assert resolve_backward("fast", n, v, c, torch.bfloat16, CPU, 0) == "fast"
    assert resolve_backward("lean", n, v, c, torch.bfloat16, CPU, None) == "lean"
    assert resolve_backward("auto", n, v, c, torch.bfloat16, CPU, kept16) == "fast"   # the budget is inclusive
    assert resolve_backward("auto", n, v, c, torch.bfloat16, CPU, kept16 - 1) == "lean"
    assert resolve_backward("auto", n, v, c, F32, CPU, kept16) == "lean"              # fp32 keeps 4 bytes a logit
    assert resolve_backward("auto", n, v, c, F32, CPU, kept32) == "fast"
    assert DEFAULT_BACKWARD_MEMORY_BUDGET == 4 << 30
    big = DEFAULT_BACKWARD_MEMORY_BUDGET // 4 + 1  # n * big * 4 bytes > 4 GiB for n = 1; 4 GiB itself fits
    assert resolve_backward("auto", 1, big, big, F32, CPU, None) == "lean"
    assert resolve_backward("auto", 1, big - 1, big - 1, F32, CPU, None) == "fast"
    monkeypatch.setenv("RLK_BACKWARD_MEMORY_BUDGET", str(kept16))
    assert resolve_backward("auto", n, v, c, F16, CPU, None) == "fast"
    assert resolve_backward("auto", n + 1, v, c, F16, CPU, None) == "lean"
    assert resolve_backward("auto", n + 1, v, c, F16, CPU, 2 * kept16) == "fast"  # the argument wins over the env


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
    kept = saved_logits_bytes(n, v, 75, getattr(torch, dtype), CPU)
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

    def spy(*args, **kwargs):
        kept.append(kwargs["saved_logits"] is not None)
        return forward(*args, **kwargs)

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

def _decode_cpu_kept(kept, n, v, chunk):
    """The CPU 16-bit kept record -> (z - m) [n, v] float64 (from q and the tile maxima; -inf where
    q = 0), the chunk moments [n, chunks, 6] and the target logits [n]."""
    chunks, tiles = v // chunk, -(-chunk // 64)
    rows = kept.view(n, -1)
    floats = 6 * chunks + chunks * tiles + 1
    f = rows[:, :4 * floats].contiguous().view(torch.float32).double()
    q = rows[:, 4 * floats:4 * floats + 2 * v].contiguous().view(F16).double()
    mom, tmax, zt = f[:, :6 * chunks].reshape(n, chunks, 6), f[:, 6 * chunks:-1], f[:, -1]
    col = torch.arange(v)
    tile = col // chunk * tiles + col % chunk // 64
    return q.log() + tmax[:, tile] - mom[:, :, 0].max(dim=1).values[:, None], mom, zt


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
def test_kept_buffer_holds_the_scaled_logits(dtype):
    """fp32 operands: z = (h.W + b) / T in fp32 (by row blocks). 16-bit: per row q = exp(z - tile max) in
    fp16 (relative error 2^-11 at any |z|), the fp32 tile maxima, chunk moments and target logit."""
    d, kw, _, _ = make_inputs(4, 45, 32, 300, dtype, bias=True, temp="array", real_vocab=290)
    h, w, T = d["hidden"], d["weight"], kw["temperature"]
    b, t = kw["bias"].float(), d["targets"].int()
    logits = torch.full((saved_logits_bytes(45, 300, 75, h.dtype, CPU),), 255, dtype=torch.uint8)
    stats = torch.empty((45, 4, 3))
    _rlk_core.forward(hidden=h, weight=w, bias=b, targets=t, temperature=T.float(), stats=stats,
                      target_logit=torch.empty(45), saved_logits=logits, vocab_start=0, real_vocab=290, chunk=75,
                      ignore_index=-100, with_entropy=True)
    z = (h.double() @ w.double().T + b.double()) / T.double()[:, None]
    mag = (h.double().abs() @ w.double().abs().T + b.double().abs()) / T.double()[:, None]
    if dtype == "float32":
        kz = saved_z(logits, 45, 300, "cpu").double()
        assert ((kz[:, :290] - z[:, :290]).abs() <= 1e-6 * mag[:, :290]).all()
    else:
        zm, mom, zt = _decode_cpu_kept(logits, 45, 300, 75)
        want = z - z[:, :290].max(dim=1, keepdim=True).values
        # exp(z - mt) to fp16's relative 2^-11, fp32 arithmetic a few ulps of the summed magnitudes
        live = want[:, :290] > -9  # q in fp16's normal range
        err = (zm[:, :290] - want[:, :290]).abs()
        assert (err[live] <= 2.0 ** -10 + 1e-6 * mag[:, :290][live]).all()
        assert torch.equal(mom[:, :, :3].float(), stats) or torch.allclose(mom[:, :, :2].float(), stats[:, :, :2])
        assert (mom[:, :, 4:] == 0).all()  # the nucleus's sums: written, 0 without one
        zm_c = z[:, :290].reshape(45, -1)  # second moments: sum exp(z - m_c) (z - m_c)^2 per chunk
        for c in range(4):
            zc = z[:, 75 * c:min(75 * (c + 1), 290)]
            u = zc - mom[:, c, 0:1]
            np.testing.assert_allclose(mom[:, c, 3], (u.exp() * u * u).sum(dim=1), rtol=1e-4, atol=1e-5)
        np.testing.assert_allclose(zt, z.gather(1, t.long()[:, None])[:, 0], rtol=1e-5, atol=1e-4)
    # the op allocates it alike; with keep_logits=False it carries an empty [0]
    for keep, shape in ((True, tuple(logits.shape)), (False, (0,))):
        out = torch.ops.rlk.linear_logp(h, w, b, t, T, 290, 75, -100, True, keep)[4]
        assert out.dtype == torch.uint8 and tuple(out.shape) == shape
    assert torch.equal(torch.ops.rlk.linear_logp(h, w, b, t, T, 290, 75, -100, True, True)[4], logits)


def test_cpu_fast_backward_only_reads_the_kept_buffer():
    """The CPU backward reads the kept buffer (CUDA overwrites it: test_torch_gpu.py)."""
    d, kw, g, e = make_inputs(5, 30, 16, 200, "bfloat16", bias=True, temp="array")
    h, w, b, t, T = d["hidden"], d["weight"], kw["bias"].float(), d["targets"].int(), kw["temperature"]
    logp, ent, m, log_s, logits, _ = torch.ops.rlk.linear_logp(h, w, b, t, T, 200, 200, -100, True, True)
    before = logits.clone()
    fast = torch.ops.rlk.linear_logp_backward(h, w, b, t, T, m, log_s, ent, g, e, logits, 0, 200, 200, -100, False)
    assert torch.equal(logits, before)
    lean = torch.ops.rlk.linear_logp_backward(h, w, b, t, T, m, log_s, ent, g, e, torch.zeros(0, dtype=torch.uint8),
                                              0, 200, 200, -100, False)
    assert all(x.shape == y.shape and x.dtype == y.dtype for x, y in zip(fast, lean))


def test_backward_op_rejects_a_buffer_that_is_not_the_saved_logits():
    d, kw, g, _ = make_inputs(5, 10, 16, 100, "bfloat16")
    h, w, t, T = d["hidden"], d["weight"], d["targets"].int(), torch.ones(10)
    m, log_s = torch.zeros(10), torch.zeros(10)
    nbytes = saved_logits_bytes(10, 100, 100, torch.bfloat16, CPU)
    for bad in (torch.zeros((10, 100), dtype=F16), torch.zeros(nbytes - 1, dtype=torch.uint8), torch.zeros(3)):
        with pytest.raises(ValueError, match="saved_logits must be the forward.s saved logits"):
            torch.ops.rlk.linear_logp_backward(h, w, None, t, T, m, log_s, None, g, None, bad, 0, 100, 100, -100,
                                               True)


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
