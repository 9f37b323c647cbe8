"""torch_bridge.integrations.megatron with the real megatron-core GPTModel (tiny), gloo on the CPU at TP = 1 and
2 (spawned processes): tied and untied output weights, a padded vocab, sequence parallelism.
logp against megatron.core.tensor_parallel.vocab_parallel_cross_entropy over Megatron's own logits
and against float64; gradients of every parameter (decoder, embedding, output layer) against those
of Megatron's path."""
import pytest

pytest.importorskip("torch", reason="torch is not installed: these tests need it")
pytest.importorskip("megatron.core", reason="megatron-core is not installed (pip install megatron-core)")

import os
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from subprocs import free_port, gloo_worker

# name: (tp, tied, real vocab of the padded 128). Sequence parallelism: _sequence_parallel at TP = 2.
CASES = {"tp1_tied": (1, True, 120), "tp1_untied": (1, False, 128), "tp2_tied": (2, True, 120),
         "tp2_untied": (2, False, 128)}
S, B, V = 8, 2, 128


# megatron-core's CUDA-only pieces (its attention scratch buffer, the model-parallel RNG tracker's
# CUDA fork, the sequence-parallel gather / reduce-scatter), replaced for gloo on the CPU: the
# runnable recipe's own patches (examples/megatron_cpu.py), so the tests run what users run.
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "examples"))
from megatron_cpu import cpu_patches as _cpu_megatron  # noqa: E402


def _model(tp, tied):
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_config import TransformerConfig
    torch.manual_seed(0)  # the same full weights at every TP (CPU initialization splits a master copy)
    cfg = TransformerConfig(num_layers=1, hidden_size=32, num_attention_heads=4, use_cpu_initialization=True,
                            params_dtype=torch.float32, tensor_model_parallel_size=tp,
                            hidden_dropout=0.0, attention_dropout=0.0)
    return GPTModel(config=cfg, transformer_layer_spec=get_gpt_layer_local_spec(), vocab_size=V,
                    max_sequence_length=S, share_embeddings_and_output_weights=tied)


def _grads(model):
    return {k: p.grad.detach().clone() for k, p in model.named_parameters() if p.grad is not None}


def _case(name, rank, device):
    import torch_bridge.integrations.megatron as tbm
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy
    tp, tied, real = CASES[name]
    model = _model(tp, tied).to(device)
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, real, (B, S), generator=gen).to(device)
    labels = torch.randint(0, real, (B, S), generator=gen).to(device)
    g = torch.randn(B, S, generator=gen).to(device)
    pos = torch.arange(S, device=device)[None].expand(B, S)
    mask = torch.triu(torch.ones(S, S, dtype=torch.bool, device=device), 1)[None, None]
    # Megatron's path: logits [b, s, V_local], then its vocab-parallel cross entropy
    logits = model(ids, pos, mask)
    meg = -vocab_parallel_cross_entropy(logits.transpose(0, 1).contiguous(), labels.transpose(0, 1).contiguous()).transpose(0, 1)
    (meg * g).sum().backward()
    meg_grads = _grads(model)
    model.zero_grad(set_to_none=True)
    # ours: hidden states only, no logits
    with tbm.hidden_states_only(model):
        hidden = model(ids, pos, mask)
    logp, ent = tbm.linear_logp(model, hidden, labels, return_entropy=True,
                                real_vocab_size=real if real < V else None)
    (logp * g).sum().backward()
    ours = _grads(model)
    # float64 from the same hidden states and the whole output weight
    weight, _ = tbm.output_weight(model)
    full_w = [torch.empty_like(weight) for _ in range(tp)]
    dist.all_gather(full_w, weight.detach().contiguous())
    z = hidden.detach().double().transpose(0, 1) @ torch.cat(full_w).double().T
    z = z.masked_fill(torch.arange(V, device=device) >= real, float("-inf"))
    ls = torch.log_softmax(z, -1)
    ref = ls.gather(-1, labels[..., None])[..., 0]
    ref_ent = -(ls.exp() * ls.nan_to_num(0.0, 0.0, 0.0)).sum(-1)
    out = dict(logp=logp.detach(), meg=meg.detach(), ref=ref, ent=ent.detach(), ref_ent=ref_ent, ours=ours,
               meg_grads=meg_grads, padded=real < V)
    if tp > 1:
        out["sp"] = _sequence_parallel(model, hidden.detach(), labels, g, rank, tp)
    return {k: (v.cpu() if isinstance(v, torch.Tensor) else {n: t.cpu() for n, t in v.items()}
                if isinstance(v, dict) else v) for k, v in out.items()}


