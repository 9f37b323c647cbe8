"""Tunix, one line: `use_rlk()` before building (or running) a Tunix GRPO or PPO learner.

Tunix has no fused-head switch. Its learners and its RL cluster score tokens through one function,
`tunix.rl.common.compute_per_token_logps` (the policy loss, the old and the reference logps), which
runs the model to its [B, L, V] logits; the policy losses then take the entropy of those logits
with `tunix.rl.algo_core.compute_entropy_from_logits`. Both are looked up on their module at each
call, so `use_rlk()` rebinds the two names:

- compute_per_token_logps runs the model with `output_hidden_states=True`, takes the final hidden
  states it sows, and calls rlk_xla.linear_logp with the LM head (`lm_head.w`, [D, V], or the tied
  `embedder.input_embedding`, [V, D]) at the rollout temperature. The model's logits are never
  used, so XLA drops their GEMM and their [B, L, V] buffer. With return_logits=True (the policy
  losses) it returns, in the logits' place, the op's entropies wrapped in `Entropy`;
- compute_entropy_from_logits returns an `Entropy`'s values and passes anything else to Tunix's.

`use_rlk()` returns a handle whose `restore()` (or leaving it as a context manager) puts Tunix's
functions back. Refused with a clear error: images (vision inputs), models that do not sow their
final hidden states or have no LM head the op can read, softcapped logits.
"""
from __future__ import annotations

import dataclasses
import functools
import inspect

import jax
import jax.numpy as jnp

from ..linear_logp import linear_logp


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Entropy:
    """Per-token entropies [B, T] of the tempered distribution, passed where Tunix passes logits."""
    values: jax.Array


class Handle:
    """The rebinding use_rlk made; restore() undoes it."""

    def __init__(self, saved):
        self._saved = saved

    def restore(self):
        for module, name, fn in self._saved:
            setattr(module, name, fn)
        self._saved = []

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.restore()


def use_rlk(**op_kwargs) -> Handle:
    """Route Tunix's per-token logps and entropies through rlk_xla.linear_logp (op_kwargs go to it:
    mode=, backward=, ...)."""
    from tunix.rl import algo_core, common

    if getattr(common.compute_per_token_logps, "func", None) is compute_per_token_logps:
        raise RuntimeError("use_rlk() is already in effect: restore() its handle first")
    saved = [(common, "compute_per_token_logps", common.compute_per_token_logps),
             (algo_core, "compute_entropy_from_logits", algo_core.compute_entropy_from_logits)]
    common.compute_per_token_logps = functools.partial(compute_per_token_logps, op_kwargs=tuple(op_kwargs.items()))
    native_entropy = algo_core.compute_entropy_from_logits
    algo_core.compute_entropy_from_logits = lambda x: x.values if isinstance(x, Entropy) else native_entropy(x)
    return Handle(saved)


@functools.partial(jax.jit, static_argnames=("pad_id", "eos_id", "stop_gradient", "return_logits", "temperature",
                                             "op_kwargs"))
def compute_per_token_logps(graphdef, state, prompt_tokens, completion_tokens, pad_id, eos_id, images=None,
                            stop_gradient=True, return_logits=False, segment_ids=None, segment_positions=None,
                            temperature=1.0, op_kwargs=()):
    """tunix.rl.common.compute_per_token_logps's contract (same arguments, same outputs) through
    rlk_xla.linear_logp; with return_logits, (logps, Entropy) instead of (logps, logits)."""
    from flax import nnx
    from tunix.rl import common

    if images is not None:
        raise ValueError("rlk_xla.integrations.tunix does not score vision inputs: call restore() on use_rlk()'s "
                         "handle for this model")
    model = nnx.merge(graphdef, state)
    tokens, positions, attn_mask, input_seg_ids = common.process_ids(
        prompt_tokens, completion_tokens, pad_id, eos_id, segment_ids, segment_positions)
    kwargs = {"positions": positions, "cache": None, "attention_mask": attn_mask, "output_hidden_states": True}
    params = inspect.signature(model.__call__).parameters
    if "output_hidden_states" not in params:
        raise ValueError(f"{type(model).__name__} takes no output_hidden_states: rlk_xla.integrations.tunix needs "
                         "the final hidden states")
    seg = segment_ids if segment_ids is not None else input_seg_ids
    if seg is not None and "segment_ids" in params:
        kwargs["segment_ids"] = seg
    model(tokens, **kwargs)  # its logits stay unused: XLA drops them
    hidden = _final_hidden(model)
    weight = _head(model)
    packed = segment_ids is not None
    keep = tokens.shape[1] - 1 if packed else completion_tokens.shape[1]
    res = linear_logp(hidden[:, -keep - 1:-1].astype(weight.dtype), weight, tokens[:, -keep:],
                      temperature=temperature, return_entropy=return_logits, **dict(op_kwargs))
    logps, ent = res if return_logits else (res, None)
    if packed:  # Tunix's packed layout: [B, L], logp[i] for token i, 0 for the first
        logps = jnp.pad(logps, ((0, 0), (1, 0)))
        ent = None if ent is None else jnp.pad(ent, ((0, 0), (1, 0)))
    if stop_gradient:
        logps, ent = jax.lax.stop_gradient((logps, ent))
    return (logps, Entropy(ent)) if return_logits else logps


def _final_hidden(model):
    from flax import nnx

    sown = nnx.pop(model, nnx.Intermediate)
    found = sown.get("all_hidden_states") if hasattr(sown, "get") else None
    if found is None:
        raise ValueError(f"{type(model).__name__} sowed no 'all_hidden_states': rlk_xla.integrations.tunix needs the "
                         "final hidden states")
    return found.get_value()[-1]  # sow appends to a tuple


def _head(model):
    """The LM head as [V, D] in the model's compute dtype (Tunix's Einsum and Embedder.decode cast both
    operands to it)."""
    cfg = model.config
    if getattr(cfg, "final_logit_softcap", None) is not None:
        raise ValueError(f"{type(model).__name__} softcaps its logits, which linear_logp does not do")
    if getattr(cfg, "use_tied_embedding", False):
        w = model.embedder.input_embedding[...]
    elif hasattr(model, "lm_head") and getattr(model.lm_head, "einsum_str", None) == "BTD,DV->BTV":
        w = model.lm_head.w[...].T
    else:
        raise ValueError(f"{type(model).__name__}'s LM head is neither a tied embedder nor a 'BTD,DV->BTV' einsum")
    return w.astype(cfg.dtype)
