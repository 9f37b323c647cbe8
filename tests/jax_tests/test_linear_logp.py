"""rlk_xla.linear_logp on the CPU against the float64 oracle; jit, vmap, grad; consistency; errors."""
import re

import pytest

pytest.importorskip("jax", reason="jax is not installed: these tests need it")

import jax
import jax.numpy as jnp
import numpy as np

import rlk_xla
import oracle
from rlk_xla._args import saved_logits_bytes
from rlk_xla._core import core
from jax_helpers import check_against_oracle, make_inputs, value_and_grads
from oracle import case_grid


@pytest.mark.parametrize("backward", ["fast", "lean"])
@pytest.mark.parametrize("n,h,v,dtype,o", case_grid(), ids=lambda x: str(x) if not isinstance(x, dict) else "")
def test_against_float64_oracle(n, h, v, dtype, o, backward):
    check_against_oracle(rlk_xla.linear_logp, n, h, v, dtype, o, backward=backward)


def test_reference_matches_oracle():
    for o in case_grid()[:8]:
        check_against_oracle(rlk_xla.reference.linear_logp, *o[:4], o[4])


def test_leading_dims_and_jit():
    d, kw, _, _ = make_inputs(1, None, 64, 700, leading=(3, 5), bias=True, temp="array")
    f = jax.jit(lambda h, w, t, b, T: rlk_xla.linear_logp(h, w, t, bias=b, temperature=T, return_entropy=True))
    logp, ent = f(d["hidden"], d["weight"], d["targets"], kw["bias"], kw["temperature"])
    assert logp.shape == (3, 5) and ent.shape == (3, 5) and logp.dtype == jnp.float32
    ref = oracle.linear_logp(d["hidden"].reshape(15, 64), d["weight"], d["targets"], bias=kw["bias"],
                             temperature=kw["temperature"].reshape(15))
    oracle.assert_values(logp.reshape(-1), ref["logp"], "logp")
    oracle.assert_values(ent.reshape(-1), ref["entropy"], "entropy")


@pytest.mark.parametrize("batched_weight", [False, True])
def test_vmap(batched_weight):
    d, kw, g, _ = make_inputs(2, 4 * 33, 48, 300, bias=True)
    hb = d["hidden"].reshape(4, 33, 48)
    tb = d["targets"].reshape(4, 33)
    wb = jnp.stack([d["weight"] * s for s in (1.0, 0.5, 2.0, -1.0)]).astype(d["weight"].dtype)
    w_axis = 0 if batched_weight else None
    w_in = wb if batched_weight else d["weight"]
    f = lambda h, w, t: rlk_xla.linear_logp(h, w, t, bias=kw["bias"], return_entropy=True)
    logp, ent = jax.vmap(f, in_axes=(0, w_axis, 0))(hb, w_in, tb)
    for i in range(4):
        li, ei = f(hb[i], wb[i] if batched_weight else d["weight"], tb[i])
        np.testing.assert_array_equal(np.asarray(logp[i]), np.asarray(li))  # batch invariant: same bits
        np.testing.assert_array_equal(np.asarray(ent[i]), np.asarray(ei))
    # vmap of grad: per-example gradients w.r.t. hidden and weight
    gfun = jax.grad(lambda h, w, t: jnp.sum(f(h, w, t)[0] * 1.5) + jnp.sum(f(h, w, t)[1]), argnums=(0, 1))
    gh, gw = jax.vmap(gfun, in_axes=(0, w_axis, 0))(hb, w_in, tb)
    for i in range(4):
        ghi, gwi = gfun(hb[i], wb[i] if batched_weight else d["weight"], tb[i])
        np.testing.assert_array_equal(np.asarray(gh[i], np.float32), np.asarray(ghi, np.float32))
        np.testing.assert_array_equal(np.asarray(gw[i], np.float32), np.asarray(gwi, np.float32))


def _forward_and_dh(d, kw, g, e):
    logp, ent, grads = value_and_grads(rlk_xla.linear_logp, d, kw, g, e)
    return [np.asarray(x, np.float32) for x in (logp, ent, grads["hidden"], grads["weight"])]


