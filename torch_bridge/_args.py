"""Argument checking and normalisation shared by the fused op and the reference.

Mirrors rlk_xla._args: every mistake is reported before anything runs, naming the argument, as
ValueError (values, shapes) or TypeError (dtypes); torch adds device checks.
"""
from __future__ import annotations

import dataclasses
import math
import numbers
import zlib
from typing import Any

import torch

import rlk_common as common
from rlk_common import BACKWARDS, DEFAULT_BACKWARD_MEMORY_BUDGET  # noqa: F401  (torch_bridge's API)

from . import _dist
from ._core import PLATFORMS, core

F32 = torch.float32
SUPPORTED_DTYPES = tuple(getattr(torch, name) for name in common.KERNEL_DTYPES)


def dtype_name(dtype: torch.dtype) -> str:
    """The dtype's name as rlk_common and jax name it ("bfloat16" for torch.bfloat16)."""
    return str(dtype).removeprefix("torch.")


@dataclasses.dataclass
class Args:
    hidden: torch.Tensor         # [n, h]
    weight: torch.Tensor         # [v_local, h]
    bias: Any                    # [v_local] (its own dtype) or None
    targets: torch.Tensor        # [n] int32, global ids
    temperature: torch.Tensor    # [n] f32 (differentiable when an array was given)
    temperature_is_array: bool
    ignore_index: int
    vocab_start: int
    real_vocab: int
    v_global: int
    tp: int
    rank: int
    tp_group: Any
    out_shape: tuple
    keep: Any = None             # [n, v_local] bool (a top-p nucleus) or None

    @property
    def n(self) -> int:
        return self.hidden.shape[0]

    @property
    def chunk(self) -> int:
        """The chunk this shard is reduced in (rlk_common.shard_chunk)."""
        return chunk_of(self.v_global, self.weight.shape[0])


_MAX_INVARIANT_TP = int(core.MAX_INVARIANT_TP)


def canonical_chunk(vocab_global: int) -> int:
    """core.canonical_chunk in Python (traceable by torch.compile; a test checks they agree):
    the global vocab over the largest power of two <= MAX_INVARIANT_TP that divides it."""
    parts = 1
    while parts < _MAX_INVARIANT_TP and vocab_global % (parts * 2) == 0:
        parts *= 2
    return vocab_global // parts if vocab_global > 0 else 1


def chunk_of(v_global: int, v_local: int) -> int:
    return common.shard_chunk(canonical_chunk(int(v_global)), int(v_local))


def _tensor(x, name):
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    return tuple(x.shape)


def _same_device(x, ref, name):
    if x.device != ref.device:
        raise ValueError(f"{name} is on {x.device} but hidden is on {ref.device}")


def check_tensors(hidden, weight, targets, bias) -> tuple:
    """Shapes, dtypes and devices of the operands (nothing runs); returns the targets' shape."""
    hs, ws, ts = _tensor(hidden, "hidden"), _tensor(weight, "weight"), _tensor(targets, "targets")
    common.check_shapes(hs, ws, ts, None if bias is None else _tensor(bias, "bias"))
    if not hidden.dtype.is_floating_point:
        raise TypeError(f"hidden must be floating point, got {hidden.dtype}")
    if weight.dtype != hidden.dtype:
        raise TypeError(f"weight dtype {weight.dtype} differs from hidden dtype {hidden.dtype}")
    if targets.dtype.is_floating_point or targets.dtype.is_complex or targets.dtype == torch.bool:
        raise TypeError(f"targets must be integer token ids, got {targets.dtype}")
    _same_device(weight, hidden, "weight")
    _same_device(targets, hidden, "targets")
    if bias is not None:
        if bias.dtype != weight.dtype:
            raise TypeError(f"bias dtype {bias.dtype} differs from weight dtype {weight.dtype}")
        _same_device(bias, hidden, "bias")
    return ts


def check_temperature(temperature, ts: tuple, hidden) -> float | None:
    """A number: checked > 0 and returned as a float; a tensor: checked (floating, shaped () or like
    the targets, on hidden's device) and None returned."""
    scalar = common.scalar_temperature(temperature)
    if scalar is not None:
        return scalar
    tshape = _tensor(temperature, "temperature")
    if not temperature.dtype.is_floating_point:
        raise TypeError(f"temperature must be a float or a floating tensor, got {temperature.dtype}")
    if tshape not in ((), ts):
        raise ValueError(f"temperature array must be shaped like targets {ts}, got {tshape}")
    _same_device(temperature, hidden, "temperature")
    return None


