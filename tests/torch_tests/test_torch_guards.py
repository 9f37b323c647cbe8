"""torch_bridge against hostile arguments (issue 23): ids of every integer dtype range-checked
before the int32 cast, counters under torch.compile, and errors that name the argument and say
what to pass."""
import pytest

torch = pytest.importorskip("torch", reason="torch is not installed: these tests need it")

import torch_bridge as tb
from torch_bridge import routes

N, H, V = 6, 16, 40


def inputs(seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(N, H, generator=g, dtype=dtype), torch.randn(V, H, generator=g, dtype=dtype) / H ** 0.5


@pytest.mark.parametrize("dtype", [torch.uint32, torch.uint64, torch.int64])
def test_ids_beyond_int32_are_nan_rows_not_other_ids(dtype):
    h, w = inputs()
    ids = [3, 2 ** 32 - 100, 5, 2 ** 32 + 5 if dtype != torch.uint32 else 2 ** 31, 0, 39]
    t = torch.tensor(ids, dtype=torch.int64 if dtype != torch.uint64 else torch.uint64).to(dtype)
    lp = tb.linear_logp(h, w, t, validate_targets=False)
    ref = tb.linear_logp(h, w, torch.tensor([3, 0, 5, 0, 0, 39]))
    assert torch.isnan(lp[[1, 3]]).all()  # before: uint32 2^32-100 was ignore_index -100, 2^32+5 id 5
    torch.testing.assert_close(lp[[0, 2, 4, 5]], ref[[0, 2, 4, 5]], rtol=0, atol=0)


@pytest.mark.parametrize("ignore_index", [-100, -1, 0, 39, 2 ** 31 - 2, -(2 ** 31) + 1])
def test_int64_ids_clamped_read_as_remapped(ignore_index):
    """int64 ids reach the kernels by one clamp (IdRule.clamp): every id is read as the
    comparisons-and-selects remap reads it (valid and the same id, ignored, or invalid)."""
    import dataclasses

    import rlk_common as common
    from torch_bridge._args import id_rule, int32_targets
    edges = [0, 1, 39, 40, -1, -2, -100, 2 ** 31 - 2, 2 ** 31 - 1, 2 ** 31, 2 ** 32 - 100, 2 ** 32 + 5, -(2 ** 31),
             -(2 ** 31) - 1, -(2 ** 32) - 100, 2 ** 63 - 1, -(2 ** 63), ignore_index]
    t = torch.tensor(edges, dtype=torch.int64)
    rule = id_rule(t, ignore_index)
    assert rule.clamp == (common.INT32_MIN, common.INT32_MAX)

    def read(ids):  # what a kernel makes of an id of a V-id vocabulary (classify_target)
        return torch.where(ids == rule.ignore, -2, torch.where((ids < 0) | (ids >= V), -1, ids))
    clamped = int32_targets(t, rule)
    assert clamped.dtype == torch.int32
    assert torch.equal(read(clamped), read(int32_targets(t, dataclasses.replace(rule, clamp=None))))


@pytest.mark.parametrize("dtype", [torch.uint64, torch.int32, torch.int16])
def test_no_clamp_where_a_cast_suffices_or_ids_are_unsigned(dtype):
    from torch_bridge._args import id_rule
    assert id_rule(torch.zeros(1, dtype=dtype), -100).clamp is None
    assert id_rule(torch.zeros(1, dtype=torch.int64), -(2 ** 40)).clamp is None  # ignore_index outside int32


@pytest.mark.parametrize("dtype", [torch.uint8, torch.uint16, torch.uint32, torch.uint64, torch.int8, torch.int16])
def test_validate_targets_with_unsigned_and_small_ids(dtype):
    """Before: uint16/32/64 raised NotImplementedError "lt_cpu" even for valid ids."""
    h, w = inputs()
    t = torch.tensor([0, 1, 5, 39, 12, 3]).to(dtype)
    torch.testing.assert_close(tb.linear_logp(h, w, t), tb.linear_logp(h, w, t.to(torch.int64)), rtol=0, atol=0)
    bad = torch.tensor([0, 1, 5, 40, 12, 3]).to(dtype)
    with pytest.raises(ValueError, match=r"targets\[3\] = 40 is outside \[0, 40\)"):
        tb.linear_logp(h, w, bad)


def test_uint64_top_ids_and_ignore_index_outside_int32():
    h, w = inputs()
    t = torch.tensor([3, 2 ** 63 + 1, 5, 7, 2 ** 32 + 5, 1], dtype=torch.uint64)
    with pytest.raises(ValueError, match=rf"targets\[1\] = {2 ** 63 + 1} is outside"):
        tb.linear_logp(h, w, t, ignore_index=2 ** 32 + 5)
    lp = tb.linear_logp(h, w, t, ignore_index=2 ** 32 + 5, validate_targets=False)
    assert torch.isnan(lp[1]) and lp[4] == 0 and torch.isfinite(lp[[0, 2, 3, 5]]).all()
    # an int32 id -1 with an ignore_index outside int32: an invalid id (NaN), not ignored
    lp = tb.linear_logp(h, w, torch.tensor([-1, 3, 4, 5, 6, 7], dtype=torch.int32), ignore_index=-(2 ** 40),
                        validate_targets=False)
    assert torch.isnan(lp[0]) and torch.isfinite(lp[1:]).all()


def test_int64_ids_under_torch_compile():
    h, w = inputs()
    h.requires_grad_(True)
    t = torch.tensor([3, 2 ** 32 + 5, 5, -100, 0, 39])
    f = torch.compile(lambda h, w, t: tb.linear_logp(h, w, t), fullgraph=True)
    lp = f(h, w, t)
    assert torch.isnan(lp[1]) and lp[3] == 0 and torch.isfinite(lp[[0, 2, 4, 5]]).all()


def test_fallbacks_counted_under_torch_compile():
    """A float64 call falls back to the reference: counted on every compiled run (before: never)."""
    h, w = inputs(dtype=torch.float64)
    t = torch.tensor([3, 2, 5, 1, 0, 39])
    f = torch.compile(lambda h, w, t: tb.linear_logp(h, w, t), fullgraph=True)
    f(h, w, t)
    routes.reset_route_stats()
    f(h, w, t), f(h, w, t)
    s = routes.route_stats()
    assert s["fallback_total"] == 2 and s["reference"] == {"calls": 2, "tokens": 2 * N}
    tb.linear_logp(h, w, t, mode="off")
    assert routes.route_stats()["reference"] == {"calls": 3, "tokens": 3 * N}


def test_messages_name_the_argument_and_what_to_pass():
    h, w = inputs()
    t = torch.arange(N)
    with pytest.raises(TypeError, match="return_entropy must be True or False, got 1"):
        tb.linear_logp(h, w, t, return_entropy=1)
    with pytest.raises(ValueError, match="V >= 1 vocab rows, got V = 0"):
        tb.linear_logp(h, w[:0], t)
    with pytest.raises(Exception, match="mode='audit'.*cannot run inside torch.compile: pass mode='auto'"):
        torch.compile(lambda h: tb.linear_logp(h, w, t, mode="audit"), fullgraph=True)(h)
    hg = h.clone().requires_grad_(True)
    lp = tb.linear_logp(hg, w, t, backward="fast")
    lp.sum().backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="pass backward='lean' to linear_logp and retain_graph=True"):
        lp.sum().backward()
    lp = tb.linear_logp(hg, w, t, backward="lean")  # what the message says works
    lp.sum().backward(retain_graph=True)
    lp.sum().backward()


