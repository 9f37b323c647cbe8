"""Per-step train/rollout log-probability figures, framework-neutral (numpy only).

dlogp = train_logp - rollout_logp over the tokens the mask keeps. Where both sides run the same
kernels on the same hidden rows every token is bitwise equal; what remains is the model body's
contribution. The frontends (torch_bridge.diagnostics, rlk_xla.diagnostics) move the two [...] f32
arrays and the mask to the host once (O(tokens) bytes, one sync) and call dlogp_stats here.

    mismatches        tokens whose two fp32 values differ in any bit (NaN against the same NaN
                      bits is equal); bitwise_equal_frac = 1 - mismatches / tokens
    max/mean/p50/p90/p99 |dlogp|   over the finite dlogp (numpy's linear-interpolation percentiles)
    approx_kl         mean of exp(dlogp) - 1 - dlogp (the k3 estimator of KL(rollout || train),
                      >= 0, 0 exactly where the two agree)
    nonfinite         kept tokens whose dlogp is NaN or inf (left out of the figures above)
    worst             the token of largest |dlogp|: its sample (row; sample_ids[row] when given),
                      position (column, or positions[...] when given), the caller's rank, both values
"""
from __future__ import annotations

import dataclasses
from typing import Any, Optional

import numpy as np

PREFIX = "rlk_dlogp_"


@dataclasses.dataclass(frozen=True)
class WorstToken:
    sample: int
    position: int
    rank: Optional[int]
    dlogp: float
    train_logp: float
    rollout_logp: float


@dataclasses.dataclass(frozen=True)
class DlogpStats:
    tokens: int
    mismatches: int
    bitwise_equal_frac: float
    max_abs: float
    mean_abs: float
    p50_abs: float
    p90_abs: float
    p99_abs: float
    approx_kl: float
    nonfinite: int
    worst: Optional[WorstToken]

    def as_dict(self, prefix: str = PREFIX) -> dict[str, Any]:
        """Flat {name: int | float} for a metrics logger; the worst token's fields are -1 / 0.0 when
        there is none (no kept token, or every dlogp non-finite)."""
        out = {f"{prefix}{f.name}": getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "worst"}
        w = self.worst
        out.update({f"{prefix}worst_sample": -1 if w is None else w.sample,
                    f"{prefix}worst_position": -1 if w is None else w.position,
                    f"{prefix}worst_rank": -1 if w is None or w.rank is None else w.rank,
                    f"{prefix}worst_dlogp": 0.0 if w is None else w.dlogp})
        return out

    def __str__(self) -> str:
        s = (f"tokens {self.tokens}  mismatches {self.mismatches}  bitwise-equal {self.bitwise_equal_frac:.6f}  "
             f"|dlogp| max {self.max_abs:.3e} mean {self.mean_abs:.3e} p50 {self.p50_abs:.3e} "
             f"p90 {self.p90_abs:.3e} p99 {self.p99_abs:.3e}  approx_kl {self.approx_kl:.3e}")
        if self.nonfinite:
            s += f"  nonfinite {self.nonfinite}"
        w = self.worst
        if w is not None and w.dlogp != 0.0:
            rank = "" if w.rank is None else f" rank {w.rank}"
            s += (f"  worst: sample {w.sample} position {w.position}{rank} dlogp {w.dlogp:+.3e} "
                  f"(train {w.train_logp:.6f}, rollout {w.rollout_logp:.6f})")
        return s


def dlogp_stats(train_logp, rollout_logp, mask=None, *, sample_ids=None, positions=None,
                rank: Optional[int] = None) -> DlogpStats:
    """The figures of train_logp against rollout_logp (numpy arrays of the same shape, [samples,
    positions] or [tokens]; any float dtype, compared as fp32). mask: same shape, nonzero = kept
    (None: every token). sample_ids: one id per sample (per row of a 2-D input; per token of a 1-D
    one); positions: same shape as the inputs, a token's position in its sequence (default: its
    column, or its index for 1-D inputs)."""
    train = np.asarray(train_logp, dtype=np.float32)
    roll = np.asarray(rollout_logp, dtype=np.float32)
    if train.shape != roll.shape:
        raise ValueError(f"train_logp {train.shape} and rollout_logp {roll.shape} must have the same shape")
    if train.ndim not in (1, 2):
        raise ValueError(f"train_logp must be [samples, positions] or [tokens], got shape {train.shape}")
    keep = np.ones(train.shape, bool) if mask is None else np.asarray(mask).astype(bool)
    if keep.shape != train.shape:
        raise ValueError(f"mask {keep.shape} must be shaped like train_logp {train.shape}")
    if sample_ids is not None and np.size(sample_ids) != train.shape[0]:
        raise ValueError(f"sample_ids must hold one id per {'sample' if train.ndim == 2 else 'token'}, "
                         f"{train.shape[0]}, got {np.size(sample_ids)}")
    if positions is not None and np.shape(positions) != train.shape:
        raise ValueError(f"positions {np.shape(positions)} must be shaped like train_logp {train.shape}")
    idx = np.flatnonzero(keep)
    t, r = train.reshape(-1)[idx], roll.reshape(-1)[idx]
    mismatches = int(np.count_nonzero(t.view(np.uint32) != r.view(np.uint32)))
    d = t.astype(np.float64) - r.astype(np.float64)
    finite = np.isfinite(d)
    df, fidx = d[finite], idx[finite]
    a = np.abs(df)
    n = int(idx.size)
    if a.size:
        p50, p90, p99 = (float(q) for q in np.percentile(a, [50, 90, 99]))
        i = int(np.argmax(a))
        worst = _worst(int(fidx[i]), train, roll, float(df[i]), sample_ids, positions, rank)
        max_abs, mean_abs, kl = float(a[i]), float(a.mean()), float(np.mean(np.expm1(df) - df))
    else:
        p50 = p90 = p99 = max_abs = mean_abs = kl = 0.0
        worst = None
    return DlogpStats(tokens=n, mismatches=mismatches, bitwise_equal_frac=1.0 - mismatches / n if n else 1.0,
                      max_abs=max_abs, mean_abs=mean_abs, p50_abs=p50, p90_abs=p90, p99_abs=p99, approx_kl=kl,
                      nonfinite=int(d.size - df.size), worst=worst)


def _worst(flat: int, train, roll, dlogp: float, sample_ids, positions, rank) -> WorstToken:
    if train.ndim == 2:
        row, col = divmod(flat, train.shape[1])
    else:
        row, col = flat, flat
    sample = row if sample_ids is None else int(np.asarray(sample_ids).reshape(-1)[row])
    position = col if positions is None else int(np.asarray(positions).reshape(-1)[flat])
    return WorstToken(sample=sample, position=position, rank=rank, dlogp=dlogp,
                      train_logp=float(train.reshape(-1)[flat]), rollout_logp=float(roll.reshape(-1)[flat]))
