"""linear_logp under jax.jit with sharded inputs and no shard_map (GSPMD / Shardy): the op
partitions itself.

Engaged by rlk_xla.linear_logp (axis_name=None) on its fused route when no mesh axis is manual (not
inside shard_map) and a mesh of several devices is in sight (engaged()): set with `jax.set_mesh(mesh)` or the
deprecated `with mesh:`, or carried by an operand. Under plain `jax.jit(f)(hidden, weight, targets)`
over `jax.device_put(x, NamedSharding(mesh, ...))` arrays (how MaxText, Tunix and Levanter call it)
no mesh is set, but the abstract value of a NamedSharding argument, and of a value derived from one
or constrained with with_sharding_constraint, keeps its mesh (jax >= 0.6), and that suffices: each
half of the custom_vjp is a custom_partitioning op, and jax hands its partition callbacks the mesh
and the operands' shardings at lowering, with or without a set mesh. With no mesh set, calls whose
operands are on one device (a single-device program, eager or jitted, on a host with one device or
many) are not engaged: their program is exactly the one without this module. (Under a set mesh or
`with mesh:` they are, and custom_partitioning inlines the per-device program on one device: the
lean backward.) Not seen: jit(in_shardings=...) over
uncommitted arrays with no mesh set (their abstract values carry no mesh, and which custom_vjp to
build is decided when tracing): the call is then the single-device program, which GSPMD partitions
by gathering the weight; set the mesh, or pass arrays already placed (jax.device_put), to partition
it. The partition callbacks read the operands' shardings:

- weight [V, H] (and bias [V]) sharded over one mesh axis on V: that axis is the vocab axis, each
  device runs the kernels on its shard and the shards exchange the per-row statistics, exactly the
  shard_map path's program (linear_logp(..., axis_name=)), hence its bits;
- hidden's rows (and targets, a per-token temperature) sharded over other axes stay local; dW and
  the bias gradient are summed over those axes;
- a nucleus (keep_mask [n, V] bool; keep_ids become the mask they stand for, globally) is taken
  sharded like (hidden's rows, the weight's vocab): each device passes its [n_local, V_local] slice
  to the per-shard program, as the shard_map path does. Sharded otherwise (replicated, or over
  other axes), it is resharded to that layout, one [n, V] bool resharding at most (a slice of a
  replicated mask; a collective-permute of [n_local, V_local] bytes for a transposed one): its
  sharding never propagates to the rows or the vocab (its own factors in the sharding rule);
- outputs: logp and entropy sharded like the rows, dH like hidden, dW and db like the weight;
- nothing sharded (every operand replicated over the mesh): every device runs the whole call (the
  per-shard program with no vocab axis);
- gathered, never the vocab: the hidden dimension sharded (of hidden, or of the weight as FSDP shards
  it) is all-gathered, the weight's within its vocab shard (FSDP's own gather); rows sharded over
  the vocab axis too (sequence parallelism) are all-gathered over that axis (Megatron's own gather
  before its LM head); the results come with the rows' remaining sharding;
- refused with a clear error: the vocab sharded over several axes, an operand sharded with no mesh
  axis names (a GSPMDSharding: which axis is the vocab's cannot be told), and vmap
  (custom_partitioning has no batching rule).

The backward recomputes the forward statistics on each shard (the "lean" backward; bits equal the
shard_map path with backward="lean"); backward="fast" is not kept under GSPMD. The reference routes
(mode="off", auto's fallbacks) are not partitioned here: they are jnp, which GSPMD partitions
itself, and they count through host callbacks (jax.debug.callback), as audit records its reference
beside the kernels; a callback inside a custom_partitioning body crashes jax 0.10's CPU runtime
(SIGSEGV), so the per-shard program runs the kernels alone (mode="strict").
"""
from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental.custom_partitioning import custom_partitioning
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from ._compat import aval_mesh, legacy_mesh_size

_PER_SHARD = contextvars.ContextVar("rlk_gspmd_per_shard", default=False)


def engaged(*operands) -> bool:
    """GSPMD may partition this call: not the per-shard program itself, no mesh axis manual (not
    inside shard_map), and a mesh of several devices in sight, either set (jax.set_mesh, or the
    deprecated `with mesh:`) or carried by an operand: a NamedSharding array, or a traced value
    derived from one (under jax.jit its aval keeps the array's mesh; rlk_xla._compat.aval_mesh)."""
    if _PER_SHARD.get():
        return False
    ctx = jax.sharding.get_abstract_mesh()
    if not ctx.empty:
        return not _manual(ctx)
    meshes = [m for m in (aval_mesh(x) for x in operands) if m is not None and not m.empty]
    if any(_manual(m) for m in meshes):
        return False
    return any(m.size > 1 for m in meshes) or legacy_mesh_size() > 1


def _manual(mesh) -> bool:
    return any(t == jax.sharding.AxisType.Manual for t in getattr(mesh, "axis_types", ()))


