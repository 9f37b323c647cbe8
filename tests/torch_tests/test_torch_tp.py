"""Vocab-parallel torch_bridge.linear_logp over 2 and 4 gloo processes: bitwise the same logp and
entropy as the unsharded call (TP = 1, 2, 4), gradients against the float64 oracle with the lean and
the fast backward, dH reduction options, the reference (off) path, a top-p nucleus in the fused
kernels (keep_mask) and the vime provider (fused and logits routes, masked or not) under TP; and the
rollout side: score_sampled on padded decode batches at TP 2 and 4
gives the TP 1 trainer's rows."""
import pytest

pytest.importorskip("torch", reason="torch is not installed: these tests need it")

import os

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import _rlk_core
import oracle
from subprocs import free_port, gloo_worker
import rollout_helpers as R
import torch_bridge
from torch_bridge import vime
import vime_side
from torch_helpers import make_inputs, oracle_of, to_np

# name: (seed, n, h, v_global, dtype, options)
CASES = {
    "bf16_bias_temp_pad": (0, 67, 64, 1024, "bfloat16", dict(bias=True, temp="array", ignore_frac=0.2,
                                                              real_vocab=1000)),
    "f32_shard_all_padding": (1, 33, 32, 1024, "float32", dict(temp="scalar", ignore_frac=0.1, real_vocab=700)),
    "f16_odd_chunk": (2, 20, 48, 520, "float16", dict(bias=True, temp=None, real_vocab=517)),
}


def _case_inputs(name):
    seed, n, h, v, dtype, o = CASES[name]
    return make_inputs(seed, n, h, v, dtype, **o)


def _fast_calls():
    return _rlk_core.route_counts()["cpu"][4]


def _nucleus(name):
    """A top-p-like keep mask [n, V] of the case: each row's real argmax and valid target kept."""
    d, kw, _, _ = _case_inputs(name)
    z = d["hidden"].double() @ d["weight"].double().T
    real = kw.get("real_vocab_size", z.shape[1])
    keep = torch.rand(z.shape, generator=torch.Generator().manual_seed(11)) < 0.3
    rows, t = torch.arange(z.shape[0]), d["targets"]
    keep[rows, z[:, :real].argmax(dim=1)] = True
    keep[rows[t >= 0], t[t >= 0]] = True
    return keep


def _run(d, kw, g, e, *, group=None, rank=0, world=1, mode=None, reduce_grad_hidden=True, backward="lean",
         keep=None):
    """One rank's call on its vocab shard (keep: the global [n, V] nucleus, or None): logp, entropy,
    the gradients of sum g*logp + e*ent and how many fast backwards ran."""
    v_local = d["weight"].shape[0] // world
    sl = slice(rank * v_local, (rank + 1) * v_local)
    h = d["hidden"].clone().requires_grad_()
    w = d["weight"][sl].clone().requires_grad_()
    kwargs = dict(kw)
    if keep is not None:
        kwargs["keep_mask"] = keep[:, sl]
    leaves = [h, w]
    if "bias" in kw:
        kwargs["bias"] = kw["bias"][sl].clone().requires_grad_()
        leaves.append(kwargs["bias"])
    if isinstance(kw.get("temperature"), torch.Tensor):
        kwargs["temperature"] = kw["temperature"].clone().requires_grad_()
        leaves.append(kwargs["temperature"])
    fast0 = _fast_calls()
    logp, ent = torch_bridge.linear_logp(h, w, d["targets"], return_entropy=True, tp_group=group, mode=mode,
                                         reduce_grad_hidden=reduce_grad_hidden, backward=backward, **kwargs)
    ((logp * g).sum() + (ent * e).sum()).backward()
    out = dict(logp=logp.detach(), ent=ent.detach(), dh=h.grad, dw=w.grad, fast_calls=_fast_calls() - fast0)
    if "bias" in kw:
        out["db"] = kwargs["bias"].grad
    if isinstance(kw.get("temperature"), torch.Tensor):
        out["dtemp"] = kwargs["temperature"].grad
    return out