def test_bitwise_deterministic():
    d, kw, g, e = make_inputs(3, 300, 96, 1000, "bfloat16", bias=True, temp="array", ignore_frac=0.1)
    first = _forward_and_dh(d, kw, g, e)
    for _ in range(2):
        for a, b in zip(first, _forward_and_dh(d, kw, g, e)):
            np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("rows", [slice(5, 68), slice(0, 1), slice(250, 300)])
def test_batch_invariant(rows):
    d, kw, g, e = make_inputs(4, 300, 96, 1000, "bfloat16", bias=True, temp="array", ignore_frac=0.1)
    full = _forward_and_dh(d, kw, g, e)
    sub = dict(d, hidden=d["hidden"][rows], targets=d["targets"][rows])
    kws = dict(kw, temperature=kw["temperature"][rows])
    part = _forward_and_dh(sub, kws, g[rows], e[rows])
    for i in range(3):  # logp, entropy, dH rows: bitwise
        np.testing.assert_array_equal(part[i], full[i][rows])


def test_out_of_range_targets_give_nan_and_no_gradient():
    d, kw, g, e = make_inputs(5, 20, 32, 200, "float32", real_vocab=180)
    t = np.asarray(d["targets"]).copy()
    t[[1, 4, 7]] = [200, -5, 190]  # past the weight; negative; in the padding
    d["targets"] = jnp.asarray(t)
    logp, ent, grads = value_and_grads(rlk_xla.linear_logp, d, kw, g, e)
    assert np.isnan(np.asarray(logp)[[1, 4, 7]]).all() and not np.isnan(np.asarray(logp)[[0, 2, 3]]).any()
    assert np.all(np.asarray(grads["hidden"])[[1, 4, 7]] == 0)
    ref = oracle.linear_logp(d["hidden"], d["weight"], t, temperature=kw["temperature"], real_vocab=180, g=g, e=e)
    oracle.assert_values(logp, ref["logp"], "logp")
    oracle.assert_grad(grads["weight"], ref["dw"], "float32", "d weight", ref["dw_abs"])
    with pytest.raises(ValueError, match=r"targets\[1\] = 200"):
        rlk_xla.validate_targets(d["targets"], 180)
    rlk_xla.validate_targets(jnp.asarray([0, 179, -100]), 180)


def test_ignore_rows_zero_value_and_gradient():
    d, kw, g, e = make_inputs(6, 50, 32, 300, "bfloat16", ignore_frac=0.5)
    logp, ent, grads = value_and_grads(rlk_xla.linear_logp, d, kw, g, e)
    ign = np.asarray(d["targets"]) == -100
    assert ign.any()
    assert np.all(np.asarray(logp)[ign] == 0) and np.all(np.asarray(ent)[ign] == 0)
    assert np.all(np.asarray(grads["hidden"], np.float32)[ign] == 0)


def test_empty_input():
    w = jnp.ones((100, 16), jnp.bfloat16)
    logp, ent = rlk_xla.linear_logp(jnp.zeros((0, 16), jnp.bfloat16), w, jnp.zeros((0,), jnp.int32),
                                    return_entropy=True)
    assert logp.shape == (0,) and ent.shape == (0,)
    gw = jax.grad(lambda w: rlk_xla.linear_logp(jnp.zeros((0, 16), jnp.bfloat16), w,
                                                jnp.zeros((0,), jnp.int32)).sum())(w)
    assert gw.shape == w.shape and not np.asarray(gw, np.float32).any()


