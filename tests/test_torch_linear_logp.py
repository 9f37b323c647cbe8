"""torch_bridge.linear_logp on the CPU against the float64 oracle; autograd, opcheck, torch.compile,
consistency (determinism, batch invariance), targets, errors, no jax."""
import pytest

pytest.importorskip("torch", reason="torch is not installed: these tests need it")

import os
import subprocess
import sys

import numpy as np
import torch

import oracle
import torch_bridge
from torch_bridge import _ops  # noqa: F401
from oracle import case_grid
from torch_helpers import GPU, check_against_oracle, make_inputs, to_np, value_and_grads


@pytest.mark.parametrize("backward", ["lean", "fast"])
@pytest.mark.parametrize("n,h,v,dtype,o", case_grid(), ids=lambda x: str(x) if not isinstance(x, dict) else "")
def test_against_float64_oracle(n, h, v, dtype, o, backward):
    check_against_oracle(torch_bridge.linear_logp, n, h, v, dtype, o, backward=backward)


def test_reference_matches_oracle():
    for o in case_grid()[:12] + case_grid()[-6:]:
        check_against_oracle(torch_bridge.reference.linear_logp, *o[:4], o[4])


def test_off_mode_matches_oracle():
    for o in case_grid()[24:30]:
        check_against_oracle(lambda *a, **k: torch_bridge.linear_logp(*a, mode="off", **k), *o[:4], o[4])


def test_leading_dims_and_scalar_temperature_tensor():
    d, kw, _, _ = make_inputs(1, None, 64, 700, leading=(3, 5), bias=True, temp="array")
    logp, ent = torch_bridge.linear_logp(d["hidden"], d["weight"], d["targets"], bias=kw["bias"],
                                         temperature=kw["temperature"], return_entropy=True)
    assert logp.shape == (3, 5) and ent.shape == (3, 5) and logp.dtype == torch.float32
    ref = oracle.linear_logp(to_np(d["hidden"]).reshape(15, 64), to_np(d["weight"]), d["targets"].numpy(),
                             bias=to_np(kw["bias"]), temperature=kw["temperature"].numpy().reshape(15))
    oracle.assert_values(to_np(logp).reshape(-1), ref["logp"], "logp")
    oracle.assert_values(to_np(ent).reshape(-1), ref["entropy"], "entropy")
    # a 0-d temperature tensor broadcasts and gets a gradient
    T = torch.tensor(1.3, requires_grad=True)
    out = torch_bridge.linear_logp(d["hidden"], d["weight"], d["targets"], temperature=T)
    out.sum().backward()
    ref = oracle.linear_logp(to_np(d["hidden"]).reshape(15, 64), to_np(d["weight"]), d["targets"].numpy(),
                             temperature=1.3, g=np.ones(15))
    np.testing.assert_allclose(float(T.grad), ref["dtemp"].sum(), rtol=1e-4)


def test_int32_and_int64_targets_agree_and_scalar_float_equals_tensor():
    d, kw, _, _ = make_inputs(2, 40, 32, 300, "float32", temp=None)
    a = torch_bridge.linear_logp(d["hidden"], d["weight"], d["targets"])
    b = torch_bridge.linear_logp(d["hidden"], d["weight"], d["targets"].to(torch.int32))
    c = torch_bridge.linear_logp(d["hidden"], d["weight"], d["targets"], temperature=torch.ones(40))
    assert torch.equal(a, b) and torch.equal(a, c)


def _forward_and_grads(d, kw, g, e, backward="auto"):
    logp, ent, grads = value_and_grads(torch_bridge.linear_logp, d, kw, g, e, backward=backward)
    return [to_np(x) for x in (logp, ent, grads["hidden"], grads["weight"], grads["bias"], grads["temperature"])]


@pytest.mark.parametrize("backward", ["lean", "fast"])
def test_bitwise_deterministic(backward):
    d, kw, g, e = make_inputs(3, 300, 96, 1000, "bfloat16", bias=True, temp="array", ignore_frac=0.1)
    first = _forward_and_grads(d, kw, g, e, backward)
    for _ in range(2):
        for a, b in zip(first, _forward_and_grads(d, kw, g, e, backward)):
            np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("backward", ["lean", "fast"])
@pytest.mark.parametrize("rows", [slice(5, 68), slice(0, 1), slice(250, 300)])
def test_batch_invariant(rows, backward):
    d, kw, g, e = make_inputs(4, 300, 96, 1000, "bfloat16", bias=True, temp="array", ignore_frac=0.1)
    full = _forward_and_grads(d, kw, g, e, backward)
    sub = dict(d, hidden=d["hidden"][rows], targets=d["targets"][rows])
    kws = dict(kw, temperature=kw["temperature"][rows])
    part = _forward_and_grads(sub, kws, g[rows], e[rows], backward)
    for i in (0, 1, 2, 5):  # logp, entropy, dH rows, dtemperature: bitwise
        np.testing.assert_array_equal(part[i], full[i][rows])


