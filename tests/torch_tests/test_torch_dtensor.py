"""torch_bridge.linear_logp with DTensor operands over 2 gloo processes: a weight (and bias) sharded
Shard(0) over a 1-D mesh, or over the "tp" dim of a (dp, tp) mesh, gives the plain-tensor TP path's
logp, entropy and gradients bit for bit, dW and the bias gradient as DTensors with the weight's
placements; a replicated DTensor hidden is accepted (outputs and dH as replicated DTensors); a
weight sharded over a data-parallel (FSDP) dim, over two dims, or with tp_group passed, is refused
with the fix. The nucleus as a DTensor (a keep_mask sharded over the vocab or replicated, keep_ids
replicated) gives the plain TP path's bits, an empty row's NaN included; a mask sharded over its rows
on the vocab's mesh dim is refused."""
import pytest

pytest.importorskip("torch", reason="torch is not installed: these tests need it")

import os
import re

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from subprocs import free_port, gloo_worker

import torch_bridge

N, H, V = 37, 24, 302
WORLD = 2


def _inputs():
    gen = torch.Generator().manual_seed(3)
    hidden = torch.randn(N, H, generator=gen)
    weight = torch.randn(V, H, generator=gen) * 2
    bias = torch.randn(V, generator=gen)
    targets = torch.randint(0, V, (N,), generator=gen)
    targets[::7] = -100
    g, e = torch.randn(N, generator=gen), torch.randn(N, generator=gen)
    return hidden, weight, bias, targets, g, e


def _call(h, w, b, t, g, e, **kw):
    logp, ent = torch_bridge.linear_logp(h, w, t, bias=b, temperature=0.7, return_entropy=True, **kw)
    ((_local(logp) * g).sum() + (_local(ent) * e).sum()).backward()
    return logp, ent


def _local(x):
    return x.to_local() if hasattr(x, "to_local") else x


