"""The compiled kernels as jax.ffi calls: forward statistics (optionally saving the logits),
combine, backward (lean: recompute; fast: from the saved logits).

Each call lowers to the handler of the platform it runs on (lax.platform_dependent); every target
takes a trailing scratch result, sized by the library on CUDA (the CPU uses none).
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

import rlk_common as common

from ._args import saved_logits_bytes
from ._compat import result_type
from ._core import PLATFORMS, core, registered_platforms

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


def _on_platform(results, workspace: dict[str, int], name: str, args, attrs, aliases=None):
    """ffi_call `name` on whichever platform this lowers for, with the trailing scratch result every
    target takes (workspace: its bytes per XLA platform, absent: none; at least 1 byte is passed).
    aliases: {operand index: result index} (input_output_aliases)."""
    def call(platform):
        def f(*a):
            with_ws = list(results) + [_sds((max(workspace.get(platform, 0), 1),), jnp.uint8, a)]
            out = jax.ffi.ffi_call(name, with_ws, vmap_method="expand_dims", input_output_aliases=aliases or {})(
                *a, **attrs)
            return tuple(out[:-1])
        return f

    platforms = registered_platforms()
    if len(platforms) == 1:
        return call(platforms[0])(*args)
    lowering = {p["xla_platform"]: p["jax_lowering"] for p in PLATFORMS.values()}
    return lax.platform_dependent(*args, **{lowering[p]: call(p) for p in platforms})


def _workspace(hidden, weight, cfg: KernelConfig, which: str, dhidden_f32: bool = True) -> dict[str, int]:
    """Scratch bytes of call `which` ("forward", "lean" or "fast") per XLA platform, for those that
    take any (PLATFORMS' "workspace": rlk_common.cuda_workspace_bytes)."""
    n, h = hidden.shape
    nbytes = common.cuda_workspace_bytes(core, n, h, weight.shape[0], cfg.chunk, jnp.dtype(hidden.dtype).name,
                                         cfg.has_bias, cfg.with_entropy, dhidden_f32)[which]
    return {p["xla_platform"]: nbytes for p in PLATFORMS.values() if p["workspace"]}


_OPERANDS = core.ffi_operands()
# What an absent buffer is passed as, where its element type is checked even when empty (the rest: f32).
_ABSENT_DTYPE = {"keep": jnp.uint8, "saved_logits": jnp.uint8}


def _operands(stage: str, buffers: dict) -> tuple:
    """The stage's FFI operands in its table's order (ffi/io.h, through core.ffi_operands), each
    taken from `buffers` by name; an absent one (None, or not given) is the empty array the kernels
    read as absent. A name not in the table is a TypeError (an operand the kernels do not take)."""
    table = _OPERANDS[stage]
    unknown = set(buffers) - {name for name, _ in table}
    if unknown:
        raise TypeError(f"rlk_{stage} takes no operand(s) {sorted(unknown)}; its operands: {[n for n, _ in table]}")
    return tuple(buffers[name] if buffers.get(name) is not None else jnp.zeros((0,) * rank, _ABSENT_DTYPE.get(name, F32))
                 for name, rank in table)


def forward(cfg: KernelConfig, *, save_logits: bool = False, **buffers):
    """buffers by the forward table's names: hidden [n, h], weight [v, h], bias [v] f32 or None,
    targets [n], temperature [n] f32 (the kernels form 1/T), keep (a nucleus, uint8 [n, v], or None).
    -> stats [n, v/chunk, STAT_WIDTH] f32, target_logit [n] f32 (0 where the target is not a real id
    of this shard; with keep, -inf where it is outside the nucleus), saved_logits: with save_logits
    the fast backward's record, uint8 [saved_logits_bytes] in the backend's own layout, else [0];
    keep_sum: with keep the nucleus's per-chunk sums [n, v/chunk] f32, else [0, 0]."""
    hidden, weight, keep = buffers["hidden"], buffers["weight"], buffers.get("keep")
    n, v = hidden.shape[0], weight.shape[0]
    args = _operands("forward", buffers)
    saved = saved_logits_bytes(n, v, cfg.chunk, hidden.dtype) if save_logits else 0
    results = (_sds((n, v // cfg.chunk, STAT_WIDTH), F32, args), _sds((n,), F32, args), _sds((saved,), jnp.uint8, args),
               _sds((n, v // cfg.chunk) if keep is not None else (0, 0), F32, args))
    return _on_platform(results, _workspace(hidden, weight, cfg, "forward"), "rlk_forward", args, cfg.attrs())


def combine(*, real_vocab: int, ignore_index: int, **buffers):
    """buffers: stats, target_logit, targets, keep_sum (None: no nucleus) of all chunks of the global
    vocab -> (logp, entropy, m, log_s, log_s_keep), each [n] f32 (m, log_s: the row max and log sum
    exp(z - m), what the backward takes); with keep_sum (every chunk's kept sums) logp is the
    nucleus's and log_s_keep = log sum_kept exp(z - m), else log_s_keep is [0]."""
    n = buffers["stats"].shape[0]
    cfg = KernelConfig(vocab_start=0, real_vocab=real_vocab, chunk=1, ignore_index=ignore_index, has_bias=False,
                       with_entropy=True)
    args = _operands("combine", buffers)
    results = (_sds((n,), F32, args),) * 4 + (_sds((n if buffers.get("keep_sum") is not None else 0,), F32, args),)
    return _on_platform(results, {}, "rlk_combine", args, cfg.attrs())


def backward(cfg: KernelConfig, *, dhidden_f32: bool, **buffers):
    """buffers by the backward table's names: the forward's operands, the combine's m, log_s and
    entropy, the cotangents g and e (entropy and e: only with cfg.with_entropy), saved_logits (the
    forward's record: the fast strategy, whose CUDA kernels overwrite it, which XLA gives them
    through an operand-result alias; None: lean, recompute), and keep (the forward's nucleus) with
    log_s_keep (the combine's) for the gradient of the nucleus's logp.
    -> dhidden [n, h], dweight [v, h], dbias [v] f32, dtemperature [n] f32 (dhidden and
    dtemperature: this shard's part). dhidden is f32 with dhidden_f32 (a vocab shard's partial, to be
    summed over shards), else in hidden's dtype, rounded once from the f32 sum (the whole vocab: no
    f32 [n, h] buffer at all)."""
    hidden, weight, saved_logits = buffers["hidden"], buffers["weight"], buffers.get("saved_logits")
    n, h = hidden.shape
    v = weight.shape[0]
    if not cfg.with_entropy:
        buffers = dict(buffers, entropy=None, e=None)
    args = _operands("backward", buffers)
    results = (_sds((n, h), F32 if dhidden_f32 else hidden.dtype, args), _sds((v, h), weight.dtype, args),
               _sds((v if cfg.has_bias else 0,), F32, args), _sds((n,), F32, args))
    _prepare_cuda()
    saved_at = [name for name, _ in _OPERANDS["backward"]].index("saved_logits")
    results += (_sds(args[saved_at].shape, args[saved_at].dtype, args),)
    ws = _workspace(hidden, weight, cfg, "lean" if saved_logits is None else "fast", dhidden_f32)
    # lean's empty record is not aliased: under vmap it stays unbatched while its result is batched.
    aliases = None if saved_logits is None else {saved_at: 4}
    out = _on_platform(results, ws, "rlk_backward", args, cfg.attrs(), aliases=aliases)
    return tuple(out[:4])


@functools.lru_cache(maxsize=None)
def _prepare_cuda():
    """cuBLAS handles for every local GPU, at the first backward's trace, once per process: creating
    one inside the CUDA graph XLA may capture the backward into would fail."""
    if PLATFORMS["cuda"]["xla_platform"] not in registered_platforms():
        return
    try:
        gpus = jax.local_devices(backend="gpu")
    except RuntimeError:  # no GPU backend in this process
        return
    for d in gpus:
        core.cuda_prepare_backward(d.local_hardware_id if d.local_hardware_id is not None else d.id)
