"""The provider contract of the RL framework (Megatron side), served by torch_bridge.

The framework builds a LinearLogpRequest from what its loss already has (target ids, the
tensor-parallel group, the token layout, masks, temperature, optionally the local logits) and,
when it captured them, a LinearLogpContext (output-layer hidden states, the local LM-head
projection and the vocab partition). compute_linear_logp(request, mode) returns a
LinearLogpResult: logp [T, 1] fp32, entropy [T] or None, the backend that ran and provenance.

Modes: off = the native path (materialized logits, log_softmax, gather) from request.logits, or
from the context by materializing the logits; auto = our kernels, falling back to native ONLY when
our provider reports itself unavailable for the request (no context, unsupported device or dtype,
a chunk size other than ours) -- an error raised inside our kernels propagates; strict = our
kernels or an error: unavailability, malformed output, detached gradients or a route mismatch
raise; audit = ours returned, native computed alongside and |dlogp| recorded.
request.backward picks our kernels' backward strategy (linear_logp's `backward`: "auto", the
default, within env RLK_BACKWARD_MEMORY_BUDGET; "fast"; "lean"); the native path ignores it.
"""
from __future__ import annotations

import collections
import dataclasses
import math
import numbers
import threading
from typing import Any, Optional, Union

import torch

from . import _dist, reference, routes
from ._args import BACKWARDS, chunk_of, unsupported
from .linear_logp import linear_logp

CONTRACT_ID = "rlk.linear_logp/v1"
LAYOUTS = ("single", "zigzag", "allgather")
MODES = routes.MODES
IGNORE_INDEX = -100
F32 = torch.float32


class ProviderUnavailable(RuntimeError):
    """Our provider cannot serve this request (strict mode raises it; auto falls back on it)."""


def _int(x, name, lo=None):
    if not isinstance(x, numbers.Integral) or isinstance(x, bool):
        raise ValueError(f"{name} must be an int, got {x!r}")
    if lo is not None and x < lo:
        raise ValueError(f"{name} must be >= {lo}, got {x}")
    return int(x)


def _tensor(x, name):
    if not isinstance(x, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(x).__name__}")


def _integer_dtype(t: torch.Tensor) -> bool:
    return not (t.dtype.is_floating_point or t.dtype.is_complex or t.dtype == torch.bool)


# ---- the dataclasses ------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class TokenLayout:
    """How the tokens of a sequence are split over context-parallel ranks. Rows are independent for
    linear_logp, so the layout is recorded (provenance) and checked, not acted on."""
    world_size: int = 1
    rank: int = 0
    layout: str = "single"

    def __post_init__(self):
        _int(self.world_size, "world_size", 1)
        _int(self.rank, "rank", 0)
        if self.rank >= self.world_size:
            raise ValueError(f"rank must be in [0, world_size={self.world_size}), got {self.rank}")
        if self.layout not in LAYOUTS:
            raise ValueError(f"layout must be one of {LAYOUTS}, got {self.layout!r}")
        if (self.layout == "single") != (self.world_size == 1):
            raise ValueError(f"layout must be 'single' exactly when world_size == 1, got layout={self.layout!r} "
                             f"with world_size={self.world_size}")


@dataclasses.dataclass(frozen=True)
class LinearProjection:
    """The (local shard of the) LM head: weight [V_local, H], bias [V_local] or None."""
    weight: torch.Tensor
    bias: Optional[torch.Tensor] = None

    def __post_init__(self):
        _tensor(self.weight, "weight")
        if self.weight.dim() != 2:
            raise ValueError(f"weight must be [V_local, H], got shape {tuple(self.weight.shape)}")
        if not self.weight.dtype.is_floating_point:
            raise ValueError(f"weight must be floating point, got {self.weight.dtype}")
        if self.bias is not None:
            _tensor(self.bias, "bias")
            if tuple(self.bias.shape) != (self.weight.shape[0],):
                raise ValueError(f"bias must be [V_local] = ({self.weight.shape[0]},), got {tuple(self.bias.shape)}")
            if self.bias.dtype != self.weight.dtype:
                raise ValueError(f"bias dtype {self.bias.dtype} differs from weight dtype {self.weight.dtype}")
            if self.bias.device != self.weight.device:
                raise ValueError(f"bias is on {self.bias.device} but weight is on {self.weight.device}")


