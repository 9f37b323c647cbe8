"""Vocab-parallel linear_logp under shard_map on 8 CPU devices: values, gradients, TP invariance,
and the size of every collective."""
import pytest

pytest.importorskip("jax", reason="jax is not installed: these tests need it")


import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, PartitionSpec as P

import rlk_xla
import oracle
from jax_helpers import collectives, make_inputs
from rlk_xla._compat import shard_map

pytestmark = pytest.mark.skipif(len(jax.devices("cpu")) < 8, reason="needs 8 CPU devices (tests/conftest.py)")

V = 1000  # global padded vocab: canonical chunks of 125, whole chunks for TP = 1, 2, 4, 8


def mesh(tp, dp=1):
    return Mesh(np.array(jax.devices("cpu")[: dp * tp]).reshape(dp, tp), ("dp", "tp"))


def inputs(seed=0, n=96, h=64, dtype="bfloat16", real=V - 37):
    return make_inputs(seed, n, h, V, dtype, bias=True, temp="array", ignore_frac=0.15, real_vocab=real)


def run(tp, d, kw, g, e, dp=1, wrapper=True, backward="auto", mode=None):
    """(logp, entropy, grads) through vocab_parallel_linear_logp on a dp x tp mesh (tp=0: unsharded call)."""
    def loss(h, w, b, T):
        opts = dict(bias=b, temperature=T, real_vocab_size=kw["real_vocab_size"], return_entropy=True,
                    backward=backward, mode=mode)
        if tp == 0:
            lp, ent = rlk_xla.linear_logp(h, w, d["targets"], **opts)
        elif wrapper:
            lp, ent = rlk_xla.vocab_parallel_linear_logp(h, w, d["targets"], mesh=mesh(tp, dp), vocab_axis="tp",
                                                         token_axis="dp" if dp > 1 else None, **opts)
        else:
            f = shard_map(lambda h, w, t, b, T: rlk_xla.linear_logp(h, w, t, axis_name="tp", **dict(opts, bias=b, temperature=T)),
                          mesh=mesh(tp), in_specs=(P(), P("tp"), P(), P("tp"), P()), out_specs=(P(), P()))
            lp, ent = f(h, w, d["targets"], b, T)
        return jnp.sum(jnp.where(jnp.isnan(lp), 0, lp) * g) + jnp.sum(jnp.where(jnp.isnan(ent), 0, ent) * e), (lp, ent)

    (_, (lp, ent)), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3), has_aux=True))(
        d["hidden"], d["weight"], kw["bias"], kw["temperature"])
    return np.asarray(lp), np.asarray(ent), [np.asarray(x, np.float32) for x in grads]


@pytest.mark.parametrize("backward", ["fast", "lean"])
@pytest.mark.parametrize("tp,dp", [(2, 1), (4, 1), (8, 1), (4, 2)])
def test_against_float64_oracle(tp, dp, backward):
    d, kw, g, e = inputs(seed=tp + 10 * dp)
    lp, ent, (dh, dw, db, dT) = run(tp, d, kw, g, e, dp=dp, backward=backward)
    ref = oracle.linear_logp(d["hidden"], d["weight"], d["targets"], bias=kw["bias"], temperature=kw["temperature"],
                             real_vocab=kw["real_vocab_size"], g=g, e=e, kept_fp16=backward == "fast",
                             dlogit_dtype=oracle.cpu_dlogit_dtype("bfloat16"))
    oracle.assert_values(lp, ref["logp"], "logp")
    oracle.assert_values(ent, ref["entropy"], "entropy")
    oracle.assert_grads(dict(hidden=dh, weight=dw, bias=db, temperature=dT), ref, "bfloat16")


@pytest.mark.parametrize("tp,dp", [(4, 1), (4, 2)])
def test_reference_gradients_against_float64_oracle(tp, dp):
    """mode="off" under shard_map: the reference's cross-shard row max is a stopped constant before
    its pmax (which has no differentiation rule: jax.grad raised here before)."""
    d, kw, g, e = inputs(seed=3 + tp + dp)
    lp, ent, (dh, dw, db, dT) = run(tp, d, kw, g, e, dp=dp, mode="off")
    ref = oracle.linear_logp(d["hidden"], d["weight"], d["targets"], bias=kw["bias"], temperature=kw["temperature"],
                             real_vocab=kw["real_vocab_size"], g=g, e=e)
    oracle.assert_values(lp, ref["logp"], "logp")
    oracle.assert_values(ent, ref["entropy"], "entropy")
    oracle.assert_grads(dict(hidden=dh, weight=dw, bias=db, temperature=dT), ref, "bfloat16")


