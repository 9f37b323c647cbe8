"""The vime provider at TP = 2 over gloo (2 spawned processes, megatron-core's model-parallel state):
- sequence parallelism: context.hidden is the output of megatron-core's sequence-parallel gather
  (gather_from_sequence_parallel_region, whose backward reduce-scatters dH) of this rank's rows, as
  Megatron's output layer under --sequence-parallel feeds it; dH of the rank's rows and dW of its
  vocab shard against float64 within bf16 rounding, with the signal said (metadata or the context)
  or found (the gather in hidden's autograd history); a signal that contradicts the history refused;
- the nucleus as ids (metadata["top_p_sparse_token_ids"], unscaled logits, the temperature), both
  routes, against float64 and vime's native path.
Helpers shared with tests/integration_tests/test_megatron.py (megatron-core's CPU blockers) and
tests/integration_tests/test_vime_seams.py (the float64 oracle and its gradient tolerance)."""
import pytest

pytest.importorskip("torch", reason="torch is not installed: these tests need it")
pytest.importorskip("megatron.core", reason="megatron-core is not installed (pip install megatron-core)")

import os

import torch
import torch.multiprocessing as mp

from subprocs import free_port, gloo_worker

T, H, V, TP = 12, 32, 128, 2
SP_SIGNALS = ("metadata", "context", "detected", "contradicted")


def _inputs(dtype=torch.bfloat16):
    """Every rank's full hidden [T, H], weight [V, H], zero bias, targets, upstream g, e (the same
    on every rank)."""
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(T, H, generator=gen).to(dtype)
    weight = (torch.randn(V, H, generator=gen) * 4 / H ** 0.5).to(dtype)
    targets = torch.randint(0, V, (T,), generator=gen)
    return hidden, weight, torch.zeros(V, dtype=dtype), targets, torch.randn(T, generator=gen), \
        torch.randn(T, generator=gen)


def _sparse_ids():
    from test_vime_seams import _sparse
    x = _inputs()
    return _sparse(1, x[3], V, k=7, outside=(2,))


