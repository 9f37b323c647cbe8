"""The linear-logp provider for vime (a Megatron-core RL trainer), in vime's own ABI.

vime loads `torch_bridge.vime.provider` by its dotted path (--linear-logp-provider) and calls
provider(request) with its LinearLogpRequest. This module never imports vime: it reads the request's
attributes (target_ids, logits, context.hidden / .projection.weight, .bias / .vocab_partition,
tensor_parallel_group, token_layout (or context_parallel), with_entropy, with_entropy_grad,
chunk_size, log_prob_keep_mask, temperature, metadata) and returns a Result with the attributes
vime's validation reads (logp [T, 1] f32, entropy [T] f32 or None, backend_id, contract_id,
provenance).

Routes, chosen per request:
- "fused": the context (the output layer's input hidden [T, H], this rank's weight [V_local, H]
  and bias, the vocab partition) through our kernels; no logits. Used whenever the context is
  there and usable, also when the request carries the logits too (provenance says so). A top-p
  keep mask goes into the kernels (CPU and CUDA).
- "logits": the request's local logits through torch_bridge.logits (canonical-chunk statistics,
  no second projection). Used without a usable context.
- "reference": materialized fp32 logits and log_softmax (mode off, and audit's comparison).
Temperature, as vime means it: the request's logits are already divided by the rollout
temperature (metadata["logits_are_temperature_scaled"], default True; False: divided here), the
context route divides hidden @ W^T (+ b) by it once, in the kernels.
chunk_size: vime's token-row chunk (-1: none; k > 0: rows in chunks of k), which bounds the
[rows, V_local] fp32 temporaries of a logits path. The logits and reference routes run their rows in
such chunks; the fused route has no such temporaries and runs unchunked (chunks would only round
dW to the weight's dtype once per chunk). Every route is row independent: any row split gives the
same bits.

Modes (argument `mode`, else env RLK_MODE, else auto):
- off: the reference route.
- auto: fused or logits; when neither can serve the request, raises ProviderUnavailable, which
  carries vime's marker (linear_logp_provider_unavailable = True): vime's auto then runs its native
  path, vime's strict raises.
- strict: like auto, but unavailability raises StrictUnavailable (no marker: it fails in every vime
  mode), and the result is checked: rows, dtype and device against the request, entropy present
  when asked, attached to autograd when the inputs require grad, the kernel that ran on the
  request's device.
- audit: everything strict does, plus the reference on the same inputs: |dlogp| recorded
  (stats()["audit"]) and a row beyond AUDIT_MAX_ABS_DLOGP (or a NaN/inf pattern that differs)
  raises.
Every mode checks the result's rows and device against the request. The route, backend and
contract are logged once per change through logging.getLogger("rlk"), never per call.
A tensor temperature is never read on the host: the fused path is CUDA-graph capturable (modes
auto and strict; audit compares on the host).
"""
from __future__ import annotations

import dataclasses
import logging
import math
import threading
from typing import Any, Mapping, Optional

import numpy as np
import torch

from rlk_common.routes import RequestLog

from . import reference, routes
from ._args import chunk_of, unsupported
from ._core import core
from .linear_logp import linear_logp
from .logits import logp_from_logits

F32 = torch.float32
IGNORE_INDEX = -100
AUDIT_MAX_ABS_DLOGP = 1e-3  # audit: |ours - reference| on the same inputs (both fp32 statistics)
CONTRACT = "rlk.linear_logp/v2"

log = logging.getLogger("rlk")


class ProviderUnavailable(RuntimeError):
    """This provider cannot serve the request; vime's auto mode falls back to its native path."""
    linear_logp_provider_unavailable = True


class StrictUnavailable(RuntimeError):
    """mode=strict or audit: the provider cannot serve the request (no fallback marker)."""


@dataclasses.dataclass(frozen=True)
class Result:
    logp: torch.Tensor                 # [T, 1] f32
    entropy: Optional[torch.Tensor]    # [T] f32, or None when the request asked none
    backend_id: str
    contract_id: str
    provenance: Mapping[str, Any]


