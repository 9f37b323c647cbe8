"""The linear-logp provider for vime (a Megatron-core RL trainer), in vime's own ABI.

vime loads `torch_bridge.vime.provider` by its dotted path (--linear-logp-provider) and calls
provider(request) with its LinearLogpRequest. This module never imports vime: it reads the request's
attributes (target_ids, logits, context.hidden / .projection.weight, .bias / .vocab_partition,
tensor_parallel_group, token_layout (or context_parallel), with_entropy, with_entropy_grad,
chunk_size, log_prob_keep_mask, temperature, metadata) and returns a Result with the attributes
vime's validation reads (logp [T, 1] f32, entropy [T] f32 or None, backend_id, contract_id,
provenance).

Never silently wrong: a request is served with vime's native numbers (within the dtype's rounding)
or refused with a ValueError/TypeError naming the request field and the fix (never vime's
unavailable marker for a malformed or contradictory request; never an AttributeError).

Routes (docs/vime.md: which to pick, and their measured price):
- "fused" (recompute from the context): context.hidden [T, H] (the output layer's exact input),
  this rank's weight [V_local, H] and bias and the vocab partition, through our kernels: the bits
  the rollout's score_sampled gives. The default whenever the context is usable. When the request
  also carries logits (vime always does), they are checked against the context, never used:
  (hidden @ W^T + b) / temperature on SAMPLE_ROWS sampled rows (auto, strict; every row in audit)
  within a tolerance from the dtypes (check_agreement).
- "logits" (reuse): the request's logits, or context.local_logits (the LM head's own, divided by
  the temperature here), through torch_bridge.logits: no second projection, TP and batch invariant
  over those logits. Chosen by context.reuse_local_logits (RL-Kernel's flag), by the switch, or
  when the context is missing or unusable.
The switch: request.metadata["rlk_route"], else env RLK_VIME_ROUTE: "auto" | "reuse" |
"recompute" (a forced route that cannot serve raises ValueError). provenance["route_reason"] and
["route_switch_source"] say which route ran and why; stats()["backend_ids"] counts them.
Temperature, as vime means it: the request's logits are divided by the rollout temperature
(metadata["logits_are_temperature_scaled"], default True; False, as vime's sparse top-p replay
sends them: divided here). The fused route divides hidden @ W^T (+ b) by request.temperature once,
in the kernels; pre-scaled logits with no temperature are refused on that route (no guessing).
The nucleus: log_prob_keep_mask [T, V_local] bool, or metadata["top_p_sparse_token_ids"] [T, K]
global ids, -1 padded (a row of only -1 keeps everything), turned into this rank's keep mask;
logp renormalized over the kept ids (a target outside: -inf), the entropy unmasked.
Sequence parallelism: when context.hidden is the output of megatron-core's sequence-parallel
gather (whose backward reduce-scatters dH), dH must not be all-reduced again. Signal:
context.sequence_parallel or metadata["sequence_parallel"]; without one, the gather is looked for in
hidden's autograd history; a signal False against a found gather is refused.
Metadata that contradicts the request (real_vocab_size / padded_vocab_size against the partition or
V_local x TP, tp_rank / tp_world_size against the group, cp_* against token_layout) is refused,
and so are keys that change the math and are not served (_UNSERVED_KEYS).
chunk_size: vime's token-row chunk (-1: none; k > 0: rows in chunks of k), which bounds the
[rows, V_local] fp32 temporaries of the logits route; the fused route has no such temporaries and
runs unchunked. Every route is row independent: any row split gives the same bits.

Modes (argument `mode`, else env RLK_MODE, else env RL_KERNEL_MODE (vime's launcher), else auto):
- off: the provider declares itself unavailable (vime's marker): vime's auto runs its native path.
- auto: fused or logits; when neither can serve, ProviderUnavailable (the marker): vime's auto runs
  its native path, vime's strict raises.
- strict: like auto, but unavailability raises StrictUnavailable (no marker), and the result is
  checked: fp32, entropy present when asked, attached to autograd when the inputs require grad,
  the kernel that ran on the request's device; the values (logp <= 0 and not NaN, -inf only under
  a nucleus, entropy in [0, log V]); logp on the sampled rows against the reference on the same
  inputs (AUDIT_MAX_ABS_DLOGP).
- audit: strict's checks on every row, recorded in stats()["audit"]; the logits' agreement with the
  context on every row.
Every mode checks the result's rows and device, and refuses a logp detached from autograd while
request.logits require grad (a lost policy gradient). The route, backend and contract are logged
once per change through logging.getLogger("rlk"), never per call. Checks that read values on the
host are skipped inside CUDA graph capture (provenance["checks"] says so); a tensor temperature is
never read on the host.
"""
from __future__ import annotations

import dataclasses
import logging
import math
import os
import threading
from typing import Any, Mapping, Optional

import numpy as np
import torch

from rlk_common.routes import RequestLog

from .. import reference, routes
from .._args import chunk_of, unsupported
from .._core import core
from ..linear_logp import linear_logp
from ..logits import logp_from_logits

F32 = torch.float32
IGNORE_INDEX = -100
AUDIT_MAX_ABS_DLOGP = 1e-3  # audit: |ours - reference| on the same inputs (both fp32 statistics)
CONTRACT = "rlk.linear_logp/v2"

log = logging.getLogger("rlk")


class ProviderUnavailable(RuntimeError):
    """This provider cannot serve the request; vime's auto mode falls back to its native path."""
    linear_logp_provider_unavailable = True


class StrictUnavailable(RuntimeError):
    """mode=strict or audit: the provider cannot serve the request (no fallback marker)."""


@dataclasses.dataclass(frozen=True)
class Result:
    logp: torch.Tensor                 # [T, 1] f32
    entropy: Optional[torch.Tensor]    # [T] f32, or None when the request asked none
    backend_id: str
    contract_id: str
    provenance: Mapping[str, Any]


