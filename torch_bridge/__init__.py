"""torch_bridge: the PyTorch frontend of the fused linear_logp kernels (the same compiled module
as rlk_xla, reached through DLPack; jax is never imported).

    torch_bridge.linear_logp(hidden, weight, targets, ...)   fused, autograd, torch.compile-able
    torch_bridge.reference.linear_logp(...)                  the native torch path (off / fallback)
    torch_bridge.route_stats() / reset_route_stats()         routes, fallbacks, audit
    torch_bridge.vime.provider                               vime's linear-logp provider (docs/vime.md)
    torch_bridge.logits.logp_from_logits(...)                the same contract from materialized logits
    torch_bridge.megatron.linear_logp(model, hidden, labels) a megatron-core GPTModel, no logits
    torch_bridge.rollout.score_sampled(hidden, weight, ids)  the inference engine's side: forward only,
                                                             CUDA-graph capturable, the trainer's bits
    torch_bridge.diagnostics.dlogp_stats(train, rollout)     per-step train/rollout figures
"""
from ._args import validate_targets
from .linear_logp import linear_logp
from .routes import MODES, reset_route_stats, route_stats
from . import reference
from . import diagnostics, logits, megatron, rollout, vime

__all__ = ["linear_logp", "reference", "logits", "megatron", "vime", "rollout", "diagnostics", "validate_targets",
           "route_stats", "reset_route_stats", "MODES"]
__version__ = "0.1.0"
