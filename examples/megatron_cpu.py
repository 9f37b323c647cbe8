"""A training step of a tiny megatron-core GPTModel on the CPU (gloo), with selected-token logp from
its hidden states: Megatron never builds the logits.

    python3 examples/megatron_cpu.py            # TP = 1
    python3 examples/megatron_cpu.py --tp 2     # TP = 2: two processes, vocab-parallel output layer

Needs torch, megatron-core (pip install megatron-core) and this repository's _rlk_core built for the
CPU (README). Each rank: the model's decoder under torch_bridge.integrations.megatron.hidden_states_only, then
torch_bridge.integrations.megatron.linear_logp (the output weight, this rank's vocab shard, real_vocab_size),
a policy-gradient-style loss and its backward into every parameter. It checks logp against
Megatron's own path (the output layer's logits and megatron.core.tensor_parallel's
vocab_parallel_cross_entropy) and prints "ok".

megatron-core targets CUDA; four things in it allocate on CUDA or need NCCL, and cpu_patches()
replaces them for a CPU run (nothing else of Megatron changes):
- GlobalMemoryBuffer.get_tensor (the attention scratch buffer) allocates on the current CUDA device;
- the model-parallel RNG tracker's fork() swaps CUDA RNG states (here: a no-op context);
- the sequence-parallel gather and reduce-scatter use CUDA buffers, and gloo has no reduce-scatter
  (here: all_gather, and all_reduce then this rank's chunk).
"""
from __future__ import annotations

import argparse
import contextlib
import os
import sys

import torch
import torch.distributed as dist

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

SEQ, BATCH, VOCAB, REAL_VOCAB = 16, 2, 128, 120  # the padded vocab; the tokenizer's real vocab


def _gather_rows(x, group, split_sizes=None, use_global_buffer=False):
    parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, x.contiguous(), group=group)
    return torch.cat(parts)


def _reduce_scatter_rows(x, group, split_sizes=None, use_global_buffer=False):
    x = x.contiguous().clone()
    dist.all_reduce(x, group=group)
    return x.chunk(dist.get_world_size(group))[dist.get_rank(group)].contiguous()


def cpu_patches():
    """megatron-core's CUDA-only pieces, replaced for a CPU (gloo) run: its attention scratch buffer
    and causal mask default to CUDA, the model-parallel RNG tracker forks CUDA RNG state, and its
    sequence-parallel gather / reduce-scatter allocate on CUDA (gloo has no reduce-scatter: the same
    collective from all_gather and all_reduce)."""
    import megatron.core.utils as mu
    from megatron.core import tensor_parallel
    from megatron.core.tensor_parallel import mappings
    mu.GlobalMemoryBuffer.get_tensor = lambda self, shape, dtype, name, mem_alloc_context=None: torch.empty(
        shape, dtype=dtype)
    tensor_parallel.get_cuda_rng_tracker().fork = lambda *a, **k: contextlib.nullcontext()
    mappings._gather_along_first_dim = _gather_rows
    mappings._reduce_scatter_along_first_dim = _reduce_scatter_rows


def tiny_gpt(tp: int):
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_config import TransformerConfig
    torch.manual_seed(0)  # the same full weights at every TP (CPU initialization splits a master copy)
    cfg = TransformerConfig(num_layers=2, hidden_size=64, num_attention_heads=4, use_cpu_initialization=True,
                            params_dtype=torch.float32, tensor_model_parallel_size=tp, hidden_dropout=0.0,
                            attention_dropout=0.0)
    return GPTModel(config=cfg, transformer_layer_spec=get_gpt_layer_local_spec(), vocab_size=VOCAB,
                    max_sequence_length=SEQ, share_embeddings_and_output_weights=True)


def step(tp: int) -> float:
    """One training step on this rank; returns max |logp - Megatron's| over the tokens."""
    import torch_bridge.integrations.megatron as tbm
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy
    model = tiny_gpt(tp)
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    gen = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, REAL_VOCAB, (BATCH, SEQ + 1), generator=gen)
    ids, labels = tokens[:, :-1], tokens[:, 1:]
    advantages = torch.randn(BATCH, SEQ, generator=gen)
    pos = torch.arange(SEQ)[None].expand(BATCH, SEQ)
    mask = torch.triu(torch.ones(SEQ, SEQ, dtype=torch.bool), 1)[None, None]
    with tbm.hidden_states_only(model):
        hidden = model(ids, pos, mask)  # [s, b, h]: the decoder's output, no logits
    logp, ent = tbm.linear_logp(model, hidden, labels, return_entropy=True, real_vocab_size=REAL_VOCAB)
    loss = -(advantages * logp).mean() - 1e-3 * ent.mean()
    loss.backward()
    opt.step()
    with torch.no_grad():  # Megatron's own path (its logits over the padded vocab, the padding masked)
        model.zero_grad(set_to_none=True)
        logits = model(ids, pos, mask).transpose(0, 1).contiguous()  # [s, b, V_local]
        start = dist.get_rank() * logits.shape[-1] if tp > 1 else 0
        pad = torch.arange(start, start + logits.shape[-1]) >= REAL_VOCAB
        logits = logits.masked_fill(pad, float("-inf"))
        meg = -vocab_parallel_cross_entropy(logits, labels.transpose(0, 1).contiguous()).transpose(0, 1)
        with tbm.hidden_states_only(model):
            hidden = model(ids, pos, mask)
        again = tbm.linear_logp(model, hidden, labels, real_vocab_size=REAL_VOCAB)
    return float((again - meg).abs().max())


def worker(rank: int, tp: int, port: int) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=tp)
    try:
        from megatron.core import parallel_state
        cpu_patches()
        parallel_state.initialize_model_parallel(tp, 1)
        diff = step(tp)
        print(f"rank {rank}: max |logp - Megatron's| after one step = {diff:.2e}", flush=True)
        if diff > 1e-4:
            raise SystemExit(f"rank {rank}: logp differs from Megatron's by {diff}")
    finally:
        dist.destroy_process_group()


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tp", type=int, default=1)
    args = p.parse_args()
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    if args.tp == 1:
        worker(0, 1, port)
    else:
        import torch.multiprocessing as mp
        mp.spawn(worker, args=(args.tp, port), nprocs=args.tp, join=True)
    print("ok", flush=True)  # every rank's step matched Megatron's


if __name__ == "__main__":
    main()