@pytest.mark.parametrize("dtype,real", [("bfloat16", V - 37), ("float32", V), ("float16", 600)])
def test_bitwise_equal_across_tp_degrees(dtype, real):
    d, kw, g, e = inputs(seed=5, dtype=dtype, real=real)
    base_lp, base_ent, _ = run(0, d, kw, g, e)
    for tp in (1, 2, 4, 8):
        lp, ent, _ = run(tp, d, kw, g, e)
        np.testing.assert_array_equal(lp, base_lp, err_msg=f"logp TP={tp}")
        np.testing.assert_array_equal(ent, base_ent, err_msg=f"entropy TP={tp}")


def test_wrapper_and_manual_shard_map_agree():
    d, kw, g, e = inputs(seed=7)
    a = run(4, d, kw, g, e, wrapper=True)
    b = run(4, d, kw, g, e, wrapper=False)
    for x, y in zip(a[:2] + tuple(a[2]), b[:2] + tuple(b[2])):
        np.testing.assert_array_equal(x, y)


def _collectives(hlo: str):
    """(op, elements) for every collective in an HLO module's text."""
    return [(op, int(np.prod([int(x) for x in shape[shape.index("[") + 1:-1].split(",") if x] or [1])))
            for op, shapes in collectives(hlo) for shape in shapes]


def test_collectives_move_per_row_statistics_only():
    n, h, tp = 96, 64, 8
    d, kw, g, e = inputs(seed=9, n=n, h=h)
    chunks = V // 125
    f = lambda hh, ww: rlk_xla.vocab_parallel_linear_logp(hh, ww, d["targets"], mesh=mesh(tp), return_entropy=True,
                                                          real_vocab_size=kw["real_vocab_size"])
    fwd = jax.jit(lambda hh, ww: f(hh, ww)[0]).lower(d["hidden"], d["weight"]).compile().as_text()
    bwd = jax.jit(jax.grad(lambda hh, ww: jnp.sum(f(hh, ww)[0] * g) + jnp.sum(f(hh, ww)[1]), argnums=(0, 1))) \
        .lower(d["hidden"], d["weight"]).compile().as_text()
    stats_bound = n * (chunks * 3 + 4)
    fwd_c = _collectives(fwd)
    assert fwd_c and all(el <= stats_bound for _, el in fwd_c), fwd_c
    bwd_c = _collectives(bwd)
    # The backward adds exactly the partial-dH all-reduce ([n, h], inherent to a vocab-parallel
    # backward); nothing is ever [n, v]-sized.
    big = [c for c in bwd_c if c[1] > stats_bound]
    assert all(op == "all-reduce" and el == n * h for op, el in big), bwd_c
    assert all(el < n * (V // tp) for _, el in bwd_c)


@pytest.mark.parametrize("temp", [1e8, 1e30, 2.0 ** 126])
def test_padding_is_exact_at_any_finite_temperature(temp):
    """Padding columns of a shard come in as a -inf bias (z = -inf while 1 / T is a normal fp32, T <=
    2^126): at T = 1e30 the -1e30 bias it was moved logp by 9e-3; now the sharded call equals the
    unsharded one's bits. Above 2^126 (1 / T flushed to 0) a number is refused and an array's rows are
    NaN."""
    d, kw, _, _ = inputs(dtype="float32")
    t = d["targets"]
    f = lambda tp, temp: rlk_xla.vocab_parallel_linear_logp(d["hidden"], d["weight"], t, mesh=mesh(tp),  # noqa: E731
                                                            vocab_axis="tp", real_vocab_size=V - 37, temperature=temp)
    one = np.asarray(rlk_xla.linear_logp(d["hidden"], d["weight"], t, real_vocab_size=V - 37, temperature=temp))
    for tp in (2, 8):
        np.testing.assert_array_equal(np.asarray(f(tp, temp)), one)
    with pytest.raises(ValueError, match=r"temperature=3e\+38 under axis_name with padded vocab shards .* up to "
                                         r"temperature 2\*\*126"):
        f(2, 3e38)
    big = np.asarray(f(2, jnp.full(t.shape, 3e38, jnp.float32)))
    assert np.isnan(big[one != 0]).all() and (big[one == 0] == 0).all()  # ignored rows stay 0
