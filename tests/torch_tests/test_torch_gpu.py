"""torch_bridge on CUDA: the oracle checks, consistency, opcheck, torch.compile, CUDA-graph capture
(each with the lean and the fast backward) and bitwise parity with rlk_xla (the same compiled
kernels) on the same inputs."""
import pytest

pytest.importorskip("torch", reason="torch is not installed: these tests need it")

import os

import numpy as np
import torch

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # share the GPU with torch

import _rlk_core  # noqa: E402
import torch_bridge  # noqa: E402
import oracle  # noqa: E402
from oracle import case_grid
import torch_helpers  # noqa: E402
from torch_helpers import check_against_oracle, make_inputs, oracle_of, to_np, value_and_grads  # noqa: E402

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (torch.cuda.is_available() is False)"),
    pytest.mark.skipif(not _rlk_core.has_cuda, reason="this build of _rlk_core has no CUDA backend"),
]
CUDA = "cuda"


@pytest.fixture(autouse=True)
def fresh_counters():
    torch_bridge.reset_route_stats()
    yield


def _bwd_counts():
    b = torch_bridge.route_stats()["backends"]
    return sum(x["bwd_calls"] for x in b.values()), sum(x["bwd_fast_calls"] for x in b.values())


@pytest.mark.parametrize("backward", ["lean", "fast"])
@pytest.mark.parametrize("n,h,v,dtype,o", case_grid()[::3], ids=lambda x: str(x) if not isinstance(x, dict) else "")
def test_against_float64_oracle_cuda(n, h, v, dtype, o, backward):
    check_against_oracle(torch_bridge.linear_logp, n, h, v, dtype, o, device=CUDA, backward=backward)
    b = torch_bridge.route_stats()["backends"]
    assert b["cpu"]["fwd_calls"] == 0 and b["cuda_sm90"]["fwd_calls"] + b["cuda_portable"]["fwd_calls"] == 1
    assert b["cpu"]["bwd_calls"] == 0 and _bwd_counts() == (1, int(backward == "fast"))


@pytest.mark.parametrize("backward", ["lean", "fast"])
@pytest.mark.parametrize("n,h,v", [(4096, 512, 32000), (1000, 2048, 7600), (333, 256, 50000)])
def test_larger_shapes_cuda(n, h, v, backward):
    o = dict(bias=False, temp="scalar", ignore_frac=0.1, real_vocab=v - 64, entropy=True)
    check_against_oracle(torch_bridge.linear_logp, n, h, v, "bfloat16", o, device=CUDA, seed=1, backward=backward)


def _fwd_grads(d, kw, g, e, backward="auto"):
    logp, ent, grads = value_and_grads(torch_bridge.linear_logp, d, kw, g, e, backward=backward)
    return [logp, ent, grads["hidden"], grads["weight"], grads.get("bias"), grads.get("temperature")]


@pytest.mark.parametrize("backward", ["lean", "fast"])
def test_bitwise_deterministic_and_batch_invariant_cuda(backward):
    d, kw, g, e = make_inputs(3, 600, 256, 4000, "bfloat16", bias=True, temp="array", ignore_frac=0.1, device=CUDA)
    first = _fwd_grads(d, kw, g, e, backward)
    for a, b in zip(first, _fwd_grads(d, kw, g, e, backward)):
        assert torch.equal(a, b)
    for rows in (slice(5, 68), slice(0, 1), slice(500, 600)):
        part = _fwd_grads(dict(d, hidden=d["hidden"][rows], targets=d["targets"][rows]),
                          dict(kw, temperature=kw["temperature"][rows]), g[rows], e[rows], backward)
        for i in (0, 1):  # logp, entropy
            assert torch.equal(part[i], first[i][rows]), (rows, i)


def _rows_match(d, kw, g, e, backward, row_sets, grads=(2, 5), close=()):
    """The gradients (by _fwd_grads index) of each set of rows alone have the bits of the same rows
    of the whole batch; those in `close` agree only to their dtype's rounding (a sum in another order)."""
    first = _fwd_grads(d, kw, g, e, backward)
    for rows in row_sets:
        part = _fwd_grads(dict(d, hidden=d["hidden"][rows], targets=d["targets"][rows]),
                          dict(kw, temperature=kw["temperature"][rows]), g[rows], e[rows], backward)
        for i in grads:
            assert torch.equal(part[i], first[i][rows]), (rows, i)
        for i in close:
            ref = first[i][rows].float()
            torch.testing.assert_close(part[i].float(), ref, rtol=2 ** -7, atol=2 ** -10 * float(ref.abs().max()),
                                       msg=lambda m: f"rows {rows}, grad {i}: {m}")