def _sequence_parallel(model, hidden, labels, g, rank, tp):
    """The output layer under sequence parallelism fed this rank's rows of the sequence, against
    the same layer fed every row: (logp equal, max |dh| difference on this rank's rows, max |dW|
    difference). (The decoder runs without it: the local spec's torch norm refuses it.)"""
    import torch_bridge.integrations.megatron as tbm
    layer, (weight, _) = model.output_layer, tbm.output_weight(model)
    rows = slice(rank * (S // tp), (rank + 1) * (S // tp))
    full, mine = hidden.clone().requires_grad_(), hidden[rows].clone().requires_grad_()
    lp_full = tbm.output_layer_logp(layer, full, labels, weight=weight)
    dh_full, dw_full = torch.autograd.grad((lp_full * g).sum(), [full, weight])
    layer.sequence_parallel = True
    try:
        lp_sp = tbm.output_layer_logp(layer, mine, labels, weight=weight)
    finally:
        layer.sequence_parallel = False
    dh_sp, dw_sp = torch.autograd.grad((lp_sp * g).sum(), [mine, weight])
    return (torch.equal(lp_full, lp_sp), float((dh_sp - dh_full[rows]).abs().max()),
            float((dw_sp - dw_full).abs().max()))


def _worker(rank, world, port, out_dir, names, device="cpu"):
    torch.set_num_threads(1)
    if device == "cuda":
        torch.cuda.set_device(rank)
    with gloo_worker(rank, world, port, backend="gloo" if device == "cpu" else "nccl"):
        from megatron.core import parallel_state
        if device == "cpu":
            _cpu_megatron()
        parallel_state.initialize_model_parallel(world, 1)
        if device == "cuda":
            from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
            model_parallel_cuda_manual_seed(0)
        res = {name: _case(name, rank, device) for name in names}
        torch.save(res, os.path.join(out_dir, f"rank{rank}.pt"))


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    out = {}
    for tp in (1, 2):
        names = [n for n, c in CASES.items() if c[0] == tp]
        d = tmp_path_factory.mktemp(f"megatron_tp{tp}")
        mp.spawn(_worker, args=(tp, free_port(), str(d), names), nprocs=tp, join=True)
        ranks = [torch.load(d / f"rank{r}.pt") for r in range(tp)]
        out.update({n: ranks for n in names})
    return out


@pytest.mark.parametrize("name", list(CASES))
def test_megatron_logp_entropy_and_gradients(results, name):
    _check(results[name], name)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (torch.cuda.is_available() is False)")
def test_megatron_on_one_gpu(tmp_path):
    import _rlk_core
    if not _rlk_core.has_cuda:
        pytest.skip("this build of _rlk_core has no CUDA backend")
    names = [n for n, c in CASES.items() if c[0] == 1]
    mp.spawn(_worker, args=(1, free_port(), str(tmp_path), names, "cuda"), nprocs=1, join=True)
    res = torch.load(tmp_path / "rank0.pt")
    for name in names:
        _check([res], name)


def _check(ranks, name):
    for res in ranks:
        r = res[name]
        err = (r["logp"].double() - r["ref"]).abs()
        assert float(err.max()) <= 2e-5 * (1 + float(r["ref"].abs().max()))
        assert float((r["ent"].double() - r["ref_ent"]).abs().max()) <= 2e-5 * (1 + float(r["ref_ent"].abs().max()))
        if not r["padded"]:  # Megatron scores the padded ids; ours does too unless told the real vocab
            torch.testing.assert_close(r["logp"], r["meg"], rtol=1e-5, atol=2e-5)
            assert r["ours"].keys() == r["meg_grads"].keys()
            for k in r["ours"]:
                torch.testing.assert_close(r["ours"][k], r["meg_grads"][k], rtol=1e-4, atol=1e-5, msg=k)
        else:
            assert r["ours"].keys() == r["meg_grads"].keys()
        if "sp" in r:
            equal, dh, dw = r["sp"]
            assert equal and dh <= 1e-6 and dw == 0.0


def test_megatron_needs_the_last_stage():
    import types
    import torch_bridge.integrations.megatron as tbm
    with pytest.raises(ValueError, match="last pipeline stage"):
        tbm.linear_logp(types.SimpleNamespace(post_process=False), None, None)
