"""score_sampled with the sampler's nucleus and with ids of any integer dtype, in both frontends.

Nucleus (torch): score_sampled(..., keep_mask=) gives bitwise the rows of the trainer's
linear_logp(..., keep_mask=) on the same rows (padded decode batches, out= buffers, TP 1 and TP 2
over gloo), the entropy unmasked; ids outside their nucleus give -inf, as the trainer.
Ids (issue 44): int64 ids beyond int32 are never wrapped by the cast: 2^32 + 5 is no id (a NaN row,
as linear_logp(validate_targets=False) gives), not id 5, and -2^32 - 100 is not the padding id."""
import functools

import pytest

pytest.importorskip("torch", reason="torch is not installed: these tests need it")

import os

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from rollout_helpers import REAL, V, capture_size, same_bits, trainer_inputs
from subprocs import free_port, gloo_worker

import torch_bridge
from torch_bridge.integrations import rollout

BIG = (2 ** 32 + 5, -(2 ** 32) - 100, 2 ** 31, -(2 ** 31) - 1, 2 ** 63 - 1, -(2 ** 63))


def nucleus(d, kw, frac=0.3, seed=3):
    """A top-p-like keep mask [n, V]: random ids, each row's argmax and target kept."""
    z = d["hidden"].double() @ d["weight"].double().T
    keep = torch.rand(z.shape, generator=torch.Generator().manual_seed(seed)) < frac
    rows = torch.arange(z.shape[0])
    keep[rows, z[:, :REAL].argmax(dim=1)] = True
    keep[rows, d["targets"].clamp(min=0)] = True
    return keep


def trainer_rows(d, kw, keep):
    with torch.no_grad():
        return torch_bridge.linear_logp(d["hidden"], d["weight"], d["targets"], keep_mask=keep, return_entropy=True,
                                        mode="strict", **kw)


@pytest.mark.parametrize("name", ["bf16_temp_array_bias_entropy", "f32_temp_bias_entropy"])
def test_nucleus_rows_equal_trainer_rows(name):
    d, kw = trainer_inputs(name, 512)
    keep = nucleus(d, kw)
    ref_logp, ref_ent = trainer_rows(d, kw, keep)
    for live in (1, 3, 8, 64):
        cap, off = capture_size(live), 7 * live
        rows = slice(off, off + live)
        pad = cap - live
        hidden = torch.cat([d["hidden"][rows], torch.full((pad, d["hidden"].shape[1]), 1e4, dtype=d["hidden"].dtype)])
        ids = torch.cat([d["targets"][rows], torch.full((pad,), rollout.PAD_ID)])
        k = torch.cat([keep[rows], torch.zeros((pad, V), dtype=torch.bool)])
        t = kw["temperature"]
        if isinstance(t, torch.Tensor):
            t = torch.cat([t[rows], torch.ones(pad)])
        bufs = rollout.score_buffers(cap, d["weight"], bias=kw.get("bias"), return_entropy=True, nucleus=True)
        logp, ent = rollout.score_sampled(hidden, d["weight"], ids, temperature=t, bias=kw.get("bias"),
                                          real_vocab_size=REAL, return_entropy=True, keep_mask=k, out=bufs)
        assert same_bits(logp[:live], ref_logp[rows]), f"{name}: {live} live rows"
        assert same_bits(ent[:live], ref_ent[rows])
        # the nucleus changes the logp (a renormalized softmax) but not the entropy
        plain = rollout.score_sampled(hidden[:live], d["weight"], ids[:live], temperature=t if not isinstance(
            t, torch.Tensor) else t[:live], bias=kw.get("bias"), real_vocab_size=REAL)
        assert (logp[:live] >= plain).all() and (logp[:live] > plain).any()


def test_id_outside_the_nucleus_is_minus_inf_and_buffers_are_checked():
    d, kw = trainer_inputs("bf16", 8)
    keep = nucleus(d, kw)
    t = d["targets"].clamp(min=0)
    keep[0, t[0]] = False
    ref = trainer_rows(d, kw, keep)[0]
    got = rollout.score_sampled(d["hidden"], d["weight"], t, real_vocab_size=REAL, keep_mask=keep)
    assert got[0] == float("-inf") and same_bits(got, torch.where(d["targets"] < 0, 0.0, ref))
    plain = rollout.score_buffers(8, d["weight"])
    with pytest.raises(ValueError, match="nucleus"):
        rollout.score_sampled(d["hidden"], d["weight"], t, real_vocab_size=REAL, keep_mask=keep, out=plain)
    with pytest.raises(ValueError, match="nucleus"):
        rollout.score_sampled(d["hidden"], d["weight"], t, out=rollout.score_buffers(8, d["weight"], nucleus=True))
    with pytest.raises(ValueError, match="keep_mask must be shaped"):
        rollout.score_sampled(d["hidden"], d["weight"], t, keep_mask=keep[:, :10])
    with pytest.raises(TypeError, match="keep_mask must be a bool"):
        rollout.score_sampled(d["hidden"], d["weight"], t, keep_mask=keep.float())
    with pytest.raises(ValueError, match="contiguous"):
        rollout.score_sampled(d["hidden"], d["weight"], t, keep_mask=keep.T.contiguous().T,
                              out=rollout.score_buffers(8, d["weight"], nucleus=True))