@dataclasses.dataclass(frozen=True)
class VocabPartition:
    """This rank's vocab rows [local_start, local_start + local_size) of a padded vocab of
    padded_size ids, of which ids >= real_size are padding."""
    local_start: int
    local_size: int
    real_size: int
    padded_size: int

    def __post_init__(self):
        _int(self.local_start, "local_start", 0)
        _int(self.local_size, "local_size", 1)
        _int(self.real_size, "real_size", 1)
        _int(self.padded_size, "padded_size", 1)
        if self.local_start + self.local_size > self.padded_size:
            raise ValueError(f"local_start + local_size = {self.local_start + self.local_size} exceeds "
                             f"padded_size = {self.padded_size}")
        if self.real_size > self.padded_size:
            raise ValueError(f"real_size = {self.real_size} exceeds padded_size = {self.padded_size}")


@dataclasses.dataclass(frozen=True)
class LinearLogpContext:
    """What the framework captured at the output layer: hidden [..., H] (T rows), the projection and
    the vocab partition of its weight."""
    hidden: torch.Tensor
    projection: LinearProjection
    vocab_partition: VocabPartition

    def __post_init__(self):
        _tensor(self.hidden, "hidden")
        if not isinstance(self.projection, LinearProjection):
            raise ValueError(f"projection must be a LinearProjection, got {type(self.projection).__name__}")
        if not isinstance(self.vocab_partition, VocabPartition):
            raise ValueError(f"vocab_partition must be a VocabPartition, got {type(self.vocab_partition).__name__}")
        w = self.projection.weight
        if self.hidden.dim() < 1 or self.hidden.shape[-1] != w.shape[1]:
            raise ValueError(f"hidden must be [..., H] with H = {w.shape[1]} (the weight's), got "
                             f"{tuple(self.hidden.shape)}")
        if self.hidden.dtype != w.dtype:
            raise ValueError(f"hidden dtype {self.hidden.dtype} differs from the projection weight's {w.dtype}")
        if self.hidden.device != w.device:
            raise ValueError(f"hidden is on {self.hidden.device} but the projection weight is on {w.device}")
        if w.shape[0] != self.vocab_partition.local_size:
            raise ValueError(f"vocab_partition.local_size = {self.vocab_partition.local_size} differs from the "
                             f"projection weight's {w.shape[0]} rows")

    @property
    def rows(self) -> int:
        return math.prod(self.hidden.shape[:-1])