def tp_layout(tp_group, v_local: int, vocab_start) -> tuple[int, int, int]:
    """(tp, rank, vocab_start) of this rank's equal vocab shard; vocab_start None: rank * v_local."""
    if tp_group is None:
        if vocab_start not in (None, 0):
            raise ValueError(f"vocab_start={vocab_start} needs tp_group: without it the weight holds the whole vocab")
        return 1, 0, 0
    import torch.distributed as dist
    tp, rank = dist.get_world_size(tp_group), dist.get_rank(tp_group)
    if vocab_start is None:
        vocab_start = rank * v_local
    elif not isinstance(vocab_start, numbers.Integral) or vocab_start != rank * v_local:
        raise ValueError(f"vocab_start must be rank * V_local = {rank * v_local} (equal vocab shards in rank "
                         f"order), got {vocab_start}")
    return tp, rank, int(vocab_start)


def check_keep_mask(keep_mask, ts: tuple, v_local: int, hidden) -> None:
    """A top-p nucleus: a bool tensor shaped targets' shape + (V_local,), on hidden's device."""
    ks = _tensor(keep_mask, "keep_mask")
    if keep_mask.dtype != torch.bool:
        raise TypeError(f"keep_mask must be a bool tensor, got {keep_mask.dtype}")
    if ks != (*ts, v_local):
        raise ValueError(f"keep_mask must be shaped like targets plus this shard's vocab, {(*ts, v_local)}, got {ks}")
    _same_device(keep_mask, hidden, "keep_mask")


def parse(hidden, weight, targets, *, bias, temperature, ignore_index, vocab_start, real_vocab_size,
          tp_group, keep_mask=None) -> Args:
    """The checked, normalised arguments of one call. With tp_group, the ranks first agree on the
    call's shapes (_dist.agree_across_ranks; eager calls, not under torch.compile or CUDA-graph
    capture, which a host sync would break): a rank whose arguments are refused here
    makes every rank refuse, before any collective."""
    group = _dist.check_group(tp_group)
    # No host sync under torch.compile or CUDA-graph capture (asked in that order: dynamo cannot trace
    # is_current_stream_capturing, so a compiled call never reaches it).
    agree = (group is not None and not torch.compiler.is_compiling()
             and not (torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()))
    try:
        a = _parse(hidden, weight, targets, bias=bias, temperature=temperature, ignore_index=ignore_index,
                   vocab_start=vocab_start, real_vocab_size=real_vocab_size, tp_group=group, keep_mask=keep_mask)
    except (TypeError, ValueError):
        if agree:
            _dist.agree_across_ranks(group, None)
        raise
    if agree:
        _dist.agree_across_ranks(group, (a.n, a.hidden.shape[1], a.weight.shape[0],
                                         zlib.crc32(dtype_name(a.hidden.dtype).encode()), int(a.keep is not None)))
    return a


def _parse(hidden, weight, targets, *, bias, temperature, ignore_index, vocab_start, real_vocab_size,
           tp_group, keep_mask=None) -> Args:
    ts = check_tensors(hidden, weight, targets, bias)
    hs = tuple(hidden.shape)
    ignore_index = common.check_ignore_index(ignore_index)
    rule = id_rule(targets, ignore_index)

    n = math.prod(ts)
    scalar = check_temperature(temperature, ts, hidden)
    if scalar is not None:
        temp, temp_is_array = torch.full((n,), scalar, dtype=F32, device=hidden.device), False
    else:
        temp, temp_is_array = common.valid_temperatures(temperature.to(F32).expand(ts).reshape(n), torch), True

    v_local = weight.shape[0]
    if keep_mask is not None:
        check_keep_mask(keep_mask, ts, v_local, hidden)
    tp, rank, vocab_start = tp_layout(tp_group, v_local, vocab_start)
    v_global = v_local * tp
    real = common.real_vocab(real_vocab_size, v_global)

    return Args(hidden=hidden.reshape(n, hs[-1]), weight=weight, bias=bias,
                targets=int32_targets(targets.reshape(n), rule), temperature=temp, temperature_is_array=temp_is_array,
                ignore_index=rule.ignore, vocab_start=int(vocab_start), real_vocab=int(real),
                v_global=int(v_global), tp=int(tp), rank=int(rank), tp_group=tp_group, out_shape=ts,
                keep=None if keep_mask is None else keep_mask.reshape(n, v_local))


