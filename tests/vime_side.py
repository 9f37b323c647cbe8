"""vime's side of the linear-logp provider ABI, written from its public behaviour (for the tests; vime
itself is not installed here). As vime's current module does it:
- a request is checked as vime's dataclasses check it (compute() runs the checks first) (LinearLogpRequest, LinearLogpContext,
  LinearProjection, VocabPartition, TokenLayout): logits are required, target_ids [T] integer on the
  logits' device, a keep mask of the logits' shape, the context's rows, width and device matching;
- the provider mode is "auto" or "strict" only;
- loading the provider (import by dotted path) is separate from calling it: only a failed load, or
  an exception carrying `linear_logp_provider_unavailable = True`, runs the native path (auto) or
  raises (strict); any other exception propagates;
- the result is normalized (a mapping or attributes; provenance a mapping) and validated: logp
  floating [T, 1] on the logits' device, entropy floating [T] on that device exactly when asked;
  strict also: non-empty backend_id and contract_id, logp attached when the logits require grad,
  entropy attached with with_entropy_grad.
native(): vime's selected-logprob math on the request's local logits (the temperature divided out
when metadata says the logits are not scaled, as vime's sparse top-p replay sends them), the
nucleus from the keep mask or the sparse ids, the padded vocab scored; over a TP group the local
logits are all-gathered (autograd through the gather)."""
import importlib
from types import SimpleNamespace

import torch

MODES = ("auto", "strict")


def _check(req):
    """vime's dataclass checks (__post_init__), raising its ValueError/TypeError."""
    logits, t = req.logits, req.target_ids
    if not isinstance(logits, torch.Tensor) or logits.ndim != 2:
        raise ValueError(f"linear_logp logits must be [T, V_local], got {getattr(logits, 'shape', None)}")
    if tuple(t.shape) != (logits.size(0),):
        raise ValueError("linear_logp target_ids must be [T] aligned with logits")
    if t.device != logits.device:
        raise ValueError("linear_logp target_ids must share the logits device")
    if t.is_floating_point() or t.is_complex():
        raise TypeError("linear_logp target_ids must use an integer dtype")
    if req.log_prob_keep_mask is not None and req.log_prob_keep_mask.shape != logits.shape:
        raise ValueError("linear_logp log_prob_keep_mask must match logits shape")
    lay = req.token_layout
    if lay.world_size < 1 or not 0 <= lay.rank < lay.world_size or (lay.layout == "single") != (lay.world_size == 1):
        raise ValueError("invalid token topology")
    c = req.context
    if c is not None:
        w, vp = c.projection.weight, c.vocab_partition
        if c.hidden.ndim != 2 or c.hidden.size(1) != w.size(1) or w.size(0) != vp.local_size:
            raise ValueError("linear_logp context shapes disagree")
        if vp.local_start < 0 or vp.local_size <= 0 or not 0 < vp.real_size <= vp.padded_size \
                or vp.local_start + vp.local_size > vp.padded_size:
            raise ValueError("linear_logp vocabulary partition is invalid")
        if c.hidden.size(0) != logits.size(0) or w.size(0) != logits.size(1) or c.hidden.device != logits.device:
            raise ValueError("linear_logp context must match the local logits")
    temp = req.temperature
    if temp is not None:
        if isinstance(temp, torch.Tensor):
            if temp.numel() not in (1, logits.size(0)) or bool((temp <= 0).any()):
                raise ValueError("linear_logp temperature must be positive, scalar or [T]")
        elif float(temp) <= 0:
            raise ValueError("linear_logp temperature must be positive")
    return req


def request(targets, *, logits=None, hidden=None, weight=None, bias=None, partition=None, tp_group=None,
              cp=(1, 0, "single"), with_entropy=True, with_entropy_grad=True, chunk_size=-1, keep_mask=None,
              temperature=None, metadata=None, **context_extra):
    """A request's attributes as vime's dataclasses name them, unchecked (compute() checks; a test
    may build requests vime would not). partition:
    (local_start, local_size, real_size, padded_size); cp: (world_size, rank, layout);
    context_extra: further context attributes (sequence_parallel, reuse_local_logits, local_logits)."""
    context = None
    if hidden is not None:
        v = weight.shape[0]
        partition = partition or (0, v, v, v)
        context = SimpleNamespace(hidden=hidden, projection=SimpleNamespace(weight=weight, bias=bias),
                                  vocab_partition=SimpleNamespace(local_start=partition[0], local_size=partition[1],
                                                                  real_size=partition[2], padded_size=partition[3]),
                                  **context_extra)
    return SimpleNamespace(
        logits=logits, target_ids=targets, tensor_parallel_group=tp_group,
        token_layout=SimpleNamespace(world_size=cp[0], rank=cp[1], layout=cp[2]), with_entropy=with_entropy,
        with_entropy_grad=with_entropy_grad, chunk_size=chunk_size, log_prob_keep_mask=keep_mask, context=context,
        temperature=temperature,
        metadata={"logits_are_temperature_scaled": True} if metadata is None else metadata)


