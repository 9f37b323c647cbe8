"""rlk_xla.linear_logp(keep_mask=): the top-p nucleus in JAX with torch_bridge's semantics and kernels.
The same bits as torch_bridge.linear_logp for the same inputs (logp, entropy and every gradient; fp32
and bf16, lean and fast, a per-token temperature, a bias; on the CPU, and on CUDA with `-m gpu`); a target outside the nucleus gives -inf,
an empty nucleus NaN, the entropy stays the whole distribution's (the no-mask call's bits); TP 2 and
4 under shard_map give the unsharded bits (logp, entropy, dW, db; dH and dT, sums of the shards'
partials, to fp32 rounding); the reference (mode="off") agrees to fp32 rounding; a
mask of the wrong shape or dtype is refused."""
import pytest

jax = pytest.importorskip("jax", reason="jax is not installed: these tests need it")
torch = pytest.importorskip("torch", reason="torch is not installed: the bits are compared with torch_bridge's")

import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P
from torch_helpers import GPU

import rlk_xla
import torch_bridge
from rlk_xla._compat import shard_map


@pytest.fixture(autouse=True)
def on_the_cpu():
    """JAX on the CPU, as the torch side: the bits compared are the CPU kernels' on any machine."""
    with jax.default_device(jax.devices("cpu")[0]):
        yield

N, H, V = 37, 24, 304  # V: 4 shards of 76, no multiple of a tile


def _inputs(dtype="float32", seed=0):
    rng = np.random.default_rng(seed)
    hidden = rng.standard_normal((N, H)).astype(np.float32)
    weight = (rng.standard_normal((V, H)) * 3 / H ** 0.5).astype(np.float32)
    bias = rng.standard_normal(V).astype(np.float32)
    if dtype == "bfloat16":  # values exact in bf16, so both frontends start from the same bits
        hidden, weight, bias = (np.asarray(jnp.asarray(x, jnp.bfloat16).astype(jnp.float32)) for x in
                                (hidden, weight, bias))
    targets = rng.integers(0, V, N).astype(np.int32)
    targets[::6] = -100
    temp = rng.uniform(0.5, 1.5, N).astype(np.float32)
    keep = rng.random((N, V)) < 0.3
    keep[np.arange(N), np.clip(targets, 0, None)] = True  # every target kept
    g, e = rng.standard_normal(N).astype(np.float32), rng.standard_normal(N).astype(np.float32)
    return hidden, weight, bias, targets, temp, keep, g, e


def _jax(d, dtype, backward, keep=None, **kw):
    hidden, weight, bias, targets, temp, k, g, e = d
    keep = k if keep is None else keep
    cast = lambda x: jnp.asarray(x, dtype)

    def f(hh, ww, bb, tt):
        lp, en = rlk_xla.linear_logp(hh, ww, jnp.asarray(targets), bias=bb, temperature=tt, return_entropy=True,
                                     keep_mask=jnp.asarray(keep), backward=backward, **kw)
        return (lp * g).sum() + (en * e).sum(), (lp, en)
    (_, out), grads = jax.value_and_grad(f, argnums=(0, 1, 2, 3), has_aux=True)(
        cast(hidden), cast(weight), cast(bias), jnp.asarray(temp))
    return [np.asarray(x, np.float32) for x in (*out, *grads)]


def _torch(d, dtype, backward, device="cpu"):
    hidden, weight, bias, targets, temp, keep, g, e = d
    dt = {"float32": torch.float32, "bfloat16": torch.bfloat16}[dtype]
    on = lambda x: torch.tensor(x).to(device)
    leaves = [on(x).to(dt).requires_grad_() for x in (hidden, weight, bias)]
    tt = on(temp).requires_grad_()
    lp, en = torch_bridge.linear_logp(*leaves[:2], on(targets).long(), bias=leaves[2], temperature=tt,
                                      return_entropy=True, keep_mask=on(keep), backward=backward)
    ((lp * on(g)).sum() + (en * on(e)).sum()).backward()
    return [x.detach().float().cpu().numpy() for x in (lp, en, *(t.grad for t in leaves), tt.grad)]