# ---- reading vime's request ----------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class _Req:
    """The request's fields, checked (ValueError naming the field for a malformed request)."""
    targets: torch.Tensor            # [T]
    logits: Optional[torch.Tensor]   # [T, V_local]
    hidden: Optional[torch.Tensor]   # [T, H]
    weight: Optional[torch.Tensor]
    bias: Optional[torch.Tensor]
    partition: Any                   # (local_start, local_size, real_size, padded_size) or None
    group: Any                       # None when TP = 1
    tp: int
    tp_rank: int
    cp: tuple                        # (layout, world_size, rank)
    with_entropy: bool
    with_entropy_grad: bool
    row_chunk: int                   # 0: none
    keep: Optional[torch.Tensor]     # [T, V_local] bool
    temperature: Any                 # float or [T] f32 tensor
    logits_scaled: bool
    real_vocab: Optional[int]        # for the logits route without a context (metadata)

    @property
    def n(self) -> int:
        return self.targets.shape[0]

    @property
    def device(self) -> torch.device:
        return self.targets.device


def _tensor_or_none(x, name):
    if x is not None and not isinstance(x, torch.Tensor):
        raise ValueError(f"request.{name} must be a torch.Tensor or None, got {type(x).__name__}")
    return x


def _cp_layout(request) -> tuple:
    layout = getattr(request, "token_layout", None) or getattr(request, "context_parallel", None)
    if layout is None:
        return ("single", 1, 0)
    return (str(layout.layout), int(layout.world_size), int(layout.rank))


def _group(request):
    group = getattr(request, "tensor_parallel_group", None)
    if group is None:
        return None, 1, 0
    import torch.distributed as dist
    tp = dist.get_world_size(group)
    return (group if tp > 1 else None), tp, dist.get_rank(group)


def _temperature(t, n: int, device):
    if t is None:
        return 1.0
    if isinstance(t, torch.Tensor):
        if t.numel() not in (1, n):
            raise ValueError(f"request.temperature must be a number, or a tensor of 1 or T = {n} elements, "
                             f"got shape {tuple(t.shape)}")
        if t.device != device:
            raise ValueError(f"request.temperature is on {t.device} but target_ids is on {device}")
        return t.reshape(-1).to(F32).expand(n)
    t = float(t)
    if not 0.0 < t < math.inf:
        raise ValueError(f"request.temperature must be finite and > 0, got {t}")
    return t


