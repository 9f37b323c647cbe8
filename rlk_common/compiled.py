"""The compiled module's side of the shared rules: its import (one per process, both frontends), the
platforms it reports, the dtype codes and buffer sizes it computes (dtypes by name). Imports neither
jax nor torch."""
from __future__ import annotations


def import_core(frontend: str):
    """The compiled module _rlk_core (one per process, shared by both frontends), else an
    ImportError saying how `frontend` gets it."""
    try:
        import _rlk_core
    except ImportError as e:  # pragma: no cover - only when the build is missing
        raise ImportError(f"{frontend}: the compiled module _rlk_core is not installed; build it with "
                          "`pip install .` (see README, Install)") from e
    return _rlk_core


def platform(platforms: dict, key: str, value) -> dict | None:
    """The platform of the compiled module's report (`platforms`: core.platforms(), read once at
    import: each platform's names in the frontends, whether this build runs it and why not, its
    kernels) whose `key` ("name", "xla_platform", "jax_backend", "jax_lowering") is `value`; None
    for a platform the module does not know."""
    return next((p for p in platforms.values() if p[key] == value), None)


def platform_fallback(platforms: dict, key: str, value) -> str | None:
    """Why the fused kernels cannot run on the platform whose `key` is `value` (the route log's
    fallback reason), None where they can."""
    p = platform(platforms, key, value)
    if p is None:
        return f"device {value} (supported: {', '.join(platforms)})"
    return None if p["supported"] else f"device {p['name']} ({p['reason']})"


def dtype_code(core, name: str):
    """The compiled module's code for the operand dtype named `name` as jax and torch name it
    ("float32", "float16", "bfloat16"): a member of core.DType, which binds rlk::DType, so the codes
    have one home, the C++ enum. ValueError for a dtype the kernels do not take."""
    code = core.DType.__members__.get(name)
    if code is None:
        raise ValueError(f"dtype {name}: the kernels take {', '.join(core.DType.__members__)}")
    return code


def saved_logits_bytes(core, n: int, v_local: int, chunk: int, dtype: str, device: str) -> int:
    """Bytes the fast backward saves for one shard (n rows, v_local vocab rows of the dtype named
    `dtype`), in the layout of the backend on platform `device` (a name of core.platforms()): the frontends allocate
    this many uint8 and compare it with backward_memory_budget. Both backends' layouts are a record
    per row, so this is n times one row's bytes (n may be a symbolic size under torch.compile)."""
    return n * int(core.saved_logits_bytes(1, v_local, chunk, dtype_code(core, dtype), device))


def cuda_workspace_bytes(core, n: int, h: int, v_local: int, chunk: int, dtype: str, has_bias: bool,
                         with_entropy: bool, dhidden_f32: bool) -> dict:
    """CUDA scratch bytes of one shard's calls, {"forward", "lean", "fast"} (the forward and each
    backward strategy; the backward's with dhidden in float32, a vocab shard's partial sum, or in
    the dtype named `dtype`); 0 in a build without CUDA."""
    return core.cuda_workspace_bytes(n, h, v_local, chunk, dtype_code(core, dtype), has_bias, with_entropy,
                                     dhidden_f32)

