"""Autograd-aware collectives over a tensor-parallel group whose loss is replicated on every rank."""
from __future__ import annotations

import torch
import torch.distributed as dist


class _SumReplicatedLoss(torch.autograd.Function):
    """Forward: all-reduce SUM of per-shard partials. Backward: identity (every rank holds the same
    dL/dSum, and its partial enters the sum once)."""

    @staticmethod
    def forward(ctx, x, group):
        y = x.clone()
        dist.all_reduce(y, op=dist.ReduceOp.SUM, group=group)
        return y

    @staticmethod
    def backward(ctx, g):
        return g, None


class _CopyToGroup(torch.autograd.Function):
    """Forward: identity on a replicated input. Backward: all-reduce SUM of the per-shard partial
    gradients (Megatron's copy_to_tensor_model_parallel_region)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        g = g.contiguous().clone()
        dist.all_reduce(g, op=dist.ReduceOp.SUM, group=ctx.group)
        return g, None


def sum_over(x, group):
    return x if group is None else _SumReplicatedLoss.apply(x, group)


def copy_to(x, group):
    return x if group is None else _CopyToGroup.apply(x, group)


def max_over(x, group):
    """All-reduce MAX, no gradient."""
    x = x.detach().clone()
    if group is not None:
        dist.all_reduce(x, op=dist.ReduceOp.MAX, group=group)
    return x
