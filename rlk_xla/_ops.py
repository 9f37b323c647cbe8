"""The compiled kernels as jax.ffi calls: forward statistics (optionally keeping the logits),
combine, backward (lean: recompute; fast: from the kept logits).

Each call lowers to the handler of the platform it runs on (lax.platform_dependent): the CUDA
handlers take a trailing scratch buffer sized by the library, the CPU handlers none.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

import rlk_common as common

from ._args import kept_bytes
from ._compat import result_type
from ._core import core, has_platform, registered_platforms

F32 = jnp.float32
STAT_WIDTH = core.STAT_WIDTH


@dataclasses.dataclass(frozen=True)
class KernelConfig:
    """What the kernels take as attributes (static for one traced call)."""
    vocab_start: int
    real_vocab: int
    chunk: int
    ignore_index: int
    has_bias: bool
    with_entropy: bool

    def attrs(self) -> dict:
        return dict(vocab_start=np.int64(self.vocab_start), real_vocab=np.int64(self.real_vocab),
                    chunk=np.int64(self.chunk), ignore_index=np.int64(self.ignore_index),
                    has_bias=np.int64(self.has_bias), with_entropy=np.int64(self.with_entropy))


def _sds(shape, dtype=F32, operands=()):
    return result_type(tuple(shape), dtype, operands)


def _on_platform(results, cuda_workspace: int | None, name: str, args, attrs, aliases=None):
    """ffi_call `name` on whichever platform this lowers for. The CUDA handlers of forward and
    backward take a trailing scratch result of `cuda_workspace` bytes; combine (None) takes none.
    aliases: {operand index: result index} (input_output_aliases)."""
    registered_platforms()
    aliases = aliases or {}

    def cpu(*a):
        return jax.ffi.ffi_call(name, results, vmap_method="expand_dims", input_output_aliases=aliases)(*a, **attrs)

    if not has_platform("CUDA"):
        return cpu(*args)

    def cuda(*a):
        if cuda_workspace is None:
            return cpu(*a)
        with_ws = list(results) + [_sds((max(cuda_workspace, 1),), jnp.uint8, a)]
        out = jax.ffi.ffi_call(name, with_ws, vmap_method="expand_dims", input_output_aliases=aliases)(*a, **attrs)
        return tuple(out[:-1])

    return lax.platform_dependent(*args, cpu=cpu, cuda=cuda)


def _workspace(hidden, weight, cfg: KernelConfig, dhidden_f32: bool = True) -> dict[str, int]:
    """CUDA scratch bytes, {"forward", "lean", "fast"} (rlk_common.cuda_workspace_bytes)."""
    n, h = hidden.shape
    return common.cuda_workspace_bytes(core, n, h, weight.shape[0], cfg.chunk, jnp.dtype(hidden.dtype).name,
                                       cfg.has_bias, cfg.with_entropy, dhidden_f32)


def _bias_arg(bias):
    return bias if bias is not None else jnp.zeros((0,), F32)


def forward(hidden, weight, bias, targets, temperature, cfg: KernelConfig, keep_logits: bool = False):
    """bias: [v] f32 or None; temperature [n] f32 (the kernels form 1/T). -> stats [n, v/chunk, STAT_WIDTH] f32, target_logit [n] f32 (0 where
    the target is not a real id of this shard)[, with keep_logits the kept buffer for the fast
    backward: uint8 [kept_bytes], the backend's own layout]."""
    n, v = hidden.shape[0], weight.shape[0]
    args = (hidden, weight, _bias_arg(bias), targets, temperature)
    results = (_sds((n, v // cfg.chunk, STAT_WIDTH), F32, args), _sds((n,), F32, args))
    if keep_logits:
        results += (_sds((kept_bytes(n, v, cfg.chunk, hidden.dtype),), jnp.uint8, args),)
    name = "rlk_forward_keep" if keep_logits else "rlk_forward"
    return _on_platform(results, _workspace(hidden, weight, cfg)["forward"], name, args, cfg.attrs())


def combine(stats, target_logit, targets, *, real_vocab: int, ignore_index: int):
    """All chunks of the global vocab -> (logp, entropy, m, log_s), each [n] f32 (m, log_s: the row
    max and log sum exp(z - m), what the backward takes)."""
    n = stats.shape[0]
    attrs = dict(real_vocab=np.int64(real_vocab), ignore_index=np.int64(ignore_index))
    args = (stats, target_logit, targets)
    return _on_platform((_sds((n,), F32, args),) * 4, None, "rlk_combine", args, attrs)


def backward(hidden, weight, bias, targets, temperature, m, log_s, entropy, g, e, cfg: KernelConfig, *, logits,
             dhidden_f32: bool):
    """-> dhidden [n, h], dweight [v, h], dbias [v] f32, dtemperature [n] f32 (dhidden and
    dtemperature: this shard's part). dhidden is f32 with dhidden_f32 (a vocab shard's partial, to be
    summed over shards), else in hidden's dtype, rounded once from the f32 sum (the whole vocab: no
    f32 [n, h] buffer at all).
    logits: the forward's kept buffer (the fast strategy; the CUDA kernels overwrite it,
    which XLA gives them through an operand-result alias), or None (lean: recompute)."""
    n, h = hidden.shape
    v = weight.shape[0]
    empty = jnp.zeros((0,), F32)
    args = (hidden, weight, _bias_arg(bias), targets, temperature, m, log_s,
            entropy if cfg.with_entropy else empty, g, e if cfg.with_entropy else empty)
    results = (_sds((n, h), F32 if dhidden_f32 else hidden.dtype, args), _sds((v, h), weight.dtype, args),
               _sds((v if cfg.has_bias else 0,), F32, args), _sds((n,), F32, args))
    _prepare_cuda()
    ws = _workspace(hidden, weight, cfg, dhidden_f32)
    if logits is None:
        return _on_platform(results, ws["lean"], "rlk_backward", args, cfg.attrs())
    args += (logits,)
    results += (_sds(logits.shape, logits.dtype, args),)
    out = _on_platform(results, ws["fast"], "rlk_backward_fast", args, cfg.attrs(), aliases={len(args) - 1: 4})
    return tuple(out[:4])


@functools.lru_cache(maxsize=None)
def _prepare_cuda():
    """cuBLAS handles for every local GPU, at the first backward's trace, once per process: creating
    one inside the CUDA graph XLA may capture the backward into would fail."""
    if not has_platform("CUDA"):
        return
    try:
        gpus = jax.local_devices(backend="gpu")
    except RuntimeError:  # no GPU backend in this process
        return
    for d in gpus:
        core.cuda_prepare_backward(d.local_hardware_id if d.local_hardware_id is not None else d.id)