# ---- reading vime's request ----------------------------------------------------------------------

ROUTE_ENV = "RLK_VIME_ROUTE"     # auto | reuse | recompute (request.metadata["rlk_route"] wins)
ROUTE_CHOICES = ("auto", "reuse", "recompute")
# metadata keys that change the math and that no route serves: refused, never ignored
_UNSERVED_KEYS = ("top_p_token_ids", "top_p_token_offsets", "top_k", "min_p")


@dataclasses.dataclass(frozen=True)
class _Req:
    """The request's fields, checked (ValueError/TypeError naming the field for a malformed request)."""
    targets: torch.Tensor            # [T]
    logits: Optional[torch.Tensor]   # [T, V_local], the request's
    local_logits: Optional[torch.Tensor]  # context.local_logits (the LM head's own, not temperature-scaled)
    hidden: Optional[torch.Tensor]   # [T, H]
    weight: Optional[torch.Tensor]
    bias: Optional[torch.Tensor]
    partition: Any                   # (local_start, local_size, real_size, padded_size) or None
    group: Any                       # None when TP = 1
    tp: int
    tp_rank: int
    cp: tuple                        # (layout, world_size, rank)
    with_entropy: bool
    with_entropy_grad: bool
    row_chunk: int                   # 0: none
    keep: Optional[torch.Tensor]     # [T, V_local] bool: log_prob_keep_mask, or built from sparse ids
    sparse_ids: bool                 # keep came from metadata["top_p_sparse_token_ids"]
    temperature: Any                 # float or [T] f32 tensor
    temperature_given: bool
    logits_scaled: bool
    real_vocab: Optional[int]        # for the logits route without a context (metadata)
    sequence_parallel: bool          # context.hidden is the output of Megatron's sequence-parallel gather
    sp_source: str
    route_switch: str                # auto | reuse | recompute
    switch_source: str
    reuse_flag: bool                 # context.reuse_local_logits

    @property
    def n(self) -> int:
        return self.targets.shape[0]

    @property
    def device(self) -> torch.device:
        return self.targets.device


def _tensor_or_none(x, name):
    if x is not None and not isinstance(x, torch.Tensor):
        raise TypeError(f"request.{name} must be a torch.Tensor or None, got {type(x).__name__}")
    return x


def _attr(obj, name: str, path: str, fix: str):
    if not hasattr(obj, name):
        raise ValueError(f"request.{path}.{name} is missing ({type(obj).__name__} has no attribute {name!r}): {fix}")
    return getattr(obj, name)


def _cp_layout(request, meta) -> tuple:
    layout = getattr(request, "token_layout", None) or getattr(request, "context_parallel", None)
    if layout is None:
        out = ("single", 1, 0)
    else:
        fix = "pass vime's TokenLayout(world_size, rank, layout)"
        out = tuple(_attr(layout, k, "token_layout", fix) for k in ("layout", "world_size", "rank"))
        out = (str(out[0]), int(out[1]), int(out[2]))
        kind, world, rank = out
        if world < 1 or not 0 <= rank < world or (kind == "single") != (world == 1) \
                or kind not in ("single", "zigzag", "allgather"):
            raise ValueError(f"request.token_layout (layout={kind!r}, world_size={world}, rank={rank}) is not a "
                             f"token layout: 0 <= rank < world_size, layout 'single' exactly when world_size == 1, "
                             f"else 'zigzag' or 'allgather'")
    for key, i in (("cp_layout", 0), ("cp_world_size", 1), ("cp_rank", 2)):
        if meta.get(key) is not None and meta[key] != out[i]:
            raise ValueError(f"request.metadata[{key!r}] = {meta[key]!r} contradicts request.token_layout "
                             f"({out[i]!r}): send one layout")
    return out


def _group(request, meta):
    group = getattr(request, "tensor_parallel_group", None)
    if group is None:
        tp, rank = 1, 0
    else:
        import torch.distributed as dist
        tp, rank = dist.get_world_size(group), dist.get_rank(group)
    for key, value in (("tp_rank", rank), ("tp_world_size", tp)):
        if meta.get(key) is not None and int(meta[key]) != value:
            raise ValueError(f"request.metadata[{key!r}] = {meta[key]!r} contradicts request.tensor_parallel_group "
                             f"({key} {value}): pass the group the logits are sharded over")
    return (group if tp > 1 else None), tp, rank


def _temperature(t, n: int, device):
    if t is None:
        return 1.0
    if isinstance(t, torch.Tensor):
        if t.numel() not in (1, n):
            raise ValueError(f"request.temperature must be a number, or a tensor of 1 or T = {n} elements, "
                             f"got shape {tuple(t.shape)}")
        if t.device != device:
            raise ValueError(f"request.temperature is on {t.device} but target_ids is on {device}")
        return t.reshape(-1).to(F32).expand(n)
    t = float(t)
    if not 0.0 < t < math.inf:
        raise ValueError(f"request.temperature must be finite and > 0, got {t}")
    return t


