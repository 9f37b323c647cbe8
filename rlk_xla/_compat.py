"""The few JAX APIs that moved between jax 0.6 and 0.12, behind one name each."""
from __future__ import annotations

import jax
from jax import lax

try:  # jax >= 0.7
    shard_map = jax.shard_map
except AttributeError:  # pragma: no cover - older jax
    from jax.experimental.shard_map import shard_map  # type: ignore


def vma(x) -> frozenset:
    """The mesh axes a value varies over inside shard_map (empty outside it or on old jax)."""
    try:
        return frozenset(getattr(jax.typeof(x), "vma", ()) or ())
    except Exception:  # pragma: no cover - jax without typeof
        return frozenset()


def pvary(x, axis_name):
    """Mark a replicated value as varying over `axis_name` (needed to mix it with sharded values)."""
    if axis_name in vma(x):
        return x
    if hasattr(lax, "pcast"):
        return lax.pcast(x, axis_name, to="varying")
    if hasattr(lax, "pvary"):  # pragma: no cover - jax 0.6/0.7
        return lax.pvary(x, axis_name)
    return x  # pragma: no cover - jax without varying types