def _vime_fused(d, kw, g, group, rank, world, keep=None):
    v = d["weight"].shape[0]
    v_local = v // world
    sl = slice(rank * v_local, (rank + 1) * v_local)
    h = d["hidden"].clone().requires_grad_()
    req = vime_side.request(d["targets"], hidden=h, weight=d["weight"][sl],
                            bias=kw["bias"][sl] if "bias" in kw else None, tp_group=group,
                            partition=(rank * v_local, v_local, kw.get("real_vocab_size", v), v),
                            temperature=kw.get("temperature"), keep_mask=None if keep is None else keep[:, sl],
                            chunk_size=-1 if keep is None else 8)
    r = vime.provider(req, "strict")
    (r.logp[:, 0] * g).sum().backward()
    return dict(logp=r.logp[:, 0].detach(), ent=r.entropy.detach(), dh=h.grad, backend=r.backend_id,
                tp_rank=r.provenance["tp_rank"])


def _vime_logits_inputs(name):
    """Pre-scaled fp32 logits of the case, a top-p keep mask holding every valid target."""
    d, kw, g, e = _case_inputs(name)
    z = d["hidden"].float() @ d["weight"].float().T
    if "bias" in kw:
        z = z + kw["bias"].float()
    temp = kw.get("temperature", 1.0)
    z = z / (temp[:, None] if isinstance(temp, torch.Tensor) else temp)
    keep = torch.rand(z.shape, generator=torch.Generator().manual_seed(7)) < 0.4
    t = d["targets"]
    valid = (t >= 0) & (t < kw.get("real_vocab_size", z.shape[1]))
    keep[torch.arange(len(t))[valid], t[valid]] = True
    return z, keep, t, kw.get("real_vocab_size"), g, e


def vime_logits_run(name, group=None, rank=0, world=1):
    """The logits route (keep mask, row chunks of 16) on this rank's shard: logp, entropy and the
    gradient of sum g*logp + e*entropy to the shard's logits."""
    z, keep, t, real, g, e = _vime_logits_inputs(name)
    v_local = z.shape[1] // world
    sl = slice(rank * v_local, (rank + 1) * v_local)
    zl = z[:, sl].clone().requires_grad_()
    req = vime_side.request(t, logits=zl, keep_mask=keep[:, sl], tp_group=group, chunk_size=16,
                            metadata={"logits_are_temperature_scaled": True, "real_vocab_size": real})
    r = vime.provider(req, "strict")
    ((r.logp[:, 0] * g).sum() + (r.entropy * e).sum()).backward()
    return dict(logp=r.logp[:, 0].detach(), ent=r.entropy.detach(), dz=zl.grad, backend=r.backend_id)


