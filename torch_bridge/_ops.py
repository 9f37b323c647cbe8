"""torch.library custom ops (namespace `rlk`) over the DLPack entry points of _rlk_core.

Low-level ops, one per compiled entry point (used by the tensor-parallel path, which puts
collectives between them):
  rlk::forward_stats          per-(row, canonical chunk) statistics and the local target logit
  rlk::combine                all chunks' statistics -> logp, lse, entropy (fixed chunk order)
  rlk::linear_logp_backward   dH (this shard's partial, f32), dW, db (f32), dtemperature (partial)
and the fused single-shard op with autograd, traceable by torch.compile(fullgraph=True):
  rlk::linear_logp            (logp, entropy, lse); backward through rlk::linear_logp_backward

Every op takes `temperature` [n] f32 and forms inv_temp = 1 / temperature itself (the same fp32
division as the JAX frontend, so both give the same bits). Bias, when given, is fp32. Outputs and
the CUDA workspace are allocated with torch's allocator; CUDA kernels run on the current stream.
"""
from __future__ import annotations

import contextlib

from typing import Optional, Tuple

import torch
from torch import Tensor

from ._args import DTYPE_CODE
from ._core import core

F32 = torch.float32
W = int(core.STAT_WIDTH)


def _stream(t: Tensor) -> int:
    return torch.cuda.current_stream(t.device).cuda_stream if t.device.type == "cuda" else 0


def _on(t: Tensor):
    """The kernels launch on the current CUDA device: make it the tensors' device."""
    return torch.cuda.device(t.device) if t.device.type == "cuda" else contextlib.nullcontext()


def _c(t: Optional[Tensor]) -> Optional[Tensor]:
    return None if t is None else t.detach().contiguous()


def _workspace(hidden: Tensor, v: int, chunk: int, has_bias: bool, with_entropy: bool, backward: bool):
    if hidden.device.type != "cuda":
        return None
    fwd, bwd = core.cuda_workspace_bytes(hidden.shape[0], hidden.shape[1], v, chunk, DTYPE_CODE[hidden.dtype],
                                         has_bias, with_entropy)
    nbytes = bwd if backward else fwd
    return torch.empty((nbytes,), dtype=torch.uint8, device=hidden.device) if nbytes > 0 else None


def _inv_temp(temperature: Tensor) -> Tensor:
    return torch.reciprocal(temperature.detach().to(F32)).contiguous()


# ---- rlk::forward_stats ---------------------------------------------------------------------------

