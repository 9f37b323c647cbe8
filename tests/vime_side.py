"""vime's side of the linear-logp provider ABI, re-implemented from its published behaviour (for the
tests; vime itself is not installed here): requests built as vime builds them, the provider loaded
by dotted path, called, its result normalized and validated, the native path taken only when the
provider is unloadable or raises an exception carrying `linear_logp_provider_unavailable = True`."""
import importlib
from types import SimpleNamespace

import torch


def request(targets, *, logits=None, hidden=None, weight=None, bias=None, partition=None, tp_group=None,
            cp=(1, 0, "single"), with_entropy=True, with_entropy_grad=True, chunk_size=-1, keep_mask=None,
            temperature=None, metadata=None):
    """A request shaped like vime's LinearLogpRequest (attributes only). partition: (local_start,
    local_size, real_size, padded_size); cp: (world_size, rank, layout)."""
    context = None
    if hidden is not None:
        v = weight.shape[0]
        partition = partition or (0, v, v, v)
        context = SimpleNamespace(hidden=hidden, projection=SimpleNamespace(weight=weight, bias=bias),
                                  vocab_partition=SimpleNamespace(local_start=partition[0], local_size=partition[1],
                                                                  real_size=partition[2], padded_size=partition[3]))
    return SimpleNamespace(
        logits=logits, target_ids=targets, tensor_parallel_group=tp_group,
        token_layout=SimpleNamespace(world_size=cp[0], rank=cp[1], layout=cp[2]), with_entropy=with_entropy,
        with_entropy_grad=with_entropy_grad, chunk_size=chunk_size, log_prob_keep_mask=keep_mask, context=context,
        temperature=temperature,
        metadata={"logits_are_temperature_scaled": True} if metadata is None else metadata)


def native(req):
    """vime's native selected-logprob math on the request's (pre-scaled) local logits, one rank:
    log_softmax over the nucleus-masked logits for logp, the unmasked distribution's entropy."""
    z = req.logits.float()
    zk = z if req.log_prob_keep_mask is None else z.masked_fill(~req.log_prob_keep_mask, float("-inf"))
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
    t = req.target_ids.shape[0]
    dev = req.target_ids.device
    if tuple(res.logp.shape) != (t, 1) or res.logp.device != dev or not res.logp.is_floating_point():
        raise ValueError(f"logp must be floating [T, 1] on {dev}, got {tuple(res.logp.shape)} on {res.logp.device}")
    if req.with_entropy:
        e = res.entropy
        if e is None or tuple(e.shape) != (t,) or e.device != dev or not e.is_floating_point():
            raise ValueError("entropy must be floating [T] on the request's device when with_entropy")
    elif res.entropy is not None:
        raise ValueError("entropy returned although with_entropy=False")
    if strict:
        if not res.backend_id or not res.contract_id:
            raise ValueError("strict: empty backend_id or contract_id")
        inputs = [req.logits] + ([req.context.hidden, req.context.projection.weight] if req.context else [])
        if any(x is not None and x.requires_grad for x in inputs) and not res.logp.requires_grad:
            raise ValueError("strict: logp detached from autograd")
        if req.with_entropy_grad and res.entropy is not None and not res.entropy.requires_grad:
            raise ValueError("strict: entropy detached from autograd")


def compute(req, *, path="torch_bridge.vime.provider", vime_mode="auto", native=native):
    """(logp [T, 1], entropy, result or None when native(req) ran)."""
    module, _, attr = path.rpartition(".")
    try:
        fn = getattr(importlib.import_module(module), attr)
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
