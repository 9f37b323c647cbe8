"""Vocab-parallel torch_bridge.linear_logp over NCCL, one process per GPU (torchrun).

    torchrun --nproc_per_node 2 benchmarks/tp_torch.py --out $OUT
    torchrun --nproc_per_node 2 benchmarks/tp_torch.py --out /tmp --shapes tiny   # CPU + gloo dry run

Every rank builds the same inputs as benchmarks/tp_jax.py (numpy seed 0) and holds its vocab
shard. Rank 0 also runs TP = 1 on the full weight. Checks: logp/entropy bitwise across TP = 1
and TP = world, dH against TP = 1; times TP forward and forward+backward on every rank (and TP = 1
on rank 0), and the share of the statistics exchange (the same all-reduces alone). Writes
tp_torch.json and the TP logp of each shape (tp_torch_<shape>_logp.npy) for the cross-frontend
comparison.
"""
from __future__ import annotations

import argparse
import json
import os
import time

for k, v in (("NCCL_NVLS_ENABLE", "0"), ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"), ("NVSHMEM_DISABLE_NVLS", "1")):
    os.environ[k] = v

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import _rlk_core  # noqa: E402
import torch_bridge  # noqa: E402

SHAPES = {"T3": (6827, 2048, 151936), "Q8B": (4096, 4096, 151936),  # global vocab, as tp_jax.py
          "tiny": (256, 64, 1024)}  # a dry run of the script itself (CPU, gloo)


def timed_ms(fn, warmup=5, iters=20, collective=True):
    """Median CUDA-event time of fn. The iteration counts are fixed, never estimated from a first
    timing (as triton's do_bench does): every rank must issue the same collectives, or they hang."""
    for _ in range(warmup):
        fn()
    if collective:
        dist.barrier()
    times = []
    for _ in range(iters):
        if not torch.cuda.is_available():
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
            continue
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return float(np.median(times))


def steps(logp_fn, hh, ww, g):
    """(forward, forward+backward) of one call: logp_fn() -> logp, differentiable in hh and ww."""
    def fwd():
        with torch.no_grad():
            logp_fn()

    def fb():
        hh.grad = ww.grad = None
        torch.autograd.backward(logp_fn(), g)
    return fwd, fb


def inputs(n, hd, v):
    """The same arrays as benchmarks/tp_jax.py."""
    r = np.random.default_rng(0)
    h = torch.from_numpy(r.standard_normal((n, hd)).astype(np.float32)).bfloat16()
    w = torch.from_numpy((r.standard_normal((v, hd)) / np.sqrt(hd)).astype(np.float32)).bfloat16()
    t = torch.from_numpy(np.where(r.random(n) < 0.05, -100, r.integers(0, v, n)).astype(np.int64))
    g = torch.from_numpy(r.standard_normal(n).astype(np.float32))
    return h, w, t, g


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=".")
    ap.add_argument("--shapes", default="T3,Q8B")
    args = ap.parse_args()
    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    if cuda:
        torch.cuda.set_device(rank)
    dev = torch.device("cuda", rank) if cuda else torch.device("cpu")
    rows = []
    for name in args.shapes.split(","):
        n, hd, v = SHAPES[name]
        v_local = v // world
        h, w, t, g = (x.to(dev) for x in inputs(n, hd, v))
        ws = w[rank * v_local:(rank + 1) * v_local].contiguous()
        hs = h.clone().requires_grad_()
        wsg = ws.clone().requires_grad_()

        def tp_call(hh, ww):
            return torch_bridge.linear_logp(hh, ww, t, vocab_start=rank * v_local, real_vocab_size=v,
                                            tp_group=dist.group.WORLD, return_entropy=True, mode="strict",
                                            validate_targets=False)

        lp, ent = tp_call(hs, wsg)
        torch.autograd.backward(lp, g)
        out = dict(shape=name, n=n, h=hd, v_local=v_local, tp=world)
        if rank == 0:
            np.save(os.path.join(args.out, f"tp_torch_{name}_logp.npy"), lp.detach().cpu().numpy())
            h1 = h.clone().requires_grad_()
            w1 = w.clone().requires_grad_()
            lp1, ent1 = torch_bridge.linear_logp(h1, w1, t, return_entropy=True, mode="strict")
            torch.autograd.backward(lp1, g)
            out["logp_bitwise_tp1_vs_tp"] = bool(torch.equal(lp1, lp))
            out["entropy_bitwise_tp1_vs_tp"] = bool(torch.equal(ent1, ent))
            out["dh_max_rel_diff_tp1_vs_tp"] = float((hs.grad.float() - h1.grad.float()).norm() / h1.grad.float().norm())
            out["dw_shard_bitwise_tp1_vs_tp"] = bool(torch.equal(w1.grad[:v_local], wsg.grad))

        fwd, fb = steps(lambda: tp_call(hs, wsg)[0], hs, wsg, g)
        out["tp_fwd_ms"] = timed_ms(fwd)
        out["tp_fb_ms"] = timed_ms(fb)
        per_rank = [None] * world  # every rank's own times, rank order
        dist.all_gather_object(per_rank, (out["tp_fwd_ms"], out["tp_fb_ms"]))
        out["per_rank_fwd_ms"] = [f for f, _ in per_rank]
        out["per_rank_fb_ms"] = [b for _, b in per_rank]
        k = v // _rlk_core.canonical_chunk(v)
        stats = torch.zeros(n, k, 3, device=dev)
        tl = torch.zeros(n, device=dev)
        dh = torch.zeros(n, hd, device=dev)
        out["exchange_fwd_ms"] = timed_ms(lambda: (dist.all_reduce(stats), dist.all_reduce(tl)))
        out["exchange_bwd_dh_ms"] = timed_ms(lambda: dist.all_reduce(dh))
        out["exchange_share_of_fb"] = (out["exchange_fwd_ms"] + out["exchange_bwd_dh_ms"]) / out["tp_fb_ms"]
        out["stats_exchange_share_of_fb"] = out["exchange_fwd_ms"] / out["tp_fb_ms"]
        if rank == 0:  # TP = 1 on this rank alone: no collectives, so no barrier inside
            fwd1, fb1 = steps(lambda: torch_bridge.linear_logp(h1, w1, t, mode="strict", validate_targets=False),
                              h1, w1, g)
            out["tp1_fwd_ms"] = timed_ms(fwd1, collective=False)
            out["tp1_fb_ms"] = timed_ms(fb1, collective=False)
            print(json.dumps(out), flush=True)
        rows.append(out)
        dist.barrier()
    if rank == 0:
        with open(os.path.join(args.out, "tp_torch.json"), "w") as f:
            json.dump(rows, f, indent=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
