"""Modes (off / auto / strict / audit) and the observable route of every call.

The fused kernels count their own executions inside the compiled module (per backend: calls and
tokens, forward and backward). The reference path, the fallbacks (by reason) and the audit records
are counted here, on the host, whenever a call runs, eager or compiled (through the op
rlk::count_reference); the audit only in eager calls (mode="audit" is refused inside torch.compile).
"""
from __future__ import annotations

import collections
import threading

import torch

from rlk_common import MODES, backend_counts as _backend_counts, resolve_mode  # noqa: F401

from ._core import core

_lock = threading.Lock()
_reference = {"calls": 0, "tokens": 0}
_fallbacks: collections.Counter = collections.Counter()
_last = {"backend_id": None}


class AuditLog:
    """Running comparison of fused vs reference logp: calls, rows, sum/max |dlogp|, bitwise-equal
    rows and mismatching rows, and a window of the most recent |dlogp| values for the p99."""
    WINDOW = 1 << 20

    def __init__(self):
        self._lock = threading.Lock()
        self.reset()

    def reset(self):
        with self._lock:
            self.calls = self.rows = self.equal_rows = self.unequal_rows = 0
            self.sum_abs = self.max_abs = 0.0
            self._window: collections.deque = collections.deque()
            self._window_rows = 0

    def record(self, ours: torch.Tensor, ref: torch.Tensor) -> dict:
        d, equal = audit_diff(ours, ref)
        finite = d[~torch.isnan(d)]
        call = {"rows": int(d.numel()), "max_abs_dlogp": float(finite.max()) if finite.numel() else 0.0,
                "mean_abs_dlogp": float(finite.mean()) if finite.numel() else 0.0,
                "p99_abs_dlogp": float(torch.quantile(finite, 0.99)) if finite.numel() else 0.0,
                "bitwise_equal_count": int(equal.sum()), "mismatch_count": int((~equal).sum())}
        with self._lock:
            self.calls += 1
            self.rows += call["rows"]
            self.sum_abs += float(finite.sum()) if finite.numel() else 0.0
            self.max_abs = max(self.max_abs, call["max_abs_dlogp"])
            self.equal_rows += call["bitwise_equal_count"]
            self.unequal_rows += call["mismatch_count"]
            if finite.numel():
                self._window.append(finite)
                self._window_rows += finite.numel()
            while self._window_rows > self.WINDOW and len(self._window) > 1:
                self._window_rows -= self._window.popleft().numel()
        return call

    def summary(self) -> dict:
        with self._lock:
            window = list(self._window)
            out = {"calls": self.calls, "rows": self.rows, "sum_abs_dlogp": self.sum_abs,
                   "max_abs_dlogp": self.max_abs, "mean_abs_dlogp": self.sum_abs / self.rows if self.rows else 0.0,
                   "equal_rows": self.equal_rows, "unequal_rows": self.unequal_rows,
                   "bitwise_equal_count": self.equal_rows, "mismatch_count": self.unequal_rows}
        out["p99_abs_dlogp"] = float(torch.quantile(torch.cat(window)[-self.WINDOW:], 0.99)) if window else 0.0
        return out


_audit = AuditLog()


def _record_reference(tokens: int, reason: str) -> None:
    with _lock:
        _reference["calls"] += 1
        _reference["tokens"] += int(tokens)
        _last["backend_id"] = "reference"
        if reason:
            _fallbacks[reason] += 1


@torch.library.custom_op("rlk::count_reference", mutates_args=())
def _count_reference(targets: torch.Tensor, reason: str) -> torch.Tensor:
    """Counts one reference call of targets.numel() rows when it runs, and passes the targets on (a
    copy: an op's output may not alias its input). An op, not Python, so that a compiled graph
    counts every run, not its trace; its output feeds the reference, so no compiler drops it."""
    _record_reference(targets.numel(), reason)
    return targets.clone()


@_count_reference.register_fake
def _(targets, reason):
    return torch.empty_like(targets)


def count_reference(targets: torch.Tensor, reason: str | None) -> torch.Tensor:
    """One call of the reference path over these rows, counted when it runs (eager or compiled);
    `reason` is the fallback's, None for mode=off. Returns the targets for the reference to use."""
    return _count_reference(targets, reason or "")


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
    return _audit.record(ours, ref)


def backend_counts() -> dict:
    return _backend_counts(core)


def route_stats() -> dict:
    """Counters since the last reset:
    - backends: fused kernel executions per backend (cpu, cuda_sm90, cuda_portable, ...), counted in
      C++: fwd_calls, fwd_tokens, bwd_calls, bwd_tokens and bwd_fast_calls (backwards that read
      kept logits, backward="fast");
    - reference: calls/tokens of the reference path (mode off and fallbacks);
    - fallbacks: {reason: count}, fallback_total;
    - calls / tokens: all linear_logp forward calls (fused forward kernel calls + reference calls);
    - backend_id: the route of the last eager call ("cpu", "cuda", "reference");
    - audit: calls, rows, mean/max/p99 |dlogp|, equal_rows (bitwise), unequal_rows (mismatches).
    """
    backends = backend_counts()
    with _lock:
        audit = _audit.summary()
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
        _last["backend_id"] = None
    _audit.reset()