@pytest.mark.parametrize("backward", ["fast", "lean"])
def test_fake_tensor_mode_takes_the_registered_fakes(backward):
    """Under FakeTensorMode (shape propagation, memory planners) the ops' registered fakes run: the
    eager path's direct call would hand fake tensors' memory to the kernels."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    with FakeTensorMode():
        h = torch.randn(N, H, requires_grad=True)
        w = torch.randn(V, H, requires_grad=True)
        lp = tb.linear_logp(h, w, torch.randint(0, V, (N,)), validate_targets=False, backward=backward)
        lp.sum().backward()
    assert lp.shape == (N,) and h.grad.shape == (N, H) and w.grad.shape == (V, H)


def test_a_dispatch_mode_sees_the_op_and_the_same_bits():
    """A TorchDispatchMode (a flop counter, a debug log) sees rlk::linear_logp and its backward,
    and the values are the plain eager path's."""
    import contextlib

    from torch.utils._python_dispatch import TorchDispatchMode

    class Seen(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = set()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops.add(str(func.overloadpacket))
            return func(*args, **(kwargs or {}))

    h, w = inputs()
    t = torch.randint(0, V, (N,), generator=torch.Generator().manual_seed(1))
    grads = []
    for mode in (None, Seen()):
        hh, ww = h.clone().requires_grad_(), w.clone().requires_grad_()
        with mode or contextlib.nullcontext():
            lp = tb.linear_logp(hh, ww, t)
            lp.sum().backward()
        grads.append((lp.detach(), hh.grad, ww.grad))
    assert {"rlk.linear_logp", "rlk.linear_logp_backward"} <= mode.ops
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_kernels_refuse_a_tensor_subclass():
    """Below the ops, a tensor subclass reaching the kernels is refused by name, not read."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from torch_bridge import _ops
    with FakeTensorMode():
        fake = torch.empty(N)
    real = torch.zeros(N)
    with pytest.raises(TypeError, match="FakeTensor is not a plain tensor's memory"):
        _ops.combine_to(torch.zeros(N, 1, 3), fake, torch.zeros(N, dtype=torch.int32), real, real.clone(),
                        real.clone(), real.clone(), V, -100)


@pytest.mark.parametrize("backward", ["fast", "lean"])
def test_activation_checkpointing_gives_the_same_bits(backward):
    """Recompute as trainers run it (reentrant, non-reentrant, selective with the op saved: a
    dispatch mode around the op) gives plain eager's logp and gradients bit for bit."""
    import functools

    from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts
    h0, w0 = inputs()
    t = torch.randint(0, V, (N,), generator=torch.Generator().manual_seed(2))

    def f(h, w):
        return tb.linear_logp(torch.tanh(h), w, t, backward=backward).sum()

    def save_ours(ctx, op, *args, **kwargs):
        return CheckpointPolicy.MUST_SAVE if "rlk" in str(op) else CheckpointPolicy.PREFER_RECOMPUTE

    sac = functools.partial(create_selective_checkpoint_contexts, save_ours)
    runs = {"plain": f, "reentrant": functools.partial(checkpoint, f, use_reentrant=True),
            "non-reentrant": functools.partial(checkpoint, f, use_reentrant=False),
            "selective": functools.partial(checkpoint, f, use_reentrant=False, context_fn=sac)}
    out = {}
    for name, run in runs.items():
        h, w = h0.clone().requires_grad_(), w0.clone().requires_grad_()
        y = run(h, w)
        y.backward()
        out[name] = (y.detach(), h.grad, w.grad)
    for name in runs:
        for a, b in zip(out["plain"], out[name]):
            torch.testing.assert_close(a, b, rtol=0, atol=0)


# ---- issue 44 ---------------------------------------------------------------------------------

@pytest.mark.parametrize("mode", ["auto", "off"])
def test_invalid_temperature_entries_give_nan_rows(mode):
    """Negative, +inf and NaN entries of a temperature array give NaN rows, as 0 does (were
    softmax(-z / |T|) and -log V); the valid rows keep their values and gradients."""
    h, w = inputs()
    t = torch.arange(N)
    bad = torch.tensor([1.0, -1.0, float("inf"), float("nan"), 0.0, 0.7])
    T = bad.clone().requires_grad_()
    lp = tb.linear_logp(h, w, t, temperature=T, mode=mode)
    assert torch.isnan(lp[1:5]).all() and torch.isfinite(lp[[0, 5]]).all()
    good = tb.linear_logp(h, w, t, temperature=torch.tensor([1.0, 1, 1, 1, 1, 0.7]), mode=mode)
    assert torch.equal(lp[[0, 5]], good[[0, 5]])
    lp[[0, 5]].sum().backward()
    assert torch.isfinite(T.grad[[0, 5]]).all() and torch.isnan(T.grad[1:5]).all()  # NaN in, NaN out


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("mode", ["auto", "strict"])
def test_hidden_size_zero_is_the_bias_alone(dtype, mode):
    """H = 0: logits are the bias (scored stale scratch memory before: -475 for -9.8); exact, with
    the bias's and the temperature's gradients."""
    g = torch.Generator().manual_seed(3)
    b = (torch.randn(V, generator=g) * 3).to(dtype).requires_grad_()
    T = torch.full((N,), 0.8, requires_grad=True)
    t = torch.randint(0, V, (N,), generator=g)
    h, w = torch.zeros(N, 0, dtype=dtype, requires_grad=True), torch.zeros(V, 0, dtype=dtype, requires_grad=True)
    lp = tb.linear_logp(h, w, t, bias=b, temperature=T, mode=mode)
    b64, T64 = b.detach().double().requires_grad_(), T.detach().double().requires_grad_()
    ref = torch.log_softmax(b64[None, :] / T64[:, None], dim=1)[torch.arange(N), t]
    torch.testing.assert_close(lp.double(), ref, rtol=0, atol=4e-6)
    lp.sum().backward()
    ref.sum().backward()
    torch.testing.assert_close(b.grad.double(), b64.grad, rtol=2e-2 if dtype != torch.float32 else 1e-5, atol=1e-5)
    torch.testing.assert_close(T.grad.double(), T64.grad, rtol=1e-5, atol=1e-5)
    assert h.grad.shape == (N, 0) and w.grad.shape == (V, 0)


@pytest.mark.parametrize("fullgraph", [False, True])
def test_audit_under_torch_compile_raises_the_documented_runtime_error(fullgraph):
    """Was a TypeError from rlk_common/routes.py (dynamo reran the frame eagerly after the raise and
    traced the audit's numpy), or dynamo's "Observed exception" with fullgraph=True."""
    h, w = inputs()
    t = torch.arange(N)
    f = torch.compile(lambda h: tb.linear_logp(h, w, t, mode="audit"), fullgraph=fullgraph)
    with pytest.raises(RuntimeError, match=r"mode='audit'\) compares with the reference on the host and cannot run "
                                           r"inside torch.compile: pass mode='auto'") as e:
        f(h)
    assert type(e.value) is RuntimeError
