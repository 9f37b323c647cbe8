"""The registered XLA FFI targets check every buffer they are given (rank, dims, dtype, against
each other) and fail with an error naming it, never a crash: they are in XLA's global registry,
where any caller may reach them through jax.ffi.ffi_call with any shapes. Also: the CPU thread
pool turns a worker thread that cannot start into an error, not std::terminate."""
import os
import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("jax", reason="jax is not installed: these tests need it")

import jax
import jax.numpy as jnp
import numpy as np

from rlk_xla._core import core, registered_platforms

F32, BF16, I32, U8 = jnp.float32, jnp.bfloat16, jnp.int32, jnp.uint8
W = int(core.STAT_WIDTH)
N, H, V = 8, 16, 32
ATTRS = dict(vocab_start=np.int64(0), real_vocab=np.int64(V), chunk=np.int64(V), ignore_index=np.int64(-100),
             has_bias=np.int64(1), with_entropy=np.int64(1))


NO_KEEP = jnp.zeros((0, 0), U8)  # optional buffers (the nucleus's) the XLA FFI reads as absent when empty
NO_KEEP_SUM = jnp.zeros((0, 0), F32)


def sds(shape, dtype=F32):
    return jax.ShapeDtypeStruct(shape, dtype)


def operands(**over):
    """hidden, weight, bias, targets, temperature, keep (empty: no nucleus) of a valid forward; `over`
    replaces any by name."""
    ops = dict(hidden=jnp.ones((N, H), F32), weight=jnp.ones((V, H), F32), bias=jnp.zeros((V,), F32),
               targets=jnp.zeros((N,), I32), temperature=jnp.ones((N,), F32), keep=NO_KEEP)
    ops.update(over)
    return list(ops.values())


NO_S = jax.ShapeDtypeStruct((0,), F32)  # combine's log_s_keep, absent


def fwd_results(**over):
    res = dict(stats=sds((N, 1, W)), target_logit=sds((N,)), saved_logits=sds((0,), U8), keep_sum=sds((0, 0)))
    res.update(over)
    return list(res.values())


def call(name, results, args, attrs=ATTRS):
    """ffi_call of target `name` with its trailing workspace result (every target takes one: io.h)."""
    registered_platforms()
    return jax.block_until_ready(jax.ffi.ffi_call(name, results + [sds((1,), U8)])(*args, **attrs))[:-1]


def test_valid_buffers_run():
    stats, tl, _, _ = call("rlk_forward", fwd_results(), operands())
    assert stats.shape == (N, 1, W) and np.isfinite(np.asarray(stats)).all()


def test_a_nucleus_runs_and_its_buffers_are_checked():
    keep = jnp.ones((N, V), U8)
    _, _, _, keep_sum = call("rlk_forward", fwd_results(keep_sum=sds((N, 1))), operands(keep=keep))
    assert keep_sum.shape == (N, 1) and np.isfinite(np.asarray(keep_sum)).all()
    with pytest.raises(Exception, match="rlk: keep"):
        call("rlk_forward", fwd_results(keep_sum=sds((N, 1))), operands(keep=jnp.ones((N, V + 1), U8)))
    with pytest.raises(Exception, match="rlk: keep"):  # keep without keep_sum
        call("rlk_forward", fwd_results(), operands(keep=keep))


@pytest.mark.parametrize("what,results,args", [
    ("stats", fwd_results(stats=sds((1, 1, W))), operands()),               # far too few rows
    ("stats", fwd_results(stats=sds((N, 1, W + 2))), operands()),
    ("stats", fwd_results(stats=sds((N, 2, W))), operands()),               # chunks disagree with chunk
    ("stats", fwd_results(stats=sds((N, 1, W), BF16)), operands()),
    ("target_logit", fwd_results(target_logit=sds((3,))), operands()),
    ("target_logit", fwd_results(target_logit=sds((N, 1))), operands()),
    ("targets", fwd_results(), operands(targets=jnp.zeros((3,), I32))),
    ("targets", fwd_results(), operands(targets=jnp.zeros((N,), jnp.int16))),
    ("targets", fwd_results(), operands(targets=jnp.zeros((N,), F32))),
    ("temperature", fwd_results(), operands(temperature=jnp.ones((1,), F32))),
    ("temperature", fwd_results(), operands(temperature=jnp.ones((N,), jnp.float16))),
    ("bias", fwd_results(), operands(bias=jnp.zeros((3,), F32))),
    ("bias", fwd_results(), operands(bias=jnp.zeros((V,), BF16))),
    ("weight", fwd_results(), operands(weight=jnp.ones((V, H), BF16))),
    ("weight", fwd_results(), operands(weight=jnp.ones((V, H + 1), F32))),
    ("hidden", fwd_results(), operands(hidden=jnp.ones((H,), F32))),
    ("hidden", fwd_results(), operands(hidden=jnp.ones((N, H), jnp.int32))),
], ids=lambda x: x if isinstance(x, str) else "")
def test_forward_rejects(what, results, args):
    with pytest.raises(Exception, match=f"rlk: {what}|rlk: hidden"):
        call("rlk_forward", results, args)


