"""rlk_xla.linear_logp under jax.jit with NamedSharding inputs and no shard_map (GSPMD / Shardy;
rlk_xla.gspmd), on 4 and 8 CPU devices, with the mesh set (jax.set_mesh), with no mesh set (plain
jit, as MaxText, Tunix and Levanter call it) and under the deprecated `with mesh:`: the vocab sharded
over "tp" (rows over "dp" too) compiles with no all-gather, gives the shard_map path's bits (logp,
entropy and the gradients of hidden, weight, bias and a per-token temperature, backward="lean"), dW
keeps the weight's sharding and dH the hidden's, also under lax.scan and jax.checkpoint; a nucleus
(keep_mask, or keep_ids) sharded like (rows, vocab), replicated, or sharded otherwise (resharded)
gives the shard_map path's bits, an empty nucleus's NaN and an outside target's -inf included; the
reference routes (mode="off", audit) run and count; an unsharded single-device jit compiles to the
program it had before GSPMD was engaged outside a set mesh; per-device temp bytes stay far below one
logits buffer at every TP degree while the weight's bytes shrink with it; a sharded hidden
dimension (FSDP) and rows sharded over the vocab axis (sequence parallelism) are all-gathered, never
the vocab, with the shard_map path's bits; an operand sharded with no axis names, and vmap are
refused."""
import contextlib
import functools
import re
import warnings

import pytest

jax = pytest.importorskip("jax", reason="jax is not installed: these tests need it")

import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import rlk_xla
from rlk_xla import gspmd
from rlk_xla._compat import shard_map
from jax_helpers import collectives
from rlk_xla.parallel import vocab_parallel_linear_logp

pytestmark = pytest.mark.skipif(len(jax.devices("cpu")) < 8, reason="needs 8 CPU devices (tests/conftest.py)")

N, H, V, REAL = 22, 32, 1024, 1000

# (mesh shape, axis names, devices): TP 4 and 8, and dp x tp on 4 and 8 devices
MESHES = {"tp4": ((4,), ("tp",)), "tp8": ((8,), ("tp",)), "dp2_tp2": ((2, 2), ("dp", "tp")),
          "dp2_tp4": ((2, 4), ("dp", "tp"))}


def _mesh(name):
    shape, names = MESHES[name]
    return jax.make_mesh(shape, names, axis_types=(jax.sharding.AxisType.Auto,) * len(shape),
                         devices=jax.devices("cpu")[:int(np.prod(shape))])


def _inputs(seed=0):
    k = jax.random.split(jax.random.key(seed), 6)
    hidden = jax.random.normal(k[0], (N, H)).astype(jnp.bfloat16)
    weight = (jax.random.normal(k[1], (V, H)) * 3 / H ** 0.5).astype(jnp.bfloat16)
    bias = jax.random.normal(k[2], (V,)).astype(jnp.bfloat16)
    temp = jax.random.uniform(k[3], (N,), minval=0.5, maxval=1.5)
    targets = jax.random.randint(k[4], (N,), 0, REAL).at[::5].set(-100)
    g = jax.random.normal(k[5], (N,))
    return hidden, weight, bias, temp, targets, g


def _loss(call):
    def f(hidden, weight, bias, temp, targets, g):
        logp, ent = call(hidden, weight, targets, bias=bias, temperature=temp, real_vocab_size=REAL,
                         return_entropy=True)
        return (logp * g).sum() + 0.5 * ent.sum(), (logp, ent)
    return jax.jit(jax.value_and_grad(f, argnums=(0, 1, 2, 3), has_aux=True))


def _placed(mesh, rows):
    hidden, weight, bias, temp, targets, g = _inputs()
    specs = (P(rows, None), P("tp", None), P("tp"), P(rows), P(rows), P(rows))
    return [jax.device_put(x, NamedSharding(mesh, s)) for x, s in zip((hidden, weight, bias, temp, targets, g), specs,
                                                                      strict=True)]