@pytest.mark.parametrize("backward", ["lean", "fast"])
def test_gradient_batch_invariance_cuda(backward):
    """dH and dT of a row do not depend on the rows beside it: fast's dH algorithm is cuBLASLt's pick
    for a fixed row count, or one checked to give its bits (cuda/blas.h, batch_rows). lean's dH is not
    promised batch invariant (its vocabulary pieces and its GEMMs' algorithms follow the row count,
    docs/design.md §4): its rows' dH (and dT, which it sums over the same pieces) agree to bf16's rounding."""
    d, kw, g, e = make_inputs(3, 600, 256, 4000, "bfloat16", bias=True, temp="array", ignore_frac=0.1, device=CUDA)
    exact, close = ((), (2, 5)) if backward == "lean" else ((2, 5), ())
    _rows_match(d, kw, g, e, backward, (slice(5, 68), slice(0, 1), slice(500, 600)), grads=exact, close=close)


def test_fast_dh_batch_invariance_at_t1_scale_cuda():
    """At T1's H and V, the row counts 1, 127, 796 and 1820 are where cuBLASLt's own first picks
    differ (three tile configurations, docs/benchmarks.md §5): dH still keeps its bits. (lean: its
    vocabulary pieces widen as rows go, and dH sums over them in fp32, so it is not promised.)"""
    d, kw, g, e = make_inputs(11, 1820, 2048, 75968, "bfloat16", temp="array", device=CUDA)
    _rows_match(d, kw, g, e, "fast", (slice(0, 1), slice(1000, 1127), slice(3, 799)))


def test_cuda_agrees_with_the_cpu_kernels():
    d, kw, g, e = make_inputs(4, 100, 96, 1000, "float32", bias=True, device=CUDA)
    gpu = torch_bridge.linear_logp(d["hidden"], d["weight"], d["targets"], bias=kw["bias"], return_entropy=True)
    cpu = torch_bridge.linear_logp(d["hidden"].cpu(), d["weight"].cpu(), d["targets"].cpu(), bias=kw["bias"].cpu(),
                                   return_entropy=True)
    for a, b in zip(gpu, cpu):
        torch.testing.assert_close(a.cpu(), b, rtol=2e-5, atol=2e-5)


def test_fast_backward_consumes_the_kept_logits_cuda():
    """On CUDA the fast backward overwrites the kept logits (with dlogit): one backward per forward."""
    d, kw, g, e = make_inputs(5, 30, 64, 512, "bfloat16", bias=True, temp="array", device=CUDA)
    h, w, b, t, T = d["hidden"], d["weight"], kw["bias"].float(), d["targets"].int(), kw["temperature"]
    logp, ent, m, log_s, logits, _ = torch.ops.rlk.linear_logp(h, w, b, t, T, 512, 64, -100, True, True)
    before = logits.clone()
    torch.ops.rlk.linear_logp_backward(h, w, b, t, T, m, log_s, ent, g, e, logits, 0, 512, 64, -100, False)
    assert not torch.equal(logits, before)
    hg = h.clone().requires_grad_()
    loss = torch_bridge.linear_logp(hg, w, d["targets"], backward="fast").sum()
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="backward='lean'"):
        loss.backward()


@pytest.mark.parametrize("backward", ["lean", "fast"])
def test_torch_compile_cuda(backward):
    torch._dynamo.reset()
    d, kw, g, e = make_inputs(8, 257, 128, 3000, "bfloat16", bias=True, temp="array", device=CUDA)

    def f(h, w, b, T, t):
        logp, ent = torch_bridge.linear_logp(h, w, t, bias=b, temperature=T, return_entropy=True, backward=backward)
        return (logp * g).sum() + (ent * e).sum(), logp, ent

    def run(fn):
        leaves = [x.detach().clone().requires_grad_() for x in (d["hidden"], d["weight"], kw["bias"],
                                                                 kw["temperature"])]
        loss, logp, ent = fn(*leaves, d["targets"])
        return [logp, ent, *torch.autograd.grad(loss, leaves)]

    for a, b in zip(run(f), run(torch.compile(f, fullgraph=True))):
        assert torch.equal(a, b)