def _read(request) -> _Req:
    targets = _tensor_or_none(getattr(request, "target_ids", None), "target_ids")
    if targets is None or targets.dim() != 1 or targets.dtype.is_floating_point or targets.dtype == torch.bool:
        raise ValueError(f"request.target_ids must be [T] integer ids, got "
                         f"{None if targets is None else (tuple(targets.shape), targets.dtype)}")
    n, dev = targets.shape[0], targets.device
    logits = _tensor_or_none(getattr(request, "logits", None), "logits")
    if logits is not None and (logits.dim() != 2 or logits.shape[0] != n or logits.device != dev):
        raise ValueError(f"request.logits must be [T = {n}, V_local] on {dev}, got {tuple(logits.shape)} on "
                         f"{logits.device}")
    ctx = getattr(request, "context", None)
    hidden = weight = bias = partition = None
    if ctx is not None:
        hidden, proj, vp = ctx.hidden, ctx.projection, ctx.vocab_partition
        weight, bias = proj.weight, getattr(proj, "bias", None)
        if hidden.dim() != 2 or hidden.shape[0] != n or hidden.device != dev:
            raise ValueError(f"request.context.hidden must be [T = {n}, H] on {dev}, got {tuple(hidden.shape)} on "
                             f"{hidden.device}")
        partition = (int(vp.local_start), int(vp.local_size), int(vp.real_size), int(vp.padded_size))
        for name, rows in (("context.projection.weight", weight.shape[0]),
                           ("logits", None if logits is None else logits.shape[1])):
            if rows is not None and rows != partition[1]:
                raise ValueError(f"request.{name} has {rows} vocab entries, context.vocab_partition.local_size is "
                                 f"{partition[1]}")
    if logits is None and ctx is None:
        raise ValueError("request has neither logits nor context")
    v_local = logits.shape[1] if logits is not None else weight.shape[0]
    keep = _tensor_or_none(getattr(request, "log_prob_keep_mask", None), "log_prob_keep_mask")
    if keep is not None and (tuple(keep.shape) != (n, v_local) or keep.dtype != torch.bool or keep.device != dev):
        raise ValueError(f"request.log_prob_keep_mask must be [T, V_local] = ({n}, {v_local}) bool on {dev}, got "
                         f"{tuple(keep.shape)} {keep.dtype} on {keep.device}")
    chunk = getattr(request, "chunk_size", -1)
    chunk = -1 if chunk is None else chunk
    if isinstance(chunk, bool) or not isinstance(chunk, int) or not (chunk == -1 or chunk > 0):
        raise ValueError(f"request.chunk_size must be -1 (no row chunking) or a positive row count, got {chunk!r}")
    with_entropy = bool(getattr(request, "with_entropy", False))
    meta = getattr(request, "metadata", None) or {}
    group, tp, tp_rank = _group(request)
    real = meta.get("real_vocab_size")
    return _Req(targets=targets, logits=logits, hidden=hidden, weight=weight, bias=bias, partition=partition,
                group=group, tp=tp, tp_rank=tp_rank, cp=_cp_layout(request), with_entropy=with_entropy,
                with_entropy_grad=with_entropy and bool(getattr(request, "with_entropy_grad", False)),
                row_chunk=max(chunk, 0), keep=keep, temperature=_temperature(getattr(request, "temperature", None),
                                                                             n, dev),
                logits_scaled=bool(meta.get("logits_are_temperature_scaled", True)),
                real_vocab=None if real is None else int(real))


# ---- routes --------------------------------------------------------------------------------------

def _fused_unavailable(r: _Req) -> Optional[str]:
    if r.hidden is None:
        return "no context"
    why = unsupported(r.hidden)
    if why is not None:
        return why
    if r.weight.dtype != r.hidden.dtype:
        return f"context weight dtype {r.weight.dtype} differs from hidden dtype {r.hidden.dtype}"
    return _partition_unsupported(r)


def _partition_unsupported(r: _Req) -> Optional[str]:
    """Both routes take rank r's equal contiguous shard of the padded vocab (as Megatron's)."""
    if r.partition is None:
        return None
    start, size, _, padded = r.partition
    if start != r.tp_rank * size or padded != r.tp * size:
        return (f"vocab partition {r.partition} is not the equal contiguous shard of rank {r.tp_rank} of {r.tp} "
                f"(local_start = rank * local_size, padded_size = TP * local_size)")
    return None


def _logits_unavailable(r: _Req) -> Optional[str]:
    if r.logits is None:
        return "no logits"
    if not r.logits.dtype.is_floating_point:
        return f"logits dtype {r.logits.dtype}"
    return unsupported(r.logits.new_empty((0,), dtype=F32)) or _partition_unsupported(r)


def _route(r: _Req) -> tuple:
    """(route, why this route) or (None, why none can serve)."""
    fused = _fused_unavailable(r)
    if fused is None:
        return "fused", "context" + (" (the request's logits are not used)" if r.logits is not None else "")
    logits = _logits_unavailable(r)
    if logits is None:
        return "logits", f"local logits (fused route: {fused})"
    return None, f"fused route: {fused}; logits route: {logits}"


def _temp_rows(r: _Req, sl: slice):
    return r.temperature[sl] if isinstance(r.temperature, torch.Tensor) else r.temperature