@contextlib.contextmanager
def _context(how, mesh):
    """How the caller sets (or does not set) the mesh around a jit over NamedSharding inputs."""
    if how == "set_mesh":
        with jax.set_mesh(mesh):
            yield
    elif how == "with_mesh":  # deprecated in jax >= 0.7, still used (MaxText)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            with mesh:
                yield
    else:  # plain jit: the mesh only in the arrays' shardings
        yield


CASES = [(name, "set_mesh") for name in MESHES] + [(name, "plain") for name in MESHES] + [("tp4", "with_mesh")]


@pytest.mark.parametrize(("name", "how"), CASES)
def test_gspmd_gives_the_shard_map_bits_with_no_all_gather(name, how):
    mesh = _mesh(name)
    rows = "dp" if "dp" in mesh.axis_names else None
    args = _placed(mesh, rows)
    f = _loss(rlk_xla.linear_logp)
    with _context(how, mesh):
        (_, (logp, ent)), grads = f(*args)
        hlo = f.lower(*args).compile().as_text()
    assert "all-gather" not in hlo

    def shard_map_path(hidden, weight, targets, **kw):
        return vocab_parallel_linear_logp(hidden, weight, targets, mesh=mesh, vocab_axis="tp", token_axis=rows,
                                          backward="lean", **kw)
    (_, (logp_sm, ent_sm)), grads_sm = _loss(shard_map_path)(*args)
    np.testing.assert_array_equal(logp, logp_sm)
    np.testing.assert_array_equal(ent, ent_sm)
    for got, ref in zip(grads, grads_sm, strict=True):
        np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(ref, np.float32))
    dh, dw, db, _ = grads
    assert dw.sharding.is_equivalent_to(args[1].sharding, 2) and db.sharding.is_equivalent_to(args[2].sharding, 1)
    assert dh.sharding.is_equivalent_to(args[0].sharding, 2)


def _per_device_bytes(tp, how, n=256, h=256, v=32768):
    mesh = _mesh("tp8") if tp == 8 else jax.make_mesh((tp,), ("tp",), axis_types=(jax.sharding.AxisType.Auto,),
                                                       devices=jax.devices("cpu")[:tp])
    shapes = (((n, h), jnp.bfloat16, P()), ((v, h), jnp.bfloat16, P("tp", None)), ((n,), jnp.int32, P()))
    args = [jax.ShapeDtypeStruct(s, d, sharding=NamedSharding(mesh, p)) for s, d, p in shapes]

    def loss(hidden, weight, targets):
        logp, ent = rlk_xla.linear_logp(hidden, weight, targets, return_entropy=True)
        return logp.sum() + ent.sum()
    with _context(how, mesh):
        stats = jax.jit(jax.grad(loss, argnums=(0, 1))).lower(*args).compile().memory_analysis()
    return stats.temp_size_in_bytes, stats.argument_size_in_bytes, n * v * 2