@dataclasses.dataclass(frozen=True)
class LinearLogpRequest:
    target_ids: torch.Tensor
    tensor_parallel_group: Any = None
    token_layout: TokenLayout = dataclasses.field(default_factory=TokenLayout)
    with_entropy: bool = False
    with_entropy_grad: bool = False
    logits: Optional[torch.Tensor] = None
    context: Optional[LinearLogpContext] = None
    log_prob_keep_mask: Optional[torch.Tensor] = None
    temperature: Union[float, torch.Tensor, None] = None
    chunk_size: Optional[int] = None
    metadata: dict = dataclasses.field(default_factory=dict)
    backward: str = "auto"  # our kernels' backward strategy: "auto", "fast" or "lean" (see linear_logp)

    def __post_init__(self):
        t = self.target_ids
        _tensor(t, "target_ids")
        if t.dim() != 1:
            raise ValueError(f"target_ids must be [T], got shape {tuple(t.shape)}")
        if not _integer_dtype(t):
            raise ValueError(f"target_ids must be integer token ids, got {t.dtype}")
        T, dev = t.shape[0], t.device
        if not isinstance(self.token_layout, TokenLayout):
            raise ValueError(f"token_layout must be a TokenLayout, got {type(self.token_layout).__name__}")
        for name in ("with_entropy", "with_entropy_grad"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a bool, got {getattr(self, name)!r}")
        if self.with_entropy_grad and not self.with_entropy:
            raise ValueError("with_entropy_grad needs with_entropy=True")
        if self.logits is None and self.context is None:
            raise ValueError("logits and context are both None: a request needs at least one of them")
        group = self.tensor_parallel_group
        tp, rank = 1, 0
        if group is not None:
            import torch.distributed as dist
            if not dist.is_available() or not dist.is_initialized():
                raise ValueError("tensor_parallel_group is given but torch.distributed is not initialized")
            tp, rank = dist.get_world_size(group), dist.get_rank(group)
        if self.logits is not None:
            _tensor(self.logits, "logits")
            if self.logits.dim() != 2 or self.logits.shape[0] != T:
                raise ValueError(f"logits must be [T, V_local] with T = {T}, got {tuple(self.logits.shape)}")
            if not self.logits.dtype.is_floating_point:
                raise ValueError(f"logits must be floating point, got {self.logits.dtype}")
            if self.logits.device != dev:
                raise ValueError(f"logits is on {self.logits.device} but target_ids is on {dev}")
        if self.context is not None:
            c = self.context
            if not isinstance(c, LinearLogpContext):
                raise ValueError(f"context must be a LinearLogpContext, got {type(c).__name__}")
            if math.prod(c.hidden.shape[:-1]) != T:
                raise ValueError(f"context.hidden has {math.prod(c.hidden.shape[:-1])} rows, target_ids {T}")
            if c.hidden.device != dev:
                raise ValueError(f"context.hidden is on {c.hidden.device} but target_ids is on {dev}")
            vp = c.vocab_partition
            if self.logits is not None and self.logits.shape[1] != vp.local_size:
                raise ValueError(f"logits has {self.logits.shape[1]} vocab columns, vocab_partition.local_size "
                                 f"is {vp.local_size}")
            if vp.local_start != rank * vp.local_size or vp.padded_size != tp * vp.local_size:
                raise ValueError(f"vocab_partition {vp} does not match the tensor-parallel group (rank {rank} of "
                                 f"{tp}: local_start must be rank * local_size and padded_size tp * local_size)")
        if self.log_prob_keep_mask is not None:
            m = self.log_prob_keep_mask
            _tensor(m, "log_prob_keep_mask")
            if tuple(m.shape) != (T,):
                raise ValueError(f"log_prob_keep_mask must be [T] = ({T},), got {tuple(m.shape)}")
            if m.dtype != torch.bool:
                raise ValueError(f"log_prob_keep_mask must be bool, got {m.dtype}")
            if m.device != dev:
                raise ValueError(f"log_prob_keep_mask is on {m.device} but target_ids is on {dev}")
        temp = self.temperature
        if isinstance(temp, torch.Tensor):
            if not temp.dtype.is_floating_point:
                raise ValueError(f"temperature must be floating point, got {temp.dtype}")
            if tuple(temp.shape) not in ((), (T,)):
                raise ValueError(f"temperature must be a float or shaped [T] = ({T},), got {tuple(temp.shape)}")
            if temp.device != dev:
                raise ValueError(f"temperature is on {temp.device} but target_ids is on {dev}")
            if not bool(torch.all(torch.isfinite(temp) & (temp > 0))):
                raise ValueError("temperature must be finite and > 0 everywhere")
        elif temp is not None:
            if not isinstance(temp, numbers.Real) or isinstance(temp, bool) or not (0 < float(temp) < math.inf):
                raise ValueError(f"temperature must be a finite number > 0, got {temp!r}")
        if self.chunk_size is not None:
            _int(self.chunk_size, "chunk_size", 1)
        if not isinstance(self.metadata, dict):
            raise ValueError(f"metadata must be a dict, got {type(self.metadata).__name__}")
        if self.backward not in BACKWARDS:
            raise ValueError(f"backward must be one of {BACKWARDS}, got {self.backward!r}")

    @property
    def num_tokens(self) -> int:
        return self.target_ids.shape[0]


@dataclasses.dataclass(frozen=True)
class LinearLogpResult:
    logp: torch.Tensor                 # [T, 1] fp32
    entropy: Optional[torch.Tensor]    # [T] fp32 or None
    backend_id: str
    contract_id: str = CONTRACT_ID
    provenance: dict = dataclasses.field(default_factory=dict)

    def __post_init__(self):
        _tensor(self.logp, "logp")
        if self.logp.dim() != 2 or self.logp.shape[1] != 1:
            raise ValueError(f"logp must be [T, 1], got {tuple(self.logp.shape)}")
        if self.logp.dtype != F32:
            raise ValueError(f"logp must be float32, got {self.logp.dtype}")
        if self.entropy is not None:
            _tensor(self.entropy, "entropy")
            if tuple(self.entropy.shape) != (self.logp.shape[0],):
                raise ValueError(f"entropy must be [T] = ({self.logp.shape[0]},), got {tuple(self.entropy.shape)}")
            if self.entropy.dtype != F32:
                raise ValueError(f"entropy must be float32, got {self.entropy.dtype}")
            if self.entropy.device != self.logp.device:
                raise ValueError(f"entropy is on {self.entropy.device} but logp is on {self.logp.device}")
        if not isinstance(self.backend_id, str) or not self.backend_id:
            raise ValueError(f"backend_id must be a non-empty str, got {self.backend_id!r}")
        if not isinstance(self.contract_id, str) or not self.contract_id:
            raise ValueError(f"contract_id must be a non-empty str, got {self.contract_id!r}")
        if not isinstance(self.provenance, dict):
            raise ValueError(f"provenance must be a dict, got {type(self.provenance).__name__}")


# ---- counters -------------------------------------------------------------------------------------

_lock = threading.Lock()
_counts = {"calls": 0, "tokens": 0}
_fallbacks: collections.Counter = collections.Counter()
_backends: collections.Counter = collections.Counter()
_modes: collections.Counter = collections.Counter()
_last = {"backend_id": None}
_audit = routes.AuditLog()


def _count(mode: str, tokens: int, backend_id: str, reason: Optional[str]) -> None:
    with _lock:
        _counts["calls"] += 1
        _counts["tokens"] += tokens
        _modes[mode] += 1
        _backends[backend_id] += 1
        _last["backend_id"] = backend_id
        if reason is not None:
            _fallbacks[reason] += 1


def stats() -> dict:
    """The numbers an RL framework logs per step: calls, tokens, fallbacks by reason (fallback_total
    = 0 proves every result came from our kernels), calls per backend id and per mode, the last
    backend id, and the audit summary (|dlogp| mean/max/p99, mismatch and bitwise-equal counts)."""
    with _lock:
        out = {"calls": _counts["calls"], "tokens": _counts["tokens"], "fallbacks": dict(_fallbacks),
               "fallback_total": sum(_fallbacks.values()), "backend_ids": dict(_backends), "modes": dict(_modes),
               "backend_id": _last["backend_id"]}
    out["audit"] = _audit.summary()
    return out


def reset_stats() -> None:
    with _lock:
        _counts.update(calls=0, tokens=0)
        _fallbacks.clear()
        _backends.clear()
        _modes.clear()
        _last["backend_id"] = None
    _audit.reset()


route_stats, reset_route_stats = stats, reset_stats


# ---- availability, the two routes -----------------------------------------------------------------

def unavailable_reason(request: LinearLogpRequest) -> Optional[str]:
    """Why our provider cannot serve this request (auto then falls back to native), or None."""
    c = request.context
    if c is None:
        return "no context"
    why = unsupported(c.hidden)
    if why is not None:
        return why
    vp = c.vocab_partition
    if request.chunk_size is not None:
        ours = chunk_of(vp.padded_size, vp.local_size)
        if request.chunk_size != ours:
            return f"chunk_size {request.chunk_size} (our kernels use the canonical chunk {ours})"
    return None


def is_available(request: LinearLogpRequest) -> bool:
    return unavailable_reason(request) is None


def _targets(request: LinearLogpRequest) -> torch.Tensor:
    t = request.target_ids
    if request.log_prob_keep_mask is not None:
        t = torch.where(request.log_prob_keep_mask, t, torch.full_like(t, IGNORE_INDEX))
    return t


def _temperature(request: LinearLogpRequest):
    temp = request.temperature
    if temp is None:
        return 1.0
    if isinstance(temp, torch.Tensor):
        return temp.to(F32).expand(request.num_tokens)
    return float(temp)


def _reduce_grad_hidden(request: LinearLogpRequest) -> bool:
    return bool(request.metadata.get("reduce_grad_hidden", True))


def _finish(request, logp, ent):
    if ent is not None and not request.with_entropy_grad:
        ent = ent.detach()
    return logp.reshape(-1, 1), (ent.reshape(-1) if request.with_entropy else None)


def _ours(request: LinearLogpRequest):
    c = request.context
    vp = c.vocab_partition
    H = c.hidden.shape[-1]
    group = request.tensor_parallel_group
    out = linear_logp(c.hidden.reshape(request.num_tokens, H), c.projection.weight, _targets(request),
                      bias=c.projection.bias, temperature=_temperature(request), ignore_index=IGNORE_INDEX,
                      return_entropy=request.with_entropy, vocab_start=vp.local_start if group is not None else None,
                      real_vocab_size=vp.real_size, tp_group=group, mode="strict",
                      reduce_grad_hidden=_reduce_grad_hidden(request),
                      validate_targets=bool(request.metadata.get("validate_targets", True)),
                      backward=request.backward)
    logp, ent = out if request.with_entropy else (out, None)
    return _finish(request, logp, ent)


def _native(request: LinearLogpRequest):
    """log_softmax + gather over materialized logits: request.logits, else hidden @ W^T (+ b)."""
    group = request.tensor_parallel_group
    tp, rank = 1, 0
    if group is not None:
        import torch.distributed as dist
        tp, rank = dist.get_world_size(group), dist.get_rank(group)
    c = request.context
    temp = _temperature(request)
    if isinstance(temp, torch.Tensor):
        temp = _dist.copy_to(temp, group)
    else:
        temp = torch.full((request.num_tokens,), temp, dtype=F32, device=request.target_ids.device)
    if request.logits is not None:
        logits = request.logits
    else:
        h = c.hidden.reshape(request.num_tokens, c.hidden.shape[-1])
        if _reduce_grad_hidden(request):
            h = _dist.copy_to(h, group)
        logits = h.to(F32) @ c.projection.weight.to(F32).T
        if c.projection.bias is not None:
            logits = logits + c.projection.bias.to(F32)
    v_local = logits.shape[1]
    if c is not None:
        start, real = c.vocab_partition.local_start, c.vocab_partition.real_size
    else:
        start, real = rank * v_local, tp * v_local
    logp, ent = reference.logits_rows(logits, _targets(request), temp, vocab_start=start, real_vocab=real,
                                      ignore_index=IGNORE_INDEX, tp_group=group, with_entropy=request.with_entropy)
    return _finish(request, logp, ent if request.with_entropy else None)


def _provenance(request, mode, route, reason, **extra):
    c = request.context
    group = request.tensor_parallel_group
    tp = 1
    if group is not None:
        import torch.distributed as dist
        tp = dist.get_world_size(group)
    p = {"mode": mode, "route": route, "fallback_reason": reason, "tp_size": tp,
         "token_layout": dataclasses.astuple(request.token_layout), "tokens": request.num_tokens,
         "with_entropy": request.with_entropy, "backward": request.backward, "metadata": dict(request.metadata)}
    if c is not None:
        vp = c.vocab_partition
        p.update(dtype=str(c.hidden.dtype).replace("torch.", ""), device=str(c.hidden.device),
                 vocab_partition=dataclasses.astuple(vp), chunk=chunk_of(vp.padded_size, vp.local_size))
    p.update(extra)
    return p


def _requires_grad(request: LinearLogpRequest) -> bool:
    c = request.context
    ts = [c.hidden, c.projection.weight, c.projection.bias]
    if isinstance(request.temperature, torch.Tensor):
        ts.append(request.temperature)
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in ts)