def _signed(t: torch.Tensor) -> torch.Tensor:
    """t's ids in a signed dtype torch can compare: uint16/uint32 widened exactly to int64; uint64
    read as int64 (ids >= 2^63 read negative: out of range either way, as they are)."""
    if t.dtype == torch.uint64:
        return t.view(torch.int64)
    return t.to(torch.int64) if t.dtype in (torch.uint16, torch.uint32) else t


def _ignored(t: torch.Tensor, ignore_index: int):
    """Rows whose id equals ignore_index, compared in t's own dtype (None: no id of it can)."""
    info = torch.iinfo(t.dtype)
    return t == ignore_index if info.min <= ignore_index <= info.max else None


def id_rule(targets: torch.Tensor, ignore_index: int) -> common.IdRule:
    """rlk_common's IdRule for ids of this tensor's dtype."""
    info = torch.iinfo(targets.dtype)
    return common.id_rule(int(info.min), int(info.max), ignore_index)


def int32_targets(t: torch.Tensor, rule: common.IdRule) -> torch.Tensor:
    """int32 ids for the kernels by rlk_common.IdRule: checked in t's own dtype before the cast."""
    if not rule.remap:
        return t.to(torch.int32)
    if rule.clamp is not None:
        return t.clamp(*rule.clamp).to(torch.int32)
    s = _signed(t)
    bad = (s < 0) | (s > common.INT32_MAX)
    ids = torch.where(bad, torch.full_like(s, rule.invalid), s).to(torch.int32)
    ignored = _ignored(t, rule.ignore_index) if rule.match_ignore else None
    return ids if ignored is None else torch.where(ignored, torch.full_like(ids, rule.ignore), ids)


def validate_targets(targets, vocab_size: int, ignore_index: int = -100) -> None:
    """Raise ValueError, eagerly, naming the first id outside [0, vocab_size) that is not ignore_index
    (any integer dtype, unsigned included; any int ignore_index). One device->host sync for CUDA tensors."""
    t = targets.detach().reshape(-1)
    ignore_index = common.check_ignore_index(ignore_index)
    s = _signed(t)
    out = (s < 0) | (s >= vocab_size)
    ignored = _ignored(t, ignore_index)
    bad = out if ignored is None else out & ~ignored
    if bool(bad.any()):
        idx = torch.nonzero(bad).reshape(-1)
        i = int(idx[0])
        value = int(s[i]) % 2 ** 64 if t.dtype == torch.uint64 else int(s[i])
        raise common.bad_targets(i, value, vocab_size, ignore_index, idx.numel())


def unsupported(hidden: torch.Tensor) -> str | None:
    """Why the fused kernels cannot take tensors like `hidden` (the fallback reason), or None."""
    if hidden.dtype not in SUPPORTED_DTYPES:
        return common.dtype_fallback(dtype_name(hidden.dtype))
    if hidden.device.type in _KERNEL_DEVICES:
        return None
    return common.platform_fallback(PLATFORMS, "name", hidden.device.type)


# The torch device types this build's kernels run on (PLATFORMS' names, supported).
_KERNEL_DEVICES = frozenset(p["name"] for p in PLATFORMS.values() if p["supported"])


def saved_logits_bytes(n: int, v_local: int, chunk: int, dtype: torch.dtype, device: torch.device) -> int:
    """Bytes of the fast backward's saved logits (uint8) for the kernels of `device`; 0 where the
    kernels do not run (unsupported dtype or device: nothing is saved)."""
    if dtype not in SUPPORTED_DTYPES or device.type not in _KERNEL_DEVICES:
        return 0
    return n * _saved_row_bytes(int(v_local), int(chunk), dtype_name(dtype), device.type)


@torch.compiler.assume_constant_result
def _saved_row_bytes(v_local: int, chunk: int, dtype: str, device: str) -> int:
    """One row's saved bytes (rlk_common.saved_logits_bytes), a constant for torch.compile, which cannot
    trace the compiled module's call; n may be symbolic."""
    return common.saved_logits_bytes(core, 1, v_local, chunk, dtype, device)


def resolve_backward(backward: str, n: int, v_local: int, chunk: int, dtype: torch.dtype, device: torch.device,
                     budget=None) -> str:
    """The backward strategy of one call, "fast" or "lean": rlk_common.resolve_backward over this
    call's saved_logits_bytes."""
    return common.resolve_backward(backward, saved_logits_bytes(n, v_local, chunk, dtype, device), budget)
