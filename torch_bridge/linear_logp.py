"""torch_bridge.linear_logp: log_softmax(hidden @ W^T / T)[target] without materializing the logits.

One shard (tp_group=None): the custom op rlk::linear_logp with autograd, traceable by
torch.compile(fullgraph=True). Vocab-parallel (tp_group): rlk::forward_stats on every rank, the
per-chunk statistics placed at their global chunk offset in a zero [n, K, 3] tensor and
all-reduced (SUM adds exact zeros, so every rank holds the same statistics), rlk::combine in the
fixed chunk order (bitwise the same for TP = 1, 2, 4, 8), rlk::linear_logp_backward plus an
all-reduce of dH (unless reduce_grad_hidden=False) and of the temperature gradient.
Either way the backward is "fast" (reads logits the forward saved) or "lean" (recomputes them),
resolved once per call by _args.resolve_backward.
"""
from __future__ import annotations

import dataclasses
from typing import Any

import torch

import rlk_common as common

from . import _ops  # also registers torch.ops.rlk.*
from . import reference, routes
from ._args import Args, parse, resolve_backward, unsupported, validate_targets as _validate_targets
from ._autocast import autocast_rule
from ._dtensor import dtensor_rule
from ._keep_ids import keep_ids_rule

F32 = torch.float32


@dtensor_rule
@autocast_rule
@keep_ids_rule
def linear_logp(hidden, weight, targets, *, bias=None, temperature=1.0, ignore_index=-100, return_entropy=False,
                vocab_start=None, real_vocab_size=None, tp_group=None, mode=None, reduce_grad_hidden=True,
                validate_targets=True, backward="auto", backward_memory_budget=None, keep_mask=None):
    """Selected-token log-probabilities (and optionally entropies) of `hidden @ weight.T (+ bias)`.

    hidden [..., H] (bf16, fp16 or fp32), weight [V, H] (same dtype), bias [V] (same dtype) or None,
    targets [...] integer ids of the global vocab. Returns fp32 logp shaped like targets, or
    (logp, entropy) with return_entropy=True; differentiable in hidden, weight, bias and a
    temperature tensor.
    temperature: a float > 0 or a floating tensor shaped like targets (per token); its entries that
    are not finite and > 0 give NaN rows (rlk_common.valid_temperatures; no host sync).
    A hidden size of 0 gives the bias's logp (0 without a bias), exactly, through the reference.
    ignore_index rows give 0 and no gradient; ids outside [0, real_vocab_size) raise ValueError
    when validate_targets (the default; one host sync; skipped inside torch.compile and CUDA-graph
    capture), else give NaN logp and entropy and no gradient (as rlk_xla.linear_logp always does).
    tp_group: a torch.distributed group over which the vocab is sharded: weight (and bias) are
    this rank's shard of V_local rows, vocab_start defaults to rank * V_local, real_vocab_size to
    the padded global vocab V_local * world_size; before any collective the ranks agree on rows,
    hidden size, shard width (equal shards), dtype and keep_mask (one all_gather, eager calls):
    otherwise every rank raises ValueError. dH is all-reduced over the group unless
    reduce_grad_hidden=False (for callers whose column-parallel region already reduces it).
    mode: one of MODES, default env RLK_MODE, else "auto"; what each runs, raises and counts (in
    route_stats()) is rlk_common.route_call's docstring. "audit" runs in eager calls only (it
    compares on the host: RuntimeError inside torch.compile).
    backward: the gradient's strategy, "auto" (default), "fast" or "lean", with
    backward_memory_budget (bytes) the budget of auto: rlk_common.resolve_backward's docstring.
    fast's saved logits serves one backward (CUDA overwrites it): a second backward through the
    same forward (retain_graph=True) raises; pass "lean" for that. Nothing is saved when no
    gradient is needed.
    keep_mask: a top-p nucleus, bool [..., V_local] (targets' shape, then this rank's vocab shard), or
    None: logp is renormalized over each row's kept ids (-inf for a target outside them, NaN for a row
    that keeps nothing), the entropy stays that of the whole distribution; gradients of both. The
    kernels take it in the fused pass (no [n, V] float buffer; on CUDA the portable forward kernel,
    not the sm90 one, and lean's cuBLAS path).
    keep_ids: the nucleus as kept ids, int [..., K] (targets' shape plus K), -1 padded, global vocab
    ids, a repeated one counted once: the keep_mask they stand for (_keep_ids.py); not with keep_mask.
    Under torch.autocast, hidden, weight and bias are cast to the autocast dtype as F.linear casts
    them (_autocast.py); outside it, mixed dtypes raise.
    DTensor operands: a weight sharded Shard(0) over a mesh dim runs the TP path over that dim's
    group, dW comes back with the weight's placements; a replicated DTensor hidden is accepted
    (_dtensor.py has the rule and what it refuses).
    """
    mode = routes.resolve_mode(mode)
    return_entropy = common.check_flag("return_entropy", return_entropy)
    a = parse(hidden, weight, targets, bias=bias, temperature=temperature, ignore_index=ignore_index,
              vocab_start=vocab_start, real_vocab_size=real_vocab_size, tp_group=tp_group, keep_mask=keep_mask)
    save_logits = resolve_backward(backward, a.n, a.weight.shape[0], a.chunk, a.hidden.dtype, a.hidden.device,
                                   backward_memory_budget) == "fast" and _needs_grad(a)
    eager = not torch.compiler.is_compiling()
    if mode == "audit" and not eager:  # the RuntimeError when the compiled code runs (routes.refuse_audit)
        a.targets, mode = routes.refuse_audit(a.targets, "torch_bridge.linear_logp"), "auto"
    if validate_targets and eager and not _capturing(a.hidden):
        _validate_targets(targets, a.real_vocab, ignore_index)
    route = common.route_call(mode, a.n, unsupported(a.hidden), "torch_bridge.linear_logp", a.hidden.shape[1])
    if route.fused:
        logp, ent = fused_rows(a, return_entropy, reduce_grad_hidden, save_logits)
        if eager:
            routes.note_backend(a.hidden.device.type)
        if route.audit:
            with torch.no_grad():
                ref_logp, _ = reference.rows(a, False, reduce_grad_hidden)
            routes.record_audit(logp, ref_logp)
    else:
        if route.counted:
            a.targets = routes.count_reference(a.targets, route.reason)
        logp, ent = reference.rows(a, return_entropy, reduce_grad_hidden)
    logp = logp.reshape(a.out_shape)
    return (logp, ent.reshape(a.out_shape)) if return_entropy else logp


