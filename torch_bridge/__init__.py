"""torch_bridge: the PyTorch frontend of the fused linear_logp kernels (the same compiled module
as rlk_xla, reached through DLPack; jax is never imported).

    torch_bridge.linear_logp(hidden, weight, targets, ...)   fused, autograd, torch.compile-able
    torch_bridge.reference.linear_logp(...)                  the native torch path (off / fallback)
    torch_bridge.route_stats() / reset_route_stats()         routes, fallbacks, audit
    torch_bridge.vime.provider                               vime's linear-logp provider (docs/vime.md;
                                                             the module is torch_bridge.integrations.vime)
    torch_bridge.logits.logp_from_logits(...)                the same contract from materialized logits
    torch_bridge.integrations.megatron.linear_logp(model, hidden, labels)
                                                             a megatron-core GPTModel, no logits
    torch_bridge.integrations.rollout.score_sampled(hidden, weight, ids)
                                                             the inference engine's side: forward only,
                                                             CUDA-graph capturable, the trainer's bits
    torch_bridge.diagnostics.dlogp_stats(train, rollout)     per-step train/rollout figures
"""
from ._args import validate_targets
from .linear_logp import linear_logp
from .routes import MODES, reset_route_stats, route_stats
from . import reference
from . import diagnostics, integrations, logits
from .integrations import vime

__all__ = ["linear_logp", "reference", "logits", "integrations", "vime", "diagnostics", "validate_targets",
           "route_stats", "reset_route_stats", "MODES"]
_MOVED = ("megatron", "rollout")  # torch_bridge.X -> torch_bridge.integrations.X, the old path for one release


def __getattr__(name):
    if name in _MOVED:
        import importlib
        import warnings
        warnings.warn(f"torch_bridge.{name} moved to torch_bridge.integrations.{name}; the old path goes in the "
                      "next release", DeprecationWarning, stacklevel=2)
        return importlib.import_module(f"torch_bridge.integrations.{name}")
    raise AttributeError(f"module 'torch_bridge' has no attribute {name!r}")
__version__ = "0.1.0"
