"""rlk_xla against hostile arguments (issue 23): ids of every integer dtype range-checked before
the int32 cast, vocab_start under shard_map, counters under vmap, and errors that name the
argument and say what to pass."""
import pytest

pytest.importorskip("jax", reason="jax is not installed: these tests need it")

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import Mesh, PartitionSpec as P

import rlk_xla
from rlk_xla import routes
from rlk_xla._compat import shard_map

N, H, V = 6, 16, 40


def inputs(seed=0, dtype=jnp.float32):
    rng = np.random.default_rng(seed)
    return (jnp.asarray(rng.standard_normal((N, H)), dtype),
            jnp.asarray(rng.standard_normal((V, H)) / np.sqrt(H), dtype))


def logp_of_ids(ids, dtype, **kw):
    """logp of rows 0..3 with ids [7, ids..., 7]: rows with the odd ids, and a good row each side."""
    h, w = inputs()
    t = np.array([7] + list(ids) + [7] * (N - 1 - len(ids)), dtype=object)
    got = rlk_xla.linear_logp(h[: len(t)], w, jnp.asarray(t.astype(dtype)), **kw)
    good = rlk_xla.linear_logp(h[: len(t)], w, jnp.full((len(t),), 7, jnp.int32))
    return np.asarray(got), np.asarray(good)


@pytest.mark.parametrize("jit", [False, True])
def test_uint32_id_beyond_int32_is_a_nan_row_not_ignore_index(jit):
    h, w = inputs()
    t = jnp.asarray(np.array([3, 2 ** 32 - 100, 5, 2 ** 31, 0, 39], np.uint32))
    f = jax.jit(rlk_xla.linear_logp) if jit else rlk_xla.linear_logp
    lp = np.asarray(f(h, w, t))
    ref = np.asarray(rlk_xla.linear_logp(h, w, jnp.asarray([3, 0, 5, 0, 0, 39], jnp.int32)))
    assert np.isnan(lp[[1, 3]]).all()  # before: 2^32-100 wrapped to -100 and the row was ignored (0.0)
    np.testing.assert_array_equal(lp[[0, 2, 4, 5]], ref[[0, 2, 4, 5]])


@pytest.mark.parametrize("dtype", [np.int8, np.uint8, np.int16, np.uint16, np.uint32])
def test_small_and_unsigned_ids_score_their_own_id(dtype):
    h, w = inputs()
    ids = np.array([0, 1, 5, 39, 12, 3], dtype)
    np.testing.assert_array_equal(np.asarray(rlk_xla.linear_logp(h, w, jnp.asarray(ids))),
                                  np.asarray(rlk_xla.linear_logp(h, w, jnp.asarray(ids.astype(np.int32)))))


def test_ignore_index_outside_int32():
    h, w = inputs()
    t = jnp.asarray(np.array([3, 2 ** 32 + 5 - 2 ** 32, 5, 7, 0, 1], np.uint32))  # no id equals it
    lp = rlk_xla.linear_logp(h, w, t, ignore_index=2 ** 40)
    np.testing.assert_array_equal(np.asarray(lp), np.asarray(rlk_xla.linear_logp(h, w, t.astype(jnp.int32))))
    # -1 stays an invalid id (NaN), not the int32 code an out-of-int32 ignore_index gets
    lp = rlk_xla.linear_logp(h, w, jnp.asarray([-1, -100, 3, 4, 5, 6], jnp.int32), ignore_index=-(2 ** 40))
    assert np.isnan(np.asarray(lp)[:2]).all() and np.isfinite(np.asarray(lp)[2:]).all()


def test_x64_ids():
    with jax.enable_x64(True):
        h, w = inputs()
        t64 = jnp.asarray(np.array([3, 2 ** 32 + 5, 5, -100, 2 ** 40, 39], np.int64))
        lp = np.asarray(jax.jit(rlk_xla.linear_logp)(h, w, t64))
        ref = np.asarray(rlk_xla.linear_logp(h, w, jnp.asarray([3, 5, 5, -100, 5, 39], jnp.int32)))
        assert np.isnan(lp[[1, 4]]).all()  # before: 2^32+5 scored id 5
        np.testing.assert_array_equal(lp[[0, 2, 3, 5]], ref[[0, 2, 3, 5]])
        tu = jnp.asarray(np.array([3, 2 ** 64 - 100, 5, 2 ** 32 + 5, 7, 8], np.uint64))
        lp = np.asarray(rlk_xla.linear_logp(h, w, tu, ignore_index=2 ** 32 + 5))
        assert np.isnan(lp[1]) and lp[3] == 0.0 and np.isfinite(lp[[0, 2, 4, 5]]).all()


@pytest.mark.parametrize("dtype", [np.uint16, np.uint32, np.int64, np.uint64])
def test_validate_targets_any_integer_dtype(dtype):
    rlk_xla.validate_targets(np.array([0, 5, 39], dtype), V)
    with pytest.raises(ValueError, match=r"targets\[1\] = 40 is outside \[0, 40\)"):
        rlk_xla.validate_targets(np.array([0, 40, 39], dtype), V)
    big = np.iinfo(dtype).max
    with pytest.raises(ValueError, match=f"targets\\[0\\] = {big} "):
        rlk_xla.validate_targets(np.array([big, 1], dtype), V)
    rlk_xla.validate_targets(np.array([big, 1], dtype), V, ignore_index=int(big))


# ---- vocab_start under shard_map ----------------------------------------------------------

needs8 = pytest.mark.skipif(len(jax.devices("cpu")) < 4, reason="needs 4 CPU devices (tests/conftest.py)")


