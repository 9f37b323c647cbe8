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


def _target_logit(z: torch.Tensor, targets: torch.Tensor, vocab_start: int, masked=None) -> torch.Tensor:
    """z at the target for rows whose target is in this shard, else 0 (summed over the shards);
    -inf where `masked` [n, V_local] (padding, or outside the nucleus) holds at the target."""
    local = targets.to(torch.int64) - vocab_start
    here = (local >= 0) & (local < z.shape[1])
    at = local.clamp(0, max(z.shape[1] - 1, 0))[:, None]
    zt = z.gather(1, at)[:, 0]
    if masked is not None:
        zt = torch.where(masked.gather(1, at)[:, 0], torch.full_like(zt, NEG_INF), zt)
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
    logp, ent, m, log_s, _ = _ops.run("combine", stats=stats.contiguous(), target_logit=tl.contiguous(), targets=targets,
                                      real_vocab=cfg.real_vocab, ignore_index=cfg.ignore_index)
    return logp, m + log_s, ent


ROW_BLOCK_ELEMENTS = 1 << 24  # rows per block: the [rows, V_local] fp32 temporaries stay <= 64 MiB


def _row_blocks(n: int, v: int):
    """Row slices covering n rows, about ROW_BLOCK_ELEMENTS elements each: every step is row
    independent, so the blocks give the same bits as one pass, with bounded temporaries."""
    step = max(1, ROW_BLOCK_ELEMENTS // max(v, 1))
    return [slice(i, i + step) for i in range(0, n, step)]


def _pad_mask(z: torch.Tensor, cfg: _Cfg) -> Optional[torch.Tensor]:
    """[V_local] bool: this shard's padding ids (>= real_vocab), or None when it has none."""
    if cfg.vocab_start + z.shape[1] <= cfg.real_vocab:
        return None
    return cfg.vocab_start + torch.arange(z.shape[1], device=z.device) >= cfg.real_vocab


def _masked(z: torch.Tensor, pad: Optional[torch.Tensor], keep: Optional[torch.Tensor]):
    """z with -inf at the padding and, given keep, outside the nucleus; the mask (None: none)."""
    m = None if pad is None else pad[None, :].expand(z.shape)
    if keep is not None:
        m = ~keep if m is None else m | ~keep
    return (z if m is None else z.masked_fill(m, NEG_INF)), m


def _block_stats(z, targets, pad, keep, cfg: _Cfg, chunk: int):
    """(stats [n, v/chunk, 3], target logit [n]) of z masked by pad (and keep), row block by block."""
    stats, tl = [], []
    for sl in _row_blocks(z.shape[0], z.shape[1]):
        zb, m = _masked(z[sl], pad, None if keep is None else keep[sl])
        stats.append(_chunk_stats(zb, chunk))
        tl.append(_target_logit(z[sl], targets[sl], cfg.vocab_start, m))
    return torch.cat(stats), torch.cat(tl)


class _FromLogits(torch.autograd.Function):
    @staticmethod
    def forward(ctx, z, targets, keep: Optional[torch.Tensor], cfg: _Cfg):
        chunk = chunk_of(cfg.v_global, z.shape[1])
        pad = _pad_mask(z, cfg)
        logp, lse, ent = _combined(*_block_stats(z, targets, pad, None, cfg, chunk), targets, cfg, chunk)
        lse_keep = lse
        if keep is not None:
            logp, lse_keep, _ = _combined(*_block_stats(z, targets, pad, keep, cfg, chunk), targets, cfg, chunk)
        if not cfg.with_entropy:
            ent = torch.zeros_like(logp)
        ctx.save_for_backward(z, targets, keep, lse, lse_keep, ent)
        ctx.cfg = cfg
        return logp, ent

    @staticmethod
    def backward(ctx, g, e):
        z, targets, keep, lse, lse_keep, ent = ctx.saved_tensors
        cfg = ctx.cfg
        pad = _pad_mask(z, cfg)
        t = targets.to(torch.int64)
        valid = (t != cfg.ignore_index) & (t >= 0) & (t < cfg.real_vocab)
        local = t - cfg.vocab_start
        cols = torch.arange(z.shape[1], device=z.device)
        dz = torch.empty_like(z)
        for sl in _row_blocks(z.shape[0], z.shape[1]):
            zb, _ = _masked(z[sl], pad, None)
            onehot = cols[None, :] == local[sl, None]
            p_keep = torch.exp(zb - lse_keep[sl, None])
            if keep is not None:
                p_keep = p_keep.masked_fill(~keep[sl], 0.0)
                onehot = onehot & keep[sl]
            d = torch.zeros_like(zb) if g is None else g[sl, None] * (onehot.to(F32) - p_keep)
            if cfg.with_entropy and e is not None:
                p = torch.exp(zb - lse[sl, None])
                d = d + torch.where(torch.isneginf(zb), torch.zeros_like(zb),
                                    e[sl, None] * p * ((lse[sl] - ent[sl])[:, None] - zb))
            dz[sl] = torch.where(valid[sl, None], d, torch.zeros_like(d))
        return dz, None, None, None
