"""Modes (off / auto / strict / audit) and the observable route of every call.

The fused kernels count their own executions inside the compiled handlers; the reference path,
the fallbacks and the audit records are counted on the host when the program runs (through
jax.debug.callback), never at trace time.
"""
from __future__ import annotations

import collections
import threading

import jax
import numpy as np

from rlk_common import MODES, backend_counts as _backend_counts, resolve_mode  # noqa: F401

from ._core import core

_lock = threading.Lock()
_reference = {"calls": 0, "tokens": 0}
_fallbacks: collections.Counter = collections.Counter()
_AUDIT_ZERO = {"calls": 0, "rows": 0, "sum_abs_dlogp": 0.0, "max_abs_dlogp": 0.0, "unequal_rows": 0, "equal_rows": 0}
_audit = dict(_AUDIT_ZERO)


def count_reference(targets, reason: str | None) -> None:
    """At run time: one call of the reference path over the rows of `targets` (their number as it
    runs: under vmap the callback runs once per batch item, each counting its own rows, as the
    fused kernels count); `reason` is the fallback's, None for mode=off."""
    def record(t):
        with _lock:
            _reference["calls"] += 1
            _reference["tokens"] += int(np.size(t))
            if reason is not None:
                _fallbacks[reason] += 1
    jax.debug.callback(record, targets)


def record_audit(ours, ref) -> None:
    """At run time: compare the fused logp with the reference's, row by row."""
    def record(o, r):
        o, r = np.asarray(o, np.float32), np.asarray(r, np.float32)
        both_nan = np.isnan(o) & np.isnan(r)
        d = np.where(both_nan, 0.0, np.abs(o.astype(np.float64) - r))
        equal = (o.view(np.uint32) == r.view(np.uint32)) | both_nan
        with _lock:
            _audit["calls"] += 1
            _audit["rows"] += int(o.size)
            _audit["sum_abs_dlogp"] += float(np.nansum(d))
            _audit["max_abs_dlogp"] = max(_audit["max_abs_dlogp"], float(np.nanmax(d)) if d.size else 0.0)
            _audit["equal_rows"] += int(equal.sum())
            _audit["unequal_rows"] += int((~equal).sum())
    jax.debug.callback(record, ours, ref)


def route_stats() -> dict:
    """Counters since the last reset: fused calls/tokens per backend (forward and backward), the
    reference path's calls/tokens, fallbacks by reason, and the audit summary."""
    backends = _backend_counts(core)
    with _lock:
        audit = dict(_audit)
        audit["mean_abs_dlogp"] = audit["sum_abs_dlogp"] / audit["rows"] if audit["rows"] else 0.0
        return {"backends": backends, "reference": dict(_reference), "fallbacks": dict(_fallbacks),
                "fallback_total": sum(_fallbacks.values()), "audit": audit}


def reset_route_stats() -> None:
    core.reset_route_counts()
    with _lock:
        _reference.update(calls=0, tokens=0)
        _fallbacks.clear()
        _audit.update(_AUDIT_ZERO)