def _worker(rank, world, port, out_dir):
    os.environ["RLK_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    with gloo_worker(rank, world, port):
        group = dist.group.WORLD
        res = {}
        for name in CASES:
            d, kw, g, e = _case_inputs(name)
            res[name] = _run(d, kw, g, e, group=group, rank=rank, world=world)
            res[name + "/fast"] = _run(d, kw, g, e, group=group, rank=rank, world=world, backward="fast")
            res[name + "/partial_dh"] = _run(d, kw, g, e, group=group, rank=rank, world=world,
                                             reduce_grad_hidden=False)["dh"]
            res[name + "/off"] = _run(d, kw, g, e, group=group, rank=rank, world=world, mode="off")
            res[name + "/vime"] = _vime_fused(d, kw, g, group, rank, world)
            keep = _nucleus(name)
            for backward in ("lean", "fast"):
                res[f"{name}/nucleus/{backward}"] = _run(d, kw, g, e, group=group, rank=rank, world=world,
                                                         backward=backward, keep=keep)
            res[name + "/vime_nucleus"] = _vime_fused(d, kw, g, group, rank, world, keep)
            res[name + "/vime_logits"] = vime_logits_run(name, group, rank, world)
        for name in R.CASES:
            d, kw = R.trainer_inputs(name, 16384)
            for i, live in enumerate(R.LIVE):
                res[f"rollout/{name}/{live}"] = R.score(name, d, kw, live, seed=i, tp_group=group, rank=rank,
                                                        world=world)
        torch.save(res, os.path.join(out_dir, f"rank{rank}.pt"))


@pytest.fixture(scope="module")
def tp_results(tmp_path_factory):
    out = {}
    for world in (2, 4):
        d = tmp_path_factory.mktemp(f"tp{world}")
        mp.spawn(_worker, args=(world, free_port(), str(d)), nprocs=world, join=True)
        out[world] = [torch.load(d / f"rank{r}.pt", weights_only=False) for r in range(world)]  # our own files
    return out


def _oracle(name):
    d, kw, g, e = _case_inputs(name)
    temp = kw.get("temperature", 1.0)
    ref = oracle.linear_logp(to_np(d["hidden"]), to_np(d["weight"]), d["targets"].numpy(),
                             bias=to_np(kw["bias"]) if "bias" in kw else None,
                             temperature=to_np(temp) if isinstance(temp, torch.Tensor) else temp,
                             real_vocab=kw.get("real_vocab_size"), g=g.numpy(), e=e.numpy())
    return d, kw, g, e, ref


@pytest.mark.parametrize("backward", ["lean", "fast"])
@pytest.mark.parametrize("name", list(CASES))
def test_tp_bitwise_equal_to_unsharded(tp_results, name, backward):
    key_of = name if backward == "lean" else name + "/fast"
    d, kw, g, e = _case_inputs(name)
    one = _run(d, kw, g, e, backward=backward)
    for world, ranks in tp_results.items():
        for r, res in enumerate(ranks):
            for key in ("logp", "ent"):
                assert torch.equal(res[key_of][key], one[key]) or (
                    torch.equal(torch.isnan(res[key_of][key]), torch.isnan(one[key]))
                    and torch.equal(res[key_of][key].nan_to_num(), one[key].nan_to_num())), (world, r, key)
            if "dtemp" in one:  # every rank holds the same, all-reduced, temperature gradient
                assert torch.equal(res[key_of]["dtemp"], ranks[0][key_of]["dtemp"])
            assert res[key_of]["fast_calls"] == int(backward == "fast"), (world, r)


@pytest.mark.parametrize("backward", ["lean", "fast"])
@pytest.mark.parametrize("name", list(CASES))
def test_tp_gradients_against_oracle(tp_results, name, backward):
    key_of = name if backward == "lean" else name + "/fast"
    d, kw, g, e = _case_inputs(name)
    dtype = str(d["hidden"].dtype).replace("torch.", "")
    ref = oracle_of(d, kw, g, e, real_vocab=kw.get("real_vocab_size"), kept_dtype=dtype if backward == "fast" else None)
    for world, ranks in tp_results.items():
        for r, res in enumerate(ranks):  # the full dH on every rank
            oracle.assert_grads(dict(hidden=to_np(res[key_of]["dh"])), ref, dtype, f"TP{world} rank{r} ")
            assert res[key_of]["dh"].dtype == d["hidden"].dtype
        full = dict(weight=to_np(torch.cat([res[key_of]["dw"] for res in ranks])))
        if "bias" in kw:
            full["bias"] = to_np(torch.cat([res[key_of]["db"] for res in ranks]))
        if "dtemp" in ranks[0][key_of]:
            full["temperature"] = to_np(ranks[0][key_of]["dtemp"])
        oracle.assert_grads(full, ref, dtype, f"TP{world} ")
        oracle.assert_values(to_np(ranks[0][key_of]["logp"]), ref["logp"], "logp")
        oracle.assert_values(to_np(ranks[0][key_of]["ent"]), ref["entropy"], "entropy")


@pytest.mark.parametrize("name", list(CASES))
def test_tp_partial_dh_sums_to_the_full_dh(tp_results, name):
    for world, ranks in tp_results.items():
        partial = sum(res[name + "/partial_dh"].double() for res in ranks)
        full = ranks[0][name]["dh"].double()
        tol = {torch.bfloat16: 2e-2, torch.float16: 3e-3, torch.float32: 1e-5}[ranks[0][name]["dh"].dtype]
        assert (partial - full).norm() <= tol * full.norm()
        assert not torch.equal(ranks[0][name + "/partial_dh"], ranks[1][name + "/partial_dh"])


@pytest.mark.parametrize("name", list(CASES))
def test_tp_reference_path_against_oracle(tp_results, name):
    d, kw, g, e, ref = _oracle(name)
    dtype = str(d["hidden"].dtype).replace("torch.", "")
    for world, ranks in tp_results.items():
        for res in ranks:
            off = res[name + "/off"]
            oracle.assert_values(to_np(off["logp"]), ref["logp"], "off logp")
            oracle.assert_values(to_np(off["ent"]), ref["entropy"], "off entropy")
            oracle.assert_grad(to_np(off["dh"]), ref["dh"], dtype, "off d hidden", ref["dh_abs"])
        dw = torch.cat([res[name + "/off"]["dw"] for res in ranks])
        oracle.assert_grad(to_np(dw), ref["dw"], dtype, "off d weight", ref["dw_abs"])


@pytest.mark.parametrize("name", list(CASES))
def test_tp_vime_fused_equals_linear_logp(tp_results, name):
    for world, ranks in tp_results.items():
        for rank, res in enumerate(ranks):
            pr = res[name + "/vime"]
            assert pr["backend"] == "rlk.fused.cpu" and pr["tp_rank"] == rank
            assert torch.equal(pr["logp"].nan_to_num(), res[name]["logp"].nan_to_num())
            assert torch.equal(pr["ent"].nan_to_num(), res[name]["ent"].nan_to_num())
            assert pr["dh"].shape == res[name]["dh"].shape


@pytest.mark.parametrize("backward", ["lean", "fast"])
@pytest.mark.parametrize("name", list(CASES))
def test_tp_nucleus_is_tp_invariant_and_exact(tp_results, name, backward):
    """keep_mask in the fused kernels under TP: the kept sums ride the statistics' all-reduce, so
    logp and entropy are TP 1's bits at TP 2 and 4 (and the temperature gradient the same on every
    rank); gradients against float64 (the nucleus's logp, the unmasked entropy)."""
    d, kw, g, e = _case_inputs(name)
    keep = _nucleus(name)
    one = _run(d, kw, g, e, backward=backward, keep=keep)
    dtype = str(d["hidden"].dtype).replace("torch.", "")
    temp = kw.get("temperature", 1.0)
    opts = dict(bias=to_np(kw["bias"]) if "bias" in kw else None,
                temperature=to_np(temp) if isinstance(temp, torch.Tensor) else temp,
                real_vocab=kw.get("real_vocab_size"), g=g.numpy(), e=e.numpy(), nucleus=keep.numpy(),
                dlogit_dtype=oracle.cpu_dlogit_dtype(dtype))
    args = (to_np(d["hidden"]), to_np(d["weight"]), d["targets"].numpy())
    ref = oracle.linear_logp(*args, **opts)
    ref_kept = oracle.linear_logp(*args, kept_fp16=backward == "fast" and dtype != "float32", **opts)
    oracle.assert_values(to_np(one["logp"]), ref["logp"], "TP1 nucleus logp")
    oracle.assert_values(to_np(one["ent"]), ref["entropy"], "TP1 entropy")
    for world, ranks in tp_results.items():
        got = [res[f"{name}/nucleus/{backward}"] for res in ranks]
        for r, res in enumerate(got):
            for key in ("logp", "ent"):
                assert torch.equal(res[key].nan_to_num(), one[key].nan_to_num()), (world, r, key)
                assert torch.equal(res[key].isnan(), one[key].isnan()), (world, r, key)
            if "dtemp" in one:
                assert torch.equal(res["dtemp"], got[0]["dtemp"])
            assert res["fast_calls"] == int(backward == "fast")
            oracle.assert_grad(to_np(res["dh"]), ref_kept["dh"], dtype, f"TP{world} rank{r} dh", ref_kept["dh_abs"])
        oracle.assert_grad(to_np(torch.cat([r["dw"] for r in got])), ref_kept["dw"], dtype, f"TP{world} dw",
                           ref_kept["dw_abs"])
        if "db" in one:
            oracle.assert_grad(to_np(torch.cat([r["db"] for r in got])), ref_kept["db"], dtype, f"TP{world} db",
                               ref_kept["db_abs"])
        if "dtemp" in one:  # fp32 moments, also for fast: lean's tolerance
            oracle.assert_grad(to_np(got[0]["dtemp"]), ref["dtemp"], "float32", f"TP{world} dT", ref["dtemp_abs"])
        for rank, res in enumerate(ranks):  # the vime provider's fused route, the mask in the kernels
            pr = res[name + "/vime_nucleus"]
            assert pr["backend"] == "rlk.fused.cpu" and pr["tp_rank"] == rank
            assert torch.equal(pr["logp"].nan_to_num(), got[rank]["logp"].nan_to_num())
            assert torch.equal(pr["ent"].nan_to_num(), got[rank]["ent"].nan_to_num())


@pytest.mark.parametrize("name", list(CASES))
def test_tp_vime_logits_route_is_tp_invariant_and_exact(tp_results, name):
    one = vime_logits_run(name)
    z, keep, t, real, g, e = _vime_logits_inputs(name)
    z64 = z.double().requires_grad_()
    zp = z64 if real is None else z64.masked_fill(torch.arange(z.shape[1]) >= real, float("-inf"))
    lp = torch.log_softmax(zp, -1)
    ent = -(lp.exp() * lp.nan_to_num(0.0, 0.0, 0.0)).sum(-1)
    ok = t >= 0  # ignore_index rows give 0 and no gradient
    logp = torch.log_softmax(zp.masked_fill(~keep, float("-inf")), -1).gather(1, t.clamp(min=0)[:, None])[:, 0]
    logp, ent = torch.where(ok, logp, 0.0), torch.where(ok, ent, 0.0)
    ((logp * g.double()).sum() + (ent * e.double()).sum()).backward()
    oracle.assert_values(to_np(one["logp"]), logp.detach().numpy(), "logits-route logp")
    oracle.assert_values(to_np(one["ent"]), ent.detach().numpy(), "logits-route entropy")
    oracle.assert_grad(to_np(one["dz"]), z64.grad.numpy(), "float32", "logits-route dz")
    for world, ranks in tp_results.items():
        got = [res[name + "/vime_logits"] for res in ranks]
        for r in got:
            assert torch.equal(r["logp"], one["logp"]) and torch.equal(r["ent"], one["ent"]), world
        assert torch.equal(torch.cat([r["dz"] for r in got], dim=1), one["dz"]), world


def test_tp_rollout_scores_equal_tp1_trainer_rows(tp_results):
    """The engine at TP 2 or 4, the trainer at TP 1: the same bits on every live row."""
    for name in R.CASES:
        d, kw = R.trainer_inputs(name, 16384)
        ref = R.trainer(name, d, kw)
        for world, ranks in tp_results.items():
            for r, res in enumerate(ranks):
                for live in R.LIVE:
                    R.assert_rows_equal(name, res[f"rollout/{name}/{live}"], ref, live, f"TP{world} rank {r}: ")


def test_tp_arguments_are_checked():
    # vocab_start must be rank * V_local: checked before any collective (a 1-process gloo group)
    port = free_port()
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    try:
        d, kw, g, e = _case_inputs("f16_odd_chunk")
        with pytest.raises(ValueError, match="vocab_start must be rank"):
            torch_bridge.linear_logp(d["hidden"], d["weight"], d["targets"], tp_group=dist.group.WORLD,
                                     vocab_start=8)
        for backward in ("lean", "fast"):
            one = _run(d, kw, g, e, backward=backward)
            grp = _run(d, kw, g, e, group=dist.group.WORLD, backward=backward)  # TP = 1 via the group: same bits
            for k in ("logp", "ent", "dh", "dw", "db", "fast_calls"):
                assert torch.equal(torch.as_tensor(one[k]), torch.as_tensor(grp[k])), (backward, k)
        # the kept logits serve one backward through the group path too
        h = d["hidden"].clone().requires_grad_()
        out = torch_bridge.linear_logp(h, d["weight"], d["targets"], tp_group=dist.group.WORLD, backward="fast")
        out.sum().backward(retain_graph=True)
        with pytest.raises(RuntimeError, match="backward='lean'"):
            out.sum().backward()
    finally:
        dist.destroy_process_group()
