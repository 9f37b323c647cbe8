"""rlk_xla: fused selected-token log-probabilities for LLM RL, as XLA FFI custom calls."""
from ._args import validate_targets
from .linear_logp import linear_logp
from .parallel import vocab_parallel_linear_logp
from .routes import MODES, reset_route_stats, route_stats
from . import diagnostics, reference, rollout

__all__ = ["linear_logp", "vocab_parallel_linear_logp", "reference", "rollout", "diagnostics", "validate_targets",
           "route_stats", "reset_route_stats", "MODES"]
__version__ = "0.1.0"
