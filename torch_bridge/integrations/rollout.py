"""torch_bridge.integrations.rollout: the inference engine's side of linear_logp.

At every decode step the engine samples one token per sequence from the logits of the step's final
hidden state; score_sampled gives that token's log-probability (and the row's entropy) through the
same compiled kernels, with the same arguments, as the trainer's torch_bridge.linear_logp, so the
two sides record the same bits for the same hidden row, whatever the batch size, the padding and
the tensor-parallel degree (a row's logp depends on that row only; the vocab is reduced in a fixed
chunk order for TP = 1, 2, 4, 8).

For CUDA graphs: make one ScoreBuffers per capture size with score_buffers() before capturing, and
pass it as out=; the call then allocates nothing, synchronizes nothing with the host and launches
the same kernels every time (padding rows beyond the live batch are scored too and change no other
row). Its results are the buffers' logp / entropy: copy them out before the next call reuses them.

The sampler's nucleus (top-p / top-k): pass its keep mask (bool [n, V_local], this rank's vocab
shard) as keep_mask and the logp is that of the softmax renormalized over the kept ids, the
distribution the token was drawn from and the one the trainer scores with the same mask (vime's
log_prob_keep_mask, linear_logp's keep_mask); the entropy stays the full distribution's.

Ids follow linear_logp's rule (rlk_common.id_rule): checked in their own dtype, never wrapped by
the cast to the kernels' int32: an int64 id of 2^32 + 5 is no id (NaN row), not id 5.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Optional

import torch
from torch import Tensor

import rlk_common as common

from .. import _ops
from .._keep_ids import mask_of
from .._args import (SUPPORTED_DTYPES, check_keep_mask, check_temperature, check_tensors, chunk_of, id_rule,
                    int32_targets, tp_layout, unsupported)

F32 = torch.float32
PAD_ID = common.PAD_ID  # padding rows carry it (logp 0, entropy 0) or any real id; other ids give NaN rows


@dataclasses.dataclass(frozen=True)
class ScoreBuffers:
    """Everything one score_sampled call writes, for `rows` rows: the results (logp, entropy, and the
    row max m and log_s: [rows] f32) and the scratch (int32 ids, f32 temperature, the per-chunk statistics, the target
    logit, under TP the statistics of the whole vocab, the fp32 bias and the CUDA workspace; with a
    nucleus its per-chunk kept sums, under TP the whole vocab's, and log_s_keep)."""
    logp: Tensor
    entropy: Tensor
    m: Tensor
    log_s: Tensor
    ids: Tensor
    temperature: Tensor
    stats: Tensor
    target_logit: Tensor
    full_stats: Tensor
    bias32: Optional[Tensor]
    workspace: Optional[Tensor]
    with_entropy: bool
    has_bias: bool
    tp: int
    wide_ids: Optional[Tensor] = None  # int64 ids clamped into int32's range (id_rule), then cast
    keep_sum: Optional[Tensor] = None
    full_keep: Optional[Tensor] = None
    log_s_keep: Optional[Tensor] = None

    @property
    def nucleus(self) -> bool:
        return self.keep_sum is not None

    @property
    def rows(self) -> int:
        return self.logp.shape[0]

    def check(self, hidden: Tensor, weight: Tensor, has_bias: bool, tp: int, with_entropy: bool,
              nucleus: bool = False) -> None:
        """ValueError unless these buffers were made for this call's shapes and options."""
        chunk, _ = _chunking(weight, tp)
        n = hidden.shape[0]
        want = dict(rows=n, device=hidden.device, stats=(n, weight.shape[0] // chunk, _ops.W), has_bias=has_bias, tp=tp)
        got = dict(rows=self.rows, device=self.logp.device, stats=tuple(self.stats.shape), has_bias=self.has_bias,
                   tp=self.tp)
        wrong = [k for k in want if want[k] != got[k]]
        if with_entropy and not self.with_entropy:
            wrong.append("return_entropy")
        if nucleus != self.nucleus:
            wrong.append("nucleus")
        if _workspace_bytes(hidden.shape[0], weight, has_bias, with_entropy, tp) > (0 if self.workspace is None
                                                                            else self.workspace.numel()):
            wrong.append("workspace (another hidden size or dtype)")
        if wrong:
            raise ValueError(f"out: these ScoreBuffers were made for another call ({', '.join(wrong)} differ); make "
                             f"them with score_buffers({hidden.shape[0]}, weight, bias=..., tp_group=..., "
                             f"return_entropy={with_entropy}, nucleus={nucleus})")


def _chunking(weight: Tensor, tp: int) -> tuple[int, int]:
    """(chunk, global number of chunks) of a shard of weight.shape[0] rows of a TP-way vocab."""
    v_local = weight.shape[0]
    chunk = chunk_of(v_local * tp, v_local)
    return chunk, v_local * tp // chunk


def _workspace_bytes(rows: int, weight: Tensor, has_bias: bool, with_entropy: bool, tp: int) -> int:
    """CUDA scratch bytes of one forward over `rows` rows (0 off CUDA)."""
    if weight.device.type != "cuda":
        return 0
    chunk, _ = _chunking(weight, tp)
    return _ops.workspace_bytes(rows, weight.shape[1], weight.shape[0], chunk, weight.dtype, has_bias, with_entropy,
                                "forward")


def score_buffers(rows: int, weight: Tensor, *, bias: Optional[Tensor] = None, tp_group: Any = None,
                  return_entropy: bool = False, nucleus: bool = False) -> ScoreBuffers:
    """Buffers for score_sampled(..., out=) on `rows` rows (a capture size) with this LM-head shard;
    nucleus: for calls that pass a keep_mask."""
    if isinstance(rows, bool) or not isinstance(rows, int) or rows < 0:
        raise ValueError(f"rows must be an int >= 0 (the capture size), got {rows!r}")
    if weight.dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"weight dtype {weight.dtype} has no fused kernels (bfloat16, float16, float32)")
    tp, _, _ = tp_layout(tp_group, weight.shape[0], None)
    chunk, k_global = _chunking(weight, tp)
    dev = weight.device

    def f32(*shape):
        return torch.zeros(shape, dtype=F32, device=dev)

    nbytes = _workspace_bytes(rows, weight, bias is not None, return_entropy, tp)
    return ScoreBuffers(
        logp=f32(rows), entropy=f32(rows), m=f32(rows), log_s=f32(rows), ids=torch.zeros((rows,), dtype=torch.int32, device=dev),
        temperature=torch.ones((rows,), dtype=F32, device=dev), stats=f32(rows, weight.shape[0] // chunk, _ops.W),
        target_logit=f32(rows), full_stats=f32(rows, k_global, _ops.W) if tp > 1 else f32(0),
        bias32=f32(weight.shape[0]) if bias is not None and weight.dtype != F32 else None,
        workspace=torch.empty((nbytes,), dtype=torch.uint8, device=dev) if nbytes else None,
        with_entropy=bool(return_entropy), has_bias=bias is not None, tp=tp,
        wide_ids=torch.zeros((rows,), dtype=torch.int64, device=dev),
        keep_sum=f32(rows, weight.shape[0] // chunk) if nucleus else None,
        full_keep=f32(rows, k_global) if nucleus and tp > 1 else None,
        log_s_keep=f32(rows) if nucleus else None)


def score_sampled(hidden, weight, sampled_ids, *, temperature=1.0, bias=None, tp_group=None, vocab_start=None,
                  real_vocab_size=None, return_entropy=False, keep_mask=None, keep_ids=None,
                  out: Optional[ScoreBuffers] = None):
    """log_softmax((hidden @ weight.T + bias) / temperature)[sampled_ids] per row, forward only.

    hidden [n, H] (bf16, fp16 or fp32: the decode step's final hidden states, after the final norm),
    weight [V_local, H] the LM head (this rank's vocab shard under tp_group), sampled_ids [n] int
    global ids (PAD_ID for padding rows, or any real id), temperature a float > 0 or an [n] tensor
    (the sampler's), bias [V_local] or None. Returns logp [n] f32, or (logp, entropy) with
    return_entropy: bitwise what torch_bridge.linear_logp returns for the same rows and options.
    tp_group / vocab_start / real_vocab_size: as linear_logp (vocab shards in rank order; padding
    ids at or past real_vocab_size never count).
    keep_mask: the sampler's nucleus, bool [n, V_local] (this rank's shard), or None: logp over the
    kept ids (-inf for an id outside them, NaN for a row that keeps nothing), as linear_logp's keep_mask.
    keep_ids: the same nucleus as kept ids, int [n, K] global ids, -1 padded (a sparse top-p
    sampler's), taken as the keep_mask they stand for (allocated, even with out=); not with keep_mask.
    out: ScoreBuffers from score_buffers(n, weight, ..., nucleus=keep_mask is not None) for this
    call's shapes: nothing is then allocated (hidden, weight, bias and keep_mask must be contiguous;
    int64 ids are clamped into the int32 buffer) and the results are out's tensors.
    Nothing is checked on the device (no host sync): ids outside [0, real_vocab_size) other than
    PAD_ID give NaN rows, whatever their dtype (rlk_common.id_rule: never wrapped into int32).
    """
    ts = check_tensors(hidden, weight, sampled_ids, bias)
    common.check_decode_batch(ts, hidden.shape, unsupported(hidden), "torch_bridge.integrations.rollout.score_sampled")
    scalar = check_temperature(temperature, ts, hidden)
    tp, _, v_start = tp_layout(tp_group, weight.shape[0], vocab_start)
    real = common.real_vocab(real_vocab_size, weight.shape[0] * tp)
    if keep_ids is not None:
        if keep_mask is not None:
            raise ValueError("score_sampled: pass keep_ids or keep_mask, not both")
        keep_mask = mask_of(keep_ids, sampled_ids, weight.shape[0], v_start)
    nucleus = keep_mask is not None
    if nucleus:
        check_keep_mask(keep_mask, ts, weight.shape[0], hidden)
    if out is None:
        out = score_buffers(ts[0], weight, bias=bias, tp_group=tp_group, return_entropy=return_entropy,
                            nucleus=nucleus)
    else:
        loose = [name for name, t in (("hidden", hidden), ("weight", weight), ("bias", bias),
                                      ("keep_mask", keep_mask)) if t is not None and not t.is_contiguous()]
        if loose:
            raise ValueError(f"with out=, {' and '.join(loose)} must be contiguous (a copy would allocate)")
    out.check(hidden, weight, bias is not None, tp, return_entropy, nucleus)
    if ts[0]:
        with torch.no_grad():
            _score(out, hidden, weight, sampled_ids, scalar if scalar is not None else temperature, bias, tp_group,
                   v_start, real, bool(return_entropy), keep_mask)
    return (out.logp, out.entropy) if return_entropy else out.logp


def _ids_into(b: ScoreBuffers, ids: Tensor) -> None:
    """ids into b.ids (int32) by linear_logp's rule (rlk_common.IdRule), checked in their own dtype:
    a plain copy where it cannot wrap, else (int64) a clamp into int32's range in b.wide_ids and the
    cast (no allocation), else (uint64 ids) the general remap."""
    rule = id_rule(ids, PAD_ID)
    if not rule.remap:
        b.ids.copy_(ids)
    elif rule.clamp is not None:
        torch.clamp(ids, *rule.clamp, out=b.wide_ids)
        b.ids.copy_(b.wide_ids)
    else:
        b.ids.copy_(int32_targets(ids, rule))


def _score(b: ScoreBuffers, hidden, weight, ids, temperature, bias, tp_group, v_start: int, real: int,
           with_entropy: bool, keep=None) -> None:
    """The launches of one call, into b (the same sequence as linear_logp's forward)."""
    if isinstance(temperature, float):
        b.temperature.fill_(temperature)
    else:
        b.temperature.copy_(temperature.expand(b.temperature.shape))
    _ids_into(b, ids)
    bias32 = bias
    if b.bias32 is not None:
        bias32 = b.bias32
        bias32.copy_(bias)
    chunk, _ = _chunking(weight, b.tp)
    if b.tp == 1:
        _ops.forward_into(hidden, weight, bias32, b.ids, b.temperature, b.stats, b.target_logit, None, b.workspace,
                          0, real, chunk, PAD_ID, with_entropy, (b.logp, b.entropy, b.m, b.log_s), keep=keep,
                          keep_sum=b.keep_sum, log_s_keep=b.log_s_keep)
        return
    import torch.distributed as dist
    _ops.forward_into(hidden, weight, bias32, b.ids, b.temperature, b.stats, b.target_logit, None, b.workspace,
                      v_start, real, chunk, PAD_ID, with_entropy, keep=keep, keep_sum=b.keep_sum)
    off, k_local = v_start // chunk, b.stats.shape[1]
    b.full_stats.zero_()
    b.full_stats[:, off:off + k_local].copy_(b.stats)
    dist.all_reduce(b.full_stats, op=dist.ReduceOp.SUM, group=tp_group)
    dist.all_reduce(b.target_logit, op=dist.ReduceOp.SUM, group=tp_group)
    if b.nucleus:
        b.full_keep.zero_()
        b.full_keep[:, off:off + k_local].copy_(b.keep_sum)
        dist.all_reduce(b.full_keep, op=dist.ReduceOp.SUM, group=tp_group)
    _ops.combine_to(b.full_stats, b.target_logit, b.ids, b.logp, b.entropy, b.m, b.log_s, real, PAD_ID, b.full_keep,
                    b.log_s_keep)
