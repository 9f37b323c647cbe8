"""Argument checking and normalisation shared by the fused op and the reference.

Every mistake is reported at trace time, naming the argument, as ValueError (values, shapes) or
TypeError (dtypes).
"""
from __future__ import annotations

import dataclasses
import math
import numbers
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

import rlk_common as common

from ._core import PLATFORMS, core

F32 = jnp.float32
SUPPORTED_DTYPES = tuple(jnp.dtype(name) for name in common.KERNEL_DTYPES)


@dataclasses.dataclass
class Args:
    hidden: Any          # [n, h]
    weight: Any          # [v_local, h]
    bias: Any            # [v_local] or None
    targets: Any         # [n] int32, global ids
    temperature: Any     # [n] f32
    temperature_is_array: bool
    ignore_index: int
    vocab_start: Any     # int, or a traced scalar under axis_name
    real_vocab: int
    v_global: int
    tp: int
    axis_name: Any
    out_shape: tuple

    @property
    def chunk(self) -> int:
        """The chunk this shard is reduced in (rlk_common.shard_chunk)."""
        return common.shard_chunk(core.canonical_chunk(self.v_global), self.weight.shape[0])


def _shape(x, name):
    if type(x).__module__.split(".")[0] == "torch":
        raise TypeError(f"{name} is a torch tensor: rlk_xla takes JAX arrays. Pass torch tensors to "
                        f"torch_bridge.linear_logp, or convert with jax.dlpack.from_dlpack({name})")
    if not hasattr(x, "shape") or not hasattr(x, "dtype"):
        raise TypeError(f"{name} must be an array, got {type(x).__name__}")
    return tuple(x.shape)


def parse(hidden, weight, targets, *, bias, temperature, ignore_index, vocab_start, real_vocab_size,
          axis_name) -> Args:
    hs, ws, ts = _shape(hidden, "hidden"), _shape(weight, "weight"), _shape(targets, "targets")
    common.check_shapes(hs, ws, ts, None if bias is None else _shape(bias, "bias"))
    if not jnp.issubdtype(hidden.dtype, jnp.floating):
        raise TypeError(f"hidden must be floating point, got {hidden.dtype}")
    if weight.dtype != hidden.dtype:
        raise TypeError(f"weight dtype {weight.dtype} differs from hidden dtype {hidden.dtype}")
    if not jnp.issubdtype(targets.dtype, jnp.integer):
        raise TypeError(f"targets must be integer token ids, got {targets.dtype}")
    if bias is not None and bias.dtype != weight.dtype:
        raise TypeError(f"bias dtype {bias.dtype} differs from weight dtype {weight.dtype}")
    ignore_index = common.check_ignore_index(ignore_index)
    rule = common.id_rule(int(jnp.iinfo(targets.dtype).min), int(jnp.iinfo(targets.dtype).max), ignore_index)

    n = math.prod(ts)
    scalar = common.scalar_temperature(temperature)
    if scalar is not None:
        temp, temp_is_array = jnp.full((n,), scalar, F32), False
    else:
        tshape = _shape(temperature, "temperature")
        if not jnp.issubdtype(temperature.dtype, jnp.floating):
            raise TypeError(f"temperature must be a float or a floating array, got {temperature.dtype}")
        if tshape not in ((), ts):
            raise ValueError(f"temperature array must be shaped like targets {ts}, got {tshape}")
        temp, temp_is_array = jnp.broadcast_to(temperature.astype(F32), ts).reshape(n), True

    v_local = ws[0]
    if axis_name is None:
        tp, wrong_start = 1, None
        if vocab_start not in (None, 0):
            raise ValueError(f"vocab_start={vocab_start} needs axis_name: without it the weight holds the whole vocab")
        vocab_start = 0
    else:
        tp = lax.psum(1, axis_name)
        vocab_start, wrong_start = _shard_vocab_start(vocab_start, axis_name, v_local, tp)
    v_global = v_local * tp
    real = common.real_vocab(real_vocab_size, v_global)
    ids = int32_targets(targets.reshape(n), rule)
    if wrong_start is not None:
        ids = jnp.where(wrong_start, rule.invalid, ids)

    return Args(hidden=hidden.reshape(n, hs[-1]), weight=weight, bias=bias,
                targets=ids, temperature=temp, temperature_is_array=temp_is_array,
                ignore_index=rule.ignore, vocab_start=vocab_start, real_vocab=int(real), v_global=v_global,
                tp=tp, axis_name=axis_name, out_shape=ts)


