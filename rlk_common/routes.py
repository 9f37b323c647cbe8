"""The route log, once for both frontends and the vime provider: reference calls and tokens,
fallbacks by reason, the route of the last eager call, and the audit of fused against reference
logp; with the compiled module's per-backend counters, one schema (RouteLog.stats; the provider's
RequestLog adds its requests as extra keys of it).

numpy only: a frontend copies its arrays to the host and calls in when a call runs (JAX from a
jax.debug.callback, torch from the op rlk::count_reference and eager code), never at trace time.
"""
from __future__ import annotations

import collections
import threading

import numpy as np

# The compiled module's counters per backend, in the order core.route_counts() gives them
# (ffi/module.cc, from rlk::RouteCounts).
COUNT_NAMES = ("fwd_calls", "fwd_tokens", "bwd_calls", "bwd_tokens", "bwd_fast_calls")


def audit_in_compile(caller: str) -> str:
    """The RuntimeError's message for mode="audit" inside torch.compile: the audit compares on the
    host, which a compiled graph cannot."""
    return (f"{caller}(mode='audit') compares with the reference on the host and cannot run inside "
            f"torch.compile: pass mode='auto' (or 'strict') in compiled code and audit in an eager call")


def backend_counts(core) -> dict:
    """The compiled module's route counters, {backend: {count name: value}}."""
    return {name: dict(zip(COUNT_NAMES, counts)) for name, counts in core.route_counts().items()}


def audit_diff(ours, ref) -> tuple[np.ndarray, np.ndarray]:
    """Row-wise |dlogp| of two logp arrays taken as fp32 (float64; NaN where exactly one row is
    NaN or both are the same infinity, 0 where both are NaN) and their bitwise-equal mask (rows NaN
    in both count as equal)."""
    o = np.asarray(ours, np.float32).reshape(-1)
    r = np.asarray(ref, np.float32).reshape(-1)
    both_nan = np.isnan(o) & np.isnan(r)
    with np.errstate(invalid="ignore"):
        d = np.where(both_nan, 0.0, np.abs(o.astype(np.float64) - r))
    equal = (o.view(np.uint32) == r.view(np.uint32)) | both_nan
    return d, equal


class AuditLog:
    """Running comparison of fused vs reference logp: calls, rows, sum/mean/max |dlogp|,
    bitwise-equal and unequal rows, and the p99 |dlogp| over a window of the most recent rows.
    NaN |dlogp| (see audit_diff) counts as a row and an unequal row, and enters no figure of
    |dlogp|; the mean is over all rows."""
    WINDOW = 1 << 20  # rows of |dlogp| the p99 is taken over

    def __init__(self):
        self._lock = threading.Lock()
        self.reset()

    def reset(self) -> None:
        with self._lock:
            self.calls = self.rows = self.equal_rows = 0
            self.sum_abs = self.max_abs = 0.0
            self._window: collections.deque = collections.deque()
            self._window_rows = 0

    def record(self, d: np.ndarray, equal: np.ndarray) -> dict:
        """Add one call's |dlogp| and bitwise-equal mask (audit_diff); returns this call's figures."""
        seen = d[~np.isnan(d)]
        call = {"rows": int(d.size), "max_abs_dlogp": float(seen.max()) if seen.size else 0.0,
                "mean_abs_dlogp": float(seen.mean()) if seen.size else 0.0,
                "p99_abs_dlogp": float(np.quantile(seen, 0.99)) if seen.size else 0.0,
                "bitwise_equal_count": int(equal.sum()), "mismatch_count": int(equal.size - equal.sum())}
        with self._lock:
            self.calls += 1
            self.rows += call["rows"]
            self.sum_abs += float(seen.sum())
            self.max_abs = max(self.max_abs, call["max_abs_dlogp"])
            self.equal_rows += call["bitwise_equal_count"]
            if seen.size:
                self._window.append(seen)
                self._window_rows += seen.size
            while self._window_rows > self.WINDOW and len(self._window) > 1:
                self._window_rows -= self._window.popleft().size
        return call

    def summary(self) -> dict:
        """calls, rows, sum/max/mean/p99 |dlogp|, equal_rows and unequal_rows, and the same counts
        under the names of a call's figures (bitwise_equal_count, mismatch_count)."""
        with self._lock:
            window = list(self._window)
            unequal = self.rows - self.equal_rows
            out = {"calls": self.calls, "rows": self.rows, "sum_abs_dlogp": self.sum_abs,
                   "max_abs_dlogp": self.max_abs, "mean_abs_dlogp": self.sum_abs / self.rows if self.rows else 0.0,
                   "equal_rows": self.equal_rows, "unequal_rows": unequal,
                   "bitwise_equal_count": self.equal_rows, "mismatch_count": unequal}
        out["p99_abs_dlogp"] = float(np.quantile(np.concatenate(window)[-self.WINDOW:], 0.99)) if window else 0.0
        return out