@pytest.mark.parametrize("backward", ["lean", "fast"])
def test_cuda_graph_capture_and_replay(backward):
    d, kw, g, e = make_inputs(9, 300, 128, 2000, "bfloat16", bias=True, temp="array", ignore_frac=0.1, device=CUDA)
    h = d["hidden"].clone().requires_grad_()
    w = d["weight"].clone().requires_grad_()
    t, T, b = d["targets"].clone(), kw["temperature"].clone(), kw["bias"]

    def step():  # a fresh forward each time: the captured fast backward consumes the logits it kept
        logp, ent = torch_bridge.linear_logp(h, w, t, bias=b, temperature=T, return_entropy=True, backward=backward)
        dh, dw = torch.autograd.grad((logp * g).sum() + (ent * e).sum(), [h, w])
        return logp, ent, dh, dw

    graph, static = _capture(step)
    for seed in (10, 11):
        d2, kw2, _, _ = make_inputs(seed, 300, 128, 2000, "bfloat16", bias=True, temp="array", ignore_frac=0.1,
                                    device=CUDA)
        with torch.no_grad():
            h.copy_(d2["hidden"]), w.copy_(d2["weight"]), t.copy_(d2["targets"]), T.copy_(kw2["temperature"])
        graph.replay()
        torch.cuda.synchronize()
        eager = step()
        for a, b_ in zip(static, eager):
            assert torch.equal(a, b_)


def test_vime_provider_cuda_routes_and_row_chunks():
    import vime_side
    from torch_bridge import vime
    d, kw, g, e = make_inputs(12, 64, 128, 1024, "bfloat16", temp="array", device=CUDA)
    T = kw["temperature"]
    r = vime.provider(vime_side.request(d["targets"], hidden=d["hidden"], weight=d["weight"], temperature=T),
                      "strict")
    assert r.backend_id in ("rlk.fused.cuda_sm90", "rlk.fused.cuda_portable") and r.logp.device.type == "cuda"
    ref = oracle_of(d, kw, g, e)
    oracle.assert_values(to_np(r.logp[:, 0]), ref["logp"], "fused logp")
    logits = (d["hidden"].float() @ d["weight"].float().T) / T[:, None]
    keep = torch.rand(64, 1024, device=CUDA) < 0.5
    keep[torch.arange(64, device=CUDA), d["targets"]] = True
    runs = [vime.provider(vime_side.request(d["targets"], logits=logits, keep_mask=keep, chunk_size=c), "strict")
            for c in (-1, 7)]
    assert runs[0].backend_id == "rlk.logits.cuda"
    assert torch.equal(runs[0].logp, runs[1].logp) and torch.equal(runs[0].entropy, runs[1].entropy)
    z = logits.double().masked_fill(~keep, float("-inf"))
    want = torch.log_softmax(z, -1).gather(1, d["targets"][:, None])
    assert float((runs[0].logp.double() - want).abs().max()) <= 2e-5 * (1 + float(want.abs().max()))
    # the mask goes into the CUDA kernels: a masked request with the context (and the logits, or
    # not) takes the fused route, on the portable forward kernel, the same bits chunked or not
    fused = [vime.provider(vime_side.request(d["targets"], hidden=d["hidden"], weight=d["weight"], temperature=T,
                                             keep_mask=keep, chunk_size=c, **extra), "strict")
             for c, extra in ((-1, {}), (7, {}), (-1, {"logits": logits}))]
    assert all(r.backend_id == "rlk.fused.cuda_portable" for r in fused)
    assert all(torch.equal(fused[0].logp, r.logp) and torch.equal(fused[0].entropy, r.entropy) for r in fused[1:])
    assert float((fused[0].logp.double() - want).abs().max()) <= 2e-5 * (1 + float(want.abs().max()))
    ref = oracle.linear_logp(to_np(d["hidden"]), to_np(d["weight"]), d["targets"].cpu().numpy(),
                             temperature=to_np(T), nucleus=keep.cpu().numpy())
    oracle.assert_values(to_np(fused[0].logp[:, 0]), ref["logp"], "fused masked logp")
    oracle.assert_values(to_np(fused[0].entropy), ref["entropy"], "fused masked entropy")


