"""rlk_xla.linear_logp under jax.jit with NamedSharding inputs, a mesh set and no shard_map (GSPMD /
Shardy; rlk_xla.gspmd), on 4 and 8 CPU devices: the vocab sharded over "tp" (rows over "dp" too)
compiles with no all-gather, gives the shard_map path's bits (logp, entropy and the gradients of
hidden, weight, bias and a per-token temperature, backward="lean"), dW keeps the weight's sharding
and dH the hidden's; per-device temp bytes stay far below one logits buffer at every TP degree while
the weight's bytes shrink with it; a sharded hidden dimension, and vmap under the mesh, are refused."""
import pytest

jax = pytest.importorskip("jax", reason="jax is not installed: these tests need it")

import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import rlk_xla
from rlk_xla.parallel import vocab_parallel_linear_logp

pytestmark = pytest.mark.skipif(len(jax.devices("cpu")) < 8, reason="needs 8 CPU devices (tests/conftest.py)")

N, H, V, REAL = 22, 32, 1024, 1000

# (mesh shape, axis names, devices): TP 4 and 8, and dp x tp on 4 and 8 devices
MESHES = {"tp4": ((4,), ("tp",)), "tp8": ((8,), ("tp",)), "dp2_tp2": ((2, 2), ("dp", "tp")),
          "dp2_tp4": ((2, 4), ("dp", "tp"))}


def _mesh(name):
    shape, names = MESHES[name]
    return jax.make_mesh(shape, names, axis_types=(jax.sharding.AxisType.Auto,) * len(shape),
                         devices=jax.devices("cpu")[:int(np.prod(shape))])


def _inputs(seed=0):
    k = jax.random.split(jax.random.key(seed), 6)
    hidden = jax.random.normal(k[0], (N, H)).astype(jnp.bfloat16)
    weight = (jax.random.normal(k[1], (V, H)) * 3 / H ** 0.5).astype(jnp.bfloat16)
    bias = jax.random.normal(k[2], (V,)).astype(jnp.bfloat16)
    temp = jax.random.uniform(k[3], (N,), minval=0.5, maxval=1.5)
    targets = jax.random.randint(k[4], (N,), 0, REAL).at[::5].set(-100)
    g = jax.random.normal(k[5], (N,))
    return hidden, weight, bias, temp, targets, g


def _loss(call):
    def f(hidden, weight, bias, temp, targets, g):
        logp, ent = call(hidden, weight, targets, bias=bias, temperature=temp, real_vocab_size=REAL,
                         return_entropy=True)
        return (logp * g).sum() + 0.5 * ent.sum(), (logp, ent)
    return jax.jit(jax.value_and_grad(f, argnums=(0, 1, 2, 3), has_aux=True))


def _placed(mesh, rows):
    hidden, weight, bias, temp, targets, g = _inputs()
    specs = (P(rows, None), P("tp", None), P("tp"), P(rows), P(rows), P(rows))
    return [jax.device_put(x, NamedSharding(mesh, s)) for x, s in zip((hidden, weight, bias, temp, targets, g), specs,
                                                                      strict=True)]


@pytest.mark.parametrize("name", list(MESHES))
def test_gspmd_gives_the_shard_map_bits_with_no_all_gather(name):
    mesh = _mesh(name)
    rows = "dp" if "dp" in mesh.axis_names else None
    args = _placed(mesh, rows)
    f = _loss(rlk_xla.linear_logp)
    with jax.set_mesh(mesh):
        (_, (logp, ent)), grads = f(*args)
        hlo = f.lower(*args).compile().as_text()
    assert "all-gather" not in hlo

    def shard_map_path(hidden, weight, targets, **kw):
        return vocab_parallel_linear_logp(hidden, weight, targets, mesh=mesh, vocab_axis="tp", token_axis=rows,
                                          backward="lean", **kw)
    (_, (logp_sm, ent_sm)), grads_sm = _loss(shard_map_path)(*args)
    np.testing.assert_array_equal(logp, logp_sm)
    np.testing.assert_array_equal(ent, ent_sm)
    for got, ref in zip(grads, grads_sm, strict=True):
        np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(ref, np.float32))
    dh, dw, db, _ = grads
    assert dw.sharding.is_equivalent_to(args[1].sharding, 2) and db.sharding.is_equivalent_to(args[2].sharding, 1)
    assert dh.sharding.is_equivalent_to(args[0].sharding, 2)


def _per_device_bytes(tp, n=256, h=256, v=32768):
    mesh = _mesh("tp8") if tp == 8 else jax.make_mesh((tp,), ("tp",), axis_types=(jax.sharding.AxisType.Auto,),
                                                       devices=jax.devices("cpu")[:tp])
    shapes = (((n, h), jnp.bfloat16, P()), ((v, h), jnp.bfloat16, P("tp", None)), ((n,), jnp.int32, P()))
    args = [jax.ShapeDtypeStruct(s, d, sharding=NamedSharding(mesh, p)) for s, d, p in shapes]

    def loss(hidden, weight, targets):
        logp, ent = rlk_xla.linear_logp(hidden, weight, targets, return_entropy=True)
        return logp.sum() + ent.sum()
    with jax.set_mesh(mesh):
        stats = jax.jit(jax.grad(loss, argnums=(0, 1))).lower(*args).compile().memory_analysis()
    return stats.temp_size_in_bytes, stats.argument_size_in_bytes, n * v * 2


def test_per_device_memory_with_the_tp_degree():
    measured = {tp: _per_device_bytes(tp) for tp in (1, 2, 4, 8)}
    for tp, (temp, arg, logits) in measured.items():
        # no [n, V] nor [n, V / tp] buffer: the statistics exchange is O(n * V / chunk)
        assert temp < logits / 8, (tp, temp)
        if tp > 1:
            assert temp <= measured[2][0]  # constant beyond TP = 2: nothing vocab-sized to shrink
            assert arg < measured[tp // 2][1]  # the weight shard halves


def test_sharded_hidden_dimension_is_refused():
    mesh = _mesh("tp4")
    hidden, weight, _, _, targets, _ = _inputs()
    hidden = jax.device_put(hidden, NamedSharding(mesh, P(None, "tp")))
    with jax.set_mesh(mesh), pytest.raises(Exception, match="hidden dimension is sharded"):
        jax.jit(lambda h, w, t: rlk_xla.linear_logp(h, w, t))(hidden, weight, targets)


def test_vmap_under_a_set_mesh_is_refused_with_the_fix():
    mesh = _mesh("tp4")
    hidden, weight, _, _, targets, _ = _inputs()
    with jax.set_mesh(mesh), pytest.raises(ValueError, match="leading dims"):
        jax.jit(jax.vmap(lambda h, t: rlk_xla.linear_logp(h, weight, t)))(hidden[None], targets[None])
