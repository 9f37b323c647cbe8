"""The framework-neutral rules both frontends (rlk_xla, torch_bridge) share, each stated once:
the modes and the route of a call (route_call), the backward strategies and their memory budget
(resolve_backward), the argument checks that need no framework, the dtypes the kernels take, a
shard's chunk, the dtype codes and buffer sizes of the compiled module (dtypes by name), and the
import of that module. The route log and its schema, the compiled module's route counters
included, are routes.py's; the train/rollout figures diagnostics.py's.

Imports neither jax nor torch: each frontend passes in what only it knows (its compiled module,
its dtypes by name, and devices).
"""
from __future__ import annotations

import dataclasses
import numbers
import os
import typing

from .routes import COUNT_NAMES, backend_counts  # noqa: F401  (the route schema's home is routes.py)

MODES = ("off", "auto", "strict", "audit")
BACKWARDS = ("auto", "fast", "lean")
# The operand dtypes the kernels take, by the name jax and torch give them (rlk::DType; a test
# checks _rlk_core.DType binds exactly these).
KERNEL_DTYPES = ("bfloat16", "float16", "float32")
# The id of a rollout padding row (both frontends' default ignore_index): logp 0, entropy 0.
PAD_ID = -100
DEFAULT_BACKWARD_MEMORY_BUDGET = 4 << 30  # bytes of saved logits backward="auto" may spend (per shard)
# The shapes that matter (docs/design.md §6): name -> (tokens n, hidden h, local vocab V).
SHAPES = {"T1": (796, 2048, 75968), "T2": (1820, 2048, 75968), "T3": (6827, 2048, 75968),
          "T3-tp1": (6827, 2048, 151936), "Q8B-tp4": (4096, 4096, 37984), "L16k": (16384, 4096, 151936),
          "H200-pub": (4096, 4096, 128256)}


def import_core(frontend: str):
    """The compiled module _rlk_core (one per process, shared by both frontends), else an
    ImportError saying how `frontend` gets it."""
    try:
        import _rlk_core
    except ImportError as e:  # pragma: no cover - only when the build is missing
        raise ImportError(f"{frontend}: the compiled module _rlk_core is not installed; build it with "
                          "`pip install .` (see README, Install)") from e
    return _rlk_core


class BudgetTypeError(TypeError, ValueError):
    """A budget that is not an int: a TypeError by kind, and a ValueError for callers that treat
    every bad option value alike (as numpy's AxisError is both an IndexError and a ValueError)."""


def check_shapes(hidden: tuple, weight: tuple, targets: tuple, bias: tuple | None) -> None:
    """ValueError naming the argument unless hidden is [..., H], weight [V, H], targets hidden's
    leading shape and bias (None: no bias) [V]."""
    if len(hidden) < 1:
        raise ValueError(f"hidden must be [..., H], got shape {hidden}")
    if len(weight) != 2:
        raise ValueError(f"weight must be [V, H], got shape {weight}")
    if weight[1] != hidden[-1]:
        raise ValueError(f"weight's hidden size {weight[1]} does not match hidden's {hidden[-1]} "
                         f"(weight {weight}, hidden {hidden})")
    if targets != hidden[:-1]:
        raise ValueError(f"targets shape {targets} must equal hidden's leading shape {hidden[:-1]}")
    if bias is not None and bias != (weight[0],):
        raise ValueError(f"bias must be [V] = ({weight[0]},), got shape {bias}")


def check_flag(name: str, value) -> bool:
    """A bool option (Python or numpy bool), else a TypeError naming it."""
    if type(value).__name__ not in ("bool", "bool_"):
        raise TypeError(f"{name} must be True or False, got {value!r}")
    return bool(value)


def check_ignore_index(ignore_index) -> int:
    if not isinstance(ignore_index, numbers.Integral) or isinstance(ignore_index, bool):
        raise TypeError(f"ignore_index must be an int, got {type(ignore_index).__name__}")
    return int(ignore_index)