def _needs_grad(a: Args) -> bool:
    """Whether this call's backward can run (only then are logits worth saving)."""
    ts = (a.hidden, a.weight, a.bias, a.temperature)
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in ts)


def _capturing(t: torch.Tensor) -> bool:
    return t.device.type == "cuda" and torch.cuda.is_current_stream_capturing()


def fused_rows(a: Args, with_entropy: bool, reduce_grad_hidden: bool = True, save_logits: bool = False):
    """logp and entropy ([n] f32; entropy zeros unless asked) through the compiled kernels;
    save_logits: the fast backward (the forward saves this shard's logits for it)."""
    bias = None if a.bias is None else a.bias.to(F32)  # the kernels take the bias in fp32
    if a.tp_group is None:
        return _ops.LinearLogp.apply(a.hidden, a.weight, bias, a.temperature, a.targets, a.real_vocab, a.chunk,
                                     a.ignore_index, with_entropy, save_logits, a.keep)
    cfg = _TPConfig(vocab_start=a.vocab_start, real_vocab=a.real_vocab, v_global=a.v_global, chunk=a.chunk,
                    ignore_index=a.ignore_index, with_entropy=with_entropy, group=a.tp_group,
                    reduce_grad_hidden=reduce_grad_hidden, save_logits=save_logits)
    return _VocabParallel.apply(a.hidden, a.weight, bias, a.temperature, a.targets, a.keep, cfg)


