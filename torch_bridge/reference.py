"""The reference: plain torch with materialized fp32 logits. The oracle of the tests, the `off`
path and the fallback of `auto`.

Its logits are full fp32 whatever torch's global matmul precision (torch.set_float32_matmul_precision,
allow_tf32): fp16, fp32 and float64 operands are multiplied in float64 and rounded once to fp32
(the same bits under "highest", "high" and "medium"); bf16 operands are exact in every internal
format torch may pick (TF32, bf16) and accumulate in fp32 (under "medium" possibly in another
order), and stay on the fp32 path, half the cost of float64, for the common bf16 fallback.

Same signature and semantics as torch_bridge.linear_logp. With `tp_group`, the weight is this
rank's vocab shard and the row statistics (max, sum-exp, target logit, sum p z) are combined with
all-reduces; the full dH is all-reduced over the group unless reduce_grad_hidden=False.
"""
from __future__ import annotations

import torch

from . import _dist
from ._args import Args, parse

F32 = torch.float32


def linear_logp(hidden, weight, targets, *, bias=None, temperature=1.0, ignore_index=-100, return_entropy=False,
                vocab_start=None, real_vocab_size=None, tp_group=None, mode=None, reduce_grad_hidden=True,
                validate_targets=False, backward="auto", backward_memory_budget=None, keep_mask=None):
    # accepted for signature parity; out-of-range ids give NaN rows here, autograd does the backward
    del mode, validate_targets, backward, backward_memory_budget
    a = parse(hidden, weight, targets, bias=bias, temperature=temperature, ignore_index=ignore_index,
              vocab_start=vocab_start, real_vocab_size=real_vocab_size, tp_group=tp_group, keep_mask=keep_mask)
    logp, ent = rows(a, return_entropy, reduce_grad_hidden=reduce_grad_hidden)
    logp = logp.reshape(a.out_shape)
    return (logp, ent.reshape(a.out_shape)) if return_entropy else logp


def rows(a: Args, with_entropy: bool, reduce_grad_hidden: bool = True):
    """logp and entropy ([n] f32 each; entropy zeros when not asked) of parsed arguments; with a
    nucleus (a.keep) logp over it, the entropy unmasked."""
    group = a.tp_group
    hidden = _dist.copy_to(a.hidden, group) if reduce_grad_hidden else a.hidden
    logits = _logits(hidden, a.weight)
    if a.bias is not None:
        logits = logits + a.bias.to(F32)
    kw = dict(vocab_start=a.vocab_start, real_vocab=a.real_vocab, ignore_index=a.ignore_index, tp_group=group)
    temperature = _dist.copy_to(a.temperature, group)
    logp, ent = logits_rows(logits, a.targets, temperature, with_entropy=with_entropy, **kw)
    if a.keep is not None:
        logp, _ = logits_rows(logits.masked_fill(~a.keep, float("-inf")), a.targets, temperature, **kw)
    return logp, ent


def _logits(hidden, weight):
    """hidden @ weight.T in fp32 whatever the global matmul precision (see the module docstring)."""
    if hidden.dtype == torch.bfloat16:
        return hidden.to(F32) @ weight.to(F32).T
    return (hidden.to(torch.float64) @ weight.to(torch.float64).T).to(F32)


def logits_rows(logits, targets, temperature, *, vocab_start=0, real_vocab=None, ignore_index=-100, tp_group=None,
                with_entropy=False):
    """From (this rank's shard of) materialized logits [n, v_local]: logp and entropy [n] f32.
    temperature: [n] f32 (or a python float). Global ids >= real_vocab are padding."""
    n, v = logits.shape
    real_vocab = v if real_vocab is None else real_vocab
    z = logits.to(F32) / (temperature[:, None] if isinstance(temperature, torch.Tensor) else float(temperature))
    gid = vocab_start + torch.arange(v, device=logits.device)
    pad = (gid >= real_vocab)[None, :]
    z = z.masked_fill(pad, float("-inf"))
    # Everything relative to the row max m (as the kernels' statistics): accurate entropy for
    # peaked rows where lse - sum p z would cancel.
    m = _dist.max_over(z.max(dim=-1).values if v else z.new_full((n,), float("-inf")), tp_group)
    zm = z - m[:, None]
    ez = torch.exp(zm)
    s = _dist.sum_over(ez.sum(dim=-1), tp_group)
    t = targets.reshape(-1).to(torch.int64)
    local = (t >= vocab_start) & (t < vocab_start + v)
    idx = (t - vocab_start).clamp(0, max(v - 1, 0))
    zt_local = zm.gather(1, idx[:, None])[:, 0] if v else zm.new_zeros((n,))
    ztm = _dist.sum_over(torch.where(local, zt_local, torch.zeros_like(zt_local)), tp_group)
    ignored = t == ignore_index
    invalid = ~ignored & ((t < 0) | (t >= real_vocab))
    keep = ~(ignored | invalid)
    nan, zero = torch.full_like(s, float("nan")), torch.zeros_like(s)
    log_s = torch.log(torch.where(keep, s, torch.ones_like(s)))
    logp = torch.where(keep, torch.clamp(ztm - log_s, max=0.0), torch.where(invalid, nan, zero))
    if not with_entropy:
        return logp, torch.zeros_like(logp)
    zm_safe = torch.where(pad, torch.zeros_like(zm), zm)  # e^(z-m) (z-m) is 0 on padding; keep -inf out
    acc = _dist.sum_over((ez * zm_safe).sum(dim=-1), tp_group)
    ent = torch.where(keep, log_s - acc / torch.where(keep, s, torch.ones_like(s)), torch.where(invalid, nan, zero))
    return logp, ent
