"""dlogp_stats (rlk_common.diagnostics) against figures worked out by hand and in float64, and its
torch and JAX twins giving the same plain Python numbers."""
import math

import numpy as np
import pytest

from rlk_common.diagnostics import DlogpStats, dlogp_stats


def _pair(seed=0, shape=(5, 7)):
    rng = np.random.default_rng(seed)
    train = -rng.exponential(2.0, shape).astype(np.float32)
    roll = train.copy()
    moved = rng.random(shape) < 0.3
    roll[moved] += rng.standard_normal(moved.sum()).astype(np.float32) * 1e-3
    mask = rng.random(shape) < 0.8
    return train, roll, mask


def test_figures_against_float64():
    train, roll, mask = _pair()
    s = dlogp_stats(train, roll, mask, sample_ids=np.arange(100, 105), rank=3)
    t, r = train[mask].astype(np.float64), roll[mask].astype(np.float64)
    d = t - r
    a = np.abs(d)
    assert s.tokens == mask.sum()
    assert s.mismatches == int((train[mask] != roll[mask]).sum()) > 0
    assert s.bitwise_equal_frac == pytest.approx(1 - s.mismatches / s.tokens, abs=0)
    assert s.max_abs == a.max() and s.mean_abs == pytest.approx(a.mean(), rel=1e-12)
    assert (s.p50_abs, s.p90_abs, s.p99_abs) == pytest.approx(tuple(np.percentile(a, [50, 90, 99])), rel=1e-12)
    assert s.approx_kl == pytest.approx(np.mean(np.exp(d) - 1 - d), rel=1e-6) and s.approx_kl > 0
    row, col = np.argwhere(mask & (np.abs(train.astype(np.float64) - roll) == a.max()))[0]
    w = s.worst
    assert (w.sample, w.position, w.rank) == (100 + row, col, 3)
    assert (w.train_logp, w.rollout_logp) == (float(train[row, col]), float(roll[row, col]))
    assert all(isinstance(v, (int, float)) for v in s.as_dict().values())
    assert "worst: sample" in str(s)


def test_identical_inputs_and_edge_cases():
    train, _, mask = _pair(1)
    s = dlogp_stats(train, train.copy(), mask)
    assert (s.mismatches, s.bitwise_equal_frac, s.max_abs, s.approx_kl) == (0, 1.0, 0.0, 0.0)
    empty = dlogp_stats(train, train, np.zeros_like(mask))
    assert (empty.tokens, empty.worst) == (0, None) and empty.as_dict()["rlk_dlogp_worst_sample"] == -1
    # NaN against the same NaN bits is equal; NaN against a number is a mismatch left out of the figures.
    a = np.array([-1.0, np.nan, np.nan, -2.0], np.float32)
    b = np.array([-1.0, np.nan, -3.0, -2.5], np.float32)
    s = dlogp_stats(a, b, positions=np.array([10, 11, 12, 13]))
    assert (s.tokens, s.mismatches, s.nonfinite) == (4, 2, 2)
    assert (s.max_abs, s.worst.sample, s.worst.position) == (0.5, 3, 13)
    # -0.0 and 0.0 differ in one bit: a mismatch with |dlogp| = 0.
    assert dlogp_stats(np.array([0.0], np.float32), np.array([-0.0], np.float32)).mismatches == 1


def test_shapes_are_checked():
    with pytest.raises(ValueError, match="same shape"):
        dlogp_stats(np.zeros(3), np.zeros(4))
    with pytest.raises(ValueError, match="mask"):
        dlogp_stats(np.zeros(3), np.zeros(3), np.ones(4))
    with pytest.raises(ValueError, match=r"\[samples, positions\] or \[tokens\]"):
        dlogp_stats(np.zeros((2, 2, 2)), np.zeros((2, 2, 2)))
    # issue 44: sample_ids and positions were not checked (a short one failed deep inside, or not at all)
    with pytest.raises(ValueError, match="sample_ids must hold one id per sample, 2, got 3"):
        dlogp_stats(np.zeros((2, 4)), np.ones((2, 4)), sample_ids=[5, 6, 7])
    with pytest.raises(ValueError, match="sample_ids must hold one id per token, 4, got 1"):
        dlogp_stats(np.zeros(4), np.ones(4), sample_ids=[5])
    with pytest.raises(ValueError, match=r"positions \(2, 3\) must be shaped like train_logp \(2, 4\)"):
        dlogp_stats(np.zeros((2, 4)), np.ones((2, 4)), positions=np.zeros((2, 3), int))


def test_torch_and_jax_twins_give_the_same_numbers():
    torch = pytest.importorskip("torch", reason="torch is not installed")
    jnp = pytest.importorskip("jax.numpy", reason="jax is not installed")
    from torch_bridge.diagnostics import dlogp_stats as torch_stats
    from rlk_xla.diagnostics import dlogp_stats as jax_stats
    train, roll, mask = _pair(2)
    ref = dlogp_stats(train, roll, mask, rank=1)
    t = torch_stats(torch.tensor(train), torch.tensor(roll), torch.tensor(mask), rank=1)
    j = jax_stats(jnp.asarray(train), jnp.asarray(roll), jnp.asarray(mask), rank=1)
    assert isinstance(t, DlogpStats) and t == ref and j == ref
    assert not any(isinstance(v, float) and math.isnan(v) for v in ref.as_dict().values())