def _context(ctx, n: int, dev, logits):
    """(hidden, weight, bias, partition, local_logits, reuse flag) of vime's LinearLogpContext."""
    fix = "build it as vime's LinearLogpContext(hidden, LinearProjection(weight, bias), VocabPartition(...))"
    hidden = _tensor_or_none(_attr(ctx, "hidden", "context", fix), "context.hidden")
    proj = _attr(ctx, "projection", "context", fix)
    if isinstance(proj, torch.Tensor):
        raise TypeError("request.context.projection is a bare tensor: pass an object with .weight [V_local, H] "
                        "and .bias (vime's LinearProjection(weight=..., bias=...))")
    weight = _tensor_or_none(_attr(proj, "weight", "context.projection", fix), "context.projection.weight")
    bias = _tensor_or_none(getattr(proj, "bias", None), "context.projection.bias")
    vp = _attr(ctx, "vocab_partition", "context", "pass VocabPartition(local_start, local_size, real_size, "
                                                  "padded_size), this rank's shard of the padded vocab")
    try:
        partition = tuple(int(getattr(vp, k)) for k in ("local_start", "local_size", "real_size", "padded_size"))
    except (AttributeError, TypeError) as e:
        raise ValueError(f"request.context.vocab_partition must have integer local_start, local_size, real_size "
                         f"and padded_size: {e}") from None
    start, size, real, padded = partition
    if start < 0 or size <= 0 or not 0 < real <= padded or start + size > padded:
        raise ValueError(f"request.context.vocab_partition {partition} is not a shard of the padded vocab "
                         f"(0 <= local_start, local_start + local_size <= padded_size, 0 < real_size <= padded_size)")
    if hidden is None or weight is None or hidden.dim() != 2 or hidden.shape[0] != n or hidden.device != dev:
        raise ValueError(f"request.context.hidden must be [T = {n}, H] on {dev}, got "
                         f"{None if hidden is None else (tuple(hidden.shape), str(hidden.device))}")
    if weight.dim() != 2 or weight.shape[1] != hidden.shape[1] or weight.device != dev:
        raise ValueError(f"request.context.projection.weight must be [V_local, H = {hidden.shape[1]}] on {dev}, got "
                         f"{tuple(weight.shape)} on {weight.device}")
    if bias is not None and (tuple(bias.shape) != (weight.shape[0],) or bias.device != dev):
        raise ValueError(f"request.context.projection.bias must be [V_local = {weight.shape[0]}] on {dev}, got "
                         f"{tuple(bias.shape)} on {bias.device}")
    local = _tensor_or_none(getattr(ctx, "local_logits", None), "context.local_logits")
    for name, rows in (("context.projection.weight", weight.shape[0]),
                       ("logits", None if logits is None else logits.shape[1]),
                       ("context.local_logits", None if local is None else local.shape[1])):
        if rows is not None and rows != size:
            raise ValueError(f"request.{name} has {rows} vocab entries, context.vocab_partition.local_size is {size}")
    if local is not None and (local.dim() != 2 or local.shape[0] != n or local.device != dev):
        raise ValueError(f"request.context.local_logits must be [T = {n}, V_local] on {dev}, got "
                         f"{tuple(local.shape)} on {local.device}")
    return hidden, weight, bias, partition, local, bool(getattr(ctx, "reuse_local_logits", False))


def _sparse_keep(ids, n: int, dev, start: int, v_local: int, padded: int) -> torch.Tensor:
    """[T, V_local] bool of this rank's vocab slice from the nucleus as ids ([T, K] global ids, -1
    padded; a row of only -1 has no recorded nucleus and keeps every id, as vime's dense mask)."""
    if not isinstance(ids, torch.Tensor) or ids.dim() != 2 or ids.shape[0] != n or ids.device != dev \
            or ids.dtype.is_floating_point or ids.dtype == torch.bool:
        raise ValueError(f"request.metadata['top_p_sparse_token_ids'] must be a [T = {n}, K] integer tensor on "
                         f"{dev} (-1 padded), got {type(ids).__name__} "
                         f"{getattr(ids, 'shape', '')} {getattr(ids, 'dtype', '')}")
    ids = ids.to(torch.int64)
    if ids.numel() and (bool((ids < -1).any()) or bool((ids >= padded).any())):
        raise ValueError(f"request.metadata['top_p_sparse_token_ids'] holds ids outside [-1, padded vocab "
                         f"{padded}): global token ids, -1 for padding")
    local = ids - start
    here = (ids >= 0) & (local >= 0) & (local < v_local)
    keep = torch.zeros((n, v_local + 1), dtype=torch.bool, device=dev)
    keep.scatter_(1, torch.where(here, local, torch.full_like(local, v_local)), True)
    keep = keep[:, :v_local]
    return keep | ~(ids >= 0).any(dim=1, keepdim=True)


def _sp_gather_in_history(hidden: torch.Tensor, depth: int = 8) -> bool:
    """Whether hidden's autograd history holds megatron-core's sequence-parallel gather within a few
    nodes (vime reshapes and slices the gathered rows before the request)."""
    nodes, seen = [hidden.grad_fn], 0
    while nodes and seen < 4 * depth:
        node = nodes.pop(0)
        seen += 1
        if node is None:
            continue
        if "GatherFromSequenceParallelRegion" in type(node).__name__:
            return True
        nodes.extend(f for f, _ in node.next_functions)
    return False


def _sequence_parallel(ctx, meta, hidden, group) -> tuple:
    said = [(src, bool(v)) for src, v in (("context.sequence_parallel", getattr(ctx, "sequence_parallel", None)),
                                          ("metadata['sequence_parallel']", meta.get("sequence_parallel")))
            if v is not None]
    if len(said) == 2 and said[0][1] != said[1][1]:
        raise ValueError("request.context.sequence_parallel and request.metadata['sequence_parallel'] disagree")
    seen = group is not None and hidden.requires_grad and _sp_gather_in_history(hidden)
    if said:
        src, sp = said[0]
        if seen and not sp:
            raise ValueError(f"request.{src} is False but context.hidden comes from Megatron's sequence-parallel "
                             f"gather (whose backward reduce-scatters dH): set it True")
        return sp and group is not None, src
    return seen, "detected (gather in context.hidden's history)" if seen else "default (no signal)"