def test_forward_only_scoring_equals_training_forward():
    d, kw, g, e = make_inputs(5, 64, 32, 500, "bfloat16", bias=True)
    with torch.no_grad():
        score = torch_bridge.linear_logp(d["hidden"], d["weight"], d["targets"], bias=kw["bias"])
    train, _, _ = value_and_grads(torch_bridge.linear_logp, d, dict(bias=kw["bias"]), g, e)
    assert torch.equal(score, train)


def test_out_of_range_targets():
    d, kw, g, e = make_inputs(5, 20, 32, 200, "float32", real_vocab=180)
    t = d["targets"].clone()
    t[[1, 4, 7]] = torch.tensor([200, -5, 190])  # past the weight; negative; in the padding
    d["targets"] = t
    with pytest.raises(ValueError, match=r"targets\[1\] = 200 is outside \[0, 180\)"):
        torch_bridge.linear_logp(d["hidden"], d["weight"], t, **kw)
    with pytest.raises(ValueError, match=r"targets\[0\] = 70000 is outside \[0, 65536\)"):
        torch_bridge.validate_targets(torch.tensor([70000, 3]), 65536)
    torch_bridge.validate_targets(torch.tensor([0, 179, -100]), 180)
    logp, ent, grads = value_and_grads(torch_bridge.linear_logp, d, kw, g, e, validate_targets=False,
                                       backward="lean")
    assert torch.isnan(logp[[1, 4, 7]]).all() and not torch.isnan(logp[[0, 2, 3]]).any()
    assert torch.isnan(ent[[1, 4, 7]]).all()
    assert (grads["hidden"][[1, 4, 7]] == 0).all()
    ref = oracle.linear_logp(to_np(d["hidden"]), to_np(d["weight"]), t.numpy(), temperature=kw["temperature"],
                             real_vocab=180, g=g.numpy(), e=e.numpy())
    oracle.assert_values(to_np(logp), ref["logp"], "logp")
    oracle.assert_grad(to_np(grads["weight"]), ref["dw"], "float32", "d weight", ref["dw_abs"])
    # int64 ids beyond int32 never wrap into valid ids
    t2 = d["targets"].clone()
    t2[0], t2[2] = 2 ** 32 + 3, -(2 ** 40)
    out = torch_bridge.linear_logp(d["hidden"], d["weight"], t2, validate_targets=False, **kw)
    assert torch.isnan(out[[0, 2]]).all() and not torch.isnan(out[3])
    ref = torch_bridge.linear_logp(d["hidden"], d["weight"], t2, validate_targets=False, mode="off", **kw)
    assert torch.equal(torch.isnan(ref), torch.isnan(out))  # the reference reads the same int32 ids
    # ... nor into ignore_index at the bottom of the int32 range
    t2[3] = -(2 ** 31)
    out = torch_bridge.linear_logp(d["hidden"], d["weight"], t2, validate_targets=False, ignore_index=-(2 ** 31),
                                   **kw)
    assert torch.isnan(out[[0, 2]]).all() and out[3] == 0
    # ... nor at the top
    out = torch_bridge.linear_logp(d["hidden"], d["weight"], t2, validate_targets=False, ignore_index=2 ** 31 - 1,
                                   **kw)
    assert torch.isnan(out[0])


def test_ignore_rows_zero_value_and_gradient():
    d, kw, g, e = make_inputs(6, 50, 32, 300, "bfloat16", ignore_frac=0.5)
    logp, ent, grads = value_and_grads(torch_bridge.linear_logp, d, kw, g, e)
    ign = d["targets"] == -100
    assert ign.any()
    assert (logp[ign] == 0).all() and (ent[ign] == 0).all() and (grads["hidden"][ign] == 0).all()
    # another ignore_index
    t = torch.where(ign, torch.full_like(d["targets"], 7777), d["targets"])
    out = torch_bridge.linear_logp(d["hidden"], d["weight"], t, ignore_index=7777, **kw)
    assert torch.equal(out, logp)


