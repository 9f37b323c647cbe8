"""DTensor operands (torchtitan's ColwiseParallel LM head, a replicated DTensor hidden): the op
reads the tensor-parallel layout from the DTensors and runs the plain-tensor path on their local
pieces, so the bits are the plain path's.

- weight (and bias, with the same placements) a DTensor: Shard(0) over one mesh dim is the vocab
  sharded over that dim's group (tp_group and vocab_start = the dim's local rank * V_local, V
  divisible by the dim's size); Replicate() elsewhere. dW (and the bias gradient) come back as
  DTensors with the weight's placements (to_local's backward). A weight sharded over a dim named
  for data parallelism (DATA_PARALLEL_DIMS: FSDP's), over several dims, or in any other way, is
  refused with the fix.
- hidden a DTensor: Replicate() over the weight's vocab dim; rows may be Shard(d) over other mesh
  dims (d not the hidden dim), with targets a DTensor of the same placements. logp and entropy come
  back as DTensors with hidden's placements, dH as one with hidden's.
- the nucleus: keep_mask a DTensor Shard(-1) over the weight's vocab dim (this shard's columns) or
  Replicate() there (its columns of this shard are taken), keep_ids (global ids) Replicate() there;
  rows placed as hidden's.
- tp_group and vocab_start are read from the weight: passing them with a DTensor weight raises.
"""
from __future__ import annotations

import functools

import torch

DATA_PARALLEL_DIMS = frozenset({"dp", "dp_shard", "dp_replicate", "dp_shard_cp", "fsdp", "hsdp", "ddp", "data"})


def _dtensor_type():
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # a torch without torch.distributed
        return None
    return DTensor


def dtensor_rule(fn):
    """fn(hidden, weight, targets, ..., bias=, tp_group=, vocab_start=, keep_mask=) with the rule above."""
    @functools.wraps(fn)
    def wrapper(hidden, weight, targets, *args, bias=None, tp_group=None, vocab_start=None, **kwargs):
        dt = _dtensor_type()
        nucleus = ("keep_mask", "keep_ids")
        if dt is None or not any(isinstance(t, dt) for t in (hidden, weight, targets, bias,
                                                             *map(kwargs.get, nucleus))):
            return fn(hidden, weight, targets, *args, bias=bias, tp_group=tp_group, vocab_start=vocab_start,
                      **kwargs)
        weight, bias, tp_group, vocab_start, tp_dim = _weight(dt, weight, bias, tp_group, vocab_start)
        hidden, targets, wrap = _rows(dt, hidden, targets, tp_dim)
        for name in nucleus:
            if isinstance(kwargs.get(name), dt):
                kwargs[name] = _nucleus(name, kwargs[name], tp_dim, vocab_start, weight.shape[0])
        out = fn(hidden, weight, targets, *args, bias=bias, tp_group=tp_group, vocab_start=vocab_start, **kwargs)
        return tuple(map(wrap, out)) if isinstance(out, tuple) else wrap(out)

    return wrapper


