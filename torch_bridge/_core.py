"""The compiled module shared with rlk_xla (no jax here: _rlk_core does not import it)."""
from __future__ import annotations

import rlk_common

core = rlk_common.import_core("torch_bridge")

__all__ = ["core"]
