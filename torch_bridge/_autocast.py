"""The op's autocast rule, F.linear's: under torch.autocast on the operands' device, hidden, weight
and bias are cast to the autocast dtype (fp32 master weights meet bf16 activations, as in TRL with
bf16=True), and the op runs with autocast off (its fp32 statistics and its reference path stay
fp32). fp64 tensors are left as autocast leaves them (and the op refuses them). Outside autocast
nothing is cast, so mixed dtypes still raise."""
from __future__ import annotations

import functools

import torch


def autocast_rule(fn):
    """fn(hidden, weight, targets, ..., bias=None, ...) with the rule above."""
    @functools.wraps(fn)
    def wrapper(hidden, weight, targets, *args, bias=None, **kwargs):
        dev = hidden.device.type if isinstance(hidden, torch.Tensor) else None
        if dev is None or not torch.is_autocast_enabled(dev):
            return fn(hidden, weight, targets, *args, bias=bias, **kwargs)
        dtype = torch.get_autocast_dtype(dev)

        def cast(t):
            eligible = isinstance(t, torch.Tensor) and t.is_floating_point() and t.dtype != torch.float64
            return t.to(dtype) if eligible else t

        with torch.autocast(dev, enabled=False):
            return fn(cast(hidden), cast(weight), targets, *args, bias=cast(bias), **kwargs)

    return wrapper
