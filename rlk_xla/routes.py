"""Modes (off / auto / strict / audit) and the observable route of every call: the JAX glue of
rlk_common.routes (the log, its schema and the audit rules live there).

The fused kernels count their own executions inside the compiled handlers; the reference path,
the fallbacks and the audit records are counted on the host when the program runs (through
jax.debug.callback), never at trace time. JAX has no eager route to note: backend_id stays None.
"""
from __future__ import annotations

import jax
import numpy as np

from rlk_common import MODES, resolve_mode  # noqa: F401
from rlk_common.routes import RouteLog

from ._core import core

_log = RouteLog()


def count_reference(targets, reason: str | None) -> None:
    """At run time: one call of the reference path over the rows of `targets` (their number as it
    runs: under vmap the callback runs once per batch item, each counting its own rows, as the
    fused kernels count); `reason` is the fallback's, None for mode=off."""
    jax.debug.callback(lambda t: _log.count_reference(np.size(t), reason), targets)


def record_audit(ours, ref) -> None:
    """At run time: compare the fused logp with the reference's, row by row."""
    jax.debug.callback(lambda o, r: _log.record_audit(np.asarray(o), np.asarray(r)), ours, ref)


def route_stats() -> dict:
    """This frontend's counters since the last reset, in rlk_common.routes.RouteLog.stats's schema;
    the kernels' counters are the process's, shared with torch_bridge."""
    return _log.stats(core)


def reset_route_stats() -> None:
    """RouteLog.reset: this frontend's log and the process's kernel counters (torch_bridge's too)."""
    _log.reset(core)
