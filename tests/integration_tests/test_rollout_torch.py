"""torch_bridge.integrations.rollout.score_sampled: the rows of a decode batch padded to a capture size give
bitwise the logp and entropy of the same rows of one large trainer call (linear_logp), for 1, 3, 8,
64 and 256 live rows, bf16 and fp32, with and without temperature and entropy (TP 2 and 4 over gloo
against the TP 1 trainer: test_torch_tp.py); padding rows (poisoned hidden, padding or real ids)
change nothing; out= reuses the caller's buffers and allocates nothing. On the GPU (marked): 16384
trainer rows, and CUDA-graph capture/replay at the capture sizes without host syncs or
allocations."""
import pytest

pytest.importorskip("torch", reason="torch is not installed: these tests need it")

import torch

import _rlk_core
from rollout_helpers import CAPTURE, CASES, H, LIVE, REAL, V, assert_rows_equal, capture_size, decode_batch, score, \
    same_bits, trainer, trainer_inputs
from torch_bridge.integrations import rollout

@pytest.mark.parametrize("name", list(CASES))
def test_padded_decode_rows_equal_trainer_rows(name):
    d, kw = trainer_inputs(name, 16384)
    ref = trainer(name, d, kw)
    for i, live in enumerate(LIVE):
        got = score(name, d, kw, live, seed=i)
        assert_rows_equal(name, got, ref, live)
        assert torch.isfinite(got[0]).all()


def test_out_buffers_are_reused_and_results_carry_no_autograd_state():
    d, kw = trainer_inputs("bf16_temp_array_bias_entropy", 64)
    w, b = d["weight"].requires_grad_(), kw["bias"]
    bufs = rollout.score_buffers(8, w, bias=b, return_entropy=True)
    for rows in (slice(0, 8), slice(8, 16)):
        h = d["hidden"][rows].clone().requires_grad_()
        logp, ent = rollout.score_sampled(h, w, d["targets"][rows], temperature=kw["temperature"][rows], bias=b,
                                          real_vocab_size=REAL, return_entropy=True, out=bufs)
        assert logp is bufs.logp and ent is bufs.entropy
        assert not logp.requires_grad and logp.grad_fn is None
        fresh = rollout.score_sampled(h, w, d["targets"][rows], temperature=kw["temperature"][rows], bias=b,
                                      real_vocab_size=REAL, return_entropy=True)
        assert same_bits(logp, fresh[0]) and same_bits(ent, fresh[1])


def test_no_allocation_with_out():
    """The profiler's memory events of one call: none with out=, some without."""
    from torch.profiler import ProfilerActivity, profile
    d, kw = trainer_inputs("bf16_temp_array_bias_entropy", 8)
    bufs = rollout.score_buffers(8, d["weight"], bias=kw["bias"], return_entropy=True)

    def memory_events(out):
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            rollout.score_sampled(d["hidden"], d["weight"], d["targets"], temperature=kw["temperature"],
                                  bias=kw["bias"], real_vocab_size=REAL, return_entropy=True, out=out)
        return [e.cpu_memory_usage for e in prof.events() if e.name == "[memory]"]

    memory_events(bufs)  # a first call may initialize what it uses
    assert memory_events(bufs) == []
    assert memory_events(None)  # the profiler does see a call that makes its own buffers


