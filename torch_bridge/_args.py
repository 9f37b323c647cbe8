"""Argument checking and normalisation shared by the fused op and the reference.

Mirrors rlk_xla._args: every mistake is reported before anything runs, naming the argument, as
ValueError (values, shapes) or TypeError (dtypes); torch adds device checks.
"""
from __future__ import annotations

import dataclasses
import math
import numbers
from typing import Any

import torch

import rlk_common as common
from rlk_common import BACKWARDS, DEFAULT_BACKWARD_MEMORY_BUDGET  # noqa: F401  (torch_bridge's API)

from ._core import core

F32 = torch.float32
SUPPORTED_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
DTYPE_CODE = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}


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

    @property
    def n(self) -> int:
        return self.hidden.shape[0]

    @property
    def chunk(self) -> int:
        """Canonical chunk of the global vocab when the shard holds whole canonical chunks, else
        the shard is one chunk (works, without the bitwise TP-invariance promise)."""
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
    c = canonical_chunk(int(v_global))
    return c if v_local % c == 0 else int(v_local)


def _tensor(x, name):
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    return tuple(x.shape)


def _same_device(x, ref, name):
    if x.device != ref.device:
        raise ValueError(f"{name} is on {x.device} but hidden is on {ref.device}")


def parse(hidden, weight, targets, *, bias, temperature, ignore_index, vocab_start, real_vocab_size,
          tp_group) -> Args:
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
    ignore_index = common.check_ignore_index(ignore_index)

    n = math.prod(ts)
    scalar = common.scalar_temperature(temperature)
    if scalar is not None:
        temp, temp_is_array = torch.full((n,), scalar, dtype=F32, device=hidden.device), False
    else:
        tshape = _tensor(temperature, "temperature")
        if not temperature.dtype.is_floating_point:
            raise TypeError(f"temperature must be a float or a floating tensor, got {temperature.dtype}")
        if tshape not in ((), ts):
            raise ValueError(f"temperature array must be shaped like targets {ts}, got {tshape}")
        _same_device(temperature, hidden, "temperature")
        temp, temp_is_array = temperature.to(F32).expand(ts).reshape(n), True

    v_local = ws[0]
    if tp_group is None:
        tp, rank = 1, 0
        if vocab_start not in (None, 0):
            raise ValueError(f"vocab_start={vocab_start} needs tp_group: without it the weight holds the whole vocab")
        vocab_start = 0
    else:
        import torch.distributed as dist
        tp, rank = dist.get_world_size(tp_group), dist.get_rank(tp_group)
        if vocab_start is None:
            vocab_start = rank * v_local
        elif not isinstance(vocab_start, numbers.Integral) or vocab_start != rank * v_local:
            raise ValueError(f"vocab_start must be rank * V_local = {rank * v_local} (equal vocab shards in rank "
                             f"order), got {vocab_start}")
    v_global = v_local * tp
    real = common.real_vocab(real_vocab_size, v_global)

    return Args(hidden=hidden.reshape(n, hs[-1]), weight=weight, bias=bias,
                targets=int32_targets(targets.reshape(n), ignore_index), temperature=temp, temperature_is_array=temp_is_array,
                ignore_index=int(ignore_index), vocab_start=int(vocab_start), real_vocab=int(real),
                v_global=int(v_global), tp=int(tp), rank=int(rank), tp_group=tp_group, out_shape=ts)


def int32_targets(t: torch.Tensor, ignore_index: int) -> torch.Tensor:
    """int32 ids for the kernels. int64 ids beyond int32 become invalid ids (a NaN row), never
    wrapped ids, nor ignore_index: clamped to int32's ends (one kernel), or, when an end is
    ignore_index, replaced by another invalid id."""
    if t.dtype == torch.int32:
        return t
    if t.dtype == torch.int64:
        lo, hi = -(2 ** 31), 2 ** 31 - 1
        if lo < ignore_index < hi:
            t = t.clamp(lo, hi)
        else:
            t = torch.where((t < lo) | (t > hi), torch.full_like(t, -1 if ignore_index != -1 else -2), t)
    return t.to(torch.int32)


def validate_targets(targets, vocab_size: int, ignore_index: int = -100) -> None:
    """Raise ValueError, eagerly, naming the first id outside [0, vocab_size) that is not ignore_index.
    One device->host sync for CUDA tensors."""
    t = targets.detach().reshape(-1)
    bad = (t != ignore_index) & ((t < 0) | (t >= vocab_size))
    if bool(bad.any()):
        idx = torch.nonzero(bad).reshape(-1)
        i = int(idx[0])
        raise ValueError(f"targets[{i}] = {int(t[i])} is outside [0, {vocab_size}) and is not "
                         f"ignore_index={ignore_index} ({idx.numel()} bad ids in all)")


def unsupported(hidden: torch.Tensor) -> str | None:
    """Why the fused kernels cannot take tensors like `hidden` (the fallback reason), or None."""
    if hidden.dtype not in SUPPORTED_DTYPES:
        return f"dtype {str(hidden.dtype).replace('torch.', '')} (supported: bfloat16, float16, float32)"
    dev = hidden.device.type
    if dev == "cpu":
        return None
    if dev == "cuda":
        return None if core.has_cuda else "device cuda (this build of _rlk_core has no CUDA backend)"
    return f"device {dev} (supported: cpu, cuda)"


def kept_bytes(n: int, v_local: int, chunk: int, dtype: torch.dtype, device: torch.device) -> int:
    """Bytes of the fast backward's kept buffer (uint8) for the kernels of `device`; 0 where the
    kernels do not run (unsupported dtype or device: nothing is kept)."""
    if dtype not in DTYPE_CODE or device.type not in ("cpu", "cuda"):
        return 0
    return n * _kept_row_bytes(int(v_local), int(chunk), DTYPE_CODE[dtype], device.type)


@torch.compiler.assume_constant_result
def _kept_row_bytes(v_local: int, chunk: int, dtype_code: int, device: str) -> int:
    """One row's kept bytes (rlk_common.kept_bytes), a constant for torch.compile, which cannot
    trace the compiled module's call; n may be symbolic."""
    return common.kept_bytes(core, 1, v_local, chunk, dtype_code, device)


def resolve_backward(backward: str, n: int, v_local: int, chunk: int, dtype: torch.dtype, device: torch.device,
                     budget=None) -> str:
    """The backward strategy of one call, "fast" or "lean" (rlk_common.resolve_backward).
    fast: the forward also writes what the backward needs of this shard's logits (the kept
    buffer, kept_bytes) and the backward reads it instead of recomputing the logits; lean: the
    backward recomputes them chunk by chunk (small workspace). auto: fast when kept_bytes <= the
    budget (bytes; None: env RLK_BACKWARD_MEMORY_BUDGET, else 4 GiB), else lean."""
    return common.resolve_backward(backward, kept_bytes(n, v_local, chunk, dtype, device), budget)