def _jax_device(device):
    if device == "cpu":
        return jax.devices("cpu")[0]
    try:
        return jax.devices("gpu")[0]
    except RuntimeError:
        pytest.skip("needs a JAX GPU backend (jax.devices('gpu') is empty)")


@pytest.mark.parametrize("device", ["cpu", GPU])
@pytest.mark.parametrize("backward", ["lean", "fast"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_same_bits_as_torch(dtype, backward, device):
    d = _inputs(dtype)
    with jax.default_device(_jax_device(device)):
        ours = _jax(d, dtype, backward)
    for name, a, b in zip(("logp", "entropy", "dh", "dw", "db", "dtemp"), ours, _torch(d, dtype, backward, device),
                          strict=True):
        np.testing.assert_array_equal(a, b, err_msg=name)


def test_semantics_outside_empty_and_the_entropy():
    d = _inputs()
    hidden, weight, bias, targets, temp, keep, _, _ = d
    keep = keep.copy()
    keep[1, targets[1]] = False  # a target outside the nucleus
    keep[2] = False  # an empty nucleus
    logp, ent = rlk_xla.linear_logp(hidden, weight, targets, bias=bias, temperature=temp, return_entropy=True,
                                    keep_mask=jnp.asarray(keep))
    _, ent_all = rlk_xla.linear_logp(hidden, weight, targets, bias=bias, temperature=temp, return_entropy=True)
    assert logp[1] == -np.inf and np.isnan(logp[2])
    np.testing.assert_array_equal(ent, ent_all)
    rows = np.setdiff1d(np.arange(N), [1, 2])
    assert np.all(np.asarray(logp)[rows][targets[rows] >= 0] <= 0)
    ref = rlk_xla.linear_logp(hidden, weight, targets, bias=bias, temperature=temp, keep_mask=jnp.asarray(keep),
                              mode="off")
    assert ref[1] == -np.inf and np.isnan(ref[2])
    np.testing.assert_allclose(np.asarray(ref)[rows], np.asarray(logp)[rows], rtol=0, atol=2e-5)


@pytest.mark.parametrize("tp", [2, 4])
def test_tp_invariant_under_shard_map(tp):
    d = _inputs()
    hidden, weight, bias, targets, temp, keep, g, e = d
    one = _jax(d, "float32", "lean")
    mesh = jax.make_mesh((tp,), ("tp",), axis_types=(jax.sharding.AxisType.Auto,), devices=jax.devices("cpu")[:tp])

    def local(hh, ww, bb, kk, tt):
        return rlk_xla.linear_logp(hh, ww, jnp.asarray(targets), bias=bb, temperature=tt, return_entropy=True,
                                   keep_mask=kk, axis_name="tp", backward="lean")

    def f(hh, ww, bb, tt):
        lp, en = shard_map(local, mesh=mesh, in_specs=(P(), P("tp"), P("tp"), P(None, "tp"), P()),
                           out_specs=(P(), P()))(hh, ww, bb, jnp.asarray(keep), tt)
        return (lp * g).sum() + (en * e).sum(), (lp, en)
    (_, out), grads = jax.jit(jax.value_and_grad(f, argnums=(0, 1, 2, 3), has_aux=True))(
        jnp.asarray(hidden), jnp.asarray(weight), jnp.asarray(bias), jnp.asarray(temp))
    for name, ours, ref in zip(("logp", "entropy", "dh", "dw", "db", "dtemp"), (*out, *grads), one, strict=True):
        if name in ("dh", "dtemp"):  # sums of the shards' f32 partials: a TP-dependent order
            np.testing.assert_allclose(np.asarray(ours), ref, rtol=0, atol=1e-5 * np.abs(ref).max(), err_msg=name)
        else:
            np.testing.assert_array_equal(np.asarray(ours, np.float32), ref, err_msg=name)


def test_a_wrong_mask_is_refused():
    hidden, weight, _, targets, _, keep, _, _ = _inputs()
    with pytest.raises(ValueError, match="keep_mask"):
        rlk_xla.linear_logp(hidden, weight, targets, keep_mask=jnp.asarray(keep[:, 1:]))
    with pytest.raises(ValueError, match="keep_mask"):
        rlk_xla.linear_logp(hidden, weight, targets, keep_mask=jnp.asarray(keep, jnp.uint8))