@dataclasses.dataclass(frozen=True)
class _Opts:
    has_bias: bool
    temp_array: bool
    temperature: float       # when not an array
    ignore_index: int
    real_vocab: int          # of the global vocab
    has_keep: bool           # a nucleus (keep_mask) follows targets among the operands

    def split(self, rest):
        """(keep, bias, temperature) of the operands after targets: arrays, or None and the float."""
        keep, rest = (rest[0], rest[1:]) if self.has_keep else (None, rest)
        return (keep, rest[0] if self.has_bias else None, rest[-1] if self.temp_array else self.temperature)


def linear_logp(hidden, weight, targets, *, bias, temperature, ignore_index, real_vocab_size, keep_mask=None):
    """(logp, entropy) of rlk_xla.linear_logp's fused route over GSPMD-sharded operands (module
    docstring), the arguments checked by it; keep_mask [*targets.shape, V] bool or None."""
    out_shape = targets.shape
    keep = () if keep_mask is None else (keep_mask.reshape(-1, weight.shape[0]),)
    h2 = hidden.reshape(-1, hidden.shape[-1])
    t1 = targets.reshape(-1)
    temp_array = not isinstance(temperature, (int, float))
    opts = _Opts(has_bias=bias is not None, temp_array=temp_array,
                 temperature=1.0 if temp_array else float(temperature), ignore_index=int(ignore_index),
                 real_vocab=int(weight.shape[0] if real_vocab_size is None else real_vocab_size),
                 has_keep=keep_mask is not None)
    extras = ((bias,) if bias is not None else ()) + ((jnp.asarray(temperature).reshape(-1),) if temp_array else ())
    try:
        logp, ent = _op(opts, h2, weight, t1, *keep, *extras)
    except NotImplementedError as err:  # custom_partitioning has no batching rule
        if "custom_partitioning" not in str(err):
            raise
        raise ValueError("rlk_xla.linear_logp under GSPMD (a mesh set, or operands sharded over one) does not run "
                         "under vmap (custom_partitioning has no batching rule): pass the batch as leading dims of "
                         "hidden and targets (any [..., H] works)") from err
    return logp.reshape(out_shape), ent.reshape(out_shape)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _op(opts, hidden, weight, targets, *rest):
    return _forward(opts)(hidden, weight, targets, *rest)


def _op_fwd(opts, hidden, weight, targets, *rest):
    return _forward(opts)(hidden, weight, targets, *rest), (hidden, weight, targets, rest)


def _op_bwd(opts, res, cts):
    hidden, weight, targets, rest = res
    g, e = cts
    grads = _backward(opts)(hidden, weight, targets, *rest, g.astype(jnp.float32), e.astype(jnp.float32))
    return (grads[0], grads[1], None, *((None,) if opts.has_keep else ()), *grads[2:])


_op.defvjp(_op_fwd, _op_bwd)


def _layout(arg_shapes):
    """(the rows' spec entry, the mesh axes sharding the rows, the vocab axis or None) from the
    operands' shardings (hidden's and the weight's), or a clear error."""
    def spec(i):
        s, ndim = arg_shapes[i].sharding, len(arg_shapes[i].shape)
        if not hasattr(s, "spec"):  # no mesh at lowering: a sharding with no axis names
            if s.is_fully_replicated:
                return (None,) * ndim
            raise ValueError(f"rlk_xla.linear_logp under GSPMD: operand {i} is sharded ({s}) with no mesh to name "
                             "its axes: place the operands with NamedSharding, or set the mesh (jax.set_mesh)")
        return (tuple(s.spec) + (None,) * ndim)[:ndim]
    # The hidden dimension's sharding (hidden's or the weight's, as FSDP shards a weight) is not
    # served: the per-device program asks for H whole, and XLA all-gathers it (the weight's H
    # within its vocab shard, FSDP's own gather), never the vocab.
    hs, ws = spec(0), spec(1)
    vocab = ws[0]
    if isinstance(vocab, tuple):
        if len(vocab) > 1:
            raise ValueError(f"rlk_xla.linear_logp under GSPMD: the vocab is sharded over several mesh axes {vocab}: "
                             "shard it over one")
        vocab = vocab[0] if vocab else None
    rows = hs[0]
    row_axes = () if rows is None else (rows if isinstance(rows, tuple) else (rows,))
    # Rows sharded over the vocab axis too (sequence parallelism, as Megatron's): the per-device
    # program asks for them gathered over that axis (Megatron's own gather before the LM head).
    if vocab is not None and vocab in row_axes:
        row_axes = tuple(a for a in row_axes if a != vocab)
        rows = row_axes if len(row_axes) > 1 else (row_axes[0] if row_axes else None)
    return rows, row_axes, vocab


