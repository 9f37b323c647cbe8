"""The compiled module shared with torch_bridge, and the XLA FFI targets registered from it."""
from __future__ import annotations

import functools

try:
    import _rlk_core as core
except ImportError as e:  # pragma: no cover - only when the build is missing
    raise ImportError(
        "rlk_xla: the compiled module _rlk_core is not installed; build it with "
        "`pip install --no-build-isolation .` (see README)") from e

import jax

@functools.lru_cache(maxsize=None)
def registered_platforms() -> tuple[str, ...]:
    """Register every FFI target the build has, once; return the platforms ("cpu", "CUDA")."""
    targets = core.ffi_targets()
    for platform, handlers in targets.items():
        for name, capsule in handlers.items():
            jax.ffi.register_ffi_target(name, capsule, platform=platform)
    return tuple(targets)


def has_platform(platform: str) -> bool:
    return platform in registered_platforms()