def test_arguments_are_checked():
    d, kw = trainer_inputs("f32", 8)
    h, w, ids = d["hidden"], d["weight"], d["targets"]
    bufs = rollout.score_buffers(8, w)
    with pytest.raises(ValueError, match="another call.*rows"):
        rollout.score_sampled(h[:4], w, ids[:4], out=bufs)
    with pytest.raises(ValueError, match="return_entropy"):
        rollout.score_sampled(h, w, ids, return_entropy=True, out=bufs)
    with pytest.raises(ValueError, match="has_bias"):
        rollout.score_sampled(h, w, ids, bias=torch.zeros(V), out=bufs)
    with pytest.raises(ValueError, match="hidden must be contiguous"):
        rollout.score_sampled(torch.cat([h, h], 1)[:, :H], w, ids, out=bufs)
    with pytest.raises(ValueError, match=r"hidden must be \[n, H\]"):
        rollout.score_sampled(h.reshape(2, 4, H), w, ids.reshape(2, 4))
    with pytest.raises(RuntimeError, match="needs the fused kernels"):
        rollout.score_sampled(h.double(), w.double(), ids)
    with pytest.raises(ValueError, match="rows must be"):
        rollout.score_buffers(-1, w)
    with pytest.raises(ValueError, match="temperature"):
        rollout.score_sampled(h, w, ids, temperature=0.0)


# ---- GPU (marked): 16384 trainer rows; CUDA-graph capture and replay ------------------------------

def on_gpu(test):
    for mark in (pytest.mark.gpu,
                 pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (torch.cuda.is_available() "
                                                                          "is False)"),
                 pytest.mark.skipif(not _rlk_core.has_cuda, reason="this build of _rlk_core has no CUDA backend")):
        test = mark(test)
    return test


@on_gpu
@pytest.mark.parametrize("name", list(CASES))
def test_gpu_padded_decode_rows_equal_16384_trainer_rows(name):
    d, kw = trainer_inputs(name, 16384, "cuda", h=2048, v=151936, real=151643)  # Qwen's padded vocab
    ref = trainer(name, d, kw)
    for i, live in enumerate(LIVE):
        assert_rows_equal(name, score(name, d, kw, live, seed=i), ref, live, "GPU: ")


@on_gpu
@pytest.mark.parametrize("name", ["bf16_temp_array_bias_entropy", "f32_temp_bias_entropy"])
def test_gpu_cuda_graph_capture_and_replay(name):
    """One graph per capture size over static inputs and score_buffers; replaying it for live
    batches of every size gives the trainer's rows bitwise, with no allocation during replay and no
    host sync in the eager call either (torch's sync debug mode raises on one)."""
    d, kw = trainer_inputs(name, 4096, "cuda", h=1024)
    ref = trainer(name, d, kw)
    w, b = d["weight"], kw.get("bias")
    array_temp = isinstance(kw.get("temperature"), torch.Tensor)
    graphs = {}
    for cap in CAPTURE:
        hidden, ids, t, _ = decode_batch(d, kw, cap, seed=cap)
        static = dict(hidden=hidden.clone(), ids=ids.clone(), temp=t.clone() if array_temp else kw["temperature"])
        bufs = rollout.score_buffers(cap, w, bias=b, return_entropy=True)

        def step(s=static, bufs=bufs):
            return rollout.score_sampled(s["hidden"], w, s["ids"], temperature=s["temp"], bias=b,
                                         real_vocab_size=REAL, return_entropy=True, out=bufs)

        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            step()  # warm-up, outside the graph: it must neither sync nor fail
        finally:
            torch.cuda.set_sync_debug_mode("default")
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            step()
        graphs[cap] = (g, static, bufs)
    torch.cuda.synchronize()
    for i, live in enumerate(LIVE):
        g, static, bufs = graphs[capture_size(live)]
        hidden, ids, t, rows = decode_batch(d, kw, live, seed=100 + i)
        static["hidden"].copy_(hidden), static["ids"].copy_(ids)
        if array_temp:
            static["temp"].copy_(t)
        before = torch.cuda.memory_stats()
        g.replay()
        torch.cuda.synchronize()
        after = torch.cuda.memory_stats()
        for key in ("allocation.all.allocated", "segment.all.allocated", "allocated_bytes.all.allocated"):
            assert after[key] == before[key], f"replay allocated ({key})"
        got = (bufs.logp[:live].clone(), bufs.entropy[:live].clone(), rows)
        assert_rows_equal(name, got, ref, live, "CUDA graph replay: ")
