"""The one-line integrations against the trainers' own heads, one training step's loss and gradients:

  trl     a transformers Qwen3ForCausalLM (random init), model(..., labels, fused_lm_head=True).loss
          backward, with TRL's fused head (trl.trainer.utils.add_fused_lm_head: ChunkedLogProbFunction) and with
          ours (torch_bridge.integrations.trl.add_fused_lm_head); the second half of each sequence is
          scored (the completion), as GRPOTrainer scores it.
  tunix   Tunix's Qwen3 (flax nnx, random init), its registered GRPO policy loss and its gradient,
          jitted, with Tunix's compute_per_token_logps and with ours (rlk_xla.integrations.tunix).

Per path: the median step time of --steps timed steps after one warm-up, and the peak memory:
torch on CUDA the peak allocated beyond what was live before the step; torch on the CPU the peak
RSS growth of a fresh process over the model's (each path runs in its own process); JAX XLA's
compiled temp bytes of the step.

    python benchmarks/integrations.py                                  # CPU, the small shape below
    python benchmarks/integrations.py --device cuda --config qwen3-0.6b --batch 8 --seq 4096
"""
from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import time

CONFIGS = {  # layers, hidden, intermediate, heads, kv heads, head dim, vocab
    "small": (2, 256, 512, 4, 2, 64, 32768),
    "qwen3-0.6b": (28, 1024, 3072, 16, 8, 128, 151936),
}


def _rss_mb():
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def run_trl(args, head):
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM
    from trl.trainer.utils import add_fused_lm_head as trl_head

    from torch_bridge.integrations import trl as ours

    layers, hidden, inter, heads, kv, hd, vocab = CONFIGS[args.config]
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[args.dtype]
    cfg = Qwen3Config(vocab_size=vocab, hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
                      num_attention_heads=heads, num_key_value_heads=kv, head_dim=hd, tie_word_embeddings=False,
                      max_position_embeddings=args.seq)
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(cfg).to(device=args.device, dtype=dtype)
    (trl_head if head == "trl" else ours.add_fused_lm_head)(model, temperature=0.7)
    ids = torch.randint(0, vocab, (args.batch, args.seq), device=args.device)
    labels = ids.clone()
    labels[:, : args.seq // 2] = -100

    def step():
        model.zero_grad(set_to_none=True)
        model(input_ids=ids, labels=labels, fused_lm_head=True).loss.backward()
        if args.device == "cuda":
            torch.cuda.synchronize()

    base = _rss_mb()
    step()
    if args.device == "cuda":
        torch.cuda.reset_peak_memory_stats()
        live = torch.cuda.memory_allocated()
    times = []
    for _ in range(args.steps):
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    peak = (torch.cuda.max_memory_allocated() - live) / 2**20 if args.device == "cuda" else _rss_mb() - base
    return {"ms": 1e3 * statistics.median(times), "peak_mb": peak}


def run_tunix(args, head):
    import jax
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx
    from tunix.models.qwen3 import model as qwen3
    from tunix.rl import function_registry
    from tunix.rl.grpo.grpo_learner import GRPOConfig, TrainExample

    from rlk_xla.integrations.tunix import use_rlk

    layers, hidden, inter, heads, kv, hd, vocab = CONFIGS[args.config]
    dtype = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}[args.dtype]
    cfg = qwen3.ModelConfig(num_layers=layers, vocab_size=vocab, embed_dim=hidden, hidden_dim=inter, num_heads=heads,
                            head_dim=hd, num_kv_heads=kv, rope_theta=1_000_000, norm_eps=1e-6,
                            use_tied_embedding=False, dtype=dtype, param_dtype=dtype)
    graphdef, state = nnx.split(qwen3.Qwen3(cfg, rngs=nnx.Rngs(0)))
    rng = np.random.default_rng(0)
    half = args.seq // 2
    prompt = jnp.asarray(rng.integers(2, vocab, (args.batch, half)), jnp.int32)
    comp = jnp.asarray(rng.integers(2, vocab, (args.batch, args.seq - half)), jnp.int32)
    ex = TrainExample(prompt_ids=prompt, prompt_mask=prompt != 0, completion_ids=comp, completion_mask=comp != 0,
                      advantages=jnp.asarray(rng.standard_normal(args.batch), jnp.float32),
                      ref_per_token_logps=None, old_per_token_logps=None)
    algo = GRPOConfig(num_generations=2, beta=0.0)
    algo.temperature = 0.7
    loss_fn = function_registry.get_policy_loss_fn("grpo")
    f = lambda s: loss_fn(nnx.merge(graphdef, s), ex, algo_config=algo, pad_id=0, eos_id=1)[0]
    handle = use_rlk() if head == "rlk" else None
    step = jax.jit(jax.grad(f))
    temp = step.lower(state).compile().memory_analysis().temp_size_in_bytes
    jax.block_until_ready(step(state))
    times = []
    for _ in range(args.steps):
        t0 = time.perf_counter()
        jax.block_until_ready(step(state))
        times.append(time.perf_counter() - t0)
    if handle:
        handle.restore()
    return {"ms": 1e3 * statistics.median(times), "peak_mb": temp / 2**20}


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--config", default="small", choices=list(CONFIGS))
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--only", default=None, help="trainer:head, one path in this process (the driver's own use)")
    args = p.parse_args()
    if args.only:
        trainer, head = args.only.split(":")
        print(json.dumps((run_trl if trainer == "trl" else run_tunix)(args, head)))
        return
    rows = []
    argv = [a for a in sys.argv[1:]]
    for trainer, heads in (("trl", ("trl", "rlk")), ("tunix", ("tunix", "rlk"))):
        for head in heads:
            out = subprocess.run([sys.executable, __file__, *argv, "--only", f"{trainer}:{head}"], check=True,
                                 capture_output=True, text=True).stdout.strip().splitlines()[-1]
            rows.append((trainer, head, json.loads(out)))
            print(f"{trainer:6} {head:6} {rows[-1][2]['ms']:10.1f} ms {rows[-1][2]['peak_mb']:10.1f} MB", flush=True)
    what = "peak RSS growth (torch) / XLA temp bytes (JAX)" if args.device == "cpu" else "peak extra allocated / temp"
    print(f"\n| trainer | head | step ms | {what}, MB |\n|---|---|---|---|")
    for trainer, head, r in rows:
        print(f"| {trainer} | {head} | {r['ms']:.1f} | {r['peak_mb']:.1f} |")


if __name__ == "__main__":
    main()
