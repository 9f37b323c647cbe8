"""Non-finite values propagate (docs/design.md, "Non-finite values"): a row whose inputs or
statistics are not finite gives NaN logp and entropy, never a finite wrong value; one NaN in the
weight or bias makes every row NaN; NaN rows have NaN gradients. torch_bridge and rlk_xla on the
CPU, both backward strategies; the torch cases also on a GPU under -m gpu."""
import pytest

pytest.importorskip("torch", reason="torch is not installed: these tests need it")

import numpy as np
import torch

import torch_bridge
from torch_helpers import GPU

N, H, V = 70, 24, 300  # two row blocks, odd sizes
DEVICES = ["cpu", GPU]


def _inputs(dtype=torch.float32, device="cpu", seed=0):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(N, H, generator=g)
    w = torch.randn(V, H, generator=g) * 3 / H ** 0.5
    b = torch.randn(V, generator=g)
    t = torch.randint(0, V, (N,), generator=g)
    t[5] = -100  # an ignored row stays 0
    temp = 0.5 + torch.rand(N, generator=g)
    return [x.to(device) for x in (h.to(dtype), w.to(dtype), b.to(dtype), t, temp)]


# (name, how to spoil the inputs, which rows become NaN: a bool mask over rows, before ignoring)
def _spoil(case, h, w, b, t, temp):
    rows = torch.zeros(N, dtype=torch.bool)
    if case == "nan_hidden":
        h[3, 7] = float("nan"); rows[3] = True
    elif case == "inf_hidden":
        h[4, 0] = float("inf"); rows[4] = True
    elif case == "nan_weight":
        w[123, 5] = float("nan"); rows[:] = True
    elif case == "nan_bias":
        b[299] = float("nan"); rows[:] = True
    elif case == "inf_bias":  # a logit of +inf in every row (-inf would be a probability of 0)
        b[17] = float("inf"); rows[:] = True
    elif case == "nan_temperature":
        temp[9] = float("nan"); rows[9] = True
    elif case == "zero_temperature":
        temp[10] = 0.0; rows[10] = True
    elif case == "overflow":  # logits past fp32's range: +inf
        h[11] *= 1e38; rows[11] = True
    rows[5] = False  # the ignored row
    return rows


CASES = ["nan_hidden", "inf_hidden", "nan_weight", "nan_bias", "inf_bias", "nan_temperature", "zero_temperature",
         "overflow"]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("backward", ["fast", "lean"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", CASES)
def test_torch_nonfinite_rows_are_nan_with_nan_gradients(case, dtype, backward, device):
    h, w, b, t, temp = _inputs(dtype, device)
    clean = torch_bridge.linear_logp(h, w, t, bias=b, temperature=temp, return_entropy=True, mode="strict")
    rows = _spoil(case, h, w, b, t, temp).to(device)
    leaves = [x.clone().requires_grad_() for x in (h, w, b, temp)]
    logp, ent = torch_bridge.linear_logp(leaves[0], leaves[1], t, bias=leaves[2], temperature=leaves[3],
                                         return_entropy=True, mode="strict", backward=backward)
    ref = torch_bridge.linear_logp(h, w, t, bias=b, temperature=temp, return_entropy=True, mode="off")
    for ours, theirs, name in ((logp, ref[0], "logp"), (ent, ref[1], "entropy")):
        assert torch.equal(torch.isnan(ours), rows), f"{name}: NaN rows {torch.nonzero(torch.isnan(ours))[:, 0]}"
        assert torch.equal(torch.isnan(theirs), rows)  # the reference agrees
    # the other rows keep their bits (rows are independent)
    assert torch.equal(logp[~rows], clean[0][~rows]) and torch.equal(ent[~rows], clean[1][~rows])
    assert logp[5] == 0 and ent[5] == 0
    ((logp * 0.5).nansum() + (ent * 0.25).nansum() + (logp[rows] + ent[rows]).sum()).backward()
    dh, dw, db, dtemp = (x.grad for x in leaves)
    assert torch.isnan(dh[rows]).all(dim=1).all(), "every element of a NaN row's dH is NaN"
    assert torch.isnan(dtemp[rows]).all()
    if rows.any():  # a NaN row's dlogit reaches every column: dW and db are NaN everywhere
        assert torch.isnan(dw).all() and torch.isnan(db).all()
    if not rows.all():
        assert torch.isfinite(dh[~rows & (torch.arange(N, device=device) != 5)]).all()


def test_torch_tiny_scalar_temperature_gives_nan_rows():
    """A scalar temperature whose fp32 inverse overflows (T = 1e-40: 1/T = inf) gives NaN rows, never
    logp = 0 (probability 1)."""
    h, w, b, t, _ = _inputs()
    logp, ent = torch_bridge.linear_logp(h, w, t, bias=b, temperature=1e-40, return_entropy=True, mode="strict")
    keep = t != -100
    assert torch.isnan(logp[keep]).all() and torch.isnan(ent[keep]).all()


def test_jax_nonfinite_rows_are_nan():
    """The same contract through rlk_xla (the shared combine), on its own and under shard_map (TP = 4)."""
    jax = pytest.importorskip("jax", reason="jax is not installed")
    import jax.numpy as jnp
    from jax.sharding import Mesh, PartitionSpec as P

    import rlk_xla
    from rlk_xla._compat import shard_map

    h, w, b, t, temp = (x.numpy() for x in _inputs())
    h[3, 7] = np.nan
    temp[10] = 0.0
    wn = w.copy()
    wn[123, 5] = np.nan
    keep = t != -100

    def run(backward, tp):
        def f(h, w, b, temp):
            if tp == 1:
                return rlk_xla.linear_logp(h, w, t, bias=b, temperature=temp, return_entropy=True, backward=backward)
            mesh = Mesh(np.array(jax.devices("cpu")[:tp]), ("tp",))
            fn = shard_map(lambda h, w, b, temp: rlk_xla.linear_logp(h, w, t, bias=b, temperature=temp,
                                                                      return_entropy=True, axis_name="tp",
                                                                      backward=backward),
                           mesh=mesh, in_specs=(P(), P("tp"), P("tp"), P()), out_specs=(P(), P()))
            return fn(h, w, b, temp)

        def loss(*a):
            logp, ent = f(*a)
            return jnp.nansum(logp) + logp[3], (logp, ent)

        step = jax.jit(jax.grad(loss, has_aux=True))
        return [[np.asarray(x) for x in jax.tree_util.tree_leaves(step(h, ww, b, temp))] for ww in (w, wn)]

    rows = np.zeros(N, bool)
    rows[[3, 10]] = True
    for backward, tp in (("fast", 1), ("lean", 4 if len(jax.devices("cpu")) >= 4 else 1)):
        (dh, logp, ent), (_, logp_n, ent_n) = run(backward, tp)
        assert (np.isnan(logp) == rows).all() and (np.isnan(ent) == rows).all()
        assert np.isnan(dh[3]).all()
        assert np.isnan(logp_n[keep]).all() and np.isnan(ent_n[keep]).all() and logp_n[5] == 0