@dataclasses.dataclass(frozen=True)
class _TPConfig:
    vocab_start: int
    real_vocab: int
    v_global: int
    chunk: int
    ignore_index: int
    with_entropy: bool
    group: Any
    reduce_grad_hidden: bool
    save_logits: bool


def tp_forward(hidden, weight, bias32, temperature, targets, keep, cfg: _TPConfig):
    """(logp, entropy, m, log_s, log_s_keep) of one rank's shard, the statistics (and with a nucleus
    `keep` its kept sums) combined over cfg.group, and the shard's saved logits ([0] unless
    cfg.save_logits)."""
    import torch.distributed as dist
    stats, tl, saved_logits, keep_sum = _ops.run(
        "forward_stats", hidden=hidden, weight=weight, bias=bias32, targets=targets, temperature=temperature,
        vocab_start=cfg.vocab_start, real_vocab=cfg.real_vocab, chunk=cfg.chunk, ignore_index=cfg.ignore_index,
        with_entropy=cfg.with_entropy, save_logits=cfg.save_logits, keep=keep)
    n, k_local, w = stats.shape
    k, off = cfg.v_global // cfg.chunk, cfg.vocab_start // cfg.chunk
    # One buffer: the statistics [n, k, w], then (with a nucleus) the kept sums [n, k], each shard's
    # at its chunks' offset. O(n * chunks) floats: every rank ends with the same values (sums of one
    # value and zeros).
    kw = k * w
    full = stats.new_zeros((n, kw + (k if keep is not None else 0)))
    full[:, off * w:(off + k_local) * w] = stats.reshape(n, k_local * w)
    if keep is not None:
        full[:, kw + off:kw + off + k_local] = keep_sum
    dist.all_reduce(full, op=dist.ReduceOp.SUM, group=cfg.group)
    dist.all_reduce(tl, op=dist.ReduceOp.SUM, group=cfg.group)
    full_stats = full[:, :kw].reshape(n, k, w)
    full_keep = full[:, kw:].contiguous() if keep is not None else None
    return (*_ops.run("combine", stats=full_stats.contiguous(), target_logit=tl, targets=targets,
                      real_vocab=cfg.real_vocab, ignore_index=cfg.ignore_index, keep_sum=full_keep), saved_logits)


class _VocabParallel(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, bias32, temperature, targets, keep, cfg: _TPConfig):
        logp, ent, m, log_s, log_s_keep, saved_logits = tp_forward(hidden, weight, bias32, temperature, targets, keep, cfg)
        if not cfg.with_entropy:
            ent = torch.zeros_like(logp)
        ctx.save_for_backward(hidden, weight, bias32, temperature, targets, m, log_s, ent, saved_logits, keep, log_s_keep)
        ctx.cfg = cfg
        _ops.SavedLogits.setup(ctx, cfg.save_logits)
        return logp, ent

    @staticmethod
    def backward(ctx, g, e):
        import torch.distributed as dist
        cfg, saved = ctx.cfg, ctx.saved_tensors
        hidden, bias32 = saved[0], saved[2]
        dh, dw, db, dtemp = _ops.backward_of_saved(ctx, saved, g, e, vocab_start=cfg.vocab_start,
                                                   real_vocab=cfg.real_vocab, chunk=cfg.chunk,
                                                   ignore_index=cfg.ignore_index, with_entropy=cfg.with_entropy,
                                                   dhidden_f32=True)  # f32 partials: summed over the shards
        if cfg.reduce_grad_hidden and ctx.needs_input_grad[0]:
            dist.all_reduce(dh, op=dist.ReduceOp.SUM, group=cfg.group)
        if ctx.needs_input_grad[3]:
            dist.all_reduce(dtemp, op=dist.ReduceOp.SUM, group=cfg.group)
        return dh.to(hidden.dtype), dw, (db if bias32 is not None else None), dtemp, None, None, None
