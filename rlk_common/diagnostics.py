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
        there is none (no kept token, or every dlogp non-finite). Also under RL-Kernel's names
        (mismatch_count = mismatches, max_abs_diff = max_abs), so its validation scripts read it."""
        out = {f"{prefix}{f.name}": getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "worst"}
        out.update({f"{prefix}mismatch_count": self.mismatches, f"{prefix}max_abs_diff": self.max_abs})
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


# ---- where the model body drifts -----------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Drift:
    """The first captured layer whose two sides differ: how many elements differ in any bit (of
    how many; -0.0 against 0.0 differs), the largest |difference| and the first differing element
    (sample, position, feature: its index along the last axis)."""
    layer: str
    differing: int
    elements: int
    max_abs: float
    sample: int
    position: int
    feature: int

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def __str__(self) -> str:
        return (f"first drift at {self.layer}: {self.differing} of {self.elements} elements differ, max |diff| "
                f"{self.max_abs:.3e}, first at sample {self.sample} position {self.position} feature {self.feature}")


def _bits(x) -> np.ndarray:
    """An activation's raw bits as ints of its width (bf16 and other dtypes numpy lacks are viewed,
    not converted). torch is imported only with a torch tensor in hand (this module needs neither
    framework)."""
    if hasattr(x, "detach"):
        import torch
        t = x.detach().contiguous().cpu()
        return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()]).numpy()
    a = np.asarray(x)
    return a.view({1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}[a.dtype.itemsize])


def _values(x) -> np.ndarray:
    if hasattr(x, "detach"):
        return x.detach().float().cpu().numpy()
    return np.asarray(x, dtype=np.float32)


def first_drift(decode: dict, train: dict) -> Optional[Drift]:
    """The first layer (in `decode`'s order: give it in execution order) whose activations differ in
    any bit between the two sides, None if every layer is bitwise equal. It locates the first
    observed boundary, not the arithmetic that caused it (a module's internals stay unseen). decode / train: {layer name: [samples, positions,
    ...] activations at the same tokens} (torch tensors or numpy / jax arrays; the caller aligns the
    positions, e.g. CaptureLayers' decode calls concatenated along the positions against the
    trainer's forward over the same tokens)."""
    for name, d in decode.items():
        if name not in train:
            raise ValueError(f"layer {name!r} was captured on the decode side only")
        bd, bt = _bits(d), _bits(train[name])
        if bd.shape != bt.shape:
            raise ValueError(f"layer {name!r}: decode {bd.shape} and train {bt.shape} activations differ in shape")
        diff = bd != bt
        if diff.any():
            first = np.argwhere(diff)[0]
            gap = np.abs(_values(d).astype(np.float64) - _values(train[name]).astype(np.float64))
            return Drift(layer=name, differing=int(diff.sum()), elements=int(diff.size),
                         max_abs=float(np.nanmax(gap)) if np.isfinite(gap).any() else float("nan"),
                         sample=int(first[0]), position=int(first[1]) if diff.ndim > 1 else 0,
                         feature=int(first[-1]) if diff.ndim > 2 else 0)
    return None


class CaptureLayers:
    """Forward hooks on named torch modules ({name: module}): every call's output (the first element
    of a tuple output) is kept, detached, in call order. `with CaptureLayers(mods) as cap:` removes
    the hooks on exit; cap.joined(axis=1) concatenates each layer's calls (a prefill then one
    decode step per token gives the same [samples, positions, ...] a trainer's forward over the whole
    sequences gives). For flax, sow the intermediates (nnx.Module.sow) and pass the popped dict of
    arrays to first_drift directly."""

    def __init__(self, modules: dict):
        self.modules, self.calls, self._hooks = dict(modules), {k: [] for k in modules}, []

    def __enter__(self):
        for name, mod in self.modules.items():
            self._hooks.append(mod.register_forward_hook(self._hook(name)))
        return self

    def _hook(self, name):
        def keep(_mod, _inp, out):
            self.calls[name].append((out[0] if isinstance(out, tuple) else out).detach().clone())
        return keep

    def __exit__(self, *exc):
        for h in self._hooks:
            h.remove()
        self._hooks.clear()
        return False

    def joined(self, axis: int = 1) -> dict:
        """{name: the calls' outputs concatenated along `axis`}."""
        import torch
        return {k: torch.cat(v, dim=axis) for k, v in self.calls.items() if v}
