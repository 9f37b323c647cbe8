"""Autograd-aware collectives over a tensor-parallel group whose loss is replicated on every rank, and
the check that the group's ranks agree on a call's shapes before any collective runs."""
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


# What the ranks of a TP call must agree on (agree_across_ranks), in the order of the gathered vector.
SHAPE_FIELDS = ("rows", "hidden size", "vocab shard width", "dtype", "keep_mask")


def check_group(tp_group):
    """tp_group: None or a torch.distributed ProcessGroup, else a TypeError naming it."""
    if tp_group is None or isinstance(tp_group, dist.ProcessGroup):
        return tp_group
    raise TypeError(f"tp_group (a vime request's tensor_parallel_group) must be a torch.distributed ProcessGroup "
                    f"or None, got {type(tp_group).__name__}")


def agree_across_ranks(group, shape: tuple | None) -> None:
    """One small all_gather of this rank's `shape` (SHAPE_FIELDS as ints; None: this rank refuses
    the call, its own error raised by the caller after this returns) before any other collective of
    the call: every rank raises a ValueError when a rank refuses, the ranks' shapes differ, or the
    vocab shards are unequal (the layout is rank * V_local, one width), instead of aborting inside
    the collective library or waiting for a timeout. One host sync (eager calls)."""
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend(group) == "nccl" else "cpu"
    mine = torch.tensor([1, *shape] if shape is not None else [0] * (len(SHAPE_FIELDS) + 1), dtype=torch.int64,
                        device=device)
    out = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(out, mine, group=group)
    if shape is None:
        return
    ranks = torch.stack(out).cpu().tolist()
    refused = [r for r, v in enumerate(ranks) if not v[0]]
    if refused:
        raise ValueError(f"tp_group: rank(s) {refused} refused this call (their error names the argument); "
                         f"every rank refuses it, before any collective")
    for i, name in enumerate(SHAPE_FIELDS, start=1):
        values = [v[i] for v in ranks]
        if len(set(values)) > 1:
            what = "equal vocab shards (weight rows)" if name == "vocab shard width" else f"the same {name}"
            raise ValueError(f"tp_group: the ranks must pass {what}, got {name} by rank {values}; every rank "
                             f"refuses the call, before any collective")