def _route_switch(meta) -> tuple:
    if meta.get("rlk_route") is not None:
        value, src = str(meta["rlk_route"]), "metadata['rlk_route']"
    elif os.environ.get(ROUTE_ENV):
        value, src = os.environ[ROUTE_ENV], f"env {ROUTE_ENV}"
    else:
        return "auto", "default"
    if value not in ROUTE_CHOICES:
        raise ValueError(f"{'request.' if src.startswith('metadata') else ''}{src} must be one of {ROUTE_CHOICES}, "
                         f"got {value!r}")
    return value, src


def _read(request) -> _Req:
    targets = _tensor_or_none(getattr(request, "target_ids", None), "target_ids")
    if targets is None or targets.dim() != 1 or targets.dtype.is_floating_point or targets.dtype == torch.bool:
        raise ValueError(f"request.target_ids must be [T] integer ids, got "
                         f"{None if targets is None else (tuple(targets.shape), targets.dtype)}")
    n, dev = targets.shape[0], targets.device
    logits = _tensor_or_none(getattr(request, "logits", None), "logits")
    if logits is not None and (logits.dim() != 2 or logits.shape[0] != n or logits.device != dev):
        raise ValueError(f"request.logits must be [T = {n}, V_local] on {dev}, got {tuple(logits.shape)} on "
                         f"{logits.device}")
    meta = getattr(request, "metadata", None)
    meta = {} if meta is None else meta
    if not isinstance(meta, Mapping):
        raise TypeError(f"request.metadata must be a mapping, got {type(meta).__name__}")
    for key in _UNSERVED_KEYS:
        if meta.get(key) is not None:
            raise ValueError(f"request.metadata[{key!r}] changes the math and this provider does not serve it: "
                             f"send the nucleus as metadata['top_p_sparse_token_ids'] or log_prob_keep_mask")
    ctx = getattr(request, "context", None)
    hidden = weight = bias = partition = local = None
    reuse_flag = False
    if ctx is not None:
        hidden, weight, bias, partition, local, reuse_flag = _context(ctx, n, dev, logits)
    if logits is None and ctx is None:
        raise ValueError("request has neither logits nor context")
    group, tp, tp_rank = _group(request, meta)
    v_local = logits.shape[1] if logits is not None else weight.shape[0]
    real = meta.get("real_vocab_size")
    real = None if real is None else int(real)
    padded = partition[3] if partition is not None else v_local * tp
    if real is not None and partition is not None and real != partition[2]:
        raise ValueError(f"request.metadata['real_vocab_size'] = {real} contradicts "
                         f"request.context.vocab_partition.real_size = {partition[2]}: send one vocab")
    if real is not None and not 0 < real <= padded:
        raise ValueError(f"request.metadata['real_vocab_size'] = {real} is outside (0, {padded}], the padded vocab "
                         f"(V_local {v_local} x TP {tp}): an id with no logit column cannot be scored")
    if meta.get("padded_vocab_size") is not None and int(meta["padded_vocab_size"]) != padded:
        raise ValueError(f"request.metadata['padded_vocab_size'] = {meta['padded_vocab_size']} contradicts the "
                         f"request's padded vocab {padded} (vocab_partition.padded_size, else V_local x TP)")
    keep = _tensor_or_none(getattr(request, "log_prob_keep_mask", None), "log_prob_keep_mask")
    if keep is not None and (tuple(keep.shape) != (n, v_local) or keep.dtype != torch.bool or keep.device != dev):
        raise ValueError(f"request.log_prob_keep_mask must be [T, V_local] = ({n}, {v_local}) bool on {dev}, got "
                         f"{tuple(keep.shape)} {keep.dtype} on {keep.device}")
    sparse = meta.get("top_p_sparse_token_ids")
    if sparse is not None:
        if keep is not None:
            raise ValueError("request.log_prob_keep_mask and request.metadata['top_p_sparse_token_ids'] both set: "
                             "send the nucleus once")
        start = partition[0] if partition is not None else tp_rank * v_local
        keep = _sparse_keep(sparse, n, dev, start, v_local, padded)
    chunk = getattr(request, "chunk_size", -1)
    chunk = -1 if chunk is None else chunk
    if isinstance(chunk, bool) or not isinstance(chunk, int) or not (chunk == -1 or chunk > 0):
        raise ValueError(f"request.chunk_size must be -1 (no row chunking) or a positive row count, got {chunk!r}")
    with_entropy = bool(getattr(request, "with_entropy", False))
    t_raw = getattr(request, "temperature", None)
    sp, sp_src = _sequence_parallel(ctx, meta, hidden, group) if hidden is not None else (False, "no context")
    switch, switch_src = _route_switch(meta)
    return _Req(targets=targets, logits=logits, local_logits=local, hidden=hidden, weight=weight, bias=bias,
                partition=partition, group=group, tp=tp, tp_rank=tp_rank, cp=_cp_layout(request, meta),
                with_entropy=with_entropy,
                with_entropy_grad=with_entropy and bool(getattr(request, "with_entropy_grad", False)),
                row_chunk=max(chunk, 0), keep=keep, sparse_ids=sparse is not None,
                temperature=_temperature(t_raw, n, dev), temperature_given=t_raw is not None,
                logits_scaled=bool(meta.get("logits_are_temperature_scaled", True)), real_vocab=real,
                sequence_parallel=sp, sp_source=sp_src, route_switch=switch, switch_source=switch_src,
                reuse_flag=reuse_flag)


# ---- routes --------------------------------------------------------------------------------------

def _fused_unavailable(r: _Req) -> Optional[str]:
    if r.hidden is None:
        return "no context"
    why = unsupported(r.hidden)
    if why is not None:
        return why
    if r.weight.dtype != r.hidden.dtype:
        return f"context weight dtype {r.weight.dtype} differs from hidden dtype {r.hidden.dtype}"
    return _partition_unsupported(r)


