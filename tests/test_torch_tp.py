"""Vocab-parallel torch_bridge.linear_logp over 2 and 4 gloo processes: bitwise the same logp and
entropy as the unsharded call (TP = 1, 2, 4), gradients against the float64 oracle, dH reduction
options, the reference (off) path and the provider under TP."""
import pytest

pytest.importorskip("torch", reason="torch is not installed: these tests need it")

import os
import socket

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import oracle
import torch_bridge
from torch_bridge import provider as P
from torch_helpers import make_inputs, to_np

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


def _run(d, kw, g, e, *, group=None, rank=0, world=1, mode=None, reduce_grad_hidden=True):
    """One rank's call on its vocab shard: logp, entropy and the gradients of sum g*logp + e*ent."""
    v_local = d["weight"].shape[0] // world
    sl = slice(rank * v_local, (rank + 1) * v_local)
    h = d["hidden"].clone().requires_grad_()
    w = d["weight"][sl].clone().requires_grad_()
    kwargs = dict(kw)
    leaves = [h, w]
    if "bias" in kw:
        kwargs["bias"] = kw["bias"][sl].clone().requires_grad_()
        leaves.append(kwargs["bias"])
    if isinstance(kw.get("temperature"), torch.Tensor):
        kwargs["temperature"] = kw["temperature"].clone().requires_grad_()
        leaves.append(kwargs["temperature"])
    logp, ent = torch_bridge.linear_logp(h, w, d["targets"], return_entropy=True, tp_group=group, mode=mode,
                                         reduce_grad_hidden=reduce_grad_hidden, **kwargs)
    ((logp * g).sum() + (ent * e).sum()).backward()
    out = dict(logp=logp.detach(), ent=ent.detach(), dh=h.grad, dw=w.grad)
    if "bias" in kw:
        out["db"] = kwargs["bias"].grad
    if isinstance(kw.get("temperature"), torch.Tensor):
        out["dtemp"] = kwargs["temperature"].grad
    return out


def _provider_run(d, kw, g, group, rank, world):
    v = d["weight"].shape[0]
    v_local = v // world
    sl = slice(rank * v_local, (rank + 1) * v_local)
    h = d["hidden"].clone().requires_grad_()
    bias = kw["bias"][sl] if "bias" in kw else None
    ctx = P.LinearLogpContext(h, P.LinearProjection(d["weight"][sl], bias),
                              P.VocabPartition(rank * v_local, v_local, kw.get("real_vocab_size", v), v))
    req = P.LinearLogpRequest(d["targets"], tensor_parallel_group=group, context=ctx, with_entropy=True,
                              temperature=kw.get("temperature"))
    r = P.compute_linear_logp(req, "strict")
    (r.logp[:, 0] * g).sum().backward()
    return dict(logp=r.logp[:, 0].detach(), ent=r.entropy.detach(), dh=h.grad, backend=r.backend_id)


