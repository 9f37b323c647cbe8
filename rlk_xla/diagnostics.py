"""rlk_xla.diagnostics: the per-step train/rollout figures (rlk_common.diagnostics) of JAX arrays:
one device-to-host transfer of the two logp arrays and the mask, then numpy."""
from __future__ import annotations

import jax

from rlk_common import diagnostics as _common
from rlk_common.diagnostics import PREFIX, DlogpStats, WorstToken

__all__ = ["dlogp_stats", "DlogpStats", "WorstToken", "PREFIX"]


def dlogp_stats(train_logp, rollout_logp, mask=None, *, sample_ids=None, positions=None, rank=None) -> DlogpStats:
    """rlk_common.diagnostics.dlogp_stats (see there) of JAX arrays, as plain Python ints and
    floats (eager: call it outside jit)."""
    train_logp, rollout_logp, mask, sample_ids, positions = jax.device_get(
        (train_logp, rollout_logp, mask, sample_ids, positions))
    return _common.dlogp_stats(train_logp, rollout_logp, mask, sample_ids=sample_ids, positions=positions, rank=rank)