def _sequence_parallel(rank, group, signal):
    """(dh of this rank's rows, dw of its shard, provenance) or the error's text."""
    import vime_side
    from megatron.core.tensor_parallel import gather_from_sequence_parallel_region
    hidden, weight, _, targets, g, e = _inputs()
    rows, shard = slice(rank * T // TP, (rank + 1) * T // TP), slice(rank * V // TP, (rank + 1) * V // TP)
    mine = hidden[rows].clone().requires_grad_()
    w = weight[shard].clone().requires_grad_()
    gathered = gather_from_sequence_parallel_region(mine, tensor_parallel_output_grad=True, group=group)
    logits = torch.nn.functional.linear(gathered, w).float() / 0.7  # Megatron's output layer, as vime scales
    meta = {"logits_are_temperature_scaled": True}
    extra = {}
    if signal == "metadata":
        meta["sequence_parallel"] = True
    elif signal == "context":
        extra["sequence_parallel"] = True
    elif signal == "contradicted":
        meta["sequence_parallel"] = False
    req = vime_side.request(targets, logits=logits, hidden=gathered.reshape(T, H), weight=w,
                            partition=(rank * V // TP, V // TP, V, V), tp_group=group, temperature=0.7,
                            metadata=meta, **extra)
    try:
        logp, ent, res = vime_side.compute(req, vime_mode="strict")
    except ValueError as exc:
        return str(exc)
    dh, dw = torch.autograd.grad((logp[:, 0] * g).sum() + (ent * e).sum(), [mine, w])
    return dh, dw, {k: res.provenance.get(k) for k in ("sequence_parallel", "sequence_parallel_source", "route")}


def _nucleus(rank, group, route):
    """logp, entropy and the native path's logp of the sparse nucleus at this rank's shard."""
    import vime_side
    hidden, weight, _, targets, *_ = _inputs(torch.float32)
    shard = slice(rank * V // TP, (rank + 1) * V // TP)
    w = weight[shard].clone().requires_grad_()
    h = hidden.clone().requires_grad_()
    req = vime_side.request(targets, logits=torch.nn.functional.linear(h, w), hidden=h, weight=w,
                            partition=(rank * V // TP, V // TP, V, V), tp_group=group, temperature=0.8,
                            metadata={"logits_are_temperature_scaled": False, "rlk_route": route,
                                      "top_p_sparse_token_ids": _sparse_ids()})
    logp, ent, res = vime_side.compute(req, vime_mode="strict")
    return logp.detach(), ent.detach(), vime_side.native(req)[0].detach(), res.provenance["route"]


def _worker(rank, world, port, out_dir):
    torch.set_num_threads(1)
    with gloo_worker(rank, world, port):
        from megatron.core import parallel_state
        from test_megatron import _cpu_megatron
        _cpu_megatron()
        parallel_state.initialize_model_parallel(world, 1)
        group = parallel_state.get_tensor_model_parallel_group()
        out = {s: _sequence_parallel(rank, group, s) for s in SP_SIGNALS}
        out.update({f"nucleus_{r}": _nucleus(rank, group, r) for r in ("recompute", "reuse")})
        torch.save(out, os.path.join(out_dir, f"rank{rank}.pt"))


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    d = tmp_path_factory.mktemp("vime_tp2")
    mp.spawn(_worker, args=(TP, free_port(), str(d)), nprocs=TP, join=True)
    return [torch.load(d / f"rank{r}.pt") for r in range(TP)]


def _oracle(ids=None, temperature=0.7, dtype=torch.bfloat16):
    from test_vime_seams import _sparse_oracle
    x = _inputs(dtype)
    return _sparse_oracle(x, temperature, torch.full((T, 1), -1) if ids is None else ids)


@pytest.mark.parametrize("signal", ["metadata", "context", "detected"])
def test_sequence_parallel_gradients_against_float64(ranks, signal):
    from test_vime_seams import _assert_grads
    ref = _oracle()
    for rank, res in enumerate(ranks):
        dh, dw, prov = res[signal]
        rows, shard = slice(rank * T // TP, (rank + 1) * T // TP), slice(rank * V // TP, (rank + 1) * V // TP)
        mine = (ref[0], ref[1], (ref[2][0][rows], ref[2][1][shard]),
                [(m[0][rows], m[1][shard]) for m in ref[3]])
        _assert_grads((dh, dw), mine, "bfloat16", f"TP=2 SP ({signal}) rank {rank}")
        assert prov["route"] == "fused" and prov["sequence_parallel"] is True
        assert prov["sequence_parallel_source"].startswith({"metadata": "metadata", "context": "context",
                                                            "detected": "detected"}[signal])


def test_sequence_parallel_signal_that_contradicts_the_gather_is_refused(ranks):
    for res in ranks:
        assert isinstance(res["contradicted"], str) and "sequence_parallel" in res["contradicted"]


@pytest.mark.parametrize("route", ["recompute", "reuse"])
def test_sparse_nucleus_at_tp2_against_float64_and_native(ranks, route):
    import oracle
    ref = _oracle(_sparse_ids(), 0.8, torch.float32)
    for res in ranks:
        logp, ent, nat, served = res[f"nucleus_{route}"]
        assert served == ("fused" if route == "recompute" else "logits")
        assert logp[2, 0] == float("-inf") and nat[2, 0] == float("-inf")
        oracle.assert_values(logp[:, 0].numpy(), ref[0].numpy(), f"TP=2 nucleus ({route}) logp")
        oracle.assert_values(ent.numpy(), ref[1].numpy(), f"TP=2 nucleus ({route}) entropy")
        oracle.assert_values(logp[:, 0].numpy(), nat[:, 0].numpy(), f"TP=2 nucleus ({route}) vs native")
    assert torch.equal(ranks[0][f"nucleus_{route}"][0], ranks[1][f"nucleus_{route}"][0])