def checked(req):
    """vime's dataclass checks on a request (as building LinearLogpRequest runs them)."""
    return _check(req)


def _gathered(z, group):
    if group is None or torch.distributed.get_world_size(group) == 1:
        return z
    import torch.distributed.nn.functional as dnn
    return torch.cat(dnn.all_gather(z.contiguous(), group=group), dim=1)


def native(req):
    """vime's native selected logprob and entropy on the request's local logits."""
    group = req.tensor_parallel_group
    z = req.logits.float()
    meta = req.metadata or {}
    if not meta.get("logits_are_temperature_scaled", True) and req.temperature is not None:
        t = req.temperature
        z = z / (t.reshape(-1, 1).float() if isinstance(t, torch.Tensor) else float(t))
    z = _gathered(z, group)
    keep = req.log_prob_keep_mask
    if keep is not None:
        keep = _gathered(keep.to(torch.uint8), group).bool()
    ids = meta.get("top_p_sparse_token_ids")
    if ids is not None:  # the nucleus as ids ([T, K], -1 padded; a row of only -1: no nucleus)
        keep = torch.zeros(z.shape[0], z.shape[1] + 1, dtype=torch.bool, device=z.device)
        keep.scatter_(1, torch.where(ids >= 0, ids, z.shape[1]).long(), True)
        keep = keep[:, :-1] | ~(ids >= 0).any(1, keepdim=True)
    zk = z if keep is None else z.masked_fill(~keep, float("-inf"))
    logp = torch.log_softmax(zk, dim=-1).gather(1, req.target_ids.long()[:, None])
    ent = None
    if req.with_entropy:
        lp = torch.log_softmax(z, dim=-1)
        ent = -(lp.exp() * lp).sum(-1)
        if not req.with_entropy_grad:
            ent = ent.detach()
    return logp, ent


def _normalize(result):
    get = result.__getitem__ if isinstance(result, dict) else (lambda k: getattr(result, k))
    try:
        out = SimpleNamespace(**{k: get(k) for k in ("logp", "entropy", "backend_id", "contract_id", "provenance")})
    except (AttributeError, KeyError) as e:
        raise TypeError("a provider must return logp, entropy, backend_id, contract_id and provenance") from e
    if not hasattr(out.provenance, "keys"):
        raise TypeError("provenance must be a mapping")
    return out


def _validate(res, req, strict):
    t = req.logits.shape[0]
    dev = req.logits.device
    if tuple(res.logp.shape) != (t, 1) or res.logp.device != dev:
        raise ValueError(f"logp must be [T, 1] on {dev}, got {tuple(res.logp.shape)} on {res.logp.device}")
    if not res.logp.is_floating_point():
        raise TypeError("logp must be floating point")
    if req.with_entropy:
        e = res.entropy
        if e is None or tuple(e.shape) != (t,) or e.device != dev:
            raise ValueError("entropy must be [T] on the logits' device when with_entropy")
        if not e.is_floating_point():
            raise TypeError("entropy must be floating point")
    elif res.entropy is not None:
        raise ValueError("entropy returned although with_entropy=False")
    if strict:
        if not res.backend_id or not res.contract_id:
            raise ValueError("strict: empty backend_id or contract_id")
        if req.logits.requires_grad and not res.logp.requires_grad:
            raise ValueError("strict: logp detached from autograd")
        if req.with_entropy_grad and res.entropy is not None and not res.entropy.requires_grad:
            raise ValueError("strict: entropy detached from autograd")


def load(path):
    """vime's load step: import by dotted path (ImportError/AttributeError: unavailable)."""
    module, sep, attr = path.rpartition(".")
    if not sep or not module or not attr:
        raise ImportError("provider must use the import path 'package.module.callable'")
    fn = getattr(importlib.import_module(module), attr)
    if not callable(fn):
        raise TypeError(f"provider {path!r} is not callable")
    return fn


def compute(req, *, path="torch_bridge.vime.provider", vime_mode="auto", native=native):
    """(logp [T, 1], entropy, result or None when native(req) ran)."""
    if vime_mode not in MODES:
        raise ValueError(f"linear_logp_provider_mode must be 'auto' or 'strict', got {vime_mode!r}")
    _check(req)
    try:
        fn = load(path)
    except (ImportError, AttributeError) as e:
        if vime_mode == "strict":
            raise RuntimeError(f"provider {path!r} is unavailable: {e}") from e
        return (*native(req), None)
    try:
        result = fn(req)
    except Exception as e:
        if not getattr(e, "linear_logp_provider_unavailable", False):
            raise
        if vime_mode == "strict":
            raise RuntimeError(f"provider {path!r} is unavailable: {e}") from e
        return (*native(req), None)
    res = _normalize(result)
    _validate(res, req, vime_mode == "strict")
    return res.logp, res.entropy, res