@pytest.mark.parametrize("how", ["set_mesh", "plain"])
def test_per_device_memory_with_the_tp_degree(how):
    measured = {tp: _per_device_bytes(tp, how) for tp in (1, 2, 4, 8)}
    for tp, (temp, arg, logits) in measured.items():
        # no [n, V] nor [n, V / tp] buffer: the statistics exchange is O(n * V / chunk). A
        # one-device mesh with no mesh set is the single-device program (not engaged), whose
        # backward="auto" may save the logits (the fast backward) within its memory budget.
        if tp > 1 or how == "set_mesh":
            assert temp < logits / 8, (tp, temp)
        if tp > 1:
            assert temp <= measured[2][0]  # constant beyond TP = 2: nothing vocab-sized to shrink
            assert arg < measured[tp // 2][1]  # the weight shard halves


def _gathered_shapes(hlo):
    """The result shapes of the compiled program's all-gathers."""
    return [shape for op, shapes in collectives(hlo) if op == "all-gather" for shape in shapes]


# (mesh, hidden's spec, the weight's spec): the hidden dimension sharded as FSDP shards a weight
# (over "dp", which also shards the rows), and the rows sharded over the vocab axis too (sequence
# parallelism). Both are gathered (H, or the rows), never the vocab: the shard_map path's bits.
GATHERED = {"fsdp_weight": ("dp2_tp2", P("dp", None), P("tp", "dp")),
            "fsdp_hidden": ("dp2_tp2", P("dp", "tp"), P("tp", None)),
            "sequence_parallel": ("tp4", P("tp", None), P("tp", None))}


@pytest.mark.parametrize("how", ["set_mesh", "plain"])
@pytest.mark.parametrize("case", sorted(GATHERED))
def test_a_sharded_hidden_dimension_or_rows_on_the_vocab_axis_are_gathered_not_the_vocab(case, how):
    name, hidden_spec, weight_spec = GATHERED[case]
    mesh = _mesh(name)
    rows = "dp" if "dp" in mesh.axis_names else None
    hidden, weight, bias, temp, targets, g = _inputs()
    row_spec = P(hidden_spec[0])
    specs = (hidden_spec, weight_spec, P("tp"), row_spec, row_spec, row_spec)
    args = [jax.device_put(x[:20] if x.shape[0] == N else x, NamedSharding(mesh, sp))  # 20 rows: divisible by 4
            for x, sp in zip((hidden, weight, bias, temp, targets, g), specs, strict=True)]
    f = _loss(rlk_xla.linear_logp)
    with _context(how, mesh):
        (_, (logp, ent)), grads = f(*args)
        hlo = f.lower(*args).compile().as_text()
    gathered = _gathered_shapes(hlo)
    assert gathered, hlo  # the documented gather happened
    assert not any(str(V) in shape for shape in gathered), gathered  # never the vocab

    def shard_map_path(hidden, weight, targets, **kw):
        return vocab_parallel_linear_logp(hidden, weight, targets, mesh=mesh, vocab_axis="tp", token_axis=rows,
                                          backward="lean", **kw)
    plain_args = [jax.device_put(a, NamedSharding(mesh, sp)) for a, sp in
                  zip(args, (P(rows, None), P("tp", None), P("tp"), P(rows), P(rows), P(rows)), strict=True)]
    (_, (logp_sm, ent_sm)), grads_sm = _loss(shard_map_path)(*plain_args)
    np.testing.assert_array_equal(logp, logp_sm)
    np.testing.assert_array_equal(ent, ent_sm)
    for got, ref in zip(grads, grads_sm, strict=True):
        np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(ref, np.float32))


@pytest.mark.parametrize("how", ["set_mesh", "plain"])
def test_vmap_under_gspmd_is_refused_with_the_fix(how):
    mesh = _mesh("tp4")
    hidden, weight, _, _, targets, _ = _inputs()
    if how == "plain":
        weight = jax.device_put(weight, NamedSharding(mesh, P("tp", None)))
    with _context(how, mesh), pytest.raises(ValueError, match="leading dims"):
        jax.jit(jax.vmap(lambda h, t: rlk_xla.linear_logp(h, weight, t)))(hidden[None], targets[None])


def _program(f, *args):
    """Compiled HLO text without source locations (file paths and line numbers) and module name."""
    text = re.sub(r", metadata=\{[^}]*\}", "", f.lower(*args).compile().as_text())
    return [line for line in text.splitlines()
            if not re.match(r"^(HloModule|\d+ |FileNames|FunctionNames|FileLocations|StackFrames)", line)]