def bad_targets(index: int, value: int, vocab_size: int, ignore_index: int, count: int) -> ValueError:
    """validate_targets' error (both frontends): the first bad id, at `index`, of `count` ids
    outside [0, vocab_size) that are not ignore_index."""
    return ValueError(f"targets[{index}] = {value} is outside [0, {vocab_size}) and is not "
                      f"ignore_index={ignore_index} ({count} bad ids in all)")


INT32_MIN, INT32_MAX = -(2 ** 31), 2 ** 31 - 1


@dataclasses.dataclass(frozen=True)
class IdRule:
    """How ids of an integer dtype holding [lo, hi] reach the kernels, which take int32 ids and an
    int32 ignore_index: checked on the ids' own dtype first, never wrapped by the cast.
    A row whose id equals ignore_index (compared in the ids' dtype; no id equals an ignore_index
    the dtype cannot hold) becomes `ignore`; an id outside [0, INT32_MAX] becomes `invalid`, a
    negative id the kernels give a NaN row (validate_targets: a ValueError); every other id passes
    unchanged. `remap` False: a plain cast to int32 already does exactly that. `clamp` (lo, hi):
    where remapping, clamping the ids to [lo, hi] and casting gives ids the kernels read as the
    remapped ones (one elementwise op: torch runs each comparison and select as a kernel of its
    own): a negative id other than `ignore` is an invalid id to them, and INT32_MAX is no id of any
    vocabulary. None where that does not hold: ids of an unsigned dtype (a uint64 id read as
    int64 may equal `ignore`), an ignore_index outside int32 or at its ends."""
    ignore_index: int   # the caller's
    ignore: int
    invalid: int
    match_ignore: bool  # some id of the dtype can equal ignore_index
    check_low: bool     # the dtype holds negative ids
    check_high: bool    # the dtype holds ids above INT32_MAX
    remap: bool
    clamp: tuple[int, int] | None


def invalid_id(ignore: int) -> int:
    """The int32 id the kernels get for a row without a valid target, given the int32 ignore_index
    they get: -1, or -2 where -1 is the ignore_index."""
    return -1 if ignore != -1 else -2


def id_rule(lo: int, hi: int, ignore_index: int) -> IdRule:
    """The IdRule of ids in [lo, hi] (the dtype's range) with this ignore_index (any int)."""
    fits = INT32_MIN <= ignore_index <= INT32_MAX
    ignore = ignore_index if fits else -1
    invalid = invalid_id(ignore)
    remap = hi > INT32_MAX or lo < INT32_MIN or not fits
    clamp = (INT32_MIN, INT32_MAX) if remap and lo < 0 and INT32_MIN < ignore_index < INT32_MAX else None
    return IdRule(ignore_index=ignore_index, ignore=ignore, invalid=invalid, match_ignore=lo <= ignore_index <= hi,
                  check_low=lo < 0, check_high=hi > INT32_MAX, remap=remap, clamp=clamp)


def scalar_temperature(temperature) -> float | None:
    """A Python number: checked finite and > 0, as a float; anything else (an array) None."""
    if not isinstance(temperature, numbers.Real) or isinstance(temperature, bool):
        return None
    if not (float(temperature) > 0.0 and float(temperature) < float("inf")):
        raise ValueError(f"temperature must be a finite number > 0, got {temperature}")
    return float(temperature)


def shard_chunk(canonical: int, v_local: int) -> int:
    """The chunk a vocab shard of v_local rows is reduced in: the global vocab's canonical chunk
    when the shard holds whole canonical chunks, else the whole shard (which works, without the
    bitwise TP-invariance promise: TP degrees above MAX_INVARIANT_TP, or not dividing the vocab's
    power of two)."""
    return canonical if v_local % canonical == 0 else v_local


def dtype_fallback(name: str) -> str | None:
    """The fallback reason of operands of the dtype named `name`, None for a dtype the kernels take."""
    if name in KERNEL_DTYPES:
        return None
    return f"dtype {name} (supported: {', '.join(KERNEL_DTYPES)})"