def _vocab(r: _Req) -> tuple:
    """(vocab_start, real vocab, padded vocab) of this rank."""
    if r.partition is not None:
        start, _, real, padded = r.partition
        return start, real, padded
    v_local = r.logits.shape[1]
    padded = v_local * r.tp
    return r.tp_rank * v_local, (padded if r.real_vocab is None else r.real_vocab), padded


def _scaled_logits(r: _Req, sl: slice) -> torch.Tensor:
    z = r.logits[sl].to(F32)
    if r.logits_scaled:
        return z
    t = _temp_rows(r, sl)
    return z / (t[:, None] if isinstance(t, torch.Tensor) else t)


def _fused(r: _Req, sl: slice):
    start, real, _ = _vocab(r)
    out = linear_logp(r.hidden[sl], r.weight, r.targets[sl], bias=r.bias, temperature=_temp_rows(r, sl),
                      ignore_index=IGNORE_INDEX, return_entropy=r.with_entropy,
                      vocab_start=start if r.group is not None else None, real_vocab_size=real, tp_group=r.group,
                      mode="strict", keep_mask=None if r.keep is None else r.keep[sl])
    return out if r.with_entropy else (out, None)


def _from_logits(r: _Req, sl: slice):
    start, real, _ = _vocab(r)
    return logp_from_logits(_scaled_logits(r, sl), r.targets[sl], keep_mask=None if r.keep is None else r.keep[sl],
                            vocab_start=start, real_vocab=real, tp_group=r.group, with_entropy=r.with_entropy,
                            ignore_index=IGNORE_INDEX)


def _reference(r: _Req, sl: slice, with_entropy: bool, source: str):
    """Materialized fp32 logits (the request's, or hidden @ W^T (+ b) / T) and log_softmax; the
    nucleus-renormalized logp under a keep mask, the unmasked entropy."""
    start, real, _ = _vocab(r)
    n = r.targets[sl].shape[0]
    if source == "logits":
        z = _scaled_logits(r, sl)
    else:
        from . import _dist
        h = _dist.copy_to(r.hidden[sl], r.group)
        z = h.to(F32) @ r.weight.to(F32).T
        if r.bias is not None:
            z = z + r.bias.to(F32)
        t = _temp_rows(r, sl)
        z = z / (_dist.copy_to(t, r.group)[:, None] if isinstance(t, torch.Tensor) else t)
    kw = dict(vocab_start=start, real_vocab=real, ignore_index=IGNORE_INDEX, tp_group=r.group)
    one = torch.ones((n,), dtype=F32, device=z.device)
    logp, ent = reference.logits_rows(z, r.targets[sl], one, with_entropy=with_entropy, **kw)
    if r.keep is not None:
        logp, _ = reference.logits_rows(z.masked_fill(~r.keep[sl], float("-inf")), r.targets[sl], one, **kw)
    return logp, (ent if with_entropy else None)


def _run(r: _Req, step, chunked: bool = True):
    """step(slice) over the row chunks (chunked), concatenated: (logp [T], entropy [T] or None)."""
    if not chunked or not r.row_chunk or r.n <= r.row_chunk:
        return step(slice(None))
    parts = [step(slice(i, i + r.row_chunk)) for i in range(0, r.n, r.row_chunk)]
    logp = torch.cat([p[0] for p in parts])
    return logp, (torch.cat([p[1] for p in parts]) if parts[0][1] is not None else None)


# ---- checks, identity, counters ------------------------------------------------------------------

def _inputs_require_grad(r: _Req, route: str) -> bool:
    ts = [r.logits] if route == "logits" else [r.hidden, r.weight, r.bias]
    if isinstance(r.temperature, torch.Tensor) and not (route == "logits" and r.logits_scaled):
        ts.append(r.temperature)
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in ts)


