"""Modes (off / auto / strict / audit) and the observable route of every call.

The fused kernels count their own executions inside the compiled module (per backend: calls and
tokens, forward and backward). The reference path, the fallbacks (by reason) and the audit records
are counted here, on the host, when an eager call runs (under torch.compile they are counted when
the call is traced, once per compilation).
"""
from __future__ import annotations

import collections
import os
import threading

import torch

from ._core import core

MODES = ("off", "auto", "strict", "audit")

_lock = threading.Lock()
_reference = {"calls": 0, "tokens": 0}
_fallbacks: collections.Counter = collections.Counter()
_last = {"backend_id": None}
_AUDIT_ZERO = {"calls": 0, "rows": 0, "sum_abs_dlogp": 0.0, "max_abs_dlogp": 0.0, "unequal_rows": 0,
               "equal_rows": 0}
_audit = dict(_AUDIT_ZERO)
_audit_window: collections.deque = collections.deque()  # recent |dlogp| arrays, for the p99
_AUDIT_WINDOW_ROWS = 1 << 20
_audit_window_rows = [0]


def resolve_mode(mode: str | None) -> str:
    mode = mode if mode is not None else os.environ.get("RLK_MODE", "auto")
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r} (argument mode or env RLK_MODE)")
    return mode


def count_reference(tokens: int, reason: str | None) -> None:
    """One call of the reference path; `reason` is the fallback's, None for mode=off."""
    with _lock:
        _reference["calls"] += 1
        _reference["tokens"] += int(tokens)
        _last["backend_id"] = "reference"
        if reason is not None:
            _fallbacks[reason] += 1


def note_backend(backend_id: str) -> None:
    with _lock:
        _last["backend_id"] = backend_id


def audit_diff(ours: torch.Tensor, ref: torch.Tensor):
    """Row-wise |dlogp| (float64, NaN pairs count as 0) and bitwise-equal mask (both NaN = equal)."""
    o = ours.detach().reshape(-1).float().cpu()
    r = ref.detach().reshape(-1).float().cpu()
    both_nan = torch.isnan(o) & torch.isnan(r)
    d = torch.where(both_nan, torch.zeros((), dtype=torch.float64), (o.double() - r.double()).abs())
    equal = (o.view(torch.int32) == r.view(torch.int32)) | both_nan
    return d, equal


def record_audit(ours: torch.Tensor, ref: torch.Tensor) -> dict:
    """Compare the fused logp with the reference's, row by row; returns this call's summary."""
    d, equal = audit_diff(ours, ref)
    finite = d[~torch.isnan(d)]
    call = {"rows": int(d.numel()), "max_abs_dlogp": float(finite.max()) if finite.numel() else 0.0,
            "mean_abs_dlogp": float(finite.mean()) if finite.numel() else 0.0,
            "equal_rows": int(equal.sum()), "unequal_rows": int((~equal).sum())}
    with _lock:
        _audit["calls"] += 1
        _audit["rows"] += call["rows"]
        _audit["sum_abs_dlogp"] += float(finite.sum()) if finite.numel() else 0.0
        _audit["max_abs_dlogp"] = max(_audit["max_abs_dlogp"], call["max_abs_dlogp"])
        _audit["equal_rows"] += call["equal_rows"]
        _audit["unequal_rows"] += call["unequal_rows"]
        _audit_window.append(finite)
        _audit_window_rows[0] += finite.numel()
        while _audit_window_rows[0] > _AUDIT_WINDOW_ROWS and len(_audit_window) > 1:
            _audit_window_rows[0] -= _audit_window.popleft().numel()
    return call


def _p99(window) -> float:
    vals = [x for x in window if x.numel()]
    if not vals:
        return 0.0
    return float(torch.quantile(torch.cat(vals)[-_AUDIT_WINDOW_ROWS:], 0.99))


def backend_counts() -> dict:
    return {name: dict(zip(("fwd_calls", "fwd_tokens", "bwd_calls", "bwd_tokens"), counts))
            for name, counts in core.route_counts().items()}


def route_stats() -> dict:
    """Counters since the last reset:
    - backends: fused kernel executions per backend (cpu, cuda_sm90, cuda_portable), counted in C++;
    - reference: calls/tokens of the reference path (mode off and fallbacks);
    - fallbacks: {reason: count}, fallback_total;
    - calls / tokens: all linear_logp forward calls (fused forward kernel calls + reference calls);
    - backend_id: the route of the last eager call ("cpu", "cuda", "reference");
    - audit: calls, rows, mean/max/p99 |dlogp|, equal_rows (bitwise), unequal_rows (mismatches).
    """
    backends = backend_counts()
    with _lock:
        audit = dict(_audit)
        audit["mean_abs_dlogp"] = audit["sum_abs_dlogp"] / audit["rows"] if audit["rows"] else 0.0
        audit["p99_abs_dlogp"] = _p99(list(_audit_window))
        audit["mismatch_count"] = audit["unequal_rows"]
        audit["bitwise_equal_count"] = audit["equal_rows"]
        fused_calls = sum(b["fwd_calls"] for b in backends.values())
        fused_tokens = sum(b["fwd_tokens"] for b in backends.values())
        return {"calls": fused_calls + _reference["calls"], "tokens": fused_tokens + _reference["tokens"],
                "backends": backends, "reference": dict(_reference), "fallbacks": dict(_fallbacks),
                "fallback_total": sum(_fallbacks.values()), "backend_id": _last["backend_id"], "audit": audit}


def reset_route_stats() -> None:
    core.reset_route_counts()
    with _lock:
        _reference.update(calls=0, tokens=0)
        _fallbacks.clear()
        _audit.update(_AUDIT_ZERO)
        _audit_window.clear()
        _audit_window_rows[0] = 0
        _last["backend_id"] = None
