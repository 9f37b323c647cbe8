"""linear_logp under jax.jit with sharded inputs and no shard_map (GSPMD / Shardy): the op
partitions itself.

Engaged by rlk_xla.linear_logp when a mesh is set (`with jax.set_mesh(mesh):`) and the call is not
already inside shard_map (axis_name=None). Without a set mesh (jit over NamedSharding inputs alone,
or the deprecated `with mesh:`), a jitted program cannot see its operands' shardings at trace time
and the call is the single-device program, which GSPMD partitions by gathering the weight. Each
half of the custom_vjp is a custom_partitioning op that reads its operands' shardings at lowering:

- weight [V, H] (and bias [V]) sharded over one mesh axis on V: that axis is the vocab axis, each
  device runs the kernels on its shard and the shards exchange the per-row statistics, exactly the
  shard_map path's program (linear_logp(..., axis_name=)), hence its bits;
- hidden's rows (and targets, a per-token temperature) sharded over other axes stay local; dW and
  the bias gradient are summed over those axes;
- outputs: logp and entropy sharded like the rows, dH like hidden, dW and db like the weight;
- refused with a clear error: the hidden dimension sharded (of hidden or of the weight), the
  vocab sharded over several axes, or the vocab axis also sharding the rows.

The backward recomputes the forward statistics on each shard (the "lean" backward; bits equal the
shard_map path with backward="lean"); backward="fast" is not kept under GSPMD.
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

_PER_SHARD = contextvars.ContextVar("rlk_gspmd_per_shard", default=False)


def engaged() -> bool:
    """A mesh is set, no axis of it is manual (not inside shard_map), and this is not the per-shard
    program itself."""
    if _PER_SHARD.get():
        return False
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        return False
    return not any(t == jax.sharding.AxisType.Manual for t in mesh.axis_types)


@dataclasses.dataclass(frozen=True)
class _Opts:
    has_bias: bool
    temp_array: bool
    temperature: float       # when not an array
    ignore_index: int
    real_vocab: int          # of the global vocab
    mode: object


def linear_logp(hidden, weight, targets, *, bias, temperature, ignore_index, real_vocab_size, return_entropy, mode):
    """rlk_xla.linear_logp's contract over GSPMD-sharded operands (module docstring)."""
    out_shape = targets.shape
    h2 = hidden.reshape(-1, hidden.shape[-1])
    t1 = targets.reshape(-1)
    temp_array = not isinstance(temperature, (int, float))
    opts = _Opts(has_bias=bias is not None, temp_array=temp_array,
                 temperature=1.0 if temp_array else float(temperature), ignore_index=int(ignore_index),
                 real_vocab=int(weight.shape[0] if real_vocab_size is None else real_vocab_size), mode=mode)
    extras = ((bias,) if bias is not None else ()) + ((jnp.asarray(temperature).reshape(-1),) if temp_array else ())
    try:
        logp, ent = _op(opts, h2, weight, t1, *extras)
    except NotImplementedError as err:  # custom_partitioning has no batching rule
        if "custom_partitioning" not in str(err):
            raise
        raise ValueError("rlk_xla.linear_logp under jax.set_mesh does not run under vmap (custom_partitioning has "
                         "no batching rule): pass the batch as leading dims of hidden and targets (any [..., H] "
                         "works), or call it outside the mesh") from err
    logp, ent = logp.reshape(out_shape), ent.reshape(out_shape)
    return (logp, ent) if return_entropy else logp


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _op(opts, hidden, weight, targets, *extras):
    return _forward(opts)(hidden, weight, targets, *extras)


def _op_fwd(opts, hidden, weight, targets, *extras):
    return _forward(opts)(hidden, weight, targets, *extras), (hidden, weight, targets, extras)


def _op_bwd(opts, res, cts):
    hidden, weight, targets, extras = res
    g, e = cts
    grads = _backward(opts)(hidden, weight, targets, *extras, g.astype(jnp.float32), e.astype(jnp.float32))
    return (grads[0], grads[1], None, *grads[2:])


_op.defvjp(_op_fwd, _op_bwd)