def test_forward_rejects_a_200000_row_problem_with_a_tiny_stats_buffer():
    n = 200_000
    args = [jnp.ones((n, 4), F32), jnp.ones((8, 4), F32), jnp.zeros((0,), F32), jnp.zeros((n,), I32),
            jnp.ones((n,), F32), NO_KEEP]
    attrs = dict(ATTRS, real_vocab=np.int64(8), chunk=np.int64(8), has_bias=np.int64(0))
    with pytest.raises(Exception, match="rlk: stats must be"):
        call("rlk_forward", [sds((1, 1, 3)), sds((n,)), sds((0,), U8), sds((0, 0))], args, attrs)


def test_forward_rejects_a_chunk_that_does_not_divide_the_vocab():
    with pytest.raises(Exception, match="rlk: chunk"):
        call("rlk_forward", fwd_results(), operands(), dict(ATTRS, chunk=np.int64(5)))


@pytest.mark.parametrize("what,results,args", [
    ("logp", [sds((N + 1,)), sds((N,)), sds((N,)), sds((N,)), NO_S], [jnp.zeros((N, 2, W)), jnp.zeros((N,)), jnp.zeros((N,), I32), NO_KEEP_SUM]),
    ("entropy", [sds((N,)), sds((N, 2)), sds((N,)), sds((N,)), NO_S], [jnp.zeros((N, 2, W)), jnp.zeros((N,)), jnp.zeros((N,), I32), NO_KEEP_SUM]),
    ("m", [sds((N,)), sds((N,)), sds((N,), BF16), sds((N,)), NO_S], [jnp.zeros((N, 2, W)), jnp.zeros((N,)), jnp.zeros((N,), I32), NO_KEEP_SUM]),
    ("log_s", [sds((N,)), sds((N,)), sds((N,)), sds((2,)), NO_S], [jnp.zeros((N, 2, W)), jnp.zeros((N,)), jnp.zeros((N,), I32), NO_KEEP_SUM]),
    ("target_logit", [sds((N,))] * 4 + [NO_S], [jnp.zeros((1, 2, W)), jnp.zeros((N,)), jnp.zeros((N,), I32), NO_KEEP_SUM]),
    ("stats", [sds((N,))] * 4 + [NO_S], [jnp.zeros((N, 2, 1)), jnp.zeros((N,)), jnp.zeros((N,), I32), NO_KEEP_SUM]),
    ("target_logit", [sds((N,))] * 4 + [NO_S], [jnp.zeros((N, 2, W)), jnp.zeros((2,)), jnp.zeros((N,), I32), NO_KEEP_SUM]),
    ("targets", [sds((N,))] * 4 + [NO_S], [jnp.zeros((N, 2, W)), jnp.zeros((N,)), jnp.zeros((N,), jnp.int16), NO_KEEP_SUM]),
], ids=lambda x: x if isinstance(x, str) else "")
def test_combine_rejects(what, results, args):
    with pytest.raises(Exception, match=f"rlk: {what}"):
        call("rlk_combine", results, args)


def bwd_args(**over):
    ops = dict(zip(("hidden", "weight", "bias", "targets", "temperature"), operands()))
    ops.update(m=jnp.zeros((N,)), log_s=jnp.zeros((N,)), entropy=jnp.zeros((N,)), g=jnp.ones((N,)), e=jnp.ones((N,)),
               keep=NO_KEEP, log_s_keep=jnp.zeros((0,), F32), saved_logits=jnp.zeros((0,), U8))
    ops.update(over)
    return list(ops.values())


def bwd_results(**over):
    res = dict(dhidden=sds((N, H)), dweight=sds((V, H)), dbias=sds((V,)), dtemp=sds((N,)), saved_logits=sds((0,), U8))
    res.update(over)
    return list(res.values())


def test_valid_backward_runs():
    dh, dw, db, dt, _ = call("rlk_backward", bwd_results(), bwd_args())
    assert dh.shape == (N, H) and np.isfinite(np.asarray(dw)).all()


