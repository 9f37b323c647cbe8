"""keep_ids: the nucleus as kept ids (vime's sparse top-p replay), [..., K] integers, -1 padded,
global vocab ids (a repeated id counts once). The call takes them as the keep_mask they stand for (this shard's columns of the
ids, scattered into bool [..., V_local]), so the kernels, the bits and the gradients are keep_mask's.
The mask costs n x V_local bytes for the call; an O(n K H) kernel that scores the K ids alone is owed
(docs/architecture.md, "Frontend features")."""
from __future__ import annotations

import functools

import torch

from ._args import tp_layout


def keep_ids_rule(fn):
    """fn(hidden, weight, targets, ..., keep_mask=, tp_group=, vocab_start=) also taking keep_ids=."""
    @functools.wraps(fn)
    def wrapper(hidden, weight, targets, *args, keep_ids=None, keep_mask=None, tp_group=None, vocab_start=None,
                **kwargs):
        if keep_ids is not None:
            if keep_mask is not None:
                raise ValueError("linear_logp: pass keep_ids or keep_mask, not both")
            _, _, start = tp_layout(tp_group, weight.shape[0], vocab_start)
            keep_mask = mask_of(keep_ids, targets, weight.shape[0], start)
        return fn(hidden, weight, targets, *args, keep_mask=keep_mask, tp_group=tp_group, vocab_start=vocab_start,
                  **kwargs)
    return wrapper


def mask_of(keep_ids, targets, v_local: int, vocab_start: int):
    """bool [*targets.shape, v_local], contiguous (what the kernels read, with no copy): True at this
    shard's columns of each row's kept ids."""
    if not isinstance(keep_ids, torch.Tensor) or keep_ids.dtype.is_floating_point or keep_ids.dtype == torch.bool:
        raise TypeError(f"keep_ids must be an integer tensor, got {type(keep_ids).__name__}"
                        f"{'' if not isinstance(keep_ids, torch.Tensor) else ' ' + str(keep_ids.dtype)}")
    if tuple(keep_ids.shape[:-1]) != tuple(targets.shape) or keep_ids.dim() != targets.dim() + 1:
        raise ValueError(f"keep_ids must be targets' shape plus K, {(*targets.shape, 'K')}, got "
                         f"{tuple(keep_ids.shape)}")
    local = keep_ids.long() - vocab_start
    own = (keep_ids >= 0) & (local >= 0) & (local < v_local)
    # An id this shard does not own writes 0 at column 0, which a max keeps a kept id's 1 over (a
    # plain scatter's order among equal indices is not defined).
    mask = torch.zeros((*targets.shape, v_local), dtype=torch.uint8, device=keep_ids.device)
    mask.scatter_reduce_(-1, torch.where(own, local, 0), own.to(torch.uint8), reduce="amax")
    return mask.view(torch.bool)