def test_an_unsharded_single_device_jit_keeps_its_program(monkeypatch):
    hidden, weight, bias, temp, targets, g = _inputs()
    keep = jax.random.uniform(jax.random.key(1), (N, V)) < 0.5

    def loss(hidden, weight, bias, temp):
        logp, ent = rlk_xla.linear_logp(hidden, weight, targets, bias=bias, temperature=temp, real_vocab_size=REAL,
                                        return_entropy=True, keep_mask=keep)
        return (logp * g).sum() + ent.sum()
    f = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3)))
    args = (hidden, weight, bias, temp)
    assert not gspmd.engaged(*args)  # eight devices here, the arrays on one of them
    engaged_program, out = _program(f, *args), f(*args)
    monkeypatch.setattr(gspmd, "engaged", lambda *a: False)
    f = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3)))
    assert _program(f, *args) == engaged_program
    for a, b in zip(jax.tree.leaves(out), jax.tree.leaves(f(*args)), strict=True):
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))


def test_eager_sharded_call_outside_jit():
    mesh = _mesh("tp4")
    hidden, weight, bias, temp, targets, _ = _placed(mesh, None)
    kw = {"bias": bias, "temperature": temp, "real_vocab_size": REAL}
    got = rlk_xla.linear_logp(hidden, weight, targets, **kw)
    want = vocab_parallel_linear_logp(hidden, weight, targets, mesh=mesh, vocab_axis="tp", **kw)
    np.testing.assert_array_equal(got, want)


def _nucleus(targets):
    """keep [N, V] bool (about 30% of the real vocab, every valid target kept), with row 1's target
    outside its nucleus and row 2 keeping nothing."""
    keep = np.array(jax.random.uniform(jax.random.key(7), (N, V)) < 0.3)
    keep[:, REAL:] = False
    t = np.asarray(targets)
    keep[np.arange(N)[t >= 0], t[t >= 0]] = True
    keep[1, t[1]] = False
    keep[2] = False
    assert t[1] >= 0 and t[2] >= 0
    return keep


def _nucleus_loss(call):
    def f(hidden, weight, bias, temp, targets, g, keep):
        logp, ent = call(hidden, weight, targets, keep, bias=bias, temperature=temp)
        return (jnp.where(jnp.isfinite(logp), logp, 0) * g).sum() + 0.5 * ent.sum(), (logp, ent)
    return jax.jit(jax.value_and_grad(f, argnums=(0, 1, 2, 3), has_aux=True))


NUCLEUS_CASES = [(name, how, spec) for name, how in (("tp4", "plain"), ("tp4", "set_mesh"), ("dp2_tp2", "plain"))
                 for spec in ("rows_vocab", "replicated", "ids")] + [("dp2_tp2", "plain", "transposed")]


@pytest.mark.parametrize(("name", "how", "keep_spec"), NUCLEUS_CASES)
def test_nucleus_gives_the_shard_map_bits(name, how, keep_spec):
    mesh = _mesh(name)
    rows = "dp" if "dp" in mesh.axis_names else None
    args = _placed(mesh, rows)
    keep = _nucleus(args[4])
    # transposed: rows over the vocab axis and the vocab over the rows' (resharded to (rows, vocab))
    spec = {"rows_vocab": P(rows, "tp"), "replicated": P(), "transposed": P("tp", "dp"), "ids": P(rows)}[keep_spec]
    if keep_spec == "ids":  # each row's kept ids, -1 padded
        width = int(keep.sum(1).max())
        ids = np.full((N, width), -1, np.int32)
        for i, row in enumerate(keep):
            ids[i, :row.sum()] = np.flatnonzero(row)
        nucleus = jax.device_put(ids, NamedSharding(mesh, spec))

        def gspmd_call(hidden, weight, targets, nucleus, **kw):
            return rlk_xla.linear_logp(hidden, weight, targets, keep_ids=nucleus, real_vocab_size=REAL,
                                       return_entropy=True, **kw)
    else:
        nucleus = jax.device_put(keep, NamedSharding(mesh, spec))

        def gspmd_call(hidden, weight, targets, nucleus, **kw):
            return rlk_xla.linear_logp(hidden, weight, targets, keep_mask=nucleus, real_vocab_size=REAL,
                                       return_entropy=True, **kw)
    f = _nucleus_loss(gspmd_call)
    with _context(how, mesh):
        (_, (logp, ent)), grads = f(*args, nucleus)
        hlo = f.lower(*args, nucleus).compile().as_text()
    assert not [line for line in hlo.splitlines() if "all-gather" in line and f"[{V},{H}]" in line]  # of the weight
    assert logp[1] == -np.inf and np.isnan(logp[2])

    def local(hidden, weight, targets, keep, bias, temp):
        return rlk_xla.linear_logp(hidden, weight, targets, bias=bias, temperature=temp, real_vocab_size=REAL,
                                   return_entropy=True, keep_mask=keep, axis_name="tp", backward="lean")

    def shard_map_path(hidden, weight, targets, keep, *, bias, temperature):
        tok = P(rows)
        return shard_map(local, mesh=mesh, in_specs=(tok, P("tp"), tok, P(rows, "tp"), P("tp"), tok),
                         out_specs=(tok, tok))(hidden, weight, targets, keep, bias, temperature)
    (_, (logp_sm, ent_sm)), grads_sm = _nucleus_loss(shard_map_path)(*args, jax.device_put(keep, NamedSharding(
        mesh, P(rows, "tp"))))
    np.testing.assert_array_equal(logp, logp_sm)
    np.testing.assert_array_equal(ent, ent_sm)
    for got, ref in zip(grads, grads_sm, strict=True):
        np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(ref, np.float32))