@pytest.mark.parametrize("what,results,args", [
    ("dweight", bwd_results(dweight=sds((V - 1, H))), bwd_args()),
    ("dweight", bwd_results(dweight=sds((V, H), BF16)), bwd_args()),
    ("dbias", bwd_results(dbias=sds((0,))), bwd_args()),
    ("dtemp", bwd_results(dtemp=sds((1,))), bwd_args()),
    ("dhidden", bwd_results(dhidden=sds((N, H), jnp.float16)), bwd_args()),
    ("dhidden", bwd_results(dhidden=sds((N,))), bwd_args()),
    ("m", bwd_results(), bwd_args(m=jnp.zeros((2,)))),
    ("log_s", bwd_results(), bwd_args(log_s=jnp.zeros((N,), BF16))),
    ("entropy", bwd_results(), bwd_args(entropy=jnp.zeros((0,)))),
    ("g", bwd_results(), bwd_args(g=jnp.zeros((N,), BF16))),
    ("e", bwd_results(), bwd_args(e=jnp.zeros((N + 3,)))),
    ("targets", bwd_results(), bwd_args(targets=jnp.zeros((N,), jnp.uint32))),
], ids=lambda x: x if isinstance(x, str) else "")
def test_backward_rejects(what, results, args):
    with pytest.raises(Exception, match=f"rlk: {what}"):
        call("rlk_backward", results, args)


def test_fast_backward_rejects_saved_logits_too_small():
    args = bwd_args(saved_logits=jnp.zeros((8,), U8))
    with pytest.raises(Exception, match="rlk: saved_logits"):
        call("rlk_backward", bwd_results(saved_logits=sds((8,), U8)), args)


@pytest.mark.parametrize("name,results,args", [
    ("rlk_forward", fwd_results()[:2], operands()),
    ("rlk_forward", fwd_results(), operands() + [jnp.zeros((1,))]),
    ("rlk_backward", bwd_results(), bwd_args()[:-1]),
], ids=["a result missing", "an operand too many", "an operand missing"])
def test_targets_reject_a_wrong_count_of_buffers(name, results, args):
    with pytest.raises(Exception, match="rlk: too (few|many)"):
        call(name, results, args)


def test_thread_start_failure_is_an_error_not_terminate():
    """A worker thread that cannot start (an address-space limit too small for its stack) raises a
    Python exception; the process lives on (before: `terminate called without an active
    exception`)."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    script = textwrap.dedent("""
        import resource
        import jax.numpy as jnp
        import rlk_xla
        h, w = jnp.ones((4096, 64)), jnp.ones((512, 64))
        t = jnp.zeros((4096,), jnp.int32)
        rlk_xla.linear_logp(h, w, t).block_until_ready()  # compiled, every lazy allocation done
        with open("/proc/self/status") as f:
            vm = next(int(l.split()[1]) * 1024 for l in f if l.startswith("VmSize"))
        resource.setrlimit(resource.RLIMIT_AS, (vm + (16 << 20),) * 2)  # no room for 63 thread stacks
        try:
            rlk_xla.linear_logp(h * 2, w, t).block_until_ready()
            print("RAN")
        except Exception as e:
            print("RAISED", e)
    """)
    env = dict(os.environ, RLK_NUM_THREADS="64", XLA_FLAGS="--xla_cpu_multi_thread_eigen=false",
               PYTHONPATH=os.pathsep.join([root] + sys.path))
    r = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "RAISED" in r.stdout and "could not start a worker thread" in r.stdout, r.stdout + r.stderr[-2000:]


def test_jax_calls_pass_the_tables_operands_by_name():
    # rlk_xla._ops builds each FFI call's operands from the binder's table (core.ffi_operands), so
    # an operand added there reaches JAX by name; a name the table does not have is refused.
    from rlk_xla import _ops
    table = core.ffi_operands()
    names = [name for name, _ in table["forward"]]
    assert names == ["hidden", "weight", "bias", "targets", "temperature", "keep"]  # operands()'s order
    assert [name for name, _ in table["backward"]][-1] == "saved_logits"  # its alias index comes from here
    cfg = _ops.KernelConfig(vocab_start=0, real_vocab=V, chunk=V, ignore_index=-100, has_bias=True, with_entropy=True)
    with pytest.raises(TypeError, match=r"rlk_forward takes no operand\(s\) \['dlse'\]"):
        _ops.forward(cfg, **dict(zip(names, operands())), dlse=jnp.zeros((N,), F32))
