"""keep_ids= (the nucleus as kept ids, [..., K] ints, -1 padded, global vocab ids) in both frontends:
against a float64 oracle at K = 1, 7 and 64 with ragged rows (a row keeping nothing gives NaN, a
target outside its ids -inf, an ignored row 0); the same bits in JAX and torch and as the keep_mask
the ids stand for (logp, entropy, gradients); the ids of other shards ignored under JAX shard_map
(TP 2 gives the unsharded bits); both nucleus arguments at once, or ids of the wrong shape, refused."""
import pytest

jax = pytest.importorskip("jax", reason="jax is not installed: these tests need it")
torch = pytest.importorskip("torch", reason="torch is not installed: these tests need it")

import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

import rlk_xla
import torch_bridge
from rlk_xla._compat import shard_map


@pytest.fixture(autouse=True)
def on_the_cpu():
    """JAX on the CPU, as the torch side: the bits compared are the CPU kernels' on any machine."""
    with jax.default_device(jax.devices("cpu")[0]):
        yield

N, H, V, TEMP = 33, 24, 300, 0.8


def _inputs(k, seed=0):
    rng = np.random.default_rng(seed)
    hidden = rng.standard_normal((N, H)).astype(np.float32)
    weight = (rng.standard_normal((V, H)) * 4 / H ** 0.5).astype(np.float32)
    targets = rng.integers(0, V, N).astype(np.int32)
    targets[::8] = -100
    ids = np.full((N, k), -1, np.int32)
    for i in range(N):
        row = rng.choice(V, size=rng.integers(1, k + 1), replace=False)  # ragged: 1..k ids, -1 after
        if targets[i] >= 0 and i % 5:
            row[0] = targets[i]  # the target kept, but in every fifth row
        ids[i, :len(row)] = rng.permutation(row)
    ids[3] = -1  # a row keeping nothing
    mask = np.zeros((N, V), bool)
    for i in range(N):
        mask[i, ids[i][ids[i] >= 0]] = True
    g, e = rng.standard_normal(N).astype(np.float32), rng.standard_normal(N).astype(np.float32)
    return hidden, weight, targets, ids, mask, g, e


def _oracle(hidden, weight, targets, ids):
    z = hidden.astype(np.float64) @ weight.astype(np.float64).T / TEMP
    out = np.zeros(N)
    for i, t in enumerate(targets):
        kept = np.unique(ids[i][ids[i] >= 0])  # a set: a repeated id counts once
        if t < 0:
            continue
        if len(kept) == 0:
            out[i] = np.nan
        elif t not in kept:
            out[i] = -np.inf
        else:
            zk = z[i, kept]
            out[i] = z[i, t] - (zk.max() + np.log(np.exp(zk - zk.max()).sum()))
    return out


def _jax(d, **nucleus):
    hidden, weight, targets, _, _, g, e = d

    def f(hh, ww):
        lp, en = rlk_xla.linear_logp(hh, ww, jnp.asarray(targets), temperature=TEMP, return_entropy=True, **nucleus)
        return (jnp.where(jnp.isfinite(lp), lp, 0.0) * g).sum() + (en * e).sum(), (lp, en)
    (_, out), grads = jax.value_and_grad(f, argnums=(0, 1), has_aux=True)(jnp.asarray(hidden), jnp.asarray(weight))
    return [np.asarray(x) for x in (*out, *grads)]


def _torch(d, **nucleus):
    hidden, weight, targets, _, _, g, e = d
    h, w = (torch.tensor(x).requires_grad_() for x in (hidden, weight))
    lp, en = torch_bridge.linear_logp(h, w, torch.tensor(targets).long(), temperature=TEMP, return_entropy=True,
                                      **{k: torch.tensor(v) for k, v in nucleus.items()})
    ((torch.where(torch.isfinite(lp), lp, 0.0) * torch.tensor(g)).sum() + (en * torch.tensor(e)).sum()).backward()
    return [x.detach().numpy() for x in (lp, en, h.grad, w.grad)]


@pytest.mark.parametrize("k", [1, 7, 64])
def test_keep_ids_against_float64_and_across_frontends(k):
    d = _inputs(k)
    hidden, weight, targets, ids, mask, _, _ = d
    jx, tr = _jax(d, keep_ids=jnp.asarray(ids)), _torch(d, keep_ids=ids)
    oracle = _oracle(hidden, weight, targets, ids)
    for logp in (jx[0], tr[0]):
        np.testing.assert_array_equal(np.isnan(logp), np.isnan(oracle))
        np.testing.assert_array_equal(np.isneginf(logp), np.isneginf(oracle))
        fin = np.isfinite(oracle)
        assert np.all(np.abs(logp[fin] - oracle[fin]) <= 2e-5 * (1 + np.abs(oracle[fin])))
    masked = _jax(d, keep_mask=jnp.asarray(mask))
    for name, a, b, c in zip(("logp", "entropy", "dh", "dw"), jx, tr, masked, strict=True):
        np.testing.assert_array_equal(a, b, err_msg=name)  # JAX and torch
        np.testing.assert_array_equal(a, c, err_msg=name)  # ids and the mask they stand for


def test_keep_ids_under_shard_map_give_the_unsharded_bits():
    d = _inputs(7)
    hidden, weight, targets, ids, _, _, _ = d
    one = rlk_xla.linear_logp(hidden, weight, targets, temperature=TEMP, keep_ids=jnp.asarray(ids))
    mesh = jax.make_mesh((2,), ("tp",), axis_types=(jax.sharding.AxisType.Auto,), devices=jax.devices("cpu")[:2])

    def local(hh, ww, ii):
        return rlk_xla.linear_logp(hh, ww, jnp.asarray(targets), temperature=TEMP, keep_ids=ii, axis_name="tp")
    two = jax.jit(shard_map(local, mesh=mesh, in_specs=(P(), P("tp"), P()), out_specs=P()))(
        jnp.asarray(hidden), jnp.asarray(weight), jnp.asarray(ids))
    np.testing.assert_array_equal(np.asarray(two), np.asarray(one))


def test_refusals():
    hidden, weight, targets, ids, mask, _, _ = _inputs(7)
    with pytest.raises(ValueError, match="not both"):
        rlk_xla.linear_logp(hidden, weight, targets, keep_ids=jnp.asarray(ids), keep_mask=jnp.asarray(mask))
    with pytest.raises(ValueError, match="not both"):
        torch_bridge.linear_logp(torch.tensor(hidden), torch.tensor(weight), torch.tensor(targets).long(),
                                 keep_ids=torch.tensor(ids), keep_mask=torch.tensor(mask))
    with pytest.raises(ValueError, match="keep_ids must be"):
        rlk_xla.linear_logp(hidden, weight, targets, keep_ids=jnp.asarray(ids[1:]))
    with pytest.raises(ValueError, match="keep_ids must be"):
        torch_bridge.linear_logp(torch.tensor(hidden), torch.tensor(weight), torch.tensor(targets).long(),
                                 keep_ids=torch.tensor(ids[:, None]))