def test_a_wrong_nucleus_is_refused_under_gspmd():
    mesh = _mesh("tp4")
    hidden, weight, _, _, targets, _ = _placed(mesh, None)
    keep = jnp.ones((N, V - 1), jnp.bool_)
    with pytest.raises(ValueError, match="keep_mask must be bool"):
        jax.jit(lambda h, w, t, k: rlk_xla.linear_logp(h, w, t, keep_mask=k))(hidden, weight, targets, keep)


def test_with_mesh_and_in_shardings_over_host_arrays():
    """The deprecated `with mesh:` around jit(in_shardings=...) over uncommitted arrays (whose avals
    carry no mesh): the context's mesh engages GSPMD."""
    mesh = _mesh("tp4")
    args = _inputs()
    shardings = [NamedSharding(mesh, s) for s in (P(), P("tp", None), P("tp"), P(), P(), P())]
    f = jax.jit(_loss(rlk_xla.linear_logp), in_shardings=shardings)
    with _context("with_mesh", mesh):
        (_, (logp, ent)), grads = f(*args)
        hlo = f.lower(*args).compile().as_text()
    assert "all-gather" not in hlo
    (_, (logp_sm, ent_sm)), grads_sm = _loss(functools.partial(
        vocab_parallel_linear_logp, mesh=mesh, vocab_axis="tp", backward="lean"))(*_placed(mesh, None))
    for got, ref in zip((logp, ent, *grads), (logp_sm, ent_sm, *grads_sm), strict=True):
        np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(ref, np.float32))


def test_a_sharding_with_no_axis_names_is_refused():
    """A weight placed with a GSPMDSharding (device tiles, no mesh axis names; jax's internal
    sharding) cannot name the vocab axis: a clear error, not a silent gather of the weight."""
    sharding_impls = pytest.importorskip("jax._src.sharding_impls", reason="jax's internal shardings moved")
    mesh = _mesh("tp4")
    hidden, weight, _, _, targets, _ = _inputs()
    tiles = NamedSharding(mesh, P("tp", None))._to_xla_hlo_sharding(2)
    weight = jax.device_put(weight, sharding_impls.GSPMDSharding(tuple(mesh.devices.flat), tiles))
    with jax.set_mesh(mesh), pytest.raises(Exception, match="no mesh to name its axes"):
        jax.jit(lambda h, w, t: rlk_xla.linear_logp(h, w, t)).lower(hidden, weight, targets).compile()


