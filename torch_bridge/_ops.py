"""torch.library custom ops (namespace `rlk`) over the DLPack entry points of _rlk_core.

Low-level ops, one per compiled entry point (used by the tensor-parallel path, which puts
collectives between them):
  rlk::forward_stats          per-(row, canonical chunk) statistics, the local target logit and,
                              with save_logits, this shard's saved logits for the fast backward;
                              with a nucleus, its per-chunk kept sums
  rlk::combine                all chunks' statistics -> logp, entropy, m, log_s (fixed chunk order),
                              and log_s_keep with the kept sums
  rlk::linear_logp_backward   dH (this shard's partial: f32; the whole vocab's: dtype), dW, db (f32), dtemperature (partial)
and the fused single-shard forward op, with its autograd (LinearLogp), traceable by
torch.compile(fullgraph=True):
  rlk::linear_logp            (logp, entropy, m, log_s, saved logits, log_s_keep); backward through
                              rlk::linear_logp_backward
The autograd Functions reach them through run(): the op under torch.compile, its implementation
directly in eager mode.

A nucleus (`keep`, a top-p keep mask: bool [n, V_local], this shard's slice) makes logp that of the
softmax over the kept ids (on every shard) and leaves the entropy unmasked; the kernels read it as
uint8 and keep no [n, V] float buffer for it (docs/design.md §12). Without one, the ops carry an empty
[0] tensor for its outputs (keep_sum, log_s_keep).
The forward and combine calls also come as plain functions writing into caller-owned buffers
(forward_into, combine_to): the rollout path (torch_bridge.integrations.rollout) allocates nothing.

Every op passes `temperature` [n] f32 to the kernels, which form 1 / T themselves with a correctly
rounded reciprocal: the JAX frontend does the same, so both give the same bits (XLA's and torch's
own GPU divisions differ in the last bit). Bias, when given, is fp32. Outputs and
the CUDA workspace are allocated with torch's allocator; CUDA kernels run on the current stream.

Saved logits (backward="fast"): what the backend's backward needs of the shard's logits z = (h.W + b)
/ T, uint8 [_args.saved_logits_bytes] in the backend's own layout (`saved_logits` below). When nothing is
saved the ops carry an empty [0] tensor in its place, and the backward then recomputes the logits
("lean"). The backward declares `saved_logits` mutated: on CUDA it overwrites it with dlogit, so it
serves one backward. (Optional[Tensor] with None for lean would read better, but Inductor fails
to lower a mutated Optional argument that is None -- torch 2.13.)
"""
from __future__ import annotations

import contextlib
import functools
import inspect
import types

from typing import Optional, Tuple

import torch
from torch import Tensor

import rlk_common as common

from ._args import dtype_name, saved_logits_bytes
from ._core import PLATFORMS, core

F32 = torch.float32
W = int(core.STAT_WIDTH)


# Each op's implementation by name, what run() calls in eager mode.
_IMPLS = {}


def _op(name: str, mutates_args=()):
    """torch.library.custom_op("rlk::" + name) over fn (its typed signature is the op's schema),
    keeping fn for run()."""
    def wrap(fn):
        _IMPLS[name] = fn
        return torch.library.custom_op("rlk::" + name, mutates_args=mutates_args)(fn)
    return wrap


def _args_of(name: str, args: tuple, kwargs: dict) -> types.SimpleNamespace:
    """A registered fake's arguments by name: bound to the op's own signature, defaults applied (the
    schema is written once, on the implementation)."""
    bound = inspect.signature(_IMPLS[name]).bind(*args, **kwargs)
    bound.apply_defaults()
    return types.SimpleNamespace(**bound.arguments)


def run(name: str, **kwargs):
    """rlk::<name>, its arguments by name, under torch.compile (the op is what Dynamo, AOTAutograd and
    Inductor see) and wherever the dispatcher has more to do than run it: a dispatch mode is active
    (FakeTensorMode takes the op's registered fake, a FlopCounterMode or a debug mode sees the op) or
    a tensor subclass is among the arguments. Otherwise, in plain eager mode, its implementation
    called directly: the same code and bits without the dispatcher's layers around a custom op
    (autograd, ADInplaceOrView, which for the backward's declared mutation rebuilds the schema's
    argument list on every call), which cost the host more than a T1 step's forward takes on the GPU
    (docs/benchmarks.md §5)."""
    if torch.compiler.is_compiling() or torch._C._len_torch_dispatch_stack() or not all(map(_plain, kwargs.values())):
        return getattr(torch.ops.rlk, name)(**kwargs)
    return _IMPLS[name](**kwargs)