def _check_rows(r: _Req, logp, ent) -> None:
    """Every mode: the result's rows and device are the request's."""
    if tuple(logp.shape) != (r.n, 1) or logp.device != r.device:
        raise RuntimeError(f"torch_bridge.vime: logp is {tuple(logp.shape)} on {logp.device}, the request has "
                           f"{r.n} rows on {r.device}")
    if ent is not None and (tuple(ent.shape) != (r.n,) or ent.device != r.device):
        raise RuntimeError(f"torch_bridge.vime: entropy is {tuple(ent.shape)} on {ent.device}, the request has "
                           f"{r.n} rows on {r.device}")


def _check_strict(r: _Req, route: str, kernel: Optional[str], logp, ent) -> None:
    if logp.dtype != F32 or (ent is not None and ent.dtype != F32):
        raise RuntimeError(f"strict: logp/entropy must be float32, got {logp.dtype}/{None if ent is None else ent.dtype}")
    if r.with_entropy and ent is None:
        raise RuntimeError("strict: the request asked for entropy and none was computed")
    if _inputs_require_grad(r, route):
        if not logp.requires_grad:
            raise RuntimeError("strict: logp is detached although the inputs require grad")
        if r.with_entropy_grad and not ent.requires_grad:
            raise RuntimeError("strict: entropy is detached although with_entropy_grad and the inputs require grad")
    if route == "fused" and r.n and (kernel is None or not kernel.startswith(r.device.type)):
        raise RuntimeError(f"strict: route mismatch: {r.device.type} inputs but the kernels that ran were {kernel!r}")


def _kernel_ran(before: dict, after: dict) -> Optional[str]:
    ran = [k for k in after if after[k]["fwd_calls"] > before.get(k, {}).get("fwd_calls", 0)]
    return ",".join(ran) if ran else None


def _source(r: _Req, route: str) -> str:
    """What a route reads: "logits" (the request's) or "context"."""
    if route == "reference":
        return "logits" if r.logits is not None else "context"
    return "logits" if route == "logits" else "context"


def _dtype(t: Optional[torch.Tensor]) -> str:
    return "none" if t is None else str(t.dtype).replace("torch.", "")


def contract_id(r: _Req, route: str, kernel: Optional[str]) -> str:
    """The numeric contract of a request on a route: what fixes its bits (TP size, CP layout,
    vocab partition and canonical chunk, input dtype, temperature source, nucleus, kernel)."""
    _, real, padded = _vocab(r)
    v_local = padded // r.tp
    src = r.logits if _source(r, route) == "logits" else r.hidden
    layout, cp, _ = r.cp
    temp = "context" if _source(r, route) == "context" else ("prescaled" if r.logits_scaled else "divided")
    return (f"{CONTRACT};route={route};kernel={kernel or route};dtype={_dtype(src)};tp={r.tp};cp={layout}x{cp};"
            f"vocab={real}/{padded};shard={v_local};chunk={chunk_of(padded, v_local)};temperature={temp};"
            f"topp={'mask' if r.keep is not None else 'none'}")


def _provenance(r: _Req, mode: str, route: str, why: str, kernel, **extra) -> dict:
    start, real, padded = _vocab(r)
    layout, cp, cp_rank = r.cp
    p = {"mode": mode, "route": route, "route_reason": why, "kernel": kernel, "tp_rank": r.tp_rank, "tp_size": r.tp,
         "cp_rank": cp_rank, "cp_size": cp, "cp_layout": layout, "tokens": r.n,
         "row_chunk": r.row_chunk if r.row_chunk and route != "fused" else None,
         "vocab_start": start, "real_vocab": real, "padded_vocab": padded, "device": str(r.device),
         "logits_used": _source(r, route) == "logits",
         "temperature": "tensor" if isinstance(r.temperature, torch.Tensor) else r.temperature,
         "logits_are_temperature_scaled": r.logits_scaled, "with_entropy": r.with_entropy,
         "with_entropy_grad": r.with_entropy_grad, "top_p_mask": r.keep is not None}
    p.update(extra)
    return p


_log = RequestLog()
_lock = threading.Lock()
_logged: set = set()