class RouteLog:
    """One frontend's host-side route log. Each frontend (and the vime provider, a RequestLog)
    keeps its own; the per-backend counters are the compiled module's, shared by every log in the
    process."""

    def __init__(self):
        self._lock = threading.Lock()
        self.audit = AuditLog()
        self._clear()

    def _clear(self) -> None:
        with self._lock:
            self._reference = {"calls": 0, "tokens": 0}
            self._fallbacks: collections.Counter = collections.Counter()
            self._backend_id = None

    def count_reference(self, tokens: int, reason: str | None) -> None:
        """One call of the reference path over `tokens` rows; `reason` the fallback's (None or ""
        for mode off)."""
        with self._lock:
            self._reference["calls"] += 1
            self._reference["tokens"] += int(tokens)
            if reason:
                self._fallbacks[reason] += 1

    def count_fallback(self, reason: str) -> None:
        """One call that none of our paths served (the caller runs its own); `reason` why."""
        with self._lock:
            self._fallbacks[reason] += 1

    def note_backend(self, backend_id: str) -> None:
        """The route of the last eager call ("cpu", "cuda", "reference")."""
        with self._lock:
            self._backend_id = backend_id

    def record_audit(self, ours, ref) -> dict:
        """Compare fused logp with the reference's (host arrays), row by row; this call's figures."""
        return self.audit.record(*audit_diff(ours, ref))

    def stats(self, core) -> dict:
        """The route statistics' schema, since the last reset: rlk_xla.route_stats(),
        torch_bridge.route_stats() and torch_bridge.vime.stats() (RequestLog) all return it.
        - calls / tokens: forward calls (and their rows) over the fused kernels and this log's
          reference: sum of backends' fwd_calls/fwd_tokens + reference's calls/tokens;
        - backends: {backend: {COUNT_NAMES}}, fused kernel executions counted in C++ where they
          run; the compiled module's, so shared by every log in the process;
        - reference: calls/tokens of this log's reference path (mode off, and a frontend's
          fallbacks; the audit's reference is not counted);
        - fallbacks: {reason: count} of calls that did not run the fused kernels, and why (a
          frontend ran its reference for them; the provider served none of its routes, so vime's
          auto ran its native path), and fallback_total, their sum (0: every call was ours);
        - backend_id: the route of the last eager call (frontends: "cpu", "cuda", "reference";
          provider: its Result.backend_id, "rlk.<route>.<kernel>"), None if none was noted;
        - audit: AuditLog.summary().
        The vime provider's RequestLog adds:
        - requests: calls/tokens of provider(request), served or not;
        - backend_ids: {Result.backend_id: count} of the requests served;
        - modes: {mode: count} of the requests."""
        backends = backend_counts(core)
        with self._lock:
            reference, fallbacks, backend_id = dict(self._reference), dict(self._fallbacks), self._backend_id
        return {"calls": sum(b["fwd_calls"] for b in backends.values()) + reference["calls"],
                "tokens": sum(b["fwd_tokens"] for b in backends.values()) + reference["tokens"],
                "backends": backends, "reference": reference, "fallbacks": fallbacks,
                "fallback_total": sum(fallbacks.values()), "backend_id": backend_id, "audit": self.audit.summary()}

    def reset(self, core) -> None:
        """Zero the compiled module's counters (process-wide: every frontend's kernel counters restart)
        and this log."""
        core.reset_route_counts()
        self._clear()
        self.audit.reset()


class RequestLog(RouteLog):
    """The vime provider's route log: RouteLog's schema plus its requests (the extra keys
    requests, backend_ids, modes and route_reasons of RouteLog.stats)."""

    def _clear(self) -> None:
        super()._clear()
        with self._lock:
            self._requests = {"calls": 0, "tokens": 0}
            self._backend_ids: collections.Counter = collections.Counter()
            self._modes: collections.Counter = collections.Counter()
            self._route_reasons: collections.Counter = collections.Counter()

    def count_request(self, mode: str, tokens: int, backend_id: str | None, why: str | None = None) -> None:
        """One request over `tokens` rows in `mode`, served as `backend_id` for the route reason
        `why` (backend_id None: not served; its reason goes to count_fallback)."""
        with self._lock:
            self._requests["calls"] += 1
            self._requests["tokens"] += int(tokens)
            self._modes[mode] += 1
            if backend_id is not None:
                self._backend_ids[backend_id] += 1
                self._backend_id = backend_id
            if why is not None:
                self._route_reasons[why] += 1

    def stats(self, core) -> dict:
        out = super().stats(core)
        with self._lock:
            out.update(requests=dict(self._requests), backend_ids=dict(self._backend_ids), modes=dict(self._modes),
                       route_reasons=dict(self._route_reasons))
        return out