@pytest.mark.parametrize("kwargs,exc,match", [
    (dict(weight=jnp.ones((10, 9))), ValueError, "hidden size"),
    (dict(weight=jnp.ones((10, 8), jnp.bfloat16)), TypeError, "weight dtype"),
    (dict(weight=jnp.ones((10,))), ValueError, "weight must be"),
    (dict(targets=jnp.ones((4,), jnp.float32)), TypeError, "targets must be integer"),
    (dict(targets=jnp.ones((5,), jnp.int32)), ValueError, "targets shape"),
    (dict(bias=jnp.ones((11,))), ValueError, "bias must be"),
    (dict(bias=jnp.ones((10,), jnp.bfloat16)), TypeError, "bias dtype"),
    (dict(temperature=0.0), ValueError, "temperature"),
    (dict(temperature=-1.0), ValueError, "temperature"),
    (dict(temperature=jnp.ones((3,))), ValueError, "temperature array"),
    (dict(real_vocab_size=11), ValueError, "real_vocab_size"),
    (dict(real_vocab_size=0), ValueError, "real_vocab_size"),
    (dict(vocab_start=3), ValueError, "vocab_start"),
    (dict(mode="fast"), ValueError, "mode"),
])
def test_bad_input_is_a_clear_error(kwargs, exc, match):
    args = dict(hidden=jnp.ones((4, 8)), weight=jnp.ones((10, 8)), targets=jnp.ones((4,), jnp.int32))
    args.update(kwargs)
    h, w, t = args.pop("hidden"), args.pop("weight"), args.pop("targets")
    with pytest.raises(exc, match=match):
        jax.jit(lambda h, w, t: rlk_xla.linear_logp(h, w, t, **args))(h, w, t)


def test_every_ffi_target_compiles_on_the_installed_jax():
    d, kw, g, e = make_inputs(7, 33, 64, 500, bias=True, temp="array")
    f = lambda h, w, b, T: jnp.sum(rlk_xla.linear_logp(h, w, d["targets"], bias=b, temperature=T,
                                                       return_entropy=True)[1] + 0)
    args = (d["hidden"], d["weight"], kw["bias"], kw["temperature"])
    for fn in (jax.jit(f), jax.jit(jax.grad(f, argnums=(0, 1, 2, 3)))):
        compiled = fn.lower(*args).compile()
        hlo = compiled.as_text()
        for target in ("rlk_forward", "rlk_combine"):
            assert target in hlo
        jax.block_until_ready(compiled(*args))
    assert "rlk_backward" in hlo


def _temp_bytes(fn, *args):
    return jax.jit(fn).lower(*args).compile().memory_analysis().temp_size_in_bytes


def _programs(grad, backward):
    """(temp bytes by (name, v), fused HLO text by v) of sum(logp) or its gradient at n=512, h=64."""
    n, h = 512, 64
    temps, texts = {}, {}
    for v in (4096, 32768):
        d, _, _, _ = make_inputs(8, n, h, v, "bfloat16")
        fused = lambda *a, **k: rlk_xla.linear_logp(*a, backward=backward, **k)
        for name, fn in (("fused", fused), ("reference", rlk_xla.reference.linear_logp)):
            f = lambda hh, ww, fn=fn, t=d["targets"]: jnp.sum(fn(hh, ww, t))
            if grad:
                f = jax.grad(f, argnums=(0, 1))
            temps[name, v] = _temp_bytes(f, d["hidden"], d["weight"])
            if name == "fused":
                texts[v] = jax.jit(f).lower(d["hidden"], d["weight"]).compile().as_text()
    return n, temps, texts


@pytest.mark.parametrize("grad", [False, True])
def test_fused_program_has_no_logits_sized_buffer(grad):
    n, temps, texts = _programs(grad, "lean")
    for v, text in texts.items():  # nothing in the program is [n, v]-sized
        assert f"[{n},{v}]" not in text and f"[{v},{n}]" not in text
    growth_logits = n * (32768 - 4096) * 4
    assert temps["reference", 32768] - temps["reference", 4096] >= growth_logits
    assert temps["fused", 32768] - temps["fused", 4096] < 0.05 * growth_logits, temps