def _plain(a) -> bool:
    """Not a tensor, or one whose memory is its values (a Parameter's is)."""
    return not isinstance(a, Tensor) or type(a) in (Tensor, torch.nn.Parameter)


def _kernel(fn, *args, **kwargs):
    """core.<fn>(*args, **kwargs), every tensor among them _plain: the kernels read and write
    tensors' memory through DLPack, and a subclass's is not its values (a FakeTensor has none; a
    DTensor holds a shard). Refused with an error instead of read."""
    for a in (*args, *kwargs.values()):
        if not _plain(a):
            raise TypeError(f"torch_bridge: the compiled kernels read a tensor's memory, and a {type(a).__name__} "
                            "is not a plain tensor's memory; pass plain tensors (or call under torch.compile, "
                            "where the ops' registered fakes serve fake tensors)")
    return fn(*args, **kwargs)


def _stream(t: Tensor) -> int:
    return torch.cuda.current_stream(t.device).cuda_stream if t.device.type == "cuda" else 0


def _on(t: Tensor):
    """The kernels launch on the current CUDA device: make it the tensors' device."""
    return torch.cuda.device(t.device) if t.device.type == "cuda" else contextlib.nullcontext()


def _c(t: Optional[Tensor]) -> Optional[Tensor]:
    return None if t is None else t.detach().contiguous()


@functools.lru_cache(maxsize=None)
def _prepare_backward(device_index: int) -> None:
    """cuBLAS (the backward's GEMMs) and its handle for this device, once per process: creating the
    handle inside a CUDA-graph capture fails, so capture after one warm-up step."""
    core.cuda_prepare_backward(device_index)


def workspace_bytes(n: int, h: int, v: int, chunk: int, dtype: torch.dtype, has_bias: bool, with_entropy: bool,
                    which: str, dhidden_f32: bool = True) -> int:
    """CUDA scratch bytes of one call (which: "forward", "lean" or "fast"; rlk_common.cuda_workspace_bytes)."""
    return int(common.cuda_workspace_bytes(core, n, h, v, chunk, dtype_name(dtype), has_bias, with_entropy,
                                           dhidden_f32)[which])


def _workspace(hidden: Tensor, v: int, chunk: int, has_bias: bool, with_entropy: bool, which: str,
               dhidden_f32: bool = True):
    if not PLATFORMS[hidden.device.type]["workspace"]:
        return None
    if which != "forward":
        _prepare_backward(hidden.device.index)
    nbytes = workspace_bytes(hidden.shape[0], hidden.shape[1], v, chunk, hidden.dtype, has_bias, with_entropy, which,
                             dhidden_f32)
    return torch.empty((nbytes,), dtype=torch.uint8, device=hidden.device) if nbytes > 0 else None


def _saved_like(hidden: Tensor, v: int, chunk: int, save_logits: bool) -> Tensor:
    """The saved logits: uint8 [saved_logits_bytes] (written by the forward), or the empty [0]."""
    nbytes = saved_logits_bytes(hidden.shape[0], v, chunk, hidden.dtype, hidden.device) if save_logits else 0
    return hidden.new_empty((nbytes,), dtype=torch.uint8)


def _saved(saved_logits: Tensor, hidden: Tensor, v: int, chunk: int) -> Optional[Tensor]:
    """The saved logits for the fast backward, or None (lean) for the empty [0] tensor."""
    if saved_logits.numel() == 0:
        return None
    want = saved_logits_bytes(hidden.shape[0], v, chunk, hidden.dtype, hidden.device)
    if tuple(saved_logits.shape) != (want,) or saved_logits.dtype != torch.uint8:
        raise ValueError(f"saved_logits must be the forward's saved logits, uint8 [{want}], or an empty [0] "
                         f"tensor (lean backward), got {tuple(saved_logits.shape)} {saved_logits.dtype}")
    return saved_logits


def _temp(temperature: Tensor) -> Tensor:
    return temperature.detach().to(F32).contiguous()