def _shard_vocab_start(vocab_start, axis_name, v_local: int, tp: int):
    """(this shard's vocab offset, a traced bool that is True when a given offset is wrong, or None).
    Under shard_map the offset is lax.axis_index(axis_name) * V_local (equal shards in axis order).
    A traced vocab_start is checked against it when the program runs: a wrong one makes every row
    NaN (never another shard's logp). A Python int differs between shards, so only 0 at tp = 1 is one."""
    derived = lax.axis_index(axis_name) * v_local
    if vocab_start is None:
        return derived, None
    if isinstance(vocab_start, numbers.Integral) and not isinstance(vocab_start, bool):
        if tp == 1 and vocab_start == 0:
            return derived, None
        raise ValueError(f"vocab_start={vocab_start} under shard_map (axis_name={axis_name!r}): one Python int "
                         f"cannot be every shard's offset; pass vocab_start=None (derived as "
                         f"lax.axis_index({axis_name!r}) * {v_local}) or that traced value")
    if not hasattr(vocab_start, "dtype") or not jnp.issubdtype(vocab_start.dtype, jnp.integer) or jnp.shape(vocab_start):
        raise TypeError(f"vocab_start must be None, an int or a traced integer scalar, got {vocab_start!r}")
    wrong = lax.psum((vocab_start != derived).astype(jnp.int32), axis_name) > 0
    return derived, wrong


def int32_targets(t, rule: common.IdRule):
    """int32 ids for the kernels by rlk_common.IdRule: checked in t's own dtype, with jnp ops (no
    host sync, traceable), before the cast."""
    if not rule.remap:
        return t.astype(jnp.int32)
    ignored = (t == jnp.asarray(rule.ignore_index, t.dtype)) if rule.match_ignore else False
    bad = jnp.zeros(t.shape, bool)
    if rule.check_low:
        bad = bad | (t < 0)
    if rule.check_high:
        bad = bad | (t > jnp.asarray(common.INT32_MAX, t.dtype))
    ids = jnp.where(bad, rule.invalid, jnp.where(bad, 0, t).astype(jnp.int32))
    return jnp.where(ignored, rule.ignore, ids)


def validate_targets(targets, vocab_size: int, ignore_index: int = -100) -> None:
    """Raise ValueError, eagerly, naming the first id outside [0, vocab_size) that is not ignore_index
    (compared exactly, in Python ints: any integer dtype, any ignore_index)."""
    import numpy as np
    t = np.asarray(jax.device_get(targets)).reshape(-1)
    ignore_index = common.check_ignore_index(ignore_index)
    info = np.iinfo(t.dtype)
    ignored = t == ignore_index if info.min <= ignore_index <= info.max else np.zeros(t.shape, bool)
    out = (t >= vocab_size) if info.min >= 0 else ((t < 0) | (t >= vocab_size))
    bad = np.nonzero(~ignored & out)[0]
    if bad.size:
        i = int(bad[0])
        raise common.bad_targets(i, int(t[i]), vocab_size, ignore_index, int(bad.size))


def saved_logits_bytes(n: int, v_local: int, chunk: int, dtype) -> int:
    """Bytes of the fast backward's saved logits (uint8) in the layout of the default backend's
    kernels (the platform is not known at trace time; the kernels accept a larger buffer)."""
    platform = common.platform(PLATFORMS, "jax_backend", jax.default_backend())
    device = platform["name"] if platform is not None and platform["supported"] else "cpu"
    return common.saved_logits_bytes(core, n, v_local, chunk, jnp.dtype(dtype).name, device)


def resolve_backward(backward: str, a: Args, budget) -> str:
    """"fast" or "lean": rlk_common.resolve_backward over this call's saved_logits_bytes."""
    if jnp.dtype(a.hidden.dtype) not in SUPPORTED_DTYPES:  # the reference runs: nothing is kept
        return common.resolve_backward(backward, 0, budget)
    return common.resolve_backward(backward, saved_logits_bytes(a.hidden.shape[0], a.weight.shape[0], a.chunk,
                                                        a.hidden.dtype), budget)