def _worker(rank, world, port, out_dir):
    os.environ["RLK_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor
    with gloo_worker(rank, world, port):
        hidden, weight, bias, targets, g, e = _inputs()
        v_local = V // world
        sl = slice(rank * v_local, (rank + 1) * v_local)
        leaves = [x.clone().requires_grad_() for x in (hidden, weight[sl], bias[sl])]
        logp, ent = _call(*leaves[:2], leaves[2], targets, g, e, tp_group=dist.group.WORLD)
        res = {"plain": {"logp": logp.detach(), "ent": ent.detach(), "dh": leaves[0].grad, "dw": leaves[1].grad,
                         "db": leaves[2].grad}}
        meshes = {"1d": (init_device_mesh("cpu", (world,)), (Shard(0),)),
                  "dp_tp": (init_device_mesh("cpu", (1, world), mesh_dim_names=("dp", "tp")), (Replicate(), Shard(0)))}
        for name, (mesh, placements) in meshes.items():
            for hidden_kind in ("plain", "replicated"):
                w = distribute_tensor(weight, mesh, placements).requires_grad_()
                b = distribute_tensor(bias, mesh, placements).requires_grad_()
                h = hidden.clone()
                if hidden_kind == "replicated":
                    h = distribute_tensor(h, mesh, [Replicate()] * mesh.ndim)
                h.requires_grad_()
                logp, ent = _call(h, w, b, targets, g, e)
                res[f"{name}/{hidden_kind}"] = {
                    "logp": _local(logp).detach(), "ent": _local(ent).detach(), "dh": _local(h.grad),
                    "dw": w.grad.to_local(), "db": b.grad.to_local(), "dw_placements": tuple(w.grad.placements),
                    "w_placements": placements, "out_dtensor": hasattr(logp, "to_local"),
                    "dh_dtensor": hasattr(h.grad, "to_local")}
        # the nucleus: a mask sharded over the vocab or replicated, ids replicated (global ids)
        keep = torch.rand(N, V, generator=torch.Generator().manual_seed(5)) < 0.3
        keep[torch.arange(N), targets.clamp(min=0)] = True
        keep[1] = False  # an empty nucleus: NaN
        ids = torch.where(keep, torch.arange(V), -1).sort(dim=1, descending=True).values[:, :V // 2]
        mesh1 = meshes["1d"][0]
        nucleus_cases = {"plain_nucleus": dict(keep_mask=keep[:, sl].contiguous(), tp_group=dist.group.WORLD),
                         "nucleus/shard": dict(keep_mask=distribute_tensor(keep, mesh1, (Shard(1),))),
                         "nucleus/replicated": dict(keep_mask=distribute_tensor(keep, mesh1, (Replicate(),))),
                         "nucleus/ids": dict(keep_ids=distribute_tensor(ids, mesh1, (Replicate(),)))}
        for name, kw in nucleus_cases.items():
            plain = name == "plain_nucleus"
            w = (weight[sl].clone() if plain else distribute_tensor(weight, mesh1, (Shard(0),))).requires_grad_()
            h = hidden.clone().requires_grad_()
            logp, ent = _call(h, w, None, targets, g, e, **kw)
            res[name] = {"logp": _local(logp).detach(), "ent": _local(ent).detach(), "dh": h.grad,
                         "dw": _local(w.grad)}
        errors = {}
        try:
            torch_bridge.linear_logp(hidden, distribute_tensor(weight, mesh1, (Shard(0),)), targets,
                                     keep_mask=distribute_tensor(keep, mesh1, (Shard(0),)))
            errors["nucleus_rows"] = None
        except (ValueError, TypeError) as exc:
            errors["nucleus_rows"] = str(exc)
        refused = {"fsdp": (init_device_mesh("cpu", (world,), mesh_dim_names=("dp",)), (Shard(0),), {}),
                   "two_dims": (init_device_mesh("cpu", (1, world), mesh_dim_names=("a", "b")), (Shard(0), Shard(0)),
                                {}),
                   "tp_group": (meshes["1d"][0], (Shard(0),), {"tp_group": dist.group.WORLD})}
        for name, (mesh, placements, kw) in refused.items():
            try:
                torch_bridge.linear_logp(hidden, distribute_tensor(weight, mesh, placements), targets, **kw)
                errors[name] = None
            except (ValueError, TypeError) as exc:
                errors[name] = str(exc)
        res["errors"] = errors
        torch.save(res, os.path.join(out_dir, f"rank{rank}.pt"))


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    d = tmp_path_factory.mktemp("dtensor")
    mp.spawn(_worker, args=(WORLD, free_port(), str(d)), nprocs=WORLD, join=True)
    return [torch.load(d / f"rank{r}.pt", weights_only=False) for r in range(WORLD)]  # our own files


@pytest.mark.parametrize("case", ["1d/plain", "1d/replicated", "dp_tp/plain", "dp_tp/replicated"])
def test_dtensor_weight_gives_the_plain_tp_bits(results, case):
    for res in results:
        got, plain = res[case], res["plain"]
        for key in ("logp", "ent", "dh", "dw", "db"):
            assert torch.equal(got[key], plain[key]), key
        assert got["dw_placements"] == got["w_placements"]
        replicated = case.endswith("replicated")
        assert got["out_dtensor"] == replicated and got["dh_dtensor"] == replicated


@pytest.mark.parametrize("case", ["nucleus/shard", "nucleus/replicated", "nucleus/ids"])
def test_dtensor_nucleus_gives_the_plain_tp_bits(results, case):
    for res in results:
        got, plain = res[case], res["plain_nucleus"]
        for key in ("logp", "ent", "dh", "dw"):  # bitwise: the empty row's NaN too
            assert torch.equal(got[key].view(torch.int32), plain[key].view(torch.int32)), key
        assert torch.isnan(got["logp"][1]) and torch.isfinite(got["logp"][2:]).all()


@pytest.mark.parametrize("case, match", [("fsdp", "data-parallel.*forward"), ("two_dims", "several mesh dims"),
                                         ("tp_group", "read from it"), ("nucleus_rows", "keep_mask placements")])
def test_refused_layouts_name_the_fix(results, case, match):
    for res in results:
        assert res["errors"][case] is not None and re.search(match, res["errors"][case]), res["errors"][case]