def test_empty_input():
    w = torch.ones((100, 16), dtype=torch.bfloat16, requires_grad=True)
    logp, ent = torch_bridge.linear_logp(torch.zeros((0, 16), dtype=torch.bfloat16), w,
                                         torch.zeros((0,), dtype=torch.int64), return_entropy=True)
    assert logp.shape == (0,) and ent.shape == (0,)
    logp.sum().backward()
    assert w.grad is None or not w.grad.float().any()
    # the op itself takes n = 0 (the kept buffer of 0 rows is empty, as lean's)
    dh, dw, db, dt = torch.ops.rlk.linear_logp_backward(
        torch.zeros((0, 16)), torch.ones((10, 16)), torch.ones(10), torch.zeros(0, dtype=torch.int32),
        torch.ones(0), torch.zeros(0), torch.zeros(0), None, torch.zeros(0), None, torch.zeros(0, dtype=torch.uint8),
        0, 10, 10, -100, True)
    assert dh.shape == (0, 16) and not dw.any() and not db.any()


_H, _W, _T = torch.ones((4, 8)), torch.ones((10, 8)), torch.ones((4,), dtype=torch.int64)


@pytest.mark.parametrize("kwargs,exc,match", [
    (dict(weight=torch.ones((10, 9))), ValueError, "hidden size"),
    (dict(weight=torch.ones((10, 8), dtype=torch.bfloat16)), TypeError, "weight dtype"),
    (dict(weight=torch.ones((10,))), ValueError, "weight must be"),
    (dict(hidden=torch.ones((4, 8), dtype=torch.int32), weight=torch.ones((10, 8), dtype=torch.int32)), TypeError,
     "hidden must be floating"),
    (dict(hidden=[[1.0]]), TypeError, "hidden must be a torch.Tensor"),
    (dict(targets=torch.ones((4,))), TypeError, "targets must be integer"),
    (dict(targets=torch.ones((5,), dtype=torch.int64)), ValueError, "targets shape"),
    (dict(targets=torch.ones((4,), dtype=torch.int64, device="meta")), ValueError, "targets is on meta"),
    (dict(bias=torch.ones((11,))), ValueError, "bias must be"),
    (dict(bias=torch.ones((10,), dtype=torch.bfloat16)), TypeError, "bias dtype"),
    (dict(temperature=0.0), ValueError, "temperature"),
    (dict(temperature=-1.0), ValueError, "temperature"),
    (dict(temperature=float("inf")), ValueError, "temperature"),
    (dict(temperature=torch.ones((3,))), ValueError, "temperature array"),
    (dict(temperature=torch.ones((4,), dtype=torch.int64)), TypeError, "temperature must be"),
    (dict(real_vocab_size=11), ValueError, "real_vocab_size"),
    (dict(real_vocab_size=0), ValueError, "real_vocab_size"),
    (dict(vocab_start=3), ValueError, "vocab_start"),
    (dict(ignore_index=1.5), TypeError, "ignore_index"),
    (dict(mode="fast"), ValueError, "mode"),
    (dict(backward="quick"), ValueError, "backward must be one of"),
    (dict(backward_memory_budget=-1), ValueError, "backward_memory_budget must be >= 0"),
    (dict(backward_memory_budget=1.5e9), TypeError, "backward_memory_budget must be an int"),
    (dict(targets=torch.tensor([0, 1, 10, 2])), ValueError, r"targets\[2\] = 10 is outside \[0, 10\)"),
])
def test_bad_input_is_a_clear_error(kwargs, exc, match):
    args = dict(hidden=_H, weight=_W, targets=_T)
    args.update(kwargs)
    h, w, t = args.pop("hidden"), args.pop("weight"), args.pop("targets")
    with pytest.raises(exc, match=match):
        torch_bridge.linear_logp(h, w, t, **args)


def test_kernel_entry_points_reject_wrong_dtype_and_shape():
    h, w = torch.ones((4, 8)), torch.ones((10, 8))
    t, it = torch.zeros(4, dtype=torch.int32), torch.ones(4)
    stats, tl = torch.empty((4, 1, 3)), torch.empty(4)
    import _rlk_core as core

    def forward(**over):
        kw = dict(hidden=h, weight=w, targets=t, temperature=it, stats=stats, target_logit=tl, vocab_start=0,
                  real_vocab=10, chunk=10, ignore_index=-100, with_entropy=False)
        core.forward(**{**kw, **over})

    forward()  # the valid call
    with pytest.raises(ValueError, match="targets"):
        forward(targets=t.long())
    with pytest.raises(ValueError, match="chunk"):
        forward(chunk=3)
    with pytest.raises(ValueError, match="stats"):
        forward(stats=torch.empty((4, 2, 3)))
    with pytest.raises(ValueError, match="hidden must be"):  # wrong dtype: no silent conversion
        forward(hidden=h.double())
    with pytest.raises(ValueError, match="unknown keyword"):
        forward(hiden=h)
    # the saved logits: uint8 of at least saved_logits_bytes (fp32 operands: z [n, v] fp32)
    for bad in (torch.empty((4, 10)), torch.empty(4 * 10 * 4 - 1, dtype=torch.uint8)):
        with pytest.raises(ValueError, match="saved_logits"):
            forward(saved_logits=bad)


