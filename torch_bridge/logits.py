"""Selected-token logp and entropy from logits a framework already materialized (no projection).

For callers that hold (this rank's shard of) the logits z [n, V_local], e.g. Megatron's output
layer: the same contract as the fused kernels, computed in torch from z in fp32:
- per canonical chunk (_args.chunk_of) the statistics m = max z, s = sum exp(z - m),
  a = sum exp(z - m) (z - m); the sums are pairwise trees over fixed halves of the chunk, the
  exps elementwise, so a chunk's statistics do not depend on N, on a row's position or on the
  tensor-parallel degree;
- the chunks are placed at their global offset, all-reduced (a sum of one value and zeros) and
  merged in chunk order by the kernels' own combine (rlk::combine): TP = 1, 2, 4, 8 and any row
  split give the same bits.
keep_mask [n, V_local] bool (a top-p nucleus): logp is renormalized over the kept ids (a target
outside its nucleus gives -inf); the entropy stays that of the unmasked distribution.
Gradients: dz = g (delta_t kept_t - p_kept) + e p (lse - H - z) per row, the kernels' formula with
the nucleus softmax in the logp term.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Optional

import torch

from . import _ops
from rlk_common import real_vocab as real_vocab_rule

from ._args import chunk_of, id_rule, int32_targets

F32 = torch.float32
NEG_INF = float("-inf")


def logp_from_logits(logits, targets, *, keep_mask=None, vocab_start=0, real_vocab=None, tp_group=None,
                     with_entropy=False, ignore_index=-100):
    """(logp [n] f32, entropy [n] f32 or None) of softmax(logits) at targets; differentiable in
    logits. logits: [n, V_local] floating (this rank's contiguous shard when tp_group is given:
    vocab_start = rank * V_local); targets [n] global ids (ignore_index rows give 0, ids outside
    [0, real_vocab) NaN); real_vocab in [1, V_local * TP] (the fused route's rule: an id with no
    logit column is refused, never scored), default the padded V_local * TP, ids at or above it are
    padding; keep_mask: [n, V_local] bool or None."""
    n, v = logits.shape
    tp = 1 if tp_group is None else torch.distributed.get_world_size(tp_group)
    rule = id_rule(targets, int(ignore_index))
    cfg = _Cfg(vocab_start=int(vocab_start), real_vocab=real_vocab_rule(real_vocab, v * tp),
               v_global=v * tp, ignore_index=rule.ignore, group=tp_group if tp > 1 else None,
               with_entropy=bool(with_entropy))
    t32 = int32_targets(targets.reshape(n), rule)
    keep = None if keep_mask is None else keep_mask.to(torch.bool)
    logp, ent = _FromLogits.apply(logits.to(F32).contiguous(), t32, keep, cfg)
    return logp, (ent if with_entropy else None)


@dataclasses.dataclass(frozen=True)
class _Cfg:
    vocab_start: int
    real_vocab: int
    v_global: int
    ignore_index: int
    group: Any
    with_entropy: bool


def _tree_sum(x: torch.Tensor) -> torch.Tensor:
    """Sum over the last dim by a fixed pairwise tree (elementwise adds only: the same bits for a
    row wherever it sits, on every device)."""
    w = x.shape[-1]
    p = 1
    while p * 2 <= w:
        p *= 2
    if p < w:
        x = torch.cat([x[..., :w - p] + x[..., p:], x[..., w - p:p]], dim=-1)
    while x.shape[-1] > 1:
        h = x.shape[-1] // 2
        x = x[..., :h] + x[..., h:]
    return x[..., 0]


def _chunk_stats(z: torch.Tensor, chunk: int) -> torch.Tensor:
    """[n, v/chunk, 3] statistics (m, s, a) of z [n, v] (-inf entries count for nothing)."""
    n, v = z.shape
    zc = z.reshape(n, v // chunk, chunk)
    m = zc.amax(dim=-1)
    m0 = torch.where(torch.isneginf(m), torch.zeros_like(m), m)
    d = zc - m0[..., None]
    e = torch.exp(d)
    a = torch.where(e > 0, e * d, torch.zeros_like(e))
    return torch.stack([m, _tree_sum(e), _tree_sum(a)], dim=-1)


def _target_logit(z: torch.Tensor, targets: torch.Tensor, vocab_start: int) -> torch.Tensor:
    """z at the target for rows whose target is in this shard, else 0 (summed over the shards)."""
    local = targets.to(torch.int64) - vocab_start
    here = (local >= 0) & (local < z.shape[1])
    zt = z.gather(1, local.clamp(0, max(z.shape[1] - 1, 0))[:, None])[:, 0]
    return torch.where(here, zt, torch.zeros_like(zt))


def _combined(stats, tl, targets, cfg: _Cfg, chunk: int):
    """Every shard's chunks in global order, then rlk::combine: (logp, lse, entropy) [n]."""
    n, k_local, w = stats.shape
    if cfg.group is not None:
        off = cfg.vocab_start // chunk
        full = stats.new_zeros((n, cfg.v_global // chunk, w))
        full[:, off:off + k_local] = stats
        torch.distributed.all_reduce(full, group=cfg.group)
        tl = tl.clone()
        torch.distributed.all_reduce(tl, group=cfg.group)
        stats = full
    logp, ent, m, log_s, _ = _ops.run("combine", stats.contiguous(), tl.contiguous(), targets, cfg.real_vocab,
                                      cfg.ignore_index)
    return logp, m + log_s, ent


def _padded(z: torch.Tensor, cfg: _Cfg) -> torch.Tensor:
    gid = cfg.vocab_start + torch.arange(z.shape[1], device=z.device)
    return z.masked_fill((gid >= cfg.real_vocab)[None, :], NEG_INF)


class _FromLogits(torch.autograd.Function):
    @staticmethod
    def forward(ctx, z, targets, keep: Optional[torch.Tensor], cfg: _Cfg):
        chunk = chunk_of(cfg.v_global, z.shape[1])
        z = _padded(z, cfg)
        stats, tl = _chunk_stats(z, chunk), _target_logit(z, targets, cfg.vocab_start)
        logp, lse, ent = _combined(stats, tl, targets, cfg, chunk)
        lse_keep = lse
        if keep is not None:
            zk = z.masked_fill(~keep, NEG_INF)
            logp, lse_keep, _ = _combined(_chunk_stats(zk, chunk), _target_logit(zk, targets, cfg.vocab_start),
                                          targets, cfg, chunk)
        if not cfg.with_entropy:
            ent = torch.zeros_like(logp)
        ctx.save_for_backward(z, targets, keep, lse, lse_keep, ent)
        ctx.cfg = cfg
        return logp, ent

    @staticmethod
    def backward(ctx, g, e):
        z, targets, keep, lse, lse_keep, ent = ctx.saved_tensors
        cfg = ctx.cfg
        t = targets.to(torch.int64)
        valid = (t != cfg.ignore_index) & (t >= 0) & (t < cfg.real_vocab)
        local = t - cfg.vocab_start
        onehot = (torch.arange(z.shape[1], device=z.device)[None, :] == local[:, None])
        p_keep = torch.exp(z - lse_keep[:, None])
        if keep is not None:
            p_keep = p_keep.masked_fill(~keep, 0.0)
            onehot = onehot & keep
        dz = torch.zeros_like(z) if g is None else g[:, None] * (onehot.to(F32) - p_keep)
        if cfg.with_entropy and e is not None:
            p = torch.exp(z - lse[:, None])
            pad = torch.isneginf(z)
            dz = dz + torch.where(pad, torch.zeros_like(z), e[:, None] * p * ((lse - ent)[:, None] - z))
        dz = torch.where(valid[:, None], dz, torch.zeros_like(dz))
        return dz, None, None, None
