"""The framework-neutral rules both frontends (rlk_xla, torch_bridge) share, each stated once, by
what they are about:
- rules.py: the modes and the route of a call (route_call), the backward strategies and their
  memory budget (resolve_backward), the argument checks that need no framework, the dtypes the
  kernels take, a shard's chunk;
- compiled.py: the import of the compiled module, the platforms it reports, its dtype codes and
  buffer sizes (dtypes by name);
- routes.py: the route log and its schema, the compiled module's route counters included;
- diagnostics.py: the train/rollout figures;
- shapes.py: the benchmark shapes.
Every public name of rules.py, compiled.py and shapes.py is re-exported here (rlk_common.X).

Imports neither jax nor torch: each frontend passes in what only it knows (its compiled module,
its dtypes by name, and devices).
"""
from .compiled import (cuda_workspace_bytes, dtype_code, import_core, platform, platform_fallback,  # noqa: F401
                       saved_logits_bytes)
from .routes import COUNT_NAMES, backend_counts  # noqa: F401  (the route schema's home is routes.py)
from .rules import (BACKWARDS, DEFAULT_BACKWARD_MEMORY_BUDGET, INT32_MAX, INT32_MIN, KERNEL_DTYPES,  # noqa: F401
                    MODES, PAD_ID, BudgetTypeError, IdRule, Route, backward_memory_budget, bad_targets,
                    check_decode_batch, check_flag, check_ignore_index, check_shapes, dtype_fallback, id_rule,
                    invalid_id, real_vocab, resolve_backward, resolve_mode, route_call, scalar_temperature,
                    shard_chunk, valid_temperatures)
from .shapes import SHAPES  # noqa: F401