def _worker(rank, world, port, out_dir):
    os.environ["RLK_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        group = dist.group.WORLD
        res = {}
        for name in CASES:
            d, kw, g, e = _case_inputs(name)
            res[name] = _run(d, kw, g, e, group=group, rank=rank, world=world)
            res[name + "/partial_dh"] = _run(d, kw, g, e, group=group, rank=rank, world=world,
                                             reduce_grad_hidden=False)["dh"]
            res[name + "/off"] = _run(d, kw, g, e, group=group, rank=rank, world=world, mode="off")
            res[name + "/provider"] = _provider_run(d, kw, g, group, rank, world)
        torch.save(res, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def tp_results(tmp_path_factory):
    out = {}
    for world in (2, 4):
        d = tmp_path_factory.mktemp(f"tp{world}")
        mp.spawn(_worker, args=(world, _free_port(), str(d)), nprocs=world, join=True)
        out[world] = [torch.load(d / f"rank{r}.pt") for r in range(world)]
    return out


def _oracle(name):
    d, kw, g, e = _case_inputs(name)
    temp = kw.get("temperature", 1.0)
    ref = oracle.linear_logp(to_np(d["hidden"]), to_np(d["weight"]), d["targets"].numpy(),
                             bias=to_np(kw["bias"]) if "bias" in kw else None,
                             temperature=to_np(temp) if isinstance(temp, torch.Tensor) else temp,
                             real_vocab=kw.get("real_vocab_size"), g=g.numpy(), e=e.numpy())
    return d, kw, g, e, ref


@pytest.mark.parametrize("name", list(CASES))
def test_tp_bitwise_equal_to_unsharded(tp_results, name):
    d, kw, g, e = _case_inputs(name)
    one = _run(d, kw, g, e)
    for world, ranks in tp_results.items():
        for r, res in enumerate(ranks):
            for key in ("logp", "ent"):
                assert torch.equal(res[name][key], one[key]) or (
                    torch.equal(torch.isnan(res[name][key]), torch.isnan(one[key]))
                    and torch.equal(res[name][key].nan_to_num(), one[key].nan_to_num())), (world, r, key)
            if "dtemp" in one:  # every rank holds the same, all-reduced, temperature gradient
                assert torch.equal(res[name]["dtemp"], ranks[0][name]["dtemp"])


@pytest.mark.parametrize("name", list(CASES))
def test_tp_gradients_against_oracle(tp_results, name):
    d, kw, g, e, ref = _oracle(name)
    dtype = str(d["hidden"].dtype).replace("torch.", "")
    for world, ranks in tp_results.items():
        for r, res in enumerate(ranks):  # the full dH on every rank
            oracle.assert_grad(to_np(res[name]["dh"]), ref["dh"], dtype, f"TP{world} rank{r} d hidden", ref["dh_abs"])
            assert res[name]["dh"].dtype == d["hidden"].dtype
        dw = torch.cat([res[name]["dw"] for res in ranks])
        oracle.assert_grad(to_np(dw), ref["dw"], dtype, f"TP{world} d weight", ref["dw_abs"])
        if "bias" in kw:
            db = torch.cat([res[name]["db"] for res in ranks])
            oracle.assert_grad(to_np(db), ref["db"], dtype, f"TP{world} d bias", ref["db_abs"])
        if "dtemp" in ranks[0][name]:
            oracle.assert_grad(to_np(ranks[0][name]["dtemp"]), ref["dtemp"], "float32", "d temperature",
                               ref["dtemp_abs"])
        oracle.assert_values(to_np(ranks[0][name]["logp"]), ref["logp"], "logp")
        oracle.assert_values(to_np(ranks[0][name]["ent"]), ref["entropy"], "entropy")


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
def test_tp_provider_strict_equals_linear_logp(tp_results, name):
    for world, ranks in tp_results.items():
        for res in ranks:
            pr = res[name + "/provider"]
            assert pr["backend"] == "rlk.cpu"
            assert torch.equal(pr["logp"].nan_to_num(), res[name]["logp"].nan_to_num())
            assert torch.equal(pr["ent"].nan_to_num(), res[name]["ent"].nan_to_num())
            assert pr["dh"].shape == res[name]["dh"].shape


def test_tp_arguments_are_checked():
    # vocab_start must be rank * V_local: checked before any collective (a 1-process gloo group)
    port = _free_port()
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    try:
        d, kw, g, e = _case_inputs("f16_odd_chunk")
        with pytest.raises(ValueError, match="vocab_start must be rank"):
            torch_bridge.linear_logp(d["hidden"], d["weight"], d["targets"], tp_group=dist.group.WORLD,
                                     vocab_start=8)
        one = _run(d, kw, g, e)
        grp = _run(d, kw, g, e, group=dist.group.WORLD)  # TP = 1 through the group path: same bits
        for k in ("logp", "ent", "dh", "dw", "db"):
            assert torch.equal(one[k], grp[k]), k
    finally:
        dist.destroy_process_group()
