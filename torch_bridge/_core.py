"""The compiled module shared with rlk_xla (no jax here: _rlk_core does not import it)."""
from __future__ import annotations

try:
    import _rlk_core as core
except ImportError as e:  # pragma: no cover - only when the build is missing
    raise ImportError(
        "torch_bridge: the compiled module _rlk_core is not installed; build it with "
        "`pip install .` (see README, Install)") from e

__all__ = ["core"]