def test_python_chunk_rule_equals_the_compiled_one():
    import _rlk_core as core
    from torch_bridge._args import canonical_chunk
    for v in list(range(1, 600)) + [151936, 75968, 128256, 37984, 2 ** 20, 3 * 2 ** 12]:
        assert canonical_chunk(v) == core.canonical_chunk(v), v


def test_import_does_not_import_jax():
    code = "import sys, torch_bridge; assert 'jax' not in sys.modules, 'jax imported'; print('ok')"
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    r = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and "ok" in r.stdout, r.stderr


# ---- torch.library: opcheck and torch.compile ------------------------------------------------------

def _op_samples(device):
    d, kw, g, e = make_inputs(7, 13, 24, 300, "float32", bias=True, temp="array", ignore_frac=0.2, device=device)
    h, w, b = d["hidden"], d["weight"], kw["bias"]
    t, T = d["targets"].to(torch.int32), kw["temperature"]
    chunk = 300 // 4  # canonical_chunk(300) = 75
    stats, tl, kept, _ = torch.ops.rlk.forward_stats(h, w, b, t, T, 0, 290, chunk, -100, True, True)
    logp, ent, m, log_s, _ = torch.ops.rlk.combine(stats, tl, t, 290, -100)
    hh, wh = h.half(), w.half()
    kept16 = torch.ops.rlk.forward_stats(hh, wh, None, t, T, 0, 290, chunk, -100, False, True)[2]
    lean = torch.zeros(0, dtype=torch.uint8, device=device)
    samples = dict(
        forward_stats=[(h, w, b, t, T, 0, 290, chunk, -100, True, False),
                       (h.bfloat16(), w.bfloat16(), None, t, T, 0, 300, chunk, -100, False, True)],
        combine=[(stats, tl, t, 290, -100)],
        linear_logp_backward=[(h, w, b, t, T, m, log_s, ent, g, e, lean, 0, 290, chunk, -100, True),
                              (h, w, b, t, T, m, log_s, ent, g, e, kept, 0, 290, chunk, -100, False),
                              (hh, wh, None, t, T, m, log_s, None, g, None, lean, 0, 290, chunk, -100, False),
                              (hh, wh, None, t, T, m, log_s, None, g, None, kept16, 0, 290, chunk, -100, True)],
        # the forward op has no autograd of its own (torch_bridge._ops.LinearLogp is its autograd)
        linear_logp=[args for keep in (False, True) for args in (
            (h, w, b, t, T, 290, chunk, -100, True, keep),
            (h.bfloat16(), w.bfloat16(), None, t, T, 300, chunk, -100, False, keep))],
    )
    # a top-p nucleus
    nucleus = (torch.rand(13, 300, generator=torch.Generator().manual_seed(1)) < 0.5).to(device)
    _, _, kept_k, keep_sum = torch.ops.rlk.forward_stats(hh, wh, None, t, T, 0, 290, chunk, -100, True, True,
                                                         nucleus)
    lp, en, mk, lsk, log_s_keep = torch.ops.rlk.combine(stats, tl, t, 290, -100, keep_sum)
    samples["forward_stats"].append((h, w, b, t, T, 0, 290, chunk, -100, True, True, nucleus))
    samples["combine"].append((stats, tl, t, 290, -100, keep_sum))
    samples["linear_logp_backward"] += [
        (h, w, b, t, T, m, log_s, ent, g, e, lean, 0, 290, chunk, -100, True, nucleus, log_s_keep),
        (hh, wh, None, t, T, mk, lsk, en, g, e, kept_k, 0, 290, chunk, -100, False, nucleus, log_s_keep)]
    samples["linear_logp"] += [(h, w, b, t, T, 290, chunk, -100, True, keep, nucleus) for keep in (False, True)]
    return samples


