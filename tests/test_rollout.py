"""torch_bridge.rollout.score_sampled: the rows of a decode batch padded to a capture size give
bitwise the logp and entropy of the same rows of one large trainer call (linear_logp), for
1, 3, 8, 64 and 256 live rows, bf16 and fp32, with and without temperature and entropy, TP 1 and
TP 2 (gloo) against the TP 1 trainer; padding rows (poisoned hidden, padding or real ids) change
nothing; out= reuses the caller's buffers. On the GPU (marked): 16384 trainer rows, and CUDA-graph
capture/replay at the capture sizes without host syncs or allocations."""
import pytest

pytest.importorskip("torch", reason="torch is not installed: these tests need it")

import os
import socket

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import _rlk_core
import torch_bridge
from torch_bridge import rollout
from torch_helpers import make_inputs

LIVE = (1, 3, 8, 64, 256)
CAPTURE = (1, 4, 8, 64, 256)  # the engine's capture sizes: each live batch is padded to the next one
H, V, REAL = 64, 1024, 1000   # the vocab padded to 1024 (engine and trainer alike), 1000 real ids
# name: (dtype, temperature, entropy, bias)
CASES = {"bf16": ("bfloat16", None, False, False),
         "bf16_temp_entropy": ("bfloat16", "scalar", True, False),
         "bf16_temp_array_bias_entropy": ("bfloat16", "array", True, True),
         "f32": ("float32", None, False, False),
         "f32_temp_bias_entropy": ("float32", "scalar", True, True),
         "f32_temp_array": ("float32", "array", False, False)}


def _capture_size(live):
    return min(c for c in CAPTURE if c >= live)


def _same_bits(a, b):
    return a.shape == b.shape and torch.equal(a.contiguous().view(torch.int32), b.contiguous().view(torch.int32))


def trainer_inputs(name, rows, device="cpu", h=H, v=V, real=REAL):
    """The trainer's batch of `rows` tokens: inputs and options as linear_logp takes them."""
    dtype, temp, _, bias = CASES[name]
    d, kw, _, _ = make_inputs(7, rows, h, v, dtype, bias=bias, temp=temp, real_vocab=real, device=device)
    return d, kw


def decode_batch(d, kw, live, seed):
    """`live` rows of the trainer's batch (from a seed-chosen offset) padded to their capture size:
    padding rows get huge or NaN hidden values, padding or real ids and their own temperature."""
    cap = _capture_size(live)
    rng = np.random.default_rng(seed)
    off = int(rng.integers(0, d["hidden"].shape[0] - live + 1))
    rows = slice(off, off + live)
    pad = cap - live
    dev, dt = d["hidden"].device, d["hidden"].dtype
    junk = torch.tensor(rng.standard_normal((pad, d["hidden"].shape[1])) * 1e4, dtype=dt, device=dev)
    if pad:
        junk[0, 0] = float("nan")
    hidden = torch.cat([d["hidden"][rows], junk])
    real = kw["real_vocab_size"]
    pad_ids = torch.tensor(np.where(rng.random(pad) < 0.5, rollout.PAD_ID, rng.integers(0, real, pad)), device=dev)
    ids = torch.cat([d["targets"][rows], pad_ids])
    t = kw.get("temperature")
    if isinstance(t, torch.Tensor):
        t = torch.cat([t[rows], torch.tensor(rng.uniform(0.1, 5.0, pad), dtype=t.dtype, device=dev)])
    return hidden, ids, t, rows


def score(name, d, kw, live, seed, *, tp_group=None, rank=0, world=1):
    """score_sampled on the padded decode batch through fresh buffers for its capture size, with
    this rank's vocab shard: (logp, entropy or None) of the live rows, and the trainer's row slice."""
    _, _, with_entropy, _ = CASES[name]
    hidden, ids, t, rows = decode_batch(d, kw, live, seed)
    v_local = d["weight"].shape[0] // world
    shard = slice(rank * v_local, (rank + 1) * v_local)
    weight = d["weight"][shard].contiguous()
    bias = kw["bias"][shard].contiguous() if "bias" in kw else None
    bufs = rollout.score_buffers(hidden.shape[0], weight, bias=bias, tp_group=tp_group, return_entropy=with_entropy)
    out = rollout.score_sampled(hidden, weight, ids, temperature=1.0 if t is None else t, bias=bias,
                                tp_group=tp_group, real_vocab_size=kw["real_vocab_size"], return_entropy=with_entropy,
                                out=bufs)
    logp, ent = out if with_entropy else (out, None)
    assert logp.data_ptr() == bufs.logp.data_ptr()
    return logp[:live].clone(), None if ent is None else ent[:live].clone(), rows


def trainer(name, d, kw):
    """The trainer's linear_logp over the whole batch, with gradients."""
    _, _, with_entropy, _ = CASES[name]
    h = d["hidden"].clone().requires_grad_()
    out = torch_bridge.linear_logp(h, d["weight"], d["targets"], return_entropy=with_entropy, mode="strict", **kw)
    logp, ent = out if with_entropy else (out, None)
    (logp.sum() + (0 if ent is None else ent.sum())).backward()
    assert h.grad is not None
    return logp.detach(), None if ent is None else ent.detach()


def assert_rows_equal(name, got, ref, live, prefix=""):
    logp, ent, rows = got
    assert _same_bits(logp, ref[0][rows]), f"{prefix}{name} live={live}: logp differs from the trainer's rows"
    if ent is not None:
        assert _same_bits(ent, ref[1][rows]), f"{prefix}{name} live={live}: entropy differs"


@pytest.mark.parametrize("name", list(CASES))
def test_padded_decode_rows_equal_trainer_rows(name):
    d, kw = trainer_inputs(name, 2048)  # the GPU test uses 16384
    ref = trainer(name, d, kw)
    for i, live in enumerate(LIVE):
        got = score(name, d, kw, live, seed=i)
        assert_rows_equal(name, got, ref, live)
        assert torch.isfinite(got[0]).all()


def _worker(rank, world, port, out_dir):
    os.environ["RLK_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        res = {}
        for name in CASES:
            d, kw = trainer_inputs(name, 2048)
            for i, live in enumerate(LIVE):
                res[name, live] = score(name, d, kw, live, seed=i, tp_group=dist.group.WORLD, rank=rank, world=world)
        torch.save(res, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_tp2_rollout_equals_tp1_trainer(tmp_path):
    mp.spawn(_worker, args=(2, _free_port(), str(tmp_path)), nprocs=2, join=True)
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(2)]  # our own files
    for name in CASES:
        d, kw = trainer_inputs(name, 2048)
        ref = trainer(name, d, kw)
        for live in LIVE:
            for r, res in enumerate(ranks):
                assert_rows_equal(name, res[name, live], ref, live, f"TP2 rank {r}: ")


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
        assert _same_bits(logp, fresh[0]) and _same_bits(ent, fresh[1])


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
        g, static, bufs = graphs[_capture_size(live)]
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