def _weight(dt, weight, bias, tp_group, vocab_start):
    """(local weight, local bias, group, vocab_start, the vocab's mesh dim or None)."""
    if not isinstance(weight, dt):
        if isinstance(bias, dt):
            raise TypeError("linear_logp: bias is a DTensor but weight is not: pass both as DTensors or neither")
        return weight, bias, tp_group, vocab_start, None
    if tp_group is not None or vocab_start is not None:
        raise ValueError("linear_logp: weight is a DTensor, its tensor-parallel group and vocab_start are read from "
                         "it: pass neither tp_group nor vocab_start")
    mesh, placements = weight.device_mesh, tuple(weight.placements)
    names = mesh.mesh_dim_names or (None,) * mesh.ndim
    if any(not (p.is_replicate() or p.is_shard(0)) for p in placements):
        raise ValueError(f"linear_logp: weight placements {placements} are not supported: shard the LM head over the "
                         "vocab (Shard(0)) over one mesh dim, or replicate it")
    sharded = [i for i, p in enumerate(placements) if p.is_shard(0)]
    fix = ("call linear_logp inside the module's forward (where FSDP has unsharded the weight) or pass "
           "weight.full_tensor()")
    if any(names[i] in DATA_PARALLEL_DIMS for i in sharded):
        raise ValueError(f"linear_logp: weight is sharded (Shard(0)) over the data-parallel mesh dim(s) "
                         f"{[names[i] for i in sharded]} (FSDP), not over a tensor-parallel one: {fix}")
    if len(sharded) > 1:
        raise ValueError(f"linear_logp: weight is sharded over several mesh dims {[names[i] for i in sharded]}: "
                         f"linear_logp shards the vocab over one tensor-parallel dim; {fix}")
    if isinstance(bias, torch.Tensor) and (not isinstance(bias, dt) or tuple(bias.placements) != placements):
        raise TypeError(f"linear_logp: bias must be a DTensor with the weight's placements {placements}")
    local_bias = None if bias is None else bias.to_local()
    if not sharded:
        return weight.to_local(), local_bias, None, None, None
    d = sharded[0]
    size = mesh.size(d)
    if weight.shape[0] % size:
        raise ValueError(f"linear_logp: the vocab ({weight.shape[0]}) is not divisible by the tensor-parallel degree "
                         f"({size}) of mesh dim {names[d]!r}: pad the LM head to a multiple of it")
    local = weight.to_local()
    return local, local_bias, mesh.get_group(d), mesh.get_local_rank(d) * local.shape[0], d


def _rows(dt, hidden, targets, tp_dim):
    """(local hidden, local targets, wrap for the outputs)."""
    if not isinstance(hidden, dt):
        if isinstance(targets, dt):
            targets = _replicated(targets, "targets").to_local()
        return hidden, targets, lambda x: x
    placements = tuple(hidden.placements)
    last = hidden.ndim - 1
    for i, p in enumerate(placements):
        if p.is_replicate():
            continue
        if not p.is_shard() or p.dim % hidden.ndim == last or i == tp_dim:
            raise ValueError(f"linear_logp: hidden placements {placements} are not supported: replicate hidden over "
                             "the weight's vocab dim (rows may be Shard over other mesh dims, never the hidden dim)")
    sharded_rows = any(p.is_shard() for p in placements)
    if sharded_rows and (not isinstance(targets, dt) or tuple(targets.placements) != placements):
        raise TypeError(f"linear_logp: hidden's rows are sharded ({placements}): targets must be a DTensor with the "
                        "same placements")
    if isinstance(targets, dt):
        targets = targets.to_local()
    mesh = hidden.device_mesh
    return hidden.to_local(), targets, lambda x: dt.from_local(x, mesh, placements, run_check=False)


def _nucleus(name, t, tp_dim, vocab_start, v_local):
    """The local nucleus of a DTensor keep_mask or keep_ids (rows placed as hidden's: the op checks
    the local shape). keep_mask: Shard on its vocab (last) dim over the weight's vocab mesh dim is
    this shard's columns; Replicate there, its columns of this shard are sliced. keep_ids (global
    ids): Replicate over the vocab mesh dim."""
    placements = tuple(t.placements)
    on_vocab = placements[tp_dim] if tp_dim is not None else None
    local = t.to_local()
    if name == "keep_ids" or on_vocab is None:
        if on_vocab is not None and not on_vocab.is_replicate():
            raise ValueError(f"linear_logp: keep_ids placements {placements}: global ids are replicated over the "
                             "weight's vocab mesh dim")
        return local
    if on_vocab.is_shard() and on_vocab.dim % t.ndim == t.ndim - 1:
        return local
    if on_vocab.is_replicate():
        return local[..., vocab_start:vocab_start + v_local]
    raise ValueError(f"linear_logp: keep_mask placements {placements}: shard its vocab (last) dim over the weight's "
                     "vocab mesh dim (Shard(-1)), or replicate it there")


def _replicated(t, what):
    if any(not p.is_replicate() for p in t.placements):
        raise ValueError(f"linear_logp: {what} placements {tuple(t.placements)}: a plain hidden takes replicated "
                         f"{what}")
    return t