def _forward_stats(hidden, weight, bias, targets, temperature, vocab_start, real_vocab, chunk, ignore_index,
                   with_entropy):
    n, v = hidden.shape[0], weight.shape[0]
    if chunk <= 0 or v % chunk:
        raise ValueError(f"chunk {chunk} must divide the local vocab {v}")
    stats = torch.empty((n, v // chunk, W), dtype=F32, device=hidden.device)
    tl = torch.empty((n,), dtype=F32, device=hidden.device)
    if n == 0:
        return stats, tl
    with _on(hidden):
        core.forward(_c(hidden), _c(weight), _c(bias), _c(targets), _inv_temp(temperature), stats, tl,
                     _workspace(hidden, v, chunk, bias is not None, with_entropy, False), int(vocab_start),
                     int(real_vocab), int(chunk), int(ignore_index), bool(with_entropy), _stream(hidden))
    return stats, tl


@torch.library.custom_op("rlk::forward_stats", mutates_args=())
def forward_stats(hidden: Tensor, weight: Tensor, bias: Optional[Tensor], targets: Tensor, temperature: Tensor,
                  vocab_start: int, real_vocab: int, chunk: int, ignore_index: int,
                  with_entropy: bool) -> Tuple[Tensor, Tensor]:
    return _forward_stats(hidden, weight, bias, targets, temperature, vocab_start, real_vocab, chunk, ignore_index,
                          with_entropy)


@forward_stats.register_fake
def _(hidden, weight, bias, targets, temperature, vocab_start, real_vocab, chunk, ignore_index, with_entropy):
    n, v = hidden.shape[0], weight.shape[0]
    return hidden.new_empty((n, v // chunk, W), dtype=F32), hidden.new_empty((n,), dtype=F32)


# ---- rlk::combine ---------------------------------------------------------------------------------

def _combine(stats, target_logit, targets, real_vocab, ignore_index):
    n = stats.shape[0]
    logp, lse, ent = (torch.empty((n,), dtype=F32, device=stats.device) for _ in range(3))
    if n == 0:
        return logp, lse, ent
    with _on(stats):
        core.combine(_c(stats), _c(target_logit), _c(targets), logp, lse, ent, int(real_vocab), int(ignore_index),
                     _stream(stats))
    return logp, lse, ent


@torch.library.custom_op("rlk::combine", mutates_args=())
def combine(stats: Tensor, target_logit: Tensor, targets: Tensor, real_vocab: int,
            ignore_index: int) -> Tuple[Tensor, Tensor, Tensor]:
    return _combine(stats, target_logit, targets, real_vocab, ignore_index)


@combine.register_fake
def _(stats, target_logit, targets, real_vocab, ignore_index):
    n = stats.shape[0]
    return tuple(stats.new_empty((n,), dtype=F32) for _ in range(3))


# ---- rlk::linear_logp_backward --------------------------------------------------------------------

def _backward(hidden, weight, bias, targets, temperature, lse, entropy, g, e, vocab_start, real_vocab, chunk,
              ignore_index):
    n, h, v = hidden.shape[0], hidden.shape[1], weight.shape[0]
    dev = hidden.device
    dh = torch.empty((n, h), dtype=F32, device=dev)
    dw = torch.empty((v, h), dtype=weight.dtype, device=dev)
    db = torch.empty((v if bias is not None else 0,), dtype=F32, device=dev)
    dzz = torch.empty((n,), dtype=F32, device=dev)
    if n == 0:
        dw.zero_(), db.zero_()
        return dh, dw, db, dzz
    with_entropy = entropy is not None and e is not None
    inv = _inv_temp(temperature)
    with _on(hidden):
        core.backward(_c(hidden), _c(weight), _c(bias), _c(targets), inv, _c(lse), _c(entropy) if with_entropy else None,
                      _c(g.to(F32)), _c(e.to(F32)) if with_entropy else None, dh, dw, db if bias is not None else None,
                      dzz, _workspace(hidden, v, chunk, bias is not None, with_entropy, True), int(vocab_start),
                      int(real_vocab), int(chunk), int(ignore_index), _stream(hidden))
    return dh, dw, db, -inv * dzz


@torch.library.custom_op("rlk::linear_logp_backward", mutates_args=())
def linear_logp_backward(hidden: Tensor, weight: Tensor, bias: Optional[Tensor], targets: Tensor,
                         temperature: Tensor, lse: Tensor, entropy: Optional[Tensor], g: Tensor,
                         e: Optional[Tensor], vocab_start: int, real_vocab: int, chunk: int,
                         ignore_index: int) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
    """(dhidden [n, h] f32 partial over this shard's vocab, dweight [v, h] in weight's dtype,
    dbias [v] f32 ([0] without bias), dtemperature [n] f32 partial)."""
    return _backward(hidden, weight, bias, targets, temperature, lse, entropy, g, e, vocab_start, real_vocab, chunk,
                     ignore_index)


@linear_logp_backward.register_fake
def _(hidden, weight, bias, targets, temperature, lse, entropy, g, e, vocab_start, real_vocab, chunk, ignore_index):
    n, h, v = hidden.shape[0], hidden.shape[1], weight.shape[0]
    return (hidden.new_empty((n, h), dtype=F32), weight.new_empty((v, h)),
            hidden.new_empty((v if bias is not None else 0,), dtype=F32), hidden.new_empty((n,), dtype=F32))


# ---- rlk::linear_logp (one shard: the whole vocab) -------------------------------------------------

@torch.library.custom_op("rlk::linear_logp", mutates_args=())
def linear_logp(hidden: Tensor, weight: Tensor, bias: Optional[Tensor], targets: Tensor, temperature: Tensor,
                real_vocab: int, chunk: int, ignore_index: int, with_entropy: bool) -> Tuple[Tensor, Tensor, Tensor]:
    """(logp, entropy, lse), [n] f32 each; entropy is zeros unless with_entropy; lse has no gradient."""
    stats, tl = _forward_stats(hidden, weight, bias, targets, temperature, 0, real_vocab, chunk, ignore_index,
                               with_entropy)
    logp, lse, ent = _combine(stats, tl, targets, real_vocab, ignore_index)
    if not with_entropy:
        ent = torch.zeros_like(logp)
    return logp, ent, lse


@linear_logp.register_fake
def _(hidden, weight, bias, targets, temperature, real_vocab, chunk, ignore_index, with_entropy):
    n = hidden.shape[0]
    return tuple(hidden.new_empty((n,), dtype=F32) for _ in range(3))


def _setup_context(ctx, inputs, output):
    hidden, weight, bias, targets, temperature, real_vocab, chunk, ignore_index, with_entropy = inputs
    logp, ent, lse = output
    ctx.save_for_backward(hidden, weight, bias, targets, temperature, lse, ent)
    ctx.cfg = (int(real_vocab), int(chunk), int(ignore_index), bool(with_entropy))
    ctx.mark_non_differentiable(lse)


def _backward_rule(ctx, g_logp, g_ent, g_lse):
    hidden, weight, bias, targets, temperature, lse, ent = ctx.saved_tensors
    real_vocab, chunk, ignore_index, with_entropy = ctx.cfg
    g = torch.zeros_like(lse) if g_logp is None else g_logp
    e = None
    if with_entropy:
        e = torch.zeros_like(lse) if g_ent is None else g_ent
    dh, dw, db, dtemp = torch.ops.rlk.linear_logp_backward(
        hidden, weight, bias, targets, temperature, lse, ent if with_entropy else None, g.contiguous(),
        None if e is None else e.contiguous(), 0, real_vocab, chunk, ignore_index)
    return dh.to(hidden.dtype), dw, (db if bias is not None else None), None, dtemp, None, None, None, None


linear_logp.register_autograd(_backward_rule, setup_context=_setup_context)