def test_fast_backward_keeps_only_the_kept_buffer():
    """The fast strategy's one logits-sized buffer is the backend's kept buffer, uint8 [saved_logits_bytes]
    (about 2 bytes a logit for 16-bit operands); a forward-only call keeps none."""
    n, temps, texts = _programs(True, "fast")
    for v, text in texts.items():
        kept = saved_logits_bytes(n, v, core.canonical_chunk(v), jnp.bfloat16)
        assert f"u8[{kept}]" in text and n * v * 2 <= kept < n * v * 2.15  # 2.11 at v = 4096: 8 chunks of 512
        assert f"[{n},{v}]" not in text and f"[{v},{n}]" not in text
    growth_fp32_logits = n * (32768 - 4096) * 4
    kept_growth = (saved_logits_bytes(n, 32768, core.canonical_chunk(32768), jnp.bfloat16)
                   - saved_logits_bytes(n, 4096, core.canonical_chunk(4096), jnp.bfloat16))
    assert abs(temps["fused", 32768] - temps["fused", 4096] - kept_growth) < 0.05 * growth_fp32_logits, temps
    _, _, fwd_texts = _programs(False, "fast")
    # a forward-only call saves nothing: its uint8 buffers are the empty record and the 1-byte workspace
    assert all(f"[{n},{v}]" not in text and set(re.findall(r"u8\[(\d+)\]", text)) <= {"0", "1"}
               for v, text in fwd_texts.items())


def _fast_backward_calls(fn):
    before = rlk_xla.route_stats()["backends"]["cpu"]["bwd_fast_calls"]
    fn()
    return rlk_xla.route_stats()["backends"]["cpu"]["bwd_fast_calls"] - before


_KEPT = 127 * 4 * (6 + 9 + 1) + 127 * 2 * 518  # CPU, bf16, n 127, v = chunk 517: 6 moments, 9 tiles, one chunk


@pytest.mark.parametrize("backward,budget,fast", [("auto", None, 1), ("auto", 0, 0), ("auto", _KEPT, 1),
                                                  ("auto", _KEPT - 1, 0), ("fast", 0, 1), ("lean", None, 0)])
def test_backward_strategy_choice(backward, budget, fast):
    """auto keeps when the kept buffer's bytes fit the budget; the route counters say which ran."""
    d, _, _, _ = make_inputs(3, 127, 32, 517, "bfloat16")
    f = jax.grad(lambda hh: jnp.sum(rlk_xla.linear_logp(hh, d["weight"], d["targets"], backward=backward,
                                                        backward_memory_budget=budget)))
    assert _fast_backward_calls(lambda: f(d["hidden"]).block_until_ready()) == fast


def test_backward_budget_from_environment(monkeypatch):
    d, _, _, _ = make_inputs(3, 127, 32, 517, "bfloat16")
    monkeypatch.setenv("RLK_BACKWARD_MEMORY_BUDGET", "100")
    f = jax.grad(lambda hh: jnp.sum(rlk_xla.linear_logp(hh, d["weight"], d["targets"])))
    assert _fast_backward_calls(lambda: f(d["hidden"]).block_until_ready()) == 0


@pytest.mark.parametrize("kwargs,match", [(dict(backward="quick"), "backward must be one of"),
                                          (dict(backward_memory_budget=-1), "backward_memory_budget"),
                                          (dict(backward_memory_budget=1.5), "backward_memory_budget")])
def test_bad_backward_arguments(kwargs, match):
    d, _, _, _ = make_inputs(0, 3, 8, 100, "float32")
    with pytest.raises(ValueError, match=match):
        rlk_xla.linear_logp(d["hidden"], d["weight"], d["targets"], **kwargs)


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_fast_backward_is_bitwise_repeatable_and_close_to_lean(dtype):
    d, kw, g, e = make_inputs(5, 127, 96, 1000, dtype, bias=True, temp="array")
    runs = {b: [value_and_grads(lambda *a, **k: rlk_xla.linear_logp(*a, backward=b, **k), d, kw, g, e)[2]
                for _ in range(2)] for b in ("fast", "lean")}
    for b, (r1, r2) in runs.items():
        for k in r1:
            assert np.array_equal(np.asarray(r1[k], np.float32), np.asarray(r2[k], np.float32)), (b, k)
    if dtype == "float32":  # fp32 kept logits are the exact z: both strategies agree to fp32 rounding
        for k in runs["fast"][0]:
            np.testing.assert_allclose(np.asarray(runs["fast"][0][k]), np.asarray(runs["lean"][0][k]), rtol=1e-5,
                                       atol=1e-6)
