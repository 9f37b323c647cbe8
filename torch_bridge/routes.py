"""Modes (off / auto / strict / audit) and the observable route of every call: the torch glue of
rlk_common.routes (the log, its schema and the audit rules live there).

The fused kernels count their own executions inside the compiled module (per backend: calls and
tokens, forward and backward). The reference path, the fallbacks (by reason) and the audit records
are counted here, on the host, whenever a call runs, eager or compiled (through the op
rlk::count_reference); the audit only in eager calls (mode="audit" is refused inside torch.compile).
"""
from __future__ import annotations

import numpy as np
import torch

from rlk_common import MODES, backend_counts as _backend_counts, resolve_mode  # noqa: F401
from rlk_common import routes as _common
from rlk_common.routes import RouteLog

from ._core import core

_log = RouteLog()


@torch.library.custom_op("rlk::count_reference", mutates_args=())
def _count_reference(targets: torch.Tensor, reason: str) -> torch.Tensor:
    """Counts one reference call of targets.numel() rows when it runs, and passes the targets on (a
    copy: an op's output may not alias its input). An op, not Python, so that a compiled graph
    counts every run, not its trace; its output feeds the reference, so no compiler drops it."""
    _log.count_reference(targets.numel(), reason)
    _log.note_backend("reference")
    return targets.clone()


@_count_reference.register_fake
def _(targets, reason):
    return torch.empty_like(targets)


def count_reference(targets: torch.Tensor, reason: str | None) -> torch.Tensor:
    """One call of the reference path over these rows, counted when it runs (eager or compiled);
    `reason` is the fallback's, None for mode=off. Returns the targets for the reference to use."""
    return _count_reference(targets, reason or "")


@torch.library.custom_op("rlk::refuse_audit", mutates_args=())
def _refuse_audit(targets: torch.Tensor, caller: str) -> torch.Tensor:
    """mode="audit" inside torch.compile: the RuntimeError, raised when the compiled code runs. (A
    raise while dynamo traces reaches the caller as dynamo's "Observed exception" under
    fullgraph=True, and otherwise makes dynamo rerun the frame eagerly, where nothing refuses.)"""
    raise RuntimeError(_common.audit_in_compile(caller))


@_refuse_audit.register_fake
def _(targets, caller):
    return torch.empty_like(targets)


def refuse_audit(targets: torch.Tensor, caller: str) -> torch.Tensor:
    """The targets through an op that raises audit's RuntimeError when the compiled code runs
    (before any kernel that reads them)."""
    return _refuse_audit(targets, caller)


def note_backend(backend_id: str) -> None:
    _log.note_backend(backend_id)


def _host(x: torch.Tensor) -> np.ndarray:
    return x.detach().reshape(-1).float().cpu().numpy()


def audit_diff(ours: torch.Tensor, ref: torch.Tensor) -> tuple[np.ndarray, np.ndarray]:
    """rlk_common.routes.audit_diff of two logp tensors, copied to the host (a sync: eager only)."""
    return _common.audit_diff(_host(ours), _host(ref))


def record_audit(ours: torch.Tensor, ref: torch.Tensor) -> dict:
    """Compare the fused logp with the reference's, row by row; returns this call's figures."""
    return _log.record_audit(_host(ours), _host(ref))


def backend_counts() -> dict:
    return _backend_counts(core)


def route_stats() -> dict:
    """This frontend's counters since the last reset, in rlk_common.routes.RouteLog.stats's schema;
    the kernels' counters are the process's, shared with rlk_xla."""
    return _log.stats(core)


def reset_route_stats() -> None:
    """RouteLog.reset: this frontend's log and the process's kernel counters (rlk_xla's too)."""
    _log.reset(core)