def _layout(arg_shapes):
    """(the rows' spec entry, the mesh axes sharding the rows, the vocab axis or None) from the
    operands' shardings (hidden's and the weight's), or a clear error."""
    def spec(i):
        s, ndim = arg_shapes[i].sharding, len(arg_shapes[i].shape)
        return (tuple(s.spec) + (None,) * ndim)[:ndim] if hasattr(s, "spec") else (None,) * ndim
    hs, ws = spec(0), spec(1)
    if hs[1] is not None or ws[1] is not None:
        raise ValueError(f"rlk_xla.linear_logp under GSPMD: the hidden dimension is sharded (hidden {P(*hs)}, weight "
                         f"{P(*ws)}): shard the weight over the vocab (P('tp', None)) and hidden over its rows only")
    vocab = ws[0]
    if isinstance(vocab, tuple):
        if len(vocab) > 1:
            raise ValueError(f"rlk_xla.linear_logp under GSPMD: the vocab is sharded over several mesh axes {vocab}: "
                             "shard it over one")
        vocab = vocab[0] if vocab else None
    rows = hs[0]
    row_axes = () if rows is None else (rows if isinstance(rows, tuple) else (rows,))
    if vocab is not None and vocab in row_axes:
        raise ValueError(f"rlk_xla.linear_logp under GSPMD: mesh axis {vocab!r} shards both the vocab and the rows")
    return rows, row_axes, vocab


def _shardings(opts, mesh, rows, vocab, backward):
    """Operand and result shardings: the operands in call order, then the results."""
    r, rh, w, v = (NamedSharding(mesh, p) for p in (P(rows), P(rows, None), P(vocab, None), P(vocab)))
    args = [rh, w, r] + ([v] if opts.has_bias else []) + ([r] if opts.temp_array else [])
    if not backward:
        return args, (r, r)
    return args + [r, r], tuple([rh, w] + ([v] if opts.has_bias else []) + ([r] if opts.temp_array else []))


def _local_call(opts, vocab):
    """The shard_map path's program on this device's pieces: (logp, entropy) of (hidden, weight,
    targets, *extras)."""
    from .linear_logp import linear_logp as op

    def call(hidden, weight, targets, *extras):
        bias = extras[0] if opts.has_bias else None
        temp = extras[-1] if opts.temp_array else opts.temperature
        with _per_shard():
            return op(hidden, weight, targets, bias=bias, temperature=temp, ignore_index=opts.ignore_index,
                      real_vocab_size=opts.real_vocab, return_entropy=True, mode=opts.mode, axis_name=vocab,
                      backward="lean")
    return call


@contextlib.contextmanager
def _per_shard():
    token = _PER_SHARD.set(True)
    try:
        yield
    finally:
        _PER_SHARD.reset(token)


def _rule(opts, backward):
    operands = ["n h", "v h", "n"] + (["v"] if opts.has_bias else []) + (["n"] if opts.temp_array else [])
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
    def reference(hidden, weight, targets, *extras):  # the single-device program (shapes, and no mesh)
        return _local_call(opts, None)(hidden, weight, targets, *extras)

    return _partitioned(opts, False, reference, lambda vocab, row_axes: _local_call(opts, vocab))


def _rows_f32_bias(opts, vocab):
    """(logp, entropy) of (hidden, weight, targets, bias32, temperature) through the fused kernels,
    the bias taken in fp32 as the kernels take it: its gradient stays fp32 until summed over the
    row shards, then rounds once, as in the shard_map path."""
    from ._args import parse
    from .linear_logp import fused_rows

    def call(hidden, weight, targets, bias32, temp):
        a = parse(hidden, weight, targets, bias=None, temperature=temp, ignore_index=opts.ignore_index,
                  vocab_start=None, real_vocab_size=opts.real_vocab, axis_name=vocab)
        a = dataclasses.replace(a, bias=bias32)
        with _per_shard():
            return fused_rows(a, True)
    return call


@functools.cache
def _backward(opts):
    def grads(vocab, row_axes):
        def local(hidden, weight, targets, *rest):
            *extras, g, e = rest
            if opts.has_bias and opts.mode != "off":
                bias, temp = extras[0], (extras[-1] if opts.temp_array else opts.temperature)
                f = _rows_f32_bias(opts, vocab)
                diff = (hidden, weight, bias.astype(jnp.float32)) + ((temp,) if opts.temp_array else ())
                _, vjp = jax.vjp(lambda h, w, b, *t: f(h, w, targets, b, t[0] if t else temp), *diff)
            else:
                call = _local_call(opts, vocab)
                diff = (hidden, weight, *extras)
                _, vjp = jax.vjp(lambda h, w, *x: call(h, w, targets, *x), *diff)
            out = list(vjp((g, e)))
            if row_axes:  # dW and db are partial sums over the devices' rows
                for i in range(1, 2 + opts.has_bias):
                    out[i] = jax.lax.psum(out[i], row_axes)
            if opts.has_bias:
                out[2] = out[2].astype(extras[0].dtype)
            return tuple(out)
        return local

    def reference(hidden, weight, targets, *rest):
        return grads(None, ())(hidden, weight, targets, *rest)

    return _partitioned(opts, True, reference, grads)