def sharded(vocab_start_of):
    mesh = Mesh(np.array(jax.devices("cpu")[:4]), ("tp",))
    h, w = inputs(3)
    t = jnp.asarray([1, 12, 25, 39, -100, 7], jnp.int32)

    def f(h, w, t):
        return rlk_xla.linear_logp(h, w, t, axis_name="tp", vocab_start=vocab_start_of(w.shape[0]))
    out = shard_map(f, mesh=mesh, in_specs=(P(), P("tp"), P()), out_specs=P())(h, w, t)
    return np.asarray(out), np.asarray(rlk_xla.linear_logp(h, w, t))


@needs8
def test_vocab_start_derived_and_its_explicit_traced_form():
    for vs in (lambda v: None, lambda v: lax.axis_index("tp") * v):
        out, ref = sharded(vs)
        np.testing.assert_array_equal(out, ref)


@needs8
def test_wrong_traced_vocab_start_gives_nan_rows():
    out, _ = sharded(lambda v: lax.axis_index("tp") * 0)
    assert np.isnan(out).all()


@needs8
@pytest.mark.parametrize("vs", [0, 10])
def test_explicit_int_vocab_start_under_shard_map_is_rejected_with_what_to_pass(vs):
    with pytest.raises(ValueError, match=r"vocab_start=None \(derived as lax.axis_index\('tp'\) \* 10\)"):
        sharded(lambda v: vs)


# ---- counters -----------------------------------------------------------------------------

def test_reference_calls_under_vmap_count_every_row():
    """A fallback (float64 needs x64) and mode='off' under vmap over 3 x 10 rows: 30 tokens,
    one call per batch item (as the fused kernels count: one per item unless rows fold)."""
    with jax.enable_x64(True):
        h = jnp.ones((3, 10, 8), jnp.float64)
        w = jnp.ones((16, 8), jnp.float64)
        t = jnp.zeros((3, 10), jnp.int32)
        routes.reset_route_stats()
        jax.block_until_ready(jax.vmap(lambda a, b: rlk_xla.linear_logp(a, w, b))(h, t))
        s = routes.route_stats()
        assert s["reference"] == {"calls": 3, "tokens": 30} and s["fallback_total"] == 3
        jax.block_until_ready(jax.jit(jax.vmap(lambda a, b: rlk_xla.linear_logp(a, w, b, mode="off")))(h, t))
        s = routes.route_stats()
        assert s["reference"] == {"calls": 6, "tokens": 60} and s["fallback_total"] == 3


def test_rejected_kernel_call_is_not_counted():
    from rlk_xla._core import registered_platforms
    registered_platforms()
    routes.reset_route_stats()
    n, h, v = 4, 8, 16
    # hidden, weight, bias, targets, temperature, m, log_s, entropy, g, e, saved_logits
    args = [jnp.ones((n, h)), jnp.ones((v, h)), jnp.zeros((0,)), jnp.zeros((n,), jnp.int32), jnp.ones((n,)),
            jnp.zeros((n,)), jnp.zeros((n,)), jnp.zeros((0,)), jnp.ones((n,)), jnp.zeros((0,)), jnp.zeros((0,), jnp.uint8)]
    res = [jax.ShapeDtypeStruct(s, jnp.float32) for s in ((n, h), (v, h), (0,), (n + 1,))]  # dtemp too long
    res += [jax.ShapeDtypeStruct(s, jnp.uint8) for s in ((0,), (1,))]  # saved_logits, workspace
    attrs = dict(vocab_start=np.int64(0), real_vocab=np.int64(v), chunk=np.int64(v), ignore_index=np.int64(-100),
                 has_bias=np.int64(0), with_entropy=np.int64(0))
    with pytest.raises(Exception, match="rlk: dtemp"):
        jax.block_until_ready(jax.ffi.ffi_call("rlk_backward", res)(*args, **attrs))
    assert routes.route_stats()["backends"]["cpu"]["bwd_calls"] == 0


# ---- messages -----------------------------------------------------------------------------

def test_messages_name_the_argument_and_what_to_pass():
    h, w = inputs()
    t = jnp.arange(N) % V
    with pytest.raises(TypeError, match="return_entropy must be True or False, got 1"):
        rlk_xla.linear_logp(h, w, t, return_entropy=1)
    with pytest.raises(ValueError, match="V >= 1 vocab rows, got V = 0"):
        rlk_xla.linear_logp(h, w[:0], t)
    with pytest.raises(NotImplementedError, match="no second derivative.*mode='off'"):
        jax.grad(lambda x: jax.grad(lambda y: rlk_xla.linear_logp(y, w, t).sum())(x).sum())(h)
    torch = pytest.importorskip("torch", reason="torch is not installed: the torch-tensor message needs it")
    with pytest.raises(TypeError, match="hidden is a torch tensor.*torch_bridge.linear_logp"):
        rlk_xla.linear_logp(torch.ones(N, H), w, t)


def test_grad_still_works_and_mode_off_differentiates_twice():
    h, w = inputs()
    t = jnp.arange(N) % V
    g = jax.grad(lambda y: rlk_xla.linear_logp(y, w, t).sum())(h)
    g_ref = jax.grad(lambda y: rlk_xla.linear_logp(y, w, t, mode="off").sum())(h)
    np.testing.assert_allclose(np.asarray(g), np.asarray(g_ref), rtol=1e-4, atol=1e-6)
    gg = jax.grad(lambda x: jax.grad(lambda y: rlk_xla.linear_logp(y, w, t, mode="off").sum())(x).sum())(h)
    assert np.isfinite(np.asarray(gg)).all()