def _strict_checks(request: LinearLogpRequest, logp, ent, kernel: Optional[str]):
    T, dev = request.num_tokens, request.context.hidden.device
    if tuple(logp.shape) != (T, 1) or logp.dtype != F32 or logp.device != dev:
        raise RuntimeError(f"strict: malformed logp: shape {tuple(logp.shape)}, {logp.dtype} on {logp.device} "
                           f"(expected ({T}, 1) float32 on {dev})")
    if request.with_entropy and (ent is None or tuple(ent.shape) != (T,) or ent.dtype != F32 or ent.device != dev):
        raise RuntimeError(f"strict: malformed entropy: {None if ent is None else (tuple(ent.shape), ent.dtype)}")
    if _requires_grad(request):
        if not logp.requires_grad:
            raise RuntimeError("strict: logp is detached although the inputs require grad")
        if request.with_entropy_grad and not ent.requires_grad:
            raise RuntimeError("strict: entropy is detached although with_entropy_grad and the inputs require grad")
    if T and (kernel is None or not kernel.startswith(dev.type)):
        raise RuntimeError(f"strict: route mismatch: {dev.type} inputs but the kernels that ran were {kernel!r}")


def _kernel_ran(before: dict, after: dict) -> Optional[str]:
    ran = [name for name in after if after[name]["fwd_calls"] > before.get(name, {}).get("fwd_calls", 0)]
    return ran[0] if len(ran) == 1 else (",".join(ran) if ran else None)


