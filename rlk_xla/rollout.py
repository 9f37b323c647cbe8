"""rlk_xla.rollout: the sampler's side of linear_logp (the twin of torch_bridge.integrations.rollout).

score_sampled gives the log-probability (and entropy) of the token a JAX sampler just drew, from
the decode step's final hidden state, through the same compiled kernels and with the same
arguments as rlk_xla.linear_logp: the same bits for the same row, whatever the batch size, the
padding rows and the vocab-parallel degree. Forward only; jit-able (one program per padded batch
size); inside shard_map pass axis_name with this device's LM-head shard, as linear_logp.
"""
from __future__ import annotations

from jax import lax

import rlk_common as common

from ._args import parse
from .linear_logp import _keep, _mask_of, _unsupported, fused_rows

PAD_ID = common.PAD_ID  # padding rows carry it (logp 0, entropy 0) or any real id; other ids give NaN rows


def score_sampled(hidden, weight, sampled_ids, *, temperature=1.0, bias=None, axis_name=None, vocab_start=None,
                  real_vocab_size=None, return_entropy=False, keep_mask=None, keep_ids=None):
    """log_softmax((hidden @ weight.T + bias) / temperature)[sampled_ids] per row, forward only.

    hidden [n, H] (bf16, fp16 or fp32), weight [V_local, H], sampled_ids [n] int global ids (PAD_ID
    for padding rows), temperature a float > 0 or an [n] array, bias [V_local] or None. Returns
    logp [n] f32, or (logp, entropy) with return_entropy: bitwise what rlk_xla.linear_logp returns
    for the same rows and options. No gradient flows through it (lax.stop_gradient). Ids of any
    integer dtype follow linear_logp's rule (rlk_common.id_rule: never wrapped into int32; an int64
    id of 2^32 + 5 gives a NaN row).
    keep_mask (bool [n, V_local], this device's shard) or keep_ids ([n, K] global ids, -1 padded):
    the sampler's top-p nucleus, as linear_logp's: logp over the kept ids (-inf for an id outside
    them, NaN for a row that keeps nothing), the entropy the whole distribution's."""
    a = parse(hidden, weight, sampled_ids, bias=bias, temperature=temperature, ignore_index=PAD_ID,
              vocab_start=vocab_start, real_vocab_size=real_vocab_size, axis_name=axis_name)
    common.check_decode_batch(a.out_shape, hidden.shape, _unsupported(a), "rlk_xla.rollout.score_sampled")
    if keep_ids is not None:
        if keep_mask is not None:
            raise ValueError("rlk_xla.rollout.score_sampled: pass keep_ids or keep_mask, not both")
        keep_mask = _mask_of(keep_ids, sampled_ids, a)
    logp, ent = lax.stop_gradient(fused_rows(a, return_entropy, differentiable=False,
                                             keep=_keep(keep_mask, sampled_ids, a)))
    return (logp, ent) if return_entropy else logp
