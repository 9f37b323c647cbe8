"""The compiled module shared with rlk_xla (no jax here: _rlk_core does not import it)."""
from __future__ import annotations

import rlk_common

core = rlk_common.import_core("torch_bridge")
# What this build runs, by platform (rlk_common.platform): a plain dict, which torch.compile traces.
PLATFORMS = core.platforms()

__all__ = ["core", "PLATFORMS"]