@pytest.mark.parametrize("with_out", [False, True])
def test_nucleus_as_kept_ids_scores_the_masks_bits(with_out):
    """keep_ids ([n, K] global ids, -1 padded, a repeat counted once: a sparse top-p sampler's) give
    bitwise keep_mask's rows; with keep_mask too, or of the wrong shape, a clear error."""
    d, kw = trainer_inputs("bf16_temp_array_bias_entropy", 64)
    keep = nucleus(d, kw, frac=0.02)
    k = int(keep.sum(dim=1).max()) + 2
    ids = torch.full((64, k), -1, dtype=torch.int64)
    for r in range(64):
        kept = keep[r].nonzero().flatten()
        ids[r, :kept.numel()] = kept.flip(0)  # any order
    ids[5, -1] = ids[5, 0]  # a repeated id counts once
    t = d["targets"].clamp(min=0)
    call = functools.partial(rollout.score_sampled, d["hidden"], d["weight"], t, temperature=kw["temperature"],
                             bias=kw["bias"], real_vocab_size=REAL, return_entropy=True)
    out = rollout.score_buffers(64, d["weight"], bias=kw["bias"], return_entropy=True, nucleus=True) if with_out \
        else None
    want = [x.clone() for x in call(keep_mask=keep)]
    got = call(keep_ids=ids, out=out)
    assert all(same_bits(g, w) for g, w in zip(got, want))
    with pytest.raises(ValueError, match="keep_ids or keep_mask"):
        call(keep_ids=ids, keep_mask=keep)
    with pytest.raises(ValueError, match="keep_ids must be targets' shape plus K"):
        call(keep_ids=ids[:10])


@pytest.mark.parametrize("with_out", [False, True])
def test_int64_ids_follow_linear_logps_rule(with_out):
    """Issue 44: on main, 2^32 + 5 was scored as id 5 and -2^32 - 100 as padding (logp 0)."""
    d, _ = trainer_inputs("bf16", len(BIG) + 2)
    ids = torch.tensor([*BIG, 5, rollout.PAD_ID], dtype=torch.int64)
    with torch.no_grad():
        ref = torch_bridge.linear_logp(d["hidden"], d["weight"], ids, real_vocab_size=REAL, validate_targets=False)
    out = rollout.score_buffers(len(ids), d["weight"]) if with_out else None
    got = rollout.score_sampled(d["hidden"], d["weight"], ids, real_vocab_size=REAL, out=out)
    assert torch.isnan(got[:len(BIG)]).all(), got
    assert same_bits(got, ref)
    assert torch.isfinite(got[-2]) and got[-1] == 0.0
    # every integer dtype torch has: the same rows as linear_logp
    for dtype in (torch.int8, torch.uint8, torch.int16, torch.int32, torch.uint32, torch.uint64):
        small = torch.tensor([5, 100, 0], dtype=dtype)
        h, w = d["hidden"][:3], d["weight"]
        with torch.no_grad():
            want = torch_bridge.linear_logp(h, w, small, real_vocab_size=REAL, validate_targets=False)
        assert same_bits(rollout.score_sampled(h, w, small, real_vocab_size=REAL), want), dtype
    huge = torch.tensor([2 ** 64 - 1, 2 ** 32 + 5, 7], dtype=torch.uint64)
    got = rollout.score_sampled(d["hidden"][:3], d["weight"], huge, real_vocab_size=REAL)
    assert torch.isnan(got[:2]).all() and torch.isfinite(got[2])


