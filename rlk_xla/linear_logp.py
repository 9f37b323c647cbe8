"""rlk_xla.linear_logp: log_softmax(hidden @ W^T / T)[target] without materializing the logits.

The fused path is a jax.custom_vjp over three compiled kernels (rlk_xla._ops): per-chunk
forward statistics, a fixed-order combine, and the backward. Under shard_map with `axis_name`,
`weight` is this device's vocab shard; the shards exchange only per-row, per-chunk statistics.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax

import rlk_common as common

from . import _ops
from . import gspmd, reference, routes
from ._args import SUPPORTED_DTYPES, Args, parse, resolve_backward
from ._compat import psum_to, pvary
from ._core import PLATFORMS, registered_platforms

F32 = jnp.float32
# Padding columns of a vocab shard get this added (fp32) logit under shard_map: z = -inf for every
# finite temperature > 0 (1 / T > 0 in fp32 for all of them), so exp() of it is exactly 0 at any
# scale; the kernels take a -inf logit as probability 0 (a logit masked by the bias), 0 * z
# included.
PAD_LOGIT = float("-inf")


def linear_logp(hidden, weight, targets, *, bias=None, temperature=1.0, ignore_index=-100, vocab_start=None,
                real_vocab_size=None, return_entropy=False, mode=None, axis_name=None, backward="auto",
                backward_memory_budget=None, keep_mask=None, keep_ids=None):
    """Selected-token log-probabilities (and optionally entropies) of `hidden @ weight.T (+ bias)`.

    hidden [..., H] (bf16, fp16 or fp32), weight [V, H] (same dtype), bias [V] (same dtype) or None,
    targets [...] integer ids of the global vocab. Returns fp32 logp shaped like targets, or
    (logp, entropy) with return_entropy=True; differentiable in hidden, weight, bias and a
    temperature array (docs/design.md §1 has the math).
    temperature: a float > 0 or an fp32 array shaped like targets (per token, differentiable); its
    entries that are not finite and > 0 give NaN rows (rlk_common.valid_temperatures). A hidden
    size of 0 gives the bias's logp (0 without a bias), exactly, through the reference.
    ignore_index rows give 0 and no gradient. Ids outside [0, real_vocab_size) are not checked
    (that would need a host sync inside jit): their rows give NaN logp and entropy and no
    gradient; rlk_xla.validate_targets raises ValueError for them, eagerly.
    Inside shard_map pass axis_name: weight (and bias) are this device's vocab shard, vocab_start
    defaults to axis_index * V, real_vocab_size to the padded global vocab; padding columns are exact
    for temperatures up to 2**126 (a larger number raises ValueError, an array's rows are NaN).
    mode: one of MODES, default env RLK_MODE, else "auto"; what each runs, raises and counts (in
    route_stats()) is rlk_common.route_call's docstring.
    backward: the gradient's strategy, "auto" (default), "fast" or "lean", with
    backward_memory_budget (bytes) the budget of auto: rlk_common.resolve_backward's docstring.
    Under jax.jit over NamedSharding operands (a mesh set with jax.set_mesh or not) and no
    shard_map, the op partitions itself over its operands' shardings (rlk_xla.gspmd: the weight
    sharded over the vocab runs the shard_map path's per-shard program, no all-gather of the weight;
    keep_mask and keep_ids then span the global vocab).
    keep_mask: a top-p nucleus, bool [..., V_local] (targets' shape, then this device's vocab shard;
    under GSPMD the global vocab), or None: torch_bridge.linear_logp's semantics and kernels (logp
    renormalized over each row's kept ids, -inf for a target outside them, NaN for a row that keeps
    nothing, the entropy the whole distribution's; gradients of both; TP invariant under shard_map).
    keep_ids: the nucleus as kept ids, int [..., K] (targets' shape plus K), -1 padded, global vocab
    ids, a repeated one counted once: the keep_mask they stand for (this shard's columns; the same kernels and bits as
    torch_bridge's keep_ids); not with keep_mask.
    """
    mode = routes.resolve_mode(mode)
    return_entropy = common.check_flag("return_entropy", return_entropy)
    a = parse(hidden, weight, targets, bias=bias, temperature=temperature, ignore_index=ignore_index,
              vocab_start=vocab_start, real_vocab_size=real_vocab_size, axis_name=axis_name)
    n = a.hidden.shape[0]
    if keep_ids is not None:
        if keep_mask is not None:
            raise ValueError("rlk_xla.linear_logp: pass keep_ids or keep_mask, not both")
        keep_mask = _mask_of(keep_ids, targets, a)
    keep = _keep(keep_mask, targets, a)
    strategy = resolve_backward(backward, a, backward_memory_budget)
    route = common.route_call(mode, n, _unsupported(a), "rlk_xla.linear_logp", a.hidden.shape[1])
    if route.fused:
        if axis_name is None and vocab_start is None and gspmd.engaged(hidden, weight, targets, bias, temperature,
                                                                       keep_mask, keep_ids):
            # The kernels partitioned over the operands' shardings. Only they: the reference routes
            # are jnp, which GSPMD partitions itself, and count and audit through host callbacks,
            # which a custom_partitioning body cannot hold (jax 0.10's CPU runtime crashes).
            logp, ent = gspmd.linear_logp(hidden, weight, targets, bias=bias, temperature=temperature,
                                          ignore_index=ignore_index, real_vocab_size=real_vocab_size,
                                          keep_mask=keep_mask)
            logp, ent = logp.reshape(-1), ent.reshape(-1)
        else:
            logp, ent = fused_rows(a, return_entropy, save_logits=strategy == "fast", keep=keep)
        if route.audit:
            ref_logp, _ = reference.rows(a, False, keep)
            routes.record_audit(logp, lax.stop_gradient(ref_logp))
    else:
        if route.counted:
            routes.count_reference(a.targets, route.reason)
        logp, ent = reference.rows(a, return_entropy, keep)
    logp = logp.reshape(a.out_shape)
    return (logp, ent.reshape(a.out_shape)) if return_entropy else logp


def _keep(keep_mask, targets, a: Args):
    """The nucleus as the kernels read it, uint8 [n, V_local], or None."""
    if keep_mask is None:
        return None
    want = (*jnp.shape(targets), a.weight.shape[0])
    if jnp.dtype(keep_mask.dtype) != jnp.bool_ or tuple(keep_mask.shape) != want:
        raise ValueError(f"keep_mask must be bool shaped like targets plus this shard's vocab, {want}, got "
                         f"{tuple(keep_mask.shape)} {jnp.dtype(keep_mask.dtype)}")
    return keep_mask.reshape(a.hidden.shape[0], a.weight.shape[0]).astype(jnp.uint8)


def _mask_of(keep_ids, targets, a: Args):
    """bool [*targets.shape, V_local]: True at this shard's columns of each row's kept ids (-1: none)."""
    ts = tuple(jnp.shape(targets))
    if not jnp.issubdtype(jnp.result_type(keep_ids), jnp.integer):
        raise TypeError(f"keep_ids must be integers, got {jnp.result_type(keep_ids)}")
    if jnp.ndim(keep_ids) != len(ts) + 1 or tuple(jnp.shape(keep_ids)[:-1]) != ts:
        raise ValueError(f"keep_ids must be targets' shape plus K, {(*ts, 'K')}, got {tuple(jnp.shape(keep_ids))}")
    v_local = a.weight.shape[0]
    ids = jnp.asarray(keep_ids).reshape(-1, jnp.shape(keep_ids)[-1])
    local = ids - a.vocab_start
    col = jnp.where((ids >= 0) & (local >= 0) & (local < v_local), local, v_local)  # column v_local: the rest
    rows = jnp.arange(ids.shape[0])[:, None]
    mask = jnp.zeros((ids.shape[0], v_local + 1), jnp.bool_).at[rows, col].set(True)
    return mask[:, :v_local].reshape(*ts, v_local)


def _unsupported(a: Args) -> str | None:
    """Why the fused kernels cannot take this call (the fallback reason), or None."""
    if jnp.dtype(a.hidden.dtype) not in SUPPORTED_DTYPES:
        return common.dtype_fallback(jnp.dtype(a.hidden.dtype).name)
    backend = jax.default_backend()
    p = common.platform(PLATFORMS, "jax_backend", backend)
    if p is not None and p["xla_platform"] in registered_platforms():
        return None
    return f"platform {backend} (this build has kernels for: {', '.join(registered_platforms()) or 'none'})"


@dataclasses.dataclass(frozen=True)
class _Static:
    cfg: _ops.KernelConfig
    real_vocab: int          # of the global vocab, for the combine
    ignore_index: int
    axis_name: object
    tp: int
    save_logits: bool        # the fast backward: the forward saves this shard's logits


def fused_rows(a: Args, with_entropy: bool, save_logits: bool = False, differentiable: bool = True, keep=None):
    """logp and entropy ([n] f32; entropy zeros unless asked) through the compiled kernels;
    differentiable=False: the forward alone (no custom_vjp, the same launches); keep: a nucleus,
    uint8 [n, V_local], or None."""
    v_local = a.weight.shape[0]
    bias, ktargets = (None if a.bias is None else a.bias.astype(F32)), a.targets
    if a.axis_name is None:
        cfg = _ops.KernelConfig(vocab_start=0, real_vocab=a.real_vocab, chunk=a.chunk, ignore_index=a.ignore_index,
                             has_bias=bias is not None, with_entropy=with_entropy)
    else:
        # One program for every shard: the shard's offset is a run-time value, so the kernels see
        # local columns, local target columns, and padding through the bias.
        gid = a.vocab_start + jnp.arange(v_local)
        if a.real_vocab < a.v_global:
            pad = jnp.where(gid >= a.real_vocab, PAD_LOGIT, 0.0).astype(F32)
            bias = pad if bias is None else bias + pad
        ktargets = _shard_targets(a, v_local)
        cfg = _ops.KernelConfig(vocab_start=0, real_vocab=a.v_global, chunk=a.chunk, ignore_index=a.ignore_index,
                             has_bias=bias is not None, with_entropy=with_entropy)
    st = _Static(cfg=cfg, real_vocab=a.real_vocab, ignore_index=a.ignore_index, axis_name=a.axis_name, tp=a.tp,
                 save_logits=save_logits)
    args = (a.hidden, a.weight, bias, a.temperature, a.targets, ktargets, a.vocab_start // a.chunk, keep)
    return _fused(st, *args) if differentiable else _fused_fwd(st, *args)[0]


def _shard_targets(a: Args, v_local: int):
    """Global targets -> what this shard's kernels take: the local column of a local target;
    v_local (a valid id of no local column) for a real target elsewhere; the ignore/invalid codes
    of rows without gradient."""
    t = a.targets
    ignored = t == a.ignore_index
    valid = ~ignored & (t >= 0) & (t < a.real_vocab)
    local = valid & (t >= a.vocab_start) & (t < a.vocab_start + v_local)
    return jnp.where(local, t - a.vocab_start,
                     jnp.where(valid, v_local,
                               jnp.where(ignored, a.ignore_index, common.invalid_id(a.ignore_index)))).astype(jnp.int32)


@jax.custom_jvp
def _first_order_only(xs):
    return xs


@_first_order_only.defjvp
def _first_order_only_jvp(primals, tangents):
    raise NotImplementedError("rlk_xla.linear_logp has no second derivative (grad of grad, hessian, jvp of "
                              "grad): its backward is a compiled kernel. Pass mode='off' (the jnp reference) "
                              "to differentiate it more than once.")


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _fused(st: _Static, hidden, weight, bias, temperature, targets, ktargets, chunk_offset, keep):
    # Not differentiated: no logits to save, whatever the strategy.
    st = dataclasses.replace(st, save_logits=False)
    return _fused_fwd(st, hidden, weight, bias, temperature, targets, ktargets, chunk_offset, keep)[0]


def _varying(st: _Static, *xs):
    return xs if st.axis_name is None else tuple(None if x is None else pvary(x, st.axis_name) for x in xs)


def _fused_fwd(st: _Static, hidden, weight, bias, temperature, targets, ktargets, chunk_offset, keep):
    hidden, weight, bias, temperature = _first_order_only((hidden, weight, bias, temperature))
    hk, tk, ktk = _varying(st, hidden, temperature, ktargets)
    stats, target_logit, saved, keep_sum = _ops.forward(st.cfg, save_logits=st.save_logits, hidden=hk, weight=weight,
                                                        bias=bias, targets=ktk, temperature=tk, keep=keep)
    if st.axis_name is not None:
        # Every shard places its chunks at their global position and the sum over shards adds
        # exact zeros elsewhere: all shards then hold the same [n, chunks, 3] statistics (and the
        # nucleus's [n, chunks] sums), which the combine folds in chunk order, so TP = 1, 2, 4, 8
        # give the same bits.
        n, k_local, w = stats.shape
        full = jnp.zeros((n, k_local * st.tp, w), F32)
        zero = jnp.zeros((), jnp.int32)  # int32 indices: one dtype for all three under jax_enable_x64 too
        full = lax.dynamic_update_slice(full, stats, (zero, jnp.asarray(chunk_offset, jnp.int32), zero))
        stats = lax.psum(full, st.axis_name)
        target_logit = lax.psum(target_logit, st.axis_name)
        if keep is not None:
            full_keep = lax.dynamic_update_slice(jnp.zeros((n, k_local * st.tp), F32), keep_sum, (0, chunk_offset))
            keep_sum = lax.psum(full_keep, st.axis_name)
    logp, ent, m, log_s, log_s_keep = _ops.combine(real_vocab=st.real_vocab, ignore_index=st.ignore_index, stats=stats,
                                                target_logit=target_logit, targets=targets,
                                                keep_sum=keep_sum if keep is not None else None)
    if not st.cfg.with_entropy:
        ent = jnp.zeros_like(logp)
    nucleus = (keep, log_s_keep) if keep is not None else (None, None)
    return (logp, ent), (hidden, weight, bias, temperature, ktargets, m, log_s, ent, saved if st.save_logits else None,
                         *nucleus)


def _fused_bwd(st: _Static, res, cts):
    res, cts = _first_order_only((res, cts))
    hidden, weight, bias, temperature, ktargets, m, log_s, ent, saved, keep, log_s_keep = res
    g, e = cts
    hk, tk, ktk, mk, lsk, ek, gk, eek = _varying(st, hidden, temperature, ktargets, m, log_s, ent, g.astype(F32),
                                                 e.astype(F32))
    if keep is not None:
        keep, log_s_keep = _varying(st, keep, log_s_keep)
    # A shard's dH is a partial sum: f32 until the all-reduce; the whole vocab's comes in the dtype.
    dh, dw, db, dtemp = _ops.backward(st.cfg, dhidden_f32=st.axis_name is not None, hidden=hk, weight=weight, bias=bias,
                                   targets=ktk, temperature=tk, m=mk, log_s=lsk, entropy=ek, g=gk, e=eek,
                                   saved_logits=saved, keep=keep, log_s_keep=log_s_keep)
    if st.axis_name is not None:
        # dH and dT are partial sums over this shard's vocab: one all-reduce each over the vocab
        # axis; dW and db stay local (reduced only over a token axis the weight is replicated on).
        dh, dtemp = psum_to(dh, hidden, st.axis_name), psum_to(dtemp, temperature, st.axis_name)
        dw = psum_to(dw, weight, ())
        db = psum_to(db, bias, ()) if bias is not None else db
    dbias = None if bias is None else db
    return dh.astype(hidden.dtype), dw, dbias, dtemp, None, None, None, None


_fused.defvjp(_fused_fwd, _fused_bwd)