def _shardings(opts, mesh, rows, vocab, backward):
    """Operand and result shardings: the operands in call order, then the results."""
    r, rh, w, v, k = (NamedSharding(mesh, p) for p in (P(rows), P(rows, None), P(vocab, None), P(vocab), P(rows, vocab)))
    args = [rh, w, r] + ([k] if opts.has_keep else []) + ([v] if opts.has_bias else []) + ([r] if opts.temp_array else [])
    if not backward:
        return args, (r, r)
    return args + [r, r], tuple([rh, w] + ([v] if opts.has_bias else []) + ([r] if opts.temp_array else []))


def _local_call(opts, vocab):
    """The shard_map path's program on this device's pieces: (logp, entropy) of (hidden, weight,
    targets, *extras)."""
    from .linear_logp import linear_logp as op

    def call(hidden, weight, targets, *rest):
        keep, bias, temp = opts.split(rest)
        with _per_shard():
            return op(hidden, weight, targets, bias=bias, temperature=temp, ignore_index=opts.ignore_index,
                      real_vocab_size=opts.real_vocab, return_entropy=True, mode="strict", axis_name=vocab,
                      backward="lean", keep_mask=keep)
    return call


@contextlib.contextmanager
def _per_shard():
    token = _PER_SHARD.set(True)
    try:
        yield
    finally:
        _PER_SHARD.reset(token)


def _rule(opts, backward):
    # the nucleus's own factors: its sharding is never propagated to the rows or the vocab (the
    # partition reshards it to theirs)
    operands = (["n h", "v h", "n"] + (["k u"] if opts.has_keep else []) + (["v"] if opts.has_bias else [])
                + (["n"] if opts.temp_array else []))
    if not backward:
        return f"{', '.join(operands)} -> n, n"
    results = ["n h", "v h"] + (["v"] if opts.has_bias else []) + (["n"] if opts.temp_array else [])
    return f"{', '.join(operands + ['n', 'n'])} -> {', '.join(results)}"


def _partitioned(opts, backward, reference, local):
    """custom_partitioning of `reference` (the single-device program) whose per-device program is
    local(vocab axis, row axes), with the operands' and results' shardings of _shardings."""
    def partition(mesh, arg_shapes, result_shape):
        rows, row_axes, vocab = _layout(arg_shapes)
        args, results = _shardings(opts, mesh, rows, vocab, backward=backward)
        return mesh, local(vocab, row_axes), results, tuple(args)

    def infer(mesh, arg_shapes, result_shape):
        rows, _, vocab = _layout(arg_shapes)
        return _shardings(opts, mesh, rows, vocab, backward=backward)[1]

    f = custom_partitioning(reference)
    f.def_partition(partition=partition, infer_sharding_from_operands=infer, sharding_rule=_rule(opts, backward))
    return f


@functools.cache
def _forward(opts):
    def reference(hidden, weight, targets, *rest):  # the single-device program (shapes, and no mesh)
        return _local_call(opts, None)(hidden, weight, targets, *rest)

    return _partitioned(opts, False, reference, lambda vocab, row_axes: _local_call(opts, vocab))


def _rows_f32_bias(opts, vocab):
    """(logp, entropy) of (hidden, weight, targets, bias32, temperature) through the fused kernels,
    the bias taken in fp32 as the kernels take it: its gradient stays fp32 until summed over the
    row shards, then rounds once, as in the shard_map path."""
    from ._args import parse
    from .linear_logp import fused_rows

    def call(hidden, weight, targets, keep, bias32, temp):
        a = parse(hidden, weight, targets, bias=None, temperature=temp, ignore_index=opts.ignore_index,
                  vocab_start=None, real_vocab_size=opts.real_vocab, axis_name=vocab)
        a = dataclasses.replace(a, bias=bias32)
        with _per_shard():
            return fused_rows(a, True, keep=None if keep is None else keep.astype(jnp.uint8))
    return call


@functools.cache
def _backward(opts):
    def grads(vocab, row_axes):
        def local(hidden, weight, targets, *rest):
            *rest, g, e = rest
            keep, bias, temp = opts.split(rest)
            temps = (temp,) if opts.temp_array else ()
            if opts.has_bias:
                f = _rows_f32_bias(opts, vocab)
                diff = (hidden, weight, bias.astype(jnp.float32), *temps)
                _, vjp = jax.vjp(lambda h, w, b, *t: f(h, w, targets, keep, b, t[0] if t else temp), *diff)
            else:
                call = _local_call(opts, vocab)
                keeps = (keep,) if opts.has_keep else ()
                diff = (hidden, weight, *((bias,) if opts.has_bias else ()), *temps)
                _, vjp = jax.vjp(lambda h, w, *x: call(h, w, targets, *keeps, *x), *diff)
            out = list(vjp((g, e)))
            if row_axes:  # dW and db are partial sums over the devices' rows
                for i in range(1, 2 + opts.has_bias):
                    out[i] = jax.lax.psum(out[i], row_axes)
            if opts.has_bias:
                out[2] = out[2].astype(bias.dtype)
            return tuple(out)
        return local

    def reference(hidden, weight, targets, *rest):
        return grads(None, ())(hidden, weight, targets, *rest)

    return _partitioned(opts, True, reference, grads)