def test_vime_provider_captures_in_a_cuda_graph():
    """A tensor temperature, mode strict: no host sync on the provider path."""
    import vime_side
    from torch_bridge import vime
    d, kw, g, e = make_inputs(13, 200, 128, 1024, "bfloat16", temp="array", device=CUDA)
    h = d["hidden"].clone().requires_grad_()
    w = d["weight"].clone().requires_grad_()
    t, T = d["targets"].clone(), kw["temperature"].clone()

    def step():
        r = vime.provider(vime_side.request(t, hidden=h, weight=w, temperature=T), "strict")
        dh, dw = torch.autograd.grad((r.logp[:, 0] * g).sum() + (r.entropy * e).sum(), [h, w])
        return r.logp, r.entropy, dh, dw

    graph, static = _capture(step)
    d2, kw2, _, _ = make_inputs(14, 200, 128, 1024, "bfloat16", temp="array", device=CUDA)
    with torch.no_grad():
        h.copy_(d2["hidden"]), t.copy_(d2["targets"]), T.copy_(kw2["temperature"])
    graph.replay()
    torch.cuda.synchronize()
    for a, b in zip(static, step()):
        assert torch.equal(a, b)


def _run_helper(fn, tmp_path, **env):
    """torch_helpers.fn(tmp_path/in.npz, tmp_path/out.npz) in a fresh interpreter with `env` added."""
    import subprocess
    import sys
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # tests/, torch_helpers' folder
    env = dict(os.environ, **env,
               PYTHONPATH=os.pathsep.join([os.path.dirname(here), here, os.environ.get("PYTHONPATH", "")]))
    r = subprocess.run([sys.executable, "-c", f"import torch_helpers; torch_helpers.{fn}({str(tmp_path / 'in.npz')!r}, "
                        f"{str(tmp_path / 'out.npz')!r})"], cwd=here, env=env, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, f"{fn} failed (rc {r.returncode}): {r.stderr[-3000:]}"
    return dict(np.load(tmp_path / "out.npz"))


def test_tuned_gemm_pick_keeps_the_bits(tmp_path):
    """Above cuda/blas.cc's kTuneFlops the gradient GEMMs are timed once with a few cuBLASLt
    candidates and the fastest is kept: only among those with the first pick's bits. dH and dW
    here (2 x 2048 x 2048 x 131072 flops each, above the 1e12 threshold) must equal those of a
    process that never tunes (RLK_BLAS_TUNE=0)."""
    n, h, v, real = 2048, 2048, 131072, 131000
    d, kw, g, e = make_inputs(21, n, h, v, "bfloat16", ignore_frac=0.1, real_vocab=real, device=CUDA)
    torch_helpers.save_inputs(tmp_path / "in.npz", d, kw, g, e, "bfloat16", real)
    tuned = _run_helper("torch_fast_side", tmp_path)
    first_pick = _run_helper("torch_fast_side", tmp_path, RLK_BLAS_TUNE="0")
    for k in ("logp", "ent", "hidden", "weight"):
        np.testing.assert_array_equal(tuned[k], first_pick[k], err_msg=k)


# ---- parity with rlk_xla: the same kernels, the same bits -----------------------------------------

@pytest.mark.parametrize("dtype,bias,temp", [("bfloat16", True, "array"), ("float16", False, "scalar"),
                                             ("float32", True, None)])
def test_bitwise_equal_to_rlk_xla(dtype, bias, temp, tmp_path):
    import importlib.util
    if importlib.util.find_spec("jax") is None:
        pytest.skip("jax is not installed")
    n, h, v, real = 777, 256, 8192, 8100
    d, kw, g, e = make_inputs(13, n, h, v, dtype, bias=bias, temp=temp, ignore_frac=0.1, real_vocab=real,
                              device=CUDA)
    ours = dict(zip(["logp", "ent", "hidden", "weight", "bias", "temperature"], _fwd_grads(d, kw, g, e)))
    torch_helpers.save_inputs(tmp_path / "in.npz", d, kw, g, e, dtype, real)
    theirs = _run_helper("jax_side", tmp_path)
    if str(theirs.pop("backend")) != "gpu":
        pytest.skip("jax has no GPU backend here")
    for k, x in theirs.items():
        np.testing.assert_array_equal(to_np(ours[k]), x, err_msg=k)


def _capture(step):
    """Warm `step` up on a side stream, then capture it: (the graph, its static outputs)."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            step()
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static = step()
    return graph, static