def _partition_unsupported(r: _Req) -> Optional[str]:
    """Both routes take rank r's equal contiguous shard of the padded vocab (as Megatron's)."""
    if r.partition is None:
        return None
    start, size, _, padded = r.partition
    if start != r.tp_rank * size or padded != r.tp * size:
        return (f"vocab partition {r.partition} is not the equal contiguous shard of rank {r.tp_rank} of {r.tp} "
                f"(local_start = rank * local_size, padded_size = TP * local_size)")
    return None


def _logits_unavailable(r: _Req) -> Optional[str]:
    if r.logits is None:
        return "no logits"
    if not r.logits.dtype.is_floating_point:
        return f"logits dtype {r.logits.dtype}"
    return unsupported(r.logits.new_empty((0,), dtype=F32)) or _partition_unsupported(r)


def _route(r: _Req) -> tuple:
    """(route, why, r to run) or (None, why none can serve, r). The switch (metadata["rlk_route"],
    else env RLK_VIME_ROUTE) forces a route; a forced route that cannot serve raises ValueError.
    Otherwise context.reuse_local_logits selects reuse (unavailable if the logits route cannot
    serve), and without it the context is used."""
    reuse = r.route_switch == "reuse" or (r.route_switch == "auto" and r.reuse_flag)
    if reuse:
        src = r.switch_source if r.route_switch == "reuse" else "context.reuse_local_logits"
        if r.local_logits is not None:  # the LM head's own logits: divided by the temperature here
            r = dataclasses.replace(r, logits=r.local_logits, logits_scaled=False)
        why = _logits_unavailable(r)
        if why is not None and r.route_switch == "reuse":
            raise ValueError(f"{src} = 'reuse', but the logits route cannot serve this request: {why}")
        if why is not None:
            return None, f"{src} asks to reuse the logits; logits route: {why}", r
        used = "context.local_logits" if r.local_logits is not None else "request.logits"
        return "logits", f"reuse {used} ({src}): no second projection", r
    fused = _fused_unavailable(r)
    if r.route_switch == "recompute":
        if fused is not None:
            raise ValueError(f"{r.switch_source} = 'recompute', but the context cannot serve this request: {fused}")
        return "fused", f"recompute from the context ({r.switch_source}): the rollout's bits", r
    if fused is None:
        return "fused", ("recompute from the context (default; the request's logits are checked, not used)"
                         if r.logits is not None else "recompute from the context (no logits)"), r
    logits = _logits_unavailable(r)
    if logits is None:
        return "logits", f"reuse request.logits (the context cannot serve: {fused})", r
    return None, f"fused route: {fused}; logits route: {logits}", r


def _temp_rows(r: _Req, sl: slice):
    return r.temperature[sl] if isinstance(r.temperature, torch.Tensor) else r.temperature


def _vocab(r: _Req) -> tuple:
    """(vocab_start, real vocab, padded vocab) of this rank."""
    if r.partition is not None:
        start, _, real, padded = r.partition
        return start, real, padded
    v_local = r.logits.shape[1]
    padded = v_local * r.tp
    return r.tp_rank * v_local, (padded if r.real_vocab is None else r.real_vocab), padded


def _scaled_logits(r: _Req, sl: slice) -> torch.Tensor:
    z = r.logits[sl].to(F32)
    if r.logits_scaled:
        return z
    t = _temp_rows(r, sl)
    return z / (t[:, None] if isinstance(t, torch.Tensor) else t)


def _fused(r: _Req, sl: slice):
    start, real, _ = _vocab(r)
    out = linear_logp(r.hidden[sl], r.weight, r.targets[sl], bias=r.bias, temperature=_temp_rows(r, sl),
                      ignore_index=IGNORE_INDEX, return_entropy=r.with_entropy,
                      vocab_start=start if r.group is not None else None, real_vocab_size=real, tp_group=r.group,
                      mode="strict", keep_mask=None if r.keep is None else r.keep[sl],
                      # under sequence parallelism the gather's backward reduce-scatters (sums) dH
                      reduce_grad_hidden=not r.sequence_parallel)
    return out if r.with_entropy else (out, None)


def _from_logits(r: _Req, sl: slice):
    start, real, _ = _vocab(r)
    return logp_from_logits(_scaled_logits(r, sl), r.targets[sl], keep_mask=None if r.keep is None else r.keep[sl],
                            vocab_start=start, real_vocab=real, tp_group=r.group, with_entropy=r.with_entropy,
                            ignore_index=IGNORE_INDEX)


def _reference(r: _Req, sl, with_entropy: bool, source: str):
    """Materialized fp32 logits (the request's, or hidden @ W^T (+ b) / T) and log_softmax; the
    nucleus-renormalized logp under a keep mask, the unmasked entropy."""
    start, real, _ = _vocab(r)
    n = r.targets[sl].shape[0]
    if source == "logits":
        z = _scaled_logits(r, sl)
    else:
        from .. import _dist
        h = _dist.copy_to(r.hidden[sl], r.group)
        z = h.to(F32) @ r.weight.to(F32).T
        if r.bias is not None:
            z = z + r.bias.to(F32)
        t = _temp_rows(r, sl)
        z = z / (_dist.copy_to(t, r.group)[:, None] if isinstance(t, torch.Tensor) else t)
    kw = dict(vocab_start=start, real_vocab=real, ignore_index=IGNORE_INDEX, tp_group=r.group)
    one = torch.ones((n,), dtype=F32, device=z.device)
    logp, ent = reference.logits_rows(z, r.targets[sl], one, with_entropy=with_entropy, **kw)
    if r.keep is not None:
        logp, _ = reference.logits_rows(z.masked_fill(~r.keep[sl], float("-inf")), r.targets[sl], one, **kw)
    return logp, (ent if with_entropy else None)