@pytest.mark.parametrize("how", ["plain", "set_mesh"])
@pytest.mark.parametrize("mode", ["off", "audit"])
def test_reference_routes_under_gspmd(mode, how):
    """mode="off" runs the jnp reference, which GSPMD partitions itself, counted; "audit" runs the
    partitioned kernels (the shard_map path's bits) and records the reference beside them. Both
    count through host callbacks, which stay out of the per-shard program (one there crashed)."""
    mesh = _mesh("tp4")
    args = _placed(mesh, None)
    rlk_xla.reset_route_stats()
    f = _loss(functools.partial(rlk_xla.linear_logp, mode=mode))
    with _context(how, mesh):
        (_, (logp, ent)), grads = f(*args)
    jax.effects_barrier()
    (_, (logp_sm, ent_sm)), grads_sm = _loss(functools.partial(
        vocab_parallel_linear_logp, mesh=mesh, vocab_axis="tp", backward="lean"))(*args)
    stats = rlk_xla.route_stats()
    if mode == "off":
        assert stats["reference"] == {"calls": 1, "tokens": N}
        for got, ref in zip((logp, ent, *grads), (logp_sm, ent_sm, *grads_sm), strict=True):
            tol = 2 ** -7 if got.dtype == jnp.bfloat16 else 1e-5  # a bf16 gradient's rounding, else fp32's
            got, ref = np.asarray(got, np.float32), np.asarray(ref, np.float32)
            np.testing.assert_allclose(got, ref, rtol=0, atol=tol * np.abs(ref).max())
    else:
        assert stats["audit"]["calls"] == 1 and stats["audit"]["rows"] == N
        for got, ref in zip((logp, ent, *grads), (logp_sm, ent_sm, *grads_sm), strict=True):
            np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(ref, np.float32))


@pytest.mark.parametrize("wrap", ["scan", "checkpoint"])
def test_under_scan_and_checkpoint_in_plain_jit(wrap):
    """Gradient accumulation over micro-batches (lax.scan) and rematerialization (jax.checkpoint)
    around the call, no mesh set: no all-gather, dW sharded like the weight, the single-device
    program's bits (TP invariance, backward="lean")."""
    mesh = _mesh("tp4")
    hidden, weight, _, _, targets, _ = _inputs()
    hidden, targets = hidden[:21].reshape(3, 7, H), targets[:21].reshape(3, 7)

    def loss(w):
        call = functools.partial(rlk_xla.linear_logp, real_vocab_size=REAL, backward="lean")
        if wrap == "scan":
            return jax.lax.scan(lambda c, x: (c + call(x[0], w, x[1]).sum(), None), 0.0, (hidden, targets))[0]
        return jax.checkpoint(lambda w: call(hidden, w, targets).sum())(w)
    f = jax.jit(jax.value_and_grad(loss))
    sharded = jax.device_put(weight, NamedSharding(mesh, P("tp", None)))
    assert "all-gather" not in f.lower(sharded).compile().as_text()
    (value, dw), (value_1, dw_1) = f(sharded), jax.jit(jax.value_and_grad(loss))(weight)
    assert dw.sharding.is_equivalent_to(sharded.sharding, 2)
    np.testing.assert_array_equal(value, value_1)
    np.testing.assert_array_equal(np.asarray(dw, np.float32), np.asarray(dw_1, np.float32))


def test_the_gpu_check_script_runs_on_the_test_devices(capsys):
    # benchmarks/gspmd_check.py is the GPU run owed on a multi-GPU host; here on the CPU devices
    import importlib.util
    import pathlib
    path = pathlib.Path(__file__).resolve().parents[2] / "benchmarks" / "gspmd_check.py"
    spec = importlib.util.spec_from_file_location("gspmd_check", path)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    script.main(["--n", "64", "--h", "64", "--v", "1024"])
    assert "all-gather ops 0, loss equal True, dH equal True, dW equal True, dW P('tp',)" in capsys.readouterr().out