def test_linear_logp_op_is_forward_stats_then_combine_bitwise():
    """rlk::linear_logp makes one C++ call (statistics and their combine together): the same bits as
    rlk::forward_stats followed by rlk::combine, with and without entropy; and the combine outputs
    of core.forward are checked (all three or none, whole vocab only)."""
    from torch_bridge._core import core
    d, kw, g, e = make_inputs(7, 13, 24, 300, "float32", bias=True, temp="array", ignore_frac=0.2)
    h, w, b, t, T = d["hidden"], d["weight"], kw["bias"], d["targets"].to(torch.int32), kw["temperature"]
    for with_entropy in (True, False):
        stats, tl, _, _ = torch.ops.rlk.forward_stats(h, w, b, t, T, 0, 290, 75, -100, with_entropy, False)
        want = torch.ops.rlk.combine(stats, tl, t, 290, -100)
        logp, ent, m, log_s, _, _ = torch.ops.rlk.linear_logp(h, w, b, t, T, 290, 75, -100, with_entropy, False)
        assert torch.equal(logp, want[0]) and torch.equal(m, want[2]) and torch.equal(log_s, want[3])
        assert torch.equal(ent, want[1] if with_entropy else torch.zeros_like(ent))
    out = dict(zip(("logp", "entropy", "m", "log_s"), (torch.empty(7) for _ in range(4))))
    args = dict(hidden=h, weight=w, bias=b, targets=t, temperature=T, stats=stats, target_logit=tl, chunk=75,
                ignore_index=-100, with_entropy=False)
    with pytest.raises(ValueError, match="come together"):
        core.forward(**args, vocab_start=0, real_vocab=290, **{**out, "log_s": None})
    with pytest.raises(ValueError, match="whole vocab"):
        core.forward(**args, vocab_start=300, real_vocab=590, **out)


@pytest.mark.parametrize("device", ["cpu", GPU])
@pytest.mark.parametrize("name", ["forward_stats", "combine", "linear_logp_backward", "linear_logp"])
def test_opcheck(name, device):
    """(On CUDA the fast backward overwrites its kept buffer: opcheck clones the arguments of every
    check, so each gets its own.)"""
    op = getattr(torch.ops.rlk, name)
    for args in _op_samples(device)[name]:
        torch.library.opcheck(op, args)


@pytest.mark.parametrize("backward", ["lean", "fast"])
def test_torch_compile_fullgraph_forward_and_backward(backward):
    torch._dynamo.reset()
    d, kw, g, e = make_inputs(8, 37, 32, 500, "bfloat16", bias=True, temp="array", ignore_frac=0.2,
                              real_vocab=480)

    def f(h, w, b, T, t):
        logp, ent = torch_bridge.linear_logp(h, w, t, bias=b, temperature=T, real_vocab_size=480,
                                             return_entropy=True, backward=backward)
        return (logp * g).sum() + (ent * e).sum(), logp, ent

    cf = torch.compile(f, fullgraph=True, backend="aot_eager")

    def run(fn):
        leaves = [x.detach().clone().requires_grad_() for x in (d["hidden"], d["weight"], kw["bias"],
                                                                 kw["temperature"])]
        loss, logp, ent = fn(*leaves, d["targets"])
        grads = torch.autograd.grad(loss, leaves)
        return [logp, ent, *grads]

    eager, compiled = run(f), run(cf)
    for a, b in zip(eager, compiled):
        assert torch.equal(a, b)
    # inductor too (the default backend), forward-only scoring
    torch._dynamo.reset()
    score = torch.compile(lambda h, w, t: torch_bridge.linear_logp(h, w, t, real_vocab_size=480), fullgraph=True)
    with torch.no_grad():
        assert torch.equal(score(d["hidden"], d["weight"], d["targets"]),
                           torch_bridge.linear_logp(d["hidden"], d["weight"], d["targets"], real_vocab_size=480))


@pytest.mark.parametrize("dtype,bias,temp", [("bfloat16", True, "array"), ("float16", False, "scalar"),
                                             ("float32", True, None)])
def test_bitwise_equal_to_rlk_xla_on_cpu(dtype, bias, temp, tmp_path):
    pytest.importorskip("jax")
    import torch_helpers
    d, kw, g, e = make_inputs(13, 127, 96, 1000, dtype, bias=bias, temp=temp, ignore_frac=0.1, real_vocab=990)
    logp, ent, grads = value_and_grads(torch_bridge.linear_logp, d, kw, g, e)
    ours = dict(logp=logp, ent=ent, **grads)
    torch_helpers.save_inputs(tmp_path / "in.npz", d, kw, g, e, dtype, 990)
    torch_helpers.jax_side(str(tmp_path / "in.npz"), str(tmp_path / "out.npz"))
    theirs = dict(np.load(tmp_path / "out.npz"))
    theirs.pop("backend")
    assert set(theirs) == set(ours)
    for k, x in theirs.items():
        np.testing.assert_array_equal(to_np(ours[k]), x, err_msg=k)
