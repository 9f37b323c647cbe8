"""TRL, one line: `use_rlk(trainer)` after building a TRL GRPOTrainer (or RLOOTrainer).

TRL scores tokens through the model's fused LM head: its trainers call
`model(..., labels=labels, fused_lm_head=True)` and read a `FusedCausalLMOutput` (log_probs,
entropy, loss, label_mask, aux_loss), a forward that `trl.add_fused_lm_head` installs at the
trainer's construction and that runs TRL's ChunkedLogProbFunction. `use_rlk` installs the same
contract on the policy (and the reference model) with `torch_bridge.linear_logp` in place of the
chunked head, on the scored rows only (labels != -100), with the trainer's temperature,
`cast_lm_head_to_fp32` and the model's logit scale. Everything else in TRL (its loss, its
generation, the model's plain forward) is unchanged.

Refused with a clear error: `final_logit_softcapping` (the op has no softcap), outputs other than
log_probs and entropy, DeepSpeed ZeRO-3 (a partitioned head; gather it or keep TRL's head).
An FSDP2 head (a DTensor) is gathered once per call, as TRL's own head does.
"""
from __future__ import annotations

import functools
import types
from contextlib import nullcontext

import torch

from ..linear_logp import linear_logp

OUTPUTS = ("log_probs", "entropy")


def use_rlk(trainer, **op_kwargs):
    """Make `trainer` (a TRL GRPOTrainer or RLOOTrainer, already built) compute its per-token logps and
    entropies with torch_bridge.linear_logp. op_kwargs go to linear_logp (mode=, backward=, ...).
    Returns the trainer."""
    if not hasattr(trainer, "_get_per_token_logps_and_entropies"):
        raise TypeError(f"use_rlk takes a TRL GRPOTrainer or RLOOTrainer, got {type(trainer).__name__}")
    from transformers.integrations.deepspeed import is_deepspeed_zero3_enabled
    if is_deepspeed_zero3_enabled():
        raise ValueError("use_rlk: DeepSpeed ZeRO-3 partitions the LM head, which the op reads whole; use "
                         "ZeRO-2 or FSDP2, or keep TRL's head")
    cast = bool(getattr(trainer.args, "cast_lm_head_to_fp32", False))
    from accelerate.utils import is_peft_model
    model = trainer.model.get_base_model() if is_peft_model(trainer.model) else trainer.model  # as TRL patches
    add_fused_lm_head(model, trainer.temperature, cast, ("log_probs", "entropy"), **op_kwargs)
    if getattr(trainer, "ref_model", None) is not None:
        add_fused_lm_head(trainer.ref_model, trainer.temperature, cast, ("log_probs",), **op_kwargs)
    return trainer


def add_fused_lm_head(model, temperature: float = 1.0, cast_lm_head_to_fp32: bool = False,
                      outputs: tuple[str, ...] = ("log_probs",), **op_kwargs) -> None:
    """`trl.add_fused_lm_head`'s contract with torch_bridge.linear_logp: `model(..., labels=labels,
    fused_lm_head=True)` returns a trl FusedCausalLMOutput; without fused_lm_head the forward is the
    one the model had before (generation unchanged)."""
    from trl.trainer.utils import FusedCausalLMOutput

    extra = set(outputs) - set(OUTPUTS)
    if extra:
        raise ValueError(f"torch_bridge.integrations.trl computes {OUTPUTS}, not {sorted(extra)}")
    cfg = model.config.get_text_config()
    if getattr(cfg, "final_logit_softcapping", None) is not None:
        raise ValueError(f"{cfg.model_type} caps its logits (final_logit_softcapping), which linear_logp does not "
                         "do: keep TRL's head for this model")
    scale = _logit_scale(cfg)
    if not scale > 0:
        raise ValueError(f"{cfg.model_type}'s logit scale is {scale}: linear_logp needs a positive one")
    entropy = "entropy" in outputs
    original_forward = model.forward

    @functools.wraps(type(model).forward)
    def forward(self, *args, fused_lm_head=False, labels=None, shift_labels=None, num_items_in_batch=None,
                **kwargs):
        if not fused_lm_head:
            named = {"labels": labels, "shift_labels": shift_labels, "num_items_in_batch": num_items_in_batch}
            return original_forward(*args, **kwargs, **{k: v for k, v in named.items() if v is not None})
        kwargs["use_cache"] = False
        if getattr(cfg, "output_router_logits", False):
            kwargs.setdefault("output_router_logits", True)
        out = self.base_model(*args, **kwargs)
        hidden = out.last_hidden_state
        if shift_labels is None:
            hidden, labels = hidden[:, :-1], labels[:, 1:]
        else:
            labels = shift_labels
        head = self.get_output_embeddings()
        weight, bias = _whole(head.weight), _whole(head.bias)
        labels = labels.to(weight.device)
        mask = labels != -100
        rows = hidden.to(weight.device)[mask]
        ctx = nullcontext()
        if cast_lm_head_to_fp32:
            rows = rows.float()
            ctx = torch.autocast(rows.device.type, enabled=False)
        with ctx:
            res = linear_logp(rows, weight, labels[mask], bias=bias, temperature=temperature / scale,
                              return_entropy=entropy, **op_kwargs)
        logp, ent = res if entropy else (res, None)
        # masked_scatter keeps an all-masked microbatch connected to the model (a zero, differentiable)
        log_probs = logp.new_zeros(mask.shape).masked_scatter(mask, logp)
        ent = None if ent is None else ent.new_zeros(mask.shape).masked_scatter(mask, ent)
        loss = -log_probs.sum() / (mask.sum().clamp(min=1) if num_items_in_batch is None else num_items_in_batch)
        aux_loss = None
        if kwargs.get("output_router_logits"):
            from transformers.models.mixtral import modeling_mixtral
            aux_loss = modeling_mixtral.load_balancing_loss_func(out.router_logits, cfg.num_experts,
                                                                 cfg.num_experts_per_tok, kwargs.get("attention_mask"))
            loss = loss + getattr(cfg, "router_aux_loss_coef", 0.0) * aux_loss
        return FusedCausalLMOutput(loss=loss, log_probs=log_probs, entropy=ent, label_mask=mask, aux_loss=aux_loss)

    model.forward = types.MethodType(forward, model)


def _logit_scale(cfg) -> float:
    """The factor the model's own forward multiplies its logits by (as TRL reads it): logit_scale,
    output_multiplier or lm_head_multiplier, else 1 / logits_scaling (HyperCLOVA X multiplies by it)."""
    for name in ("logit_scale", "output_multiplier", "lm_head_multiplier"):
        if getattr(cfg, name, None) is not None:
            return float(getattr(cfg, name))
    s = getattr(cfg, "logits_scaling", None)
    if s is None:
        return 1.0
    return float(s) if cfg.model_type == "hyperclovax" else 1.0 / s


def _whole(p):
    """An FSDP2-sharded parameter (a DTensor) gathered, as TRL's head does; others as they are."""
    from torch.distributed.tensor import DTensor
    return p.full_tensor() if isinstance(p, DTensor) else p