def _run(r: _Req, step, chunked: bool = True):
    """step(slice) over the row chunks (chunked), concatenated: (logp [T], entropy [T] or None)."""
    if not chunked or not r.row_chunk or r.n <= r.row_chunk:
        return step(slice(None))
    parts = [step(slice(i, i + r.row_chunk)) for i in range(0, r.n, r.row_chunk)]
    logp = torch.cat([p[0] for p in parts])
    return logp, (torch.cat([p[1] for p in parts]) if parts[0][1] is not None else None)


# ---- checks, identity, counters ------------------------------------------------------------------

SAMPLE_ROWS = 32  # strict's checks against the reference: the first and last row and a stride, <= 34 rows


def _sample(n: int) -> torch.Tensor:
    """The rows strict compares: 0, n - 1 and every ceil(n / SAMPLE_ROWS)-th row (the same rows on
    every TP rank: the reference's collectives line up)."""
    step = max(1, -(-n // SAMPLE_ROWS))
    return torch.tensor(sorted(set(range(0, n, step)) | {n - 1}), dtype=torch.int64)


def _row_blocks(r: _Req, rows: Optional[torch.Tensor]):
    """Index tensors over `rows` (None: every row) in blocks of the row chunk (default 1024)."""
    idx = torch.arange(r.n) if rows is None else rows
    size = r.row_chunk or 1024
    return [idx[i:i + size].to(r.device) for i in range(0, idx.numel(), size)]


def _eps(dtype) -> float:
    return torch.finfo(dtype).eps if dtype.is_floating_point else 0.0


def check_agreement(r: _Req, rows: Optional[torch.Tensor] = None) -> None:
    """The request's logits against the context they should come from, (hidden @ W^T + b), divided by
    the temperature when the logits are pre-scaled, on `rows` (None: all). Tolerance per element:
    2 eps |z| for the rounding of the logits (eps of the coarser of the logits' and the context's
    dtypes: Megatron's GEMM rounds its output to the input dtype) plus 16 sqrt(H) eps_fp32 (|h| @ |W|^T
    + |b|) for the accumulation order. ValueError naming the fields."""
    eps = max(_eps(r.logits.dtype), _eps(r.hidden.dtype))
    h_dim = r.hidden.shape[1]
    total, first = 0, None
    with torch.no_grad():
        for idx in _row_blocks(r, rows):
            h = r.hidden[idx].to(F32)
            w = r.weight.to(F32)
            z = h @ w.T
            bound = h.abs() @ w.abs().T
            if r.bias is not None:
                z, bound = z + r.bias.to(F32), bound + r.bias.to(F32).abs()
            t = r.temperature[idx][:, None] if isinstance(r.temperature, torch.Tensor) else r.temperature
            given = r.logits[idx].to(F32)
            if not r.logits_scaled:
                given = given / t
            z, bound = z / t, bound / (t.abs() if isinstance(t, torch.Tensor) else abs(t))
            tol = 2 * eps * z.abs() + 16 * math.sqrt(h_dim) * torch.finfo(F32).eps * bound
            d = (given - z).abs()
            bad = ~(d <= tol) & ~(torch.isnan(given) & torch.isnan(z))
            count = int(bad.sum())
            if count and first is None:
                i, j = (int(k) for k in bad.nonzero()[0])
                first = (f"row {int(idx[i])}, vocab column {j}: logits {float(given[i, j]):.6g}, (hidden @ weight^T + "
                         f"bias) / temperature {float(z[i, j]):.6g} (tolerance {float(tol[i, j]):.3g})")
            total += count
    if r.group is not None:  # every rank raises, or none: the ranks' collectives stay in step
        flag = torch.tensor([total], dtype=torch.int64, device=r.device)
        torch.distributed.all_reduce(flag, group=r.group)
        total = int(flag)
    if total:
        raise ValueError(
            f"request.logits disagree with request.context: {first or 'on another tensor-parallel rank'} "
            f"for {_dtype(r.logits)} logits from a {_dtype(r.hidden)} context; {total} elements. The fix: capture "
            f"context.hidden as the exact input of the output layer that made the logits, and send "
            f"request.temperature with metadata['logits_are_temperature_scaled'] as the logits are; or reuse "
            f"the logits (metadata['rlk_route'] = 'reuse', env {ROUTE_ENV}=reuse)")


def _check_route_inputs(r: _Req, route: str) -> None:
    """Before running: refusals that no mode may pass (ValueError naming the field and the fix)."""
    if route != "fused":
        return
    if r.logits is not None and r.logits_scaled and not r.temperature_given:
        raise ValueError("request.temperature is None, but metadata['logits_are_temperature_scaled'] says the "
                         "request's logits are divided by a temperature and the context route must divide "
                         "hidden @ W^T by the same one: send request.temperature (the rollout temperature), or "
                         "reuse the logits (metadata['rlk_route'] = 'reuse')")
    if torch.is_grad_enabled() and r.logits is not None and r.logits.requires_grad \
            and not _inputs_require_grad(r, route):
        raise ValueError("request.logits require grad but request.context.hidden / projection.weight / bias do "
                         "not: logp from the context would be detached and the policy gradient lost. Capture the "
                         "context without .detach() (or under torch.no_grad() for none of them), or reuse the "
                         f"logits (metadata['rlk_route'] = 'reuse', env {ROUTE_ENV}=reuse)")


def _inputs_require_grad(r: _Req, route: str) -> bool:
    ts = [r.logits] if route == "logits" else [r.hidden, r.weight, r.bias]
    if isinstance(r.temperature, torch.Tensor) and not (route == "logits" and r.logits_scaled):
        ts.append(r.temperature)
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in ts)


def _check_rows(r: _Req, logp, ent) -> None:
    """Every mode: the result's rows and device are the request's."""
    if tuple(logp.shape) != (r.n, 1) or logp.device != r.device:
        raise RuntimeError(f"torch_bridge.vime: logp is {tuple(logp.shape)} on {logp.device}, the request has "
                           f"{r.n} rows on {r.device}")
    if ent is not None and (tuple(ent.shape) != (r.n,) or ent.device != r.device):
        raise RuntimeError(f"torch_bridge.vime: entropy is {tuple(ent.shape)} on {ent.device}, the request has "
                           f"{r.n} rows on {r.device}")


def _check_values(r: _Req, logp, ent) -> None:
    """strict: on rows with a scoreable target, logp <= 0 and not NaN (-inf only where a nucleus
    leaves the target out), entropy finite in [0, log real vocab]; ignored rows 0."""
    _, real, _ = _vocab(r)
    t = r.targets.to(torch.int64)
    ignored = t == IGNORE_INDEX
    scored = ~ignored & (t >= 0) & (t < real)
    lp = logp.detach().reshape(-1)
    bad = scored & (torch.isnan(lp) | (lp > 0) | (torch.isneginf(lp) if r.keep is None else torch.zeros_like(scored)))
    bad |= ignored & (lp != 0)
    if ent is not None:
        e = ent.detach()
        slack = 1e-4 + 1e-5 * math.log(real)
        bad |= scored & ~((e >= -slack) & (e <= math.log(real) + slack))
    if bool(bad.any()):
        i = int(bad.nonzero()[0])
        raise RuntimeError(f"strict: row {i}: logp {float(lp[i])}" +
                           ("" if ent is None else f", entropy {float(ent.detach()[i])}") +
                           f" is not a log-probability (logp <= 0, entropy in [0, log {real}]); "
                           f"{int(bad.sum())} rows in all: a NaN in the inputs or a bug; mode audit compares all rows")


def _check_strict(r: _Req, route: str, kernel: Optional[str], logp, ent) -> None:
    if logp.dtype != F32 or (ent is not None and ent.dtype != F32):
        raise RuntimeError(f"strict: logp/entropy must be float32, got {logp.dtype}/{None if ent is None else ent.dtype}")
    if r.with_entropy and ent is None:
        raise RuntimeError("strict: the request asked for entropy and none was computed")
    if _inputs_require_grad(r, route):
        if not logp.requires_grad:
            raise RuntimeError("strict: logp is detached although the inputs require grad")
        if r.with_entropy_grad and not ent.requires_grad:
            raise RuntimeError("strict: entropy is detached although with_entropy_grad and the inputs require grad")
    if route == "fused" and r.n and (kernel is None or not kernel.startswith(r.device.type)):
        raise RuntimeError(f"strict: route mismatch: {r.device.type} inputs but the kernels that ran were {kernel!r}")


def _kernel_ran(before: dict, after: dict) -> Optional[str]:
    ran = [k for k in after if after[k]["fwd_calls"] > before.get(k, {}).get("fwd_calls", 0)]
    return ",".join(ran) if ran else None


def _source(r: _Req, route: str) -> str:
    """What a route reads: "logits" (the request's) or "context"."""
    if route == "reference":
        return "logits" if r.logits is not None else "context"
    return "logits" if route == "logits" else "context"


def _dtype(t: Optional[torch.Tensor]) -> str:
    return "none" if t is None else str(t.dtype).replace("torch.", "")


def contract_id(r: _Req, route: str, kernel: Optional[str]) -> str:
    """The numeric contract of a request on a route: what fixes its bits (TP size, CP layout,
    vocab partition and canonical chunk, input dtype, temperature source, nucleus, kernel)."""
    _, real, padded = _vocab(r)
    v_local = padded // r.tp
    src = r.logits if _source(r, route) == "logits" else r.hidden
    layout, cp, _ = r.cp
    temp = "context" if _source(r, route) == "context" else ("prescaled" if r.logits_scaled else "divided")
    return (f"{CONTRACT};route={route};kernel={kernel or route};dtype={_dtype(src)};tp={r.tp};cp={layout}x{cp};"
            f"vocab={real}/{padded};shard={v_local};chunk={chunk_of(padded, v_local)};temperature={temp};"
            f"topp={'ids' if r.sparse_ids else 'mask' if r.keep is not None else 'none'}")


def _provenance(r: _Req, mode: str, route: str, why: str, kernel, **extra) -> dict:
    start, real, padded = _vocab(r)
    layout, cp, cp_rank = r.cp
    p = {"mode": mode, "route": route, "route_reason": why, "kernel": kernel, "tp_rank": r.tp_rank, "tp_size": r.tp,
         "cp_rank": cp_rank, "cp_size": cp, "cp_layout": layout, "tokens": r.n,
         "row_chunk": r.row_chunk if r.row_chunk and route != "fused" else None,
         "vocab_start": start, "real_vocab": real, "padded_vocab": padded, "device": str(r.device),
         "logits_used": _source(r, route) == "logits",
         "temperature": "tensor" if isinstance(r.temperature, torch.Tensor) else r.temperature,
         "logits_are_temperature_scaled": r.logits_scaled, "with_entropy": r.with_entropy,
         "with_entropy_grad": r.with_entropy_grad, "top_p_mask": r.keep is not None,
         "top_p": "ids" if r.sparse_ids else ("mask" if r.keep is not None else None),
         "route_switch": r.route_switch, "route_switch_source": r.switch_source,
         "sequence_parallel": r.sequence_parallel, "sequence_parallel_source": r.sp_source}
    p.update(extra)
    return p


_log = RequestLog()
_lock = threading.Lock()
_logged: set = set()


def _note(mode: str, tokens: int, backend_id: Optional[str], contract: Optional[str], reason: Optional[str],
          why: Optional[str] = None) -> None:
    """Count one request (served as backend_id for `why`, or not for `reason`) and log each new
    combination once."""
    if reason is not None:
        _log.count_fallback(reason)
    _log.count_request(mode, tokens, backend_id, why)
    with _lock:
        key = (mode, backend_id, contract, reason)
        new = key not in _logged
        _logged.add(key)
    if new and reason is not None:
        log.warning("rlk vime provider unavailable (mode=%s): %s", mode, reason)
    elif new:
        log.info("rlk vime provider route: mode=%s backend_id=%s contract_id=%s", mode, backend_id, contract)


def stats() -> dict:
    """What to log per step, since the last reset: the frontends' route statistics schema
    (rlk_common.routes.RouteLog.stats) with the provider's extra keys requests, backend_ids and
    modes, and route_reasons (served requests per route and the reason it was chosen, the
    provenance's route_reason). fallbacks / fallback_total: the requests none of our routes served
    (vime's auto ran its native path for them; mode off's as "mode off"); audit: the audit mode's
    comparisons."""
    return _log.stats(core)


def reset_stats() -> None:
    """Zero the counters, the compiled module's too (as reset_route_stats does). The log lines
    are not repeated after a reset: a combination is logged once per process."""
    _log.reset(core)


def _capturing(r: _Req) -> bool:
    return r.device.type == "cuda" and torch.cuda.is_current_stream_capturing()


def _compare(r: _Req, route: str, logp: torch.Tensor, rows: Optional[torch.Tensor], what: str) -> dict:
    """logp against the reference on the same inputs at `rows` (None: every row; audit records
    the comparison); a row beyond AUDIT_MAX_ABS_DLOGP, or with another NaN/inf pattern, raises."""
    with torch.no_grad():
        parts = [_reference(r, idx, False, _source(r, route))[0] for idx in _row_blocks(r, rows)]
    ref = torch.cat(parts) if parts else logp.new_zeros((0,))
    ours = logp.detach().reshape(-1)
    if rows is not None:
        ours = ours[rows.to(r.device)]
    d, equal = routes.audit_diff(ours, ref)
    call = _log.audit.record(d, equal) if rows is None else None
    bad = np.flatnonzero(~equal & ~(d <= AUDIT_MAX_ABS_DLOGP))
    if bad.size:
        i = int(bad[0])
        row = i if rows is None else int(rows[i])
        raise RuntimeError(f"{what}: row {row}: logp {float(ours[i])} vs the reference's {float(ref[i])} "
                           f"(|dlogp| above {AUDIT_MAX_ABS_DLOGP}; {bad.size} rows in all)")
    return call


def resolve_mode(mode: Optional[str] = None) -> str:
    """The argument, else env RLK_MODE, else env RL_KERNEL_MODE (vime's launcher's name), else auto."""
    if mode is None and not os.environ.get("RLK_MODE") and os.environ.get("RL_KERNEL_MODE"):
        mode = os.environ["RL_KERNEL_MODE"].strip().lower()
    return routes.resolve_mode(mode)


# ---- the provider --------------------------------------------------------------------------------

def provider(request, mode: Optional[str] = None) -> Result:
    """Serve one vime LinearLogpRequest (see the module docstring). mode: argument, else env
    RLK_MODE, else env RL_KERNEL_MODE, else "auto"."""
    mode = resolve_mode(mode)
    r = _read(request)
    if mode == "off":
        _note(mode, r.n, None, None, "mode off")
        raise ProviderUnavailable("torch_bridge.vime: mode off (RLK_MODE / RL_KERNEL_MODE): vime's native path")
    route, why, r = _route(r)
    if route is None:
        _note(mode, r.n, None, None, why)
        if mode == "auto":
            raise ProviderUnavailable(f"torch_bridge.vime: unavailable for this request: {why}")
        raise StrictUnavailable(f"torch_bridge.vime (mode={mode}): cannot serve this request: {why}")
    _check_route_inputs(r, route)
    capturing = _capturing(r)
    checks = "skipped: CUDA graph capture (no host sync)" if capturing else "rows and device"
    if route == "fused" and r.logits is not None and not capturing:
        check_agreement(r, None if mode == "audit" else _sample(r.n))
        checks += ", logits = context on " + ("every row" if mode == "audit" else "sampled rows")
    before = routes.backend_counts()
    logp, ent = _run(r, lambda sl: (_fused if route == "fused" else _from_logits)(r, sl), route == "logits")
    kernel = _kernel_ran(before, routes.backend_counts()) if route == "fused" else r.device.type
    extra = {}
    if ent is not None and not r.with_entropy_grad:
        ent = ent.detach()
    logp = logp.reshape(-1, 1)
    _check_rows(r, logp, ent)
    if torch.is_grad_enabled() and r.logits is not None and r.logits.requires_grad and not logp.requires_grad:
        raise RuntimeError(f"torch_bridge.vime: logp from the {route} route is detached although request.logits "
                           f"require grad (every mode refuses a lost policy gradient)")
    if mode in ("strict", "audit"):
        _check_strict(r, route, kernel, logp, ent)
        if not capturing:
            _check_values(r, logp, ent)
            checks += ", values"
            if mode == "strict":
                _compare(r, route, logp, _sample(r.n), "strict")
                checks += ", reference on sampled rows"
    if mode == "audit":
        extra["audit"] = _compare(r, route, logp, None, "audit")
        checks += ", reference on every row"
    backend_id = f"rlk.{route}.{kernel or r.device.type}"
    contract = contract_id(r, route, kernel)
    _note(mode, r.n, backend_id, contract, None, f"{route}: {why}")
    return Result(logp, ent, backend_id, contract, _provenance(r, mode, route, why, kernel, checks=checks, **extra))


__all__ = ["provider", "Result", "ProviderUnavailable", "StrictUnavailable", "stats", "reset_stats", "contract_id",
           "check_agreement", "resolve_mode", "AUDIT_MAX_ABS_DLOGP", "IGNORE_INDEX", "ROUTE_ENV", "SAMPLE_ROWS"]
