"""The reference: plain jnp with materialized fp32 logits. The oracle of the tests and the `off` path.

Its logits do not depend on jax_default_matmul_precision: fp16, fp32 and float64 operands are
multiplied at lax.Precision.HIGHEST; bf16 operands are exact in every internal format (TF32, bf16)
with fp32 accumulation, and HIGHEST would only slow them down.

Same signature and semantics as rlk_xla.linear_logp (inside shard_map with `axis_name`, the
weight is this device's vocab shard and the statistics are combined with collectives).
"""
from __future__ import annotations

import jax.numpy as jnp
from jax import lax

from ._args import Args, parse

F32 = jnp.float32


def linear_logp(hidden, weight, targets, *, bias=None, temperature=1.0, ignore_index=-100, vocab_start=None,
                real_vocab_size=None, return_entropy=False, axis_name=None, mode=None):
    del mode  # accepted for signature parity; the reference is what `off` runs
    a = parse(hidden, weight, targets, bias=bias, temperature=temperature, ignore_index=ignore_index,
              vocab_start=vocab_start, real_vocab_size=real_vocab_size, axis_name=axis_name)
    logp, ent = rows(a, return_entropy)
    logp = logp.reshape(a.out_shape)
    return (logp, ent.reshape(a.out_shape)) if return_entropy else logp


def rows(a: Args, with_entropy: bool, keep=None):
    """logp and entropy ([n] f32 each; entropy zeros when not asked) of parsed arguments; keep: a
    nucleus (uint8 or bool [n, V_local]) over which logp is renormalized (the entropy stays the whole
    distribution's)."""
    # Pinned at HIGHEST (no TF32, no bf16 passes, whatever the global default) but for bf16 operands,
    # which are exact in the fp32-accumulating default.
    precision = None if jnp.dtype(a.hidden.dtype) == jnp.bfloat16 else lax.Precision.HIGHEST
    logits = jnp.dot(a.hidden, a.weight.T, preferred_element_type=F32, precision=precision)
    if a.bias is not None:
        logits = logits + a.bias.astype(F32)
    z = logits / a.temperature[:, None]
    gid = a.vocab_start + jnp.arange(a.weight.shape[0])
    pad = gid[None, :] >= a.real_vocab
    z = jnp.where(pad, -jnp.inf, z)
    # The row max is a constant of the math (no gradient), stopped before the cross-shard max:
    # pmax has no differentiation rule.
    reduce_max = (lambda x: lax.pmax(lax.stop_gradient(x), a.axis_name)) if a.axis_name else lax.stop_gradient
    reduce_sum = (lambda x: lax.psum(x, a.axis_name)) if a.axis_name else (lambda x: x)
    # Everything relative to the row max m: log s and sum e^(z-m) (z-m) keep full fp32 accuracy
    # where lse - sum p z would cancel (peaked rows), as the kernels' statistics do.
    m = reduce_max(jnp.max(z, axis=-1))
    zm = z - m[:, None]
    ez = jnp.exp(zm)
    s = reduce_sum(jnp.sum(ez, axis=-1))
    nucleus, t = keep, a.targets
    local = (t >= a.vocab_start) & (t < a.vocab_start + a.weight.shape[0])
    idx = jnp.clip(t - a.vocab_start, 0, a.weight.shape[0] - 1)
    ztm = reduce_sum(jnp.where(local, jnp.take_along_axis(zm, idx[:, None], axis=-1)[:, 0], 0.0))
    ignored = t == a.ignore_index
    invalid = ~ignored & ((t < 0) | (t >= a.real_vocab))
    valid = ~(ignored | invalid)
    log_s = jnp.log(jnp.where(valid, s, 1.0))
    logp = jnp.where(valid, jnp.minimum(ztm - log_s, 0.0), jnp.where(invalid, jnp.nan, 0.0))
    if nucleus is not None:
        logp = _nucleus_logp(a, z, nucleus.astype(bool), local, idx, valid, reduce_max, reduce_sum)
    if not with_entropy:
        return logp, jnp.zeros_like(logp)
    zm_safe = jnp.where(pad, 0.0, zm)  # e^(z-m) (z-m) is 0 on padding; keep -inf out of the gradient
    acc = reduce_sum(jnp.sum(ez * zm_safe, axis=-1))
    ent = jnp.where(valid, log_s - acc / jnp.where(valid, s, 1.0), jnp.where(invalid, jnp.nan, 0.0))
    return logp, ent


def _nucleus_logp(a: Args, z, nucleus, local, idx, valid, reduce_max, reduce_sum):
    """logp over each row's kept ids: -inf for a target outside them, NaN for a row keeping none."""
    zk = jnp.where(nucleus, z, -jnp.inf)
    mk = reduce_max(jnp.max(zk, axis=-1))
    mk_safe = jnp.where(jnp.isfinite(mk), mk, 0.0)
    sk = reduce_sum(jnp.sum(jnp.exp(zk - mk_safe[:, None]), axis=-1))
    pick = lambda x: jnp.take_along_axis(x, idx[:, None], axis=-1)[:, 0]  # noqa: E731
    zt = reduce_sum(jnp.where(local, pick(z) - mk_safe, 0.0))
    kept = reduce_sum(jnp.where(local, pick(nucleus).astype(F32), 0.0)) > 0
    logp = jnp.where(kept, jnp.minimum(zt - jnp.log(jnp.where(sk > 0, sk, 1.0)), 0.0), -jnp.inf)
    return jnp.where(valid, jnp.where(sk > 0, logp, jnp.nan), jnp.where(a.targets == a.ignore_index, 0.0, jnp.nan))
