"""The compiled module shared with torch_bridge, and the XLA FFI targets registered from it."""
from __future__ import annotations

import functools
import importlib.util
import warnings

import jax

import rlk_common

core = rlk_common.import_core("rlk_xla")
# What this build runs, by platform (rlk_common.platform).
PLATFORMS = core.platforms()

# jax's CUDA plugins (jax[cuda12], jax[cuda13]): with one installed, jax runs on the GPU.
CUDA_PLUGINS = ("jax_cuda12_plugin", "jax_cuda13_plugin")
FALLBACK = "rlk_xla runs the reference (mode='auto') or raises (mode='strict')"


def missing_kernels() -> str | None:
    """What this build lacks for a platform jax can run on here, and the fix; None if nothing.
    Looks at installed packages only: starting a jax backend here would come before the caller's
    jax.distributed.initialize."""
    if not core.has_xla_ffi:
        return (f"this build of _rlk_core has no XLA FFI handlers (built with RLK_XLA_FFI=OFF), so {FALLBACK}. "
                "Reinstall with them: `pip install .` (README, Install)")
    cuda = PLATFORMS["cuda"]
    if not cuda["supported"] and any(importlib.util.find_spec(p) for p in CUDA_PLUGINS):
        return (f"jax's CUDA plugin is installed but {cuda['reason']}, so on a GPU {FALLBACK}. Rebuild with nvcc "
                "on PATH: `pip install .` (README, Install)")
    return None


if (_missing := missing_kernels()) is not None:
    warnings.warn(f"rlk_xla: {_missing}", RuntimeWarning)


@functools.lru_cache(maxsize=None)
def registered_platforms() -> tuple[str, ...]:
    """Register every FFI target the build has, once; return their XLA platforms (PLATFORMS' xla_platform)."""
    targets = core.ffi_targets()
    for platform, handlers in targets.items():
        for name, capsule in handlers.items():
            jax.ffi.register_ffi_target(name, capsule, platform=platform)
    return tuple(targets)