def check_decode_batch(targets_shape: tuple, hidden_shape: tuple, reason: str | None, caller: str) -> None:
    """score_sampled's rules (both frontends' rollout): one row per sequence of the decode batch
    (hidden [n, H], ids [n]; else ValueError), through the fused kernels only, so that the rollout
    records the trainer's bits (reason: why the kernels cannot take the call, None if they can;
    else RuntimeError)."""
    if len(targets_shape) != 1:
        raise ValueError(f"hidden must be [n, H] and sampled_ids [n] (one row per sequence of the decode batch), "
                         f"got hidden {tuple(hidden_shape)}")
    if reason is not None:
        raise RuntimeError(f"{caller} needs the fused kernels (the trainer's bits): {reason}")


def real_vocab(real_vocab_size, v_global: int) -> int:
    """The real (unpadded) vocab size: the argument, else the padded global vocab."""
    if v_global < 1:
        raise ValueError("weight must be [V, H] with V >= 1 vocab rows, got V = 0")
    real = v_global if real_vocab_size is None else real_vocab_size
    if not isinstance(real, numbers.Integral) or isinstance(real, bool) or not 0 < real <= v_global:
        raise ValueError(f"real_vocab_size must be an int in [1, {v_global}] (the padded vocab), got {real_vocab_size}")
    return int(real)


def resolve_mode(mode: str | None) -> str:
    """The call's mode (MODES): the argument, else env RLK_MODE, else "auto". What each mode runs,
    raises and counts: route_call."""
    mode = mode if mode is not None else os.environ.get("RLK_MODE", "auto")
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r} (argument mode or env RLK_MODE)")
    return mode


class Route(typing.NamedTuple):
    """How one call of a frontend's linear_logp runs (route_call). A NamedTuple: torch.compile
    traces it."""
    fused: bool           # the compiled kernels; else the frontend's reference
    audit: bool           # fused, and the reference too, compared row by row in the route log
    counted: bool         # a reference call the route log counts (it has rows)
    reason: str | None    # the fallback's reason (the route log's key); None for mode off


def route_call(mode: str, rows: int, reason: str | None, caller: str) -> Route:
    """The route of one call under `mode` (resolve_mode) over `rows` rows; `reason`: why the fused
    kernels cannot take the call (an unsupported dtype, no kernel for the platform), None if they
    can. The modes:
    - "auto" (the default): the kernels; where they cannot run, the reference, its fallback
      reason counted in the route log;
    - "strict": the kernels; where they cannot run, RuntimeError naming the reason;
    - "off": the reference (materialized logits), counted in the route log without a reason;
    - "audit": as auto, and where the kernels run the reference too: the result (and gradients)
      are the kernels', and the route log's audit records per call how many rows' logp equal the
      reference's bit for bit and the mean and max |logp - reference logp|.
    A call of no rows runs the reference, uncounted, in every mode."""
    if rows == 0 or mode == "off":
        return Route(fused=False, audit=False, counted=rows > 0, reason=None)
    if reason is not None:
        if mode == "strict":
            raise RuntimeError(f"{caller}(mode='strict'): the fused kernels cannot run this call: {reason}")
        return Route(fused=False, audit=False, counted=True, reason=reason)
    return Route(fused=True, audit=mode == "audit", counted=False, reason=None)


def backward_memory_budget(budget) -> int:
    """Bytes of saved logits backward="auto" may spend: `budget`, else env RLK_BACKWARD_MEMORY_BUDGET,
    else DEFAULT_BACKWARD_MEMORY_BUDGET."""
    name = "backward_memory_budget"
    if budget is None:
        env = os.environ.get("RLK_BACKWARD_MEMORY_BUDGET")
        if env is None:
            return DEFAULT_BACKWARD_MEMORY_BUDGET
        name = "env RLK_BACKWARD_MEMORY_BUDGET"
        try:
            budget = int(env)
        except ValueError:
            raise ValueError(f"{name} must be an int number of bytes >= 0, got {env!r}") from None
    if not isinstance(budget, numbers.Integral) or isinstance(budget, bool):
        raise BudgetTypeError(f"{name} must be an int number of bytes, got {type(budget).__name__}")
    if budget < 0:
        raise ValueError(f"{name} must be >= 0 bytes, got {budget}")
    return int(budget)