def _note(mode: str, tokens: int, backend_id: Optional[str], contract: Optional[str], reason: Optional[str]) -> None:
    """Count one request (served as backend_id, or not for `reason`) and log each new combination once."""
    if reason is not None:
        _log.count_fallback(reason)
    _log.count_request(mode, tokens, backend_id)
    with _lock:
        key = (mode, backend_id, contract, reason)
        new = key not in _logged
        _logged.add(key)
    if new and reason is not None:
        log.warning("rlk vime provider unavailable (mode=%s): %s", mode, reason)
    elif new:
        log.info("rlk vime provider route: mode=%s backend_id=%s contract_id=%s", mode, backend_id, contract)


def stats() -> dict:
    """What to log per step, since the last reset: the frontends' route statistics schema
    (rlk_common.routes.RouteLog.stats) with the provider's extra keys requests, backend_ids and
    modes. fallbacks / fallback_total: the requests none of our routes served (vime's auto ran its
    native path for them); reference: mode off's requests; audit: the audit mode's comparisons."""
    return _log.stats(core)


def reset_stats() -> None:
    """Zero the counters, the compiled module's too (as reset_route_stats does). The log lines
    are not repeated after a reset: a combination is logged once per process."""
    _log.reset(core)


def _audit_compare(r: _Req, route: str, logp: torch.Tensor) -> dict:
    with torch.no_grad():
        ref, _ = _run(r, lambda sl: _reference(r, sl, False, _source(r, route)))
    d, equal = routes.audit_diff(logp, ref)
    call = _log.audit.record(d, equal)
    bad = np.flatnonzero(~equal & ~(d <= AUDIT_MAX_ABS_DLOGP))
    if bad.size:
        i = int(bad[0])
        o, x = logp.detach().reshape(-1), ref.reshape(-1)
        raise RuntimeError(f"audit: row {i}: logp {float(o[i])} vs the reference's {float(x[i])} "
                           f"(|dlogp| above {AUDIT_MAX_ABS_DLOGP}; {bad.size} rows in all)")
    return call


# ---- the provider --------------------------------------------------------------------------------

def provider(request, mode: Optional[str] = None) -> Result:
    """Serve one vime LinearLogpRequest (see the module docstring). mode: argument, else env
    RLK_MODE, else "auto"."""
    mode = routes.resolve_mode(mode)
    r = _read(request)
    if mode == "off":
        route, why = "reference", "mode off"
        logp, ent = _run(r, lambda sl: _reference(r, sl, r.with_entropy, _source(r, route)))
        _log.count_reference(r.n, None)
        kernel, extra = None, {}
    else:
        route, why = _route(r)
        if route is None:
            _note(mode, r.n, None, None, why)
            if mode == "auto":
                raise ProviderUnavailable(f"torch_bridge.vime: unavailable for this request: {why}")
            raise StrictUnavailable(f"torch_bridge.vime (mode={mode}): cannot serve this request: {why}")
        before = routes.backend_counts()
        logp, ent = _run(r, lambda sl: (_fused if route == "fused" else _from_logits)(r, sl), route == "logits")
        kernel = _kernel_ran(before, routes.backend_counts()) if route == "fused" else r.device.type
        extra = {}
    if ent is not None and not r.with_entropy_grad:
        ent = ent.detach()
    logp = logp.reshape(-1, 1)
    _check_rows(r, logp, ent)
    if mode in ("strict", "audit"):
        _check_strict(r, route, kernel, logp, ent)
    if mode == "audit":
        extra["audit"] = _audit_compare(r, route, logp)
    backend_id = f"rlk.{route}.{kernel or r.device.type}"
    contract = contract_id(r, route, kernel)
    _note(mode, r.n, backend_id, contract, None)
    return Result(logp, ent, backend_id, contract, _provenance(r, mode, route, why, kernel, **extra))


__all__ = ["provider", "Result", "ProviderUnavailable", "StrictUnavailable", "stats", "reset_stats", "contract_id",
           "AUDIT_MAX_ABS_DLOGP", "IGNORE_INDEX"]
