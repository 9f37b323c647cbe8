"""torch_bridge.diagnostics: the per-step train/rollout figures (rlk_common.diagnostics) of torch
tensors: one device-to-host copy of the two logp tensors and the mask, then numpy."""
from __future__ import annotations

import torch

from rlk_common import diagnostics as _common
from rlk_common.diagnostics import PREFIX, DlogpStats, WorstToken

__all__ = ["dlogp_stats", "DlogpStats", "WorstToken", "PREFIX"]


def _host(x):
    if not isinstance(x, torch.Tensor):
        return x
    x = x.detach().cpu()
    return (x.float() if x.dtype.is_floating_point else x).numpy()


def dlogp_stats(train_logp, rollout_logp, mask=None, *, sample_ids=None, positions=None, rank=None) -> DlogpStats:
    """rlk_common.diagnostics.dlogp_stats (see there) of torch tensors on any device, as plain
    Python ints and floats."""
    return _common.dlogp_stats(_host(train_logp), _host(rollout_logp), _host(mask), sample_ids=_host(sample_ids),
                               positions=_host(positions), rank=rank)