def _keep(keep: Optional[Tensor]) -> Optional[Tensor]:
    """The nucleus as the kernels read it: uint8 [n, V_local] (bool viewed, no copy when contiguous)."""
    return None if keep is None else keep.detach().contiguous().view(torch.uint8)


def _keep_sum_like(hidden: Tensor, v: int, chunk: int, keep: Optional[Tensor]) -> Tensor:
    """The kept sums: f32 [n, v/chunk] with a nucleus, else the empty [0]."""
    shape = (hidden.shape[0], v // chunk) if keep is not None else (0,)
    return hidden.new_empty(shape, dtype=F32)


# ---- rlk::forward_stats ---------------------------------------------------------------------------

def _forward_stats(hidden, weight, bias, targets, temperature, vocab_start, real_vocab, chunk, ignore_index,
                   with_entropy, save_logits, keep=None, combine_into=(), log_s_keep=None):
    """(stats, target_logit, saved logits, keep_sum); with combine_into = (logp, entropy, m, log_s) (a
    call over the whole vocab) the same C++ call also combines the statistics into them (and, with a
    nucleus, into log_s_keep)."""
    n, v = hidden.shape[0], weight.shape[0]
    if chunk <= 0 or v % chunk:
        raise ValueError(f"chunk {chunk} must divide the local vocab {v}")
    stats = torch.empty((n, v // chunk, W), dtype=F32, device=hidden.device)
    tl = torch.empty((n,), dtype=F32, device=hidden.device)
    saved_logits = _saved_like(hidden, v, chunk, save_logits)
    keep_sum = _keep_sum_like(hidden, v, chunk, keep)
    if n == 0:
        return stats, tl, saved_logits, keep_sum
    forward_into(hidden, weight, bias, targets, _temp(temperature), stats, tl, saved_logits if save_logits else None,
                 _workspace(hidden, v, chunk, bias is not None, with_entropy, "forward"), vocab_start, real_vocab,
                 chunk, ignore_index, with_entropy, combine_into, keep=keep,
                 keep_sum=keep_sum if keep is not None else None, log_s_keep=log_s_keep)
    return stats, tl, saved_logits, keep_sum


def forward_into(hidden, weight, bias32, targets, temperature32, stats, tl, saved_logits, workspace, vocab_start,
                 real_vocab, chunk, ignore_index, with_entropy, combine_into=(), *, keep=None, keep_sum=None,
                 log_s_keep=None) -> None:
    """The compiled forward writing into buffers the caller owns (the rollout path allocates nothing):
    stats [n, v/chunk, W] f32, tl [n] f32, saved_logits or None, workspace (CUDA scratch bytes) or
    None; with combine_into = (logp, entropy, m, log_s) the same call combines the whole vocab into them.
    keep: a nucleus (bool [n, v]) with keep_sum [n, v/chunk] f32 and, combining, log_s_keep [n] f32.
    temperature32 [n] f32 contiguous, targets [n] int32; a non-contiguous input is copied (allocates)."""
    logp, entropy, m, log_s = combine_into or (None,) * 4
    with _on(hidden):
        _kernel(core.forward, hidden=_c(hidden), weight=_c(weight), bias=_c(bias32), targets=_c(targets),
                temperature=temperature32, stats=stats, target_logit=tl, saved_logits=saved_logits,
                workspace=workspace, vocab_start=int(vocab_start), real_vocab=int(real_vocab), chunk=int(chunk),
                ignore_index=int(ignore_index), with_entropy=bool(with_entropy), stream=_stream(hidden), logp=logp,
                entropy=entropy, m=m, log_s=log_s, keep=_keep(keep), keep_sum=keep_sum, log_s_keep=log_s_keep)


def combine_to(stats, target_logit, targets, logp, ent, m, log_s, real_vocab, ignore_index, keep_sum=None,
               log_s_keep=None) -> None:
    """rlk::combine writing into the caller's [n] f32 buffers (logp, entropy, m, log_s; with the kept
    sums keep_sum [n, chunks], the nucleus's logp and log_s_keep)."""
    with _on(stats):
        _kernel(core.combine, stats=_c(stats), target_logit=_c(target_logit), targets=_c(targets), logp=logp,
                entropy=ent, m=m, log_s=log_s, real_vocab=int(real_vocab), ignore_index=int(ignore_index),
                stream=_stream(stats), keep_sum=_c(keep_sum), log_s_keep=log_s_keep)


@_op("forward_stats")
def forward_stats(hidden: Tensor, weight: Tensor, bias: Optional[Tensor], targets: Tensor, temperature: Tensor,
                  vocab_start: int, real_vocab: int, chunk: int, ignore_index: int, with_entropy: bool,
                  save_logits: bool, keep: Optional[Tensor] = None) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
    """(stats [n, v/chunk, 3] f32, target_logit [n] f32 (0 unless the target is in this shard; with
    keep, -inf when it is outside the nucleus), saved logits uint8 [saved_logits_bytes] or [0], keep_sum
    [n, v/chunk] f32 (the nucleus's sum of exp(z - m_chunk) per chunk) or [0] without keep)."""
    return _forward_stats(hidden, weight, bias, targets, temperature, vocab_start, real_vocab, chunk, ignore_index,
                          with_entropy, save_logits, keep)


@forward_stats.register_fake
def _(*args, **kwargs):
    a = _args_of("forward_stats", args, kwargs)
    n, v = a.hidden.shape[0], a.weight.shape[0]
    return (a.hidden.new_empty((n, v // a.chunk, W), dtype=F32), a.hidden.new_empty((n,), dtype=F32),
            _saved_like(a.hidden, v, a.chunk, a.save_logits), _keep_sum_like(a.hidden, v, a.chunk, a.keep))


# ---- rlk::combine ---------------------------------------------------------------------------------

def _log_s_keep_like(t: Tensor, keep_given: bool) -> Tensor:
    return t.new_empty((t.shape[0] if keep_given else 0,), dtype=F32)


@_op("combine")
def combine(stats: Tensor, target_logit: Tensor, targets: Tensor, real_vocab: int, ignore_index: int,
            keep_sum: Optional[Tensor] = None) -> Tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """(logp, entropy, m, log_s, log_s_keep) [n] f32: m the row max, log_s = log sum exp(z - m)
    (lse = m + log_s), what the backward takes; with keep_sum [n, chunks] (every chunk's kept sums)
    logp is over the nucleus and log_s_keep = log sum_kept exp(z - m), else log_s_keep is [0]."""
    n = stats.shape[0]
    out = tuple(torch.empty((n,), dtype=F32, device=stats.device) for _ in range(4))
    log_s_keep = _log_s_keep_like(stats, keep_sum is not None)
    if n:
        combine_to(stats, target_logit, targets, *out, real_vocab, ignore_index, keep_sum,
                   log_s_keep if keep_sum is not None else None)
    return (*out, log_s_keep)


@combine.register_fake
def _(*args, **kwargs):
    a = _args_of("combine", args, kwargs)
    n = a.stats.shape[0]
    return (*(a.stats.new_empty((n,), dtype=F32) for _ in range(4)), _log_s_keep_like(a.stats, a.keep_sum is not None))


# ---- rlk::linear_logp_backward --------------------------------------------------------------------

@_op("linear_logp_backward", mutates_args=("saved_logits",))
def linear_logp_backward(hidden: Tensor, weight: Tensor, bias: Optional[Tensor], targets: Tensor,
                         temperature: Tensor, m: Tensor, log_s: Tensor, entropy: Optional[Tensor], g: Tensor,
                         e: Optional[Tensor], saved_logits: Tensor, vocab_start: int, real_vocab: int, chunk: int,
                         ignore_index: int, dhidden_f32: bool, keep: Optional[Tensor] = None,
                         log_s_keep: Optional[Tensor] = None) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
    """(dhidden [n, h] partial over this shard's vocab, dweight [v, h] in weight's dtype,
    dbias [v] f32 ([0] without bias), dtemperature [n] f32 partial).
    dhidden is f32 with dhidden_f32 (a vocab shard's part, to be summed over shards), else in
    hidden's dtype, rounded once from the f32 sum (no f32 [n, h] buffer).
    m, log_s: the combine's (the row max and log sum exp(z - m)).
    saved_logits: the forward's (fast; overwritten on CUDA) or an empty [0] tensor (lean).
    keep (the forward's nucleus) with log_s_keep (the combine's): the gradient of the nucleus's logp."""
    n, h, v = hidden.shape[0], hidden.shape[1], weight.shape[0]
    saved = _saved(saved_logits, hidden, v, chunk)
    dev = hidden.device
    dh = torch.empty((n, h), dtype=F32 if dhidden_f32 else hidden.dtype, device=dev)
    dw = torch.empty((v, h), dtype=weight.dtype, device=dev)
    db = torch.empty((v if bias is not None else 0,), dtype=F32, device=dev)
    dtemp = torch.empty((n,), dtype=F32, device=dev)
    if n == 0:
        dw.zero_(), db.zero_()
        return dh, dw, db, dtemp
    with_entropy = entropy is not None and e is not None
    with _on(hidden):
        _kernel(core.backward, hidden=_c(hidden), weight=_c(weight), bias=_c(bias), targets=_c(targets),
                temperature=_temp(temperature), m=_c(m), log_s=_c(log_s),
                entropy=_c(entropy) if with_entropy else None, g=_c(g.to(F32)),
                e=_c(e.to(F32)) if with_entropy else None, saved_logits=saved, dhidden=dh, dweight=dw,
                dbias=db if bias is not None else None, dtemp=dtemp,
                workspace=_workspace(hidden, v, chunk, bias is not None, with_entropy,
                                     "lean" if saved is None else "fast", dhidden_f32),
                vocab_start=int(vocab_start), real_vocab=int(real_vocab), chunk=int(chunk),
                ignore_index=int(ignore_index), stream=_stream(hidden), keep=_keep(keep),
                log_s_keep=_c(log_s_keep) if keep is not None else None)
    return dh, dw, db, dtemp


@linear_logp_backward.register_fake
def _(*args, **kwargs):
    a = _args_of("linear_logp_backward", args, kwargs)
    n, h, v = a.hidden.shape[0], a.hidden.shape[1], a.weight.shape[0]
    return (a.hidden.new_empty((n, h), dtype=F32 if a.dhidden_f32 else a.hidden.dtype), a.weight.new_empty((v, h)),
            a.hidden.new_empty((v if a.bias is not None else 0,), dtype=F32), a.hidden.new_empty((n,), dtype=F32))


# ---- rlk::linear_logp (one shard: the whole vocab) and its autograd ------------------------------

@_op("linear_logp")
def linear_logp(hidden: Tensor, weight: Tensor, bias: Optional[Tensor], targets: Tensor, temperature: Tensor,
                real_vocab: int, chunk: int, ignore_index: int, with_entropy: bool,
                save_logits: bool, keep: Optional[Tensor] = None) -> Tuple[Tensor, Tensor, Tensor, Tensor, Tensor,
                                                                          Tensor]:
    """(logp, entropy, m, log_s, saved_logits, log_s_keep): [n] f32 each, entropy zeros unless with_entropy,
    m and log_s the row's max and log sum exp(z - m) (the backward's), the saved logits for the fast
    backward ([0] unless save_logits), and with a nucleus `keep` (logp over it) its log_s_keep (else
    [0]). No autograd of its own: see LinearLogp."""
    logp, ent, m, log_s = (torch.empty((hidden.shape[0],), dtype=F32, device=hidden.device) for _ in range(4))
    log_s_keep = _log_s_keep_like(hidden, keep is not None)
    _, _, saved_logits, _ = _forward_stats(hidden, weight, bias, targets, temperature, 0, real_vocab, chunk, ignore_index,
                                     with_entropy, save_logits, keep, combine_into=(logp, ent, m, log_s),
                                     log_s_keep=log_s_keep if keep is not None else None)
    if not with_entropy:
        ent.zero_()
    return logp, ent, m, log_s, saved_logits, log_s_keep


@linear_logp.register_fake
def _(*args, **kwargs):
    a = _args_of("linear_logp", args, kwargs)
    n = a.hidden.shape[0]
    return (*(a.hidden.new_empty((n,), dtype=F32) for _ in range(4)),
            _saved_like(a.hidden, a.weight.shape[0], a.chunk, a.save_logits), _log_s_keep_like(a.hidden, a.keep is not None))


class SavedLogits:
    """The fast backward's bookkeeping on an autograd ctx (LinearLogp and the vocab-parallel path).

    The saved logits serve one backward: on CUDA it overwrites them with dlogit, so a second
    backward through the same graph (retain_graph=True) would read dlogit as logits. That is
    refused on every device alike (the CPU only reads them), before the saved tensors are unpacked
    (whose version check would give a less helpful error). This runs in eager mode only; under
    torch.compile, AOTAutograd guards the mutation itself: a backward compiled while the graph is
    retained works on a copy of the logits, one compiled without it is handed them as a donated
    buffer (no copy) and refuses retain_graph.
    The lean backward gets a fresh empty tensor, never a saved one: its declared mutation must not
    bump a saved tensor's version either."""

    @staticmethod
    def setup(ctx, save_logits: bool) -> None:
        ctx.save_logits, ctx.saved_logits_used = bool(save_logits), False

    @staticmethod
    def claim(ctx) -> None:
        if not ctx.save_logits:
            return
        if ctx.saved_logits_used:
            raise RuntimeError("torch_bridge.linear_logp: a second backward through the same graph with "
                               "backward='fast': its saved logits were consumed by the first backward. To "
                               "backpropagate through one forward more than once pass backward='lean' to "
                               "linear_logp and retain_graph=True to every backward but the last.")
        ctx.saved_logits_used = True

    @staticmethod
    def for_backward(ctx, saved: Tensor) -> Tensor:
        return saved if ctx.save_logits else saved.new_empty((0,))


class LinearLogp(torch.autograd.Function):
    """Autograd of rlk::linear_logp: (logp, entropy) of one shard holding the whole vocab.

    An autograd.Function rather than register_autograd on the op: the fast backward mutates the
    saved logits, and AOTAutograd (torch.compile, opcheck) cannot partition a graph whose backward
    mutates a tensor the forward op returns to the caller (torch 2.13: "Node ... was invalid, but
    is output"). Here the saved logits stay an intermediate of the Function, never an output."""

    @staticmethod
    def forward(ctx, hidden, weight, bias32, temperature, targets, real_vocab: int, chunk: int, ignore_index: int,
                with_entropy: bool, save_logits: bool, keep: Optional[Tensor] = None):
        logp, ent, m, log_s, saved_logits, log_s_keep = run(
            "linear_logp", hidden=hidden, weight=weight, bias=bias32, targets=targets, temperature=temperature,
            real_vocab=real_vocab, chunk=chunk, ignore_index=ignore_index, with_entropy=with_entropy,
            save_logits=save_logits, keep=keep)
        ctx.save_for_backward(hidden, weight, bias32, temperature, targets, m, log_s, ent, saved_logits, keep, log_s_keep)
        ctx.cfg = (real_vocab, chunk, ignore_index, with_entropy)
        SavedLogits.setup(ctx, save_logits)
        return logp, ent

    @staticmethod
    def backward(ctx, g, e):
        real_vocab, chunk, ignore_index, with_entropy = ctx.cfg
        saved = ctx.saved_tensors
        dh, dw, db, dtemp = backward_of_saved(ctx, saved, g, e, vocab_start=0, real_vocab=real_vocab, chunk=chunk,
                                              ignore_index=ignore_index, with_entropy=with_entropy, dhidden_f32=False)
        return dh, dw, (db if saved[2] is not None else None), dtemp, None, None, None, None, None, None, None


def backward_of_saved(ctx, saved, g, e, *, vocab_start: int, real_vocab: int, chunk: int, ignore_index: int,
                      with_entropy: bool, dhidden_f32: bool):
    """rlk::linear_logp_backward of what LinearLogp and the vocab-parallel Function save (`saved`:
    their ctx.saved_tensors, hidden, weight, bias32, temperature, targets, m, log_s, ent,
    saved_logits, keep, log_s_keep), for the upstream gradients g and e (None: zero); claims the
    saved logits (SavedLogits). -> (dh, dw, db, dtemp)."""
    SavedLogits.claim(ctx)
    hidden, weight, bias32, temperature, targets, m, log_s, ent, saved_logits, keep, log_s_keep = saved
    g = torch.zeros_like(m) if g is None else g.contiguous()
    e = (torch.zeros_like(m) if e is None else e.contiguous()) if with_entropy else None
    return run("linear_logp_backward", hidden=hidden, weight=weight, bias=bias32, targets=targets,
               temperature=temperature, m=m, log_s=log_s, entropy=ent if with_entropy else None, g=g, e=e,
               saved_logits=SavedLogits.for_backward(ctx, saved_logits), vocab_start=vocab_start,
               real_vocab=real_vocab, chunk=chunk, ignore_index=ignore_index, dhidden_f32=dhidden_f32, keep=keep,
               log_s_keep=log_s_keep if keep is not None else None)