def _tp_worker(rank, world, port, out_dir):
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    with gloo_worker(rank, world, port):
        d, kw = trainer_inputs("bf16_temp_array_bias_entropy", 64)
        keep = nucleus(d, kw)
        v_local = V // world
        shard = slice(rank * v_local, (rank + 1) * v_local)
        w, b = d["weight"][shard].contiguous(), kw["bias"][shard].contiguous()
        k = keep[:, shard].contiguous()
        bufs = rollout.score_buffers(64, w, bias=b, tp_group=dist.group.WORLD, return_entropy=True, nucleus=True)
        logp, ent = rollout.score_sampled(d["hidden"], w, d["targets"], temperature=kw["temperature"], bias=b,
                                          tp_group=dist.group.WORLD, real_vocab_size=REAL, return_entropy=True,
                                          keep_mask=k, out=bufs)
        torch.save({"logp": logp.clone(), "ent": ent.clone()}, os.path.join(out_dir, f"{rank}.pt"))


def test_tp2_nucleus_rows_equal_tp1_trainer(tmp_path):
    d, kw = trainer_inputs("bf16_temp_array_bias_entropy", 64)
    ref_logp, ref_ent = trainer_rows(d, kw, nucleus(d, kw))
    mp.spawn(_tp_worker, args=(2, free_port(), str(tmp_path)), nprocs=2, join=True)
    for r in range(2):
        got = torch.load(tmp_path / f"{r}.pt")
        assert same_bits(got["logp"], ref_logp) and same_bits(got["ent"], ref_ent), f"rank {r}"


def test_jax_int64_ids_follow_linear_logps_rule():
    jax = pytest.importorskip("jax", reason="jax is not installed: the JAX half needs it")
    import jax.numpy as jnp

    import rlk_xla
    from rlk_xla import rollout as xrollout
    d, _ = trainer_inputs("f32", len(BIG) + 2)
    h, w = jnp.asarray(d["hidden"].numpy()), jnp.asarray(d["weight"].numpy())
    with jax.enable_x64(True):
        ids = jnp.asarray(np.array([*BIG, 5, rollout.PAD_ID], dtype=np.int64))
        assert ids.dtype == jnp.int64
        got = np.asarray(jax.jit(lambda h, w, i: xrollout.score_sampled(h, w, i, real_vocab_size=REAL))(h, w, ids))
        ref = np.asarray(rlk_xla.linear_logp(h, w, ids, real_vocab_size=REAL))
    assert np.isnan(got[:len(BIG)]).all() and np.isfinite(got[-2]) and got[-1] == 0.0
    assert np.array_equal(got.view(np.uint32), ref.view(np.uint32))
    # and the torch engine's rows are the JAX trainer's
    t = rollout.score_sampled(d["hidden"], d["weight"], torch.tensor([*BIG, 5, rollout.PAD_ID]), real_vocab_size=REAL)
    assert np.array_equal(t.numpy().view(np.uint32), got.view(np.uint32))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (torch.cuda.is_available() is False)")
def test_gpu_nucleus_in_a_cuda_graph_equals_trainer_rows():
    """score_sampled with a keep mask and int64 ids (clamped into the buffers) captured as one CUDA
    graph at Qwen's padded vocab: replays give the trainer's masked rows bit for bit, and the
    out-of-range ids NaN rows, with no host sync in the eager call."""
    import _rlk_core
    if not _rlk_core.has_cuda:
        pytest.skip("this build of _rlk_core has no CUDA backend")
    v, real = 151936, 151643
    d, kw = trainer_inputs("bf16_temp_array_bias_entropy", 64, "cuda", h=1024, v=v, real=real)
    keep = nucleus({k: x.cpu() for k, x in d.items()}, kw).cuda()
    ref_logp, ref_ent = trainer_rows(d, kw, keep)
    w, b, t = d["weight"], kw["bias"], kw["temperature"]
    static = dict(h=d["hidden"].clone(), ids=d["targets"].clone(), keep=keep.clone(), t=t.clone())
    bufs = rollout.score_buffers(64, w, bias=b, return_entropy=True, nucleus=True)

    def step():
        return rollout.score_sampled(static["h"], w, static["ids"], temperature=static["t"], bias=b,
                                     real_vocab_size=real, return_entropy=True, keep_mask=static["keep"], out=bufs)

    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        step()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        step()
    static["h"].zero_(), static["keep"].zero_()
    static["h"].copy_(d["hidden"]), static["keep"].copy_(keep)
    g.replay()
    torch.cuda.synchronize()
    assert same_bits(bufs.logp, ref_logp) and same_bits(bufs.entropy, ref_ent)
    static["ids"][:2] = torch.tensor([2 ** 32 + 5, -(2 ** 32) - 100], device="cuda")
    g.replay()
    torch.cuda.synchronize()
    assert torch.isnan(bufs.logp[:2]).all() and same_bits(bufs.logp[2:], ref_logp[2:])