def compute_linear_logp(request: LinearLogpRequest, mode: Optional[str] = None) -> LinearLogpResult:
    """Serve one request (see the module docstring for the modes). mode defaults to env RLK_MODE,
    else "auto"."""
    if not isinstance(request, LinearLogpRequest):
        raise ValueError(f"request must be a LinearLogpRequest, got {type(request).__name__}")
    mode = routes.resolve_mode(mode)
    T = request.num_tokens
    if mode == "off":
        logp, ent = _native(request)
        _count(mode, T, "native", None)
        return LinearLogpResult(logp, ent, "native", CONTRACT_ID, _provenance(request, mode, "native", None))
    reason = unavailable_reason(request)
    if reason is not None:
        if mode == "strict":
            raise ProviderUnavailable(f"compute_linear_logp(mode='strict'): the rlk provider is unavailable for this "
                                      f"request: {reason}")
        if request.logits is None and request.context is None:  # pragma: no cover - rejected by the request
            raise ValueError("no logits and no context")
        logp, ent = _native(request)
        _count(mode, T, "native", reason)
        return LinearLogpResult(logp, ent, "native", CONTRACT_ID, _provenance(request, mode, "native", reason))
    before = routes.backend_counts()
    logp, ent = _ours(request)  # an error in our kernels propagates: never a silent fallback
    kernel = _kernel_ran(before, routes.backend_counts())
    if mode == "strict":
        _strict_checks(request, logp, ent, kernel)
    backend_id = f"rlk.{kernel or request.context.hidden.device.type}"
    extra = {"kernel": kernel}
    if mode == "audit":
        with torch.no_grad():
            ref_logp, _ = _native(dataclasses.replace(request, with_entropy=False, with_entropy_grad=False))
        extra["audit"] = _audit.record(logp, ref_logp)
    _count(mode, T, backend_id, None)
    return LinearLogpResult(logp, ent, backend_id, CONTRACT_ID, _provenance(request, mode, "rlk", None, **extra))


__all__ = ["TokenLayout", "LinearProjection", "VocabPartition", "LinearLogpContext", "LinearLogpRequest",
           "LinearLogpResult", "compute_linear_logp", "unavailable_reason", "is_available", "ProviderUnavailable",
           "stats", "reset_stats", "route_stats", "reset_route_stats", "CONTRACT_ID", "LAYOUTS", "MODES"]