def platform(platforms: dict, key: str, value) -> dict | None:
    """The platform of the compiled module's report (`platforms`: core.platforms(), read once at
    import: each platform's names in the frontends, whether this build runs it and why not, its
    kernels) whose `key` ("name", "xla_platform", "jax_backend", "jax_lowering") is `value`; None
    for a platform the module does not know."""
    return next((p for p in platforms.values() if p[key] == value), None)


def platform_fallback(platforms: dict, key: str, value) -> str | None:
    """Why the fused kernels cannot run on the platform whose `key` is `value` (the route log's
    fallback reason), None where they can."""
    p = platform(platforms, key, value)
    if p is None:
        return f"device {value} (supported: {', '.join(platforms)})"
    return None if p["supported"] else f"device {p['name']} ({p['reason']})"


def dtype_code(core, name: str):
    """The compiled module's code for the operand dtype named `name` as jax and torch name it
    ("float32", "float16", "bfloat16"): a member of core.DType, which binds rlk::DType, so the codes
    have one home, the C++ enum. ValueError for a dtype the kernels do not take."""
    code = core.DType.__members__.get(name)
    if code is None:
        raise ValueError(f"dtype {name}: the kernels take {', '.join(core.DType.__members__)}")
    return code


def saved_logits_bytes(core, n: int, v_local: int, chunk: int, dtype: str, device: str) -> int:
    """Bytes the fast backward saves for one shard (n rows, v_local vocab rows of the dtype named
    `dtype`), in the layout of the backend on platform `device` (a name of core.platforms()): the frontends allocate
    this many uint8 and compare it with backward_memory_budget. Both backends' layouts are a record
    per row, so this is n times one row's bytes (n may be a symbolic size under torch.compile)."""
    return n * int(core.saved_logits_bytes(1, v_local, chunk, dtype_code(core, dtype), device))


def cuda_workspace_bytes(core, n: int, h: int, v_local: int, chunk: int, dtype: str, has_bias: bool,
                         with_entropy: bool, dhidden_f32: bool) -> dict:
    """CUDA scratch bytes of one shard's calls, {"forward", "lean", "fast"} (the forward and each
    backward strategy; the backward's with dhidden in float32, a vocab shard's partial sum, or in
    the dtype named `dtype`); 0 in a build without CUDA."""
    return core.cuda_workspace_bytes(n, h, v_local, chunk, dtype_code(core, dtype), has_bias, with_entropy,
                                     dhidden_f32)


def resolve_backward(backward: str, saved_logits_bytes: int, budget=None) -> str:
    """The backward strategy of one call (BACKWARDS), "fast" or "lean":
    - "fast": the forward also keeps what the backward needs of this shard's logits (the kept
      buffer, in a max-relative form: saved_logits_bytes, about n * V_local * 2 bytes for 16-bit operands,
      4 for fp32) and the backward reads it back instead of recomputing the logits, as exact as
      lean at any logit scale and temperature (docs/design.md §5);
    - "lean": the backward recomputes the logits chunk by chunk (on CUDA a workspace of at most
      256 MiB, whatever n and V);
    - "auto" (the default): fast when saved_logits_bytes (what fast would keep: the frontend knows its
      dtypes and device; 0 where the kernels do not run) fits the budget, inclusive, else lean.
    budget: bytes (backward_memory_budget: None is env RLK_BACKWARD_MEMORY_BUDGET, else
    DEFAULT_BACKWARD_MEMORY_BUDGET, 4 GiB), checked whatever the strategy. Only calls that are
    differentiated keep logits."""
    if backward not in BACKWARDS:
        raise ValueError(f"backward must be one of {BACKWARDS}, got {backward!r}")
    budget = backward_memory_budget(budget)
    if backward != "auto":
        return backward
    return "fast" if saved_logits_bytes <= budget else "lean"
