"""GRPO on the library, from rollout to update, with the train/rollout evidence at every step.

    python examples/grpo_torch.py --steps 200 --out runs/fused          # CPU, minutes
    python examples/grpo_torch.py --arm native --steps 200 --out runs/native
    python examples/grpo_torch.py --tp 2 --steps 200 --out runs/tp2     # trainer at TP 2 (gloo), rollout at TP 1
    python examples/grpo_torch.py --preset qwen3-0.6b --device cuda --dtype bfloat16 --graphs --out runs/gpu

A transformers Qwen3ForCausalLM from a small config (random init, untied head, the vocab padded
above real_vocab_size) learns the bands task (grpo_common). Each step:
- rollout: prompts prefilled into a KV cache, then one token per sequence per decode step, sampled
  at temperature T from the top-p nucleus; the sampled token scored on the decode step's hidden row
  with torch_bridge.integrations.rollout.score_sampled(keep_mask=nucleus) (arm fused; optionally as a CUDA graph)
  or by the engine's native head (logits, then log_softmax over the nucleus: arms native and mixed);
- trainer: one forward over prompt + completion, the completion's logp recomputed through
  torch_bridge.vime.provider with a vime-shaped request (context: hidden rows, LM head, vocab
  partition; the rollout's nucleus as log_prob_keep_mask; the rollout temperature), called as vime
  calls it (its native path only when the provider says it is unavailable), or vime's native path
  (arm native);
- update: GRPO's clipped policy-gradient loss with the rollout logp as the old policy and a k3 KL
  term to the initial policy, AdamW; --epochs passes over the batch (the first on-policy).
Every step writes one JSON line to OUT/steps.jsonl: reward, loss, clip fraction, KL to the initial
policy, fallback_total, step time, the LM head's fingerprint as the rollout and the trainer saw it,
and dlogp_stats twice (docs/rollout.md): (a) the trainer's op on the rollout's own hidden rows (the
head's share: 0 mismatches when both sides run the fused kernels), (b) the full recompute against
the rollout (what the model body adds); with --drift-every, the first layer whose output differs
between decode and the recompute (rlk_common.diagnostics.first_drift). OUT/plot.png at the end.
"""
from __future__ import annotations

import dataclasses
import inspect
import os
import sys
import time
import zlib
from types import SimpleNamespace

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import grpo_common as G

from rlk_common.diagnostics import CaptureLayers, first_drift
from torch_bridge.integrations import rollout, vime
from torch_bridge.diagnostics import dlogp_stats

ARMS = {  # arm: (rollout head, trainer head)
    "fused": ("fused", "fused"),
    "native": ("native", "native"),
    "mixed": ("native", "fused"),   # fused trainer against a native rollout
}
PRESETS = {  # name: (layers, hidden, heads, kv_heads, head_dim, intermediate, padded vocab, real vocab)
    "tiny": (2, 64, 4, 2, 16, 128, 256, 250),
    "qwen3-0.6b": (28, 1024, 16, 8, 128, 3072, 151936, 151643),
}


def parse_args(argv=None):
    ap = G.loop_parser(__doc__)
    ap.add_argument("--arm", choices=sorted(ARMS), default="fused")
    ap.add_argument("--preset", choices=sorted(PRESETS), default="tiny")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    ap.add_argument("--tp", type=int, default=1, help="the trainer's vocab-parallel degree (gloo processes)")
    ap.add_argument("--graphs", action="store_true", help="score the rollout as one CUDA graph (cuda only)")
    ap.add_argument("--threads", type=int, default=1, help="torch CPU threads (0: torch's default; one is "
                    "fastest for the tiny model on a shared machine)")
    return ap.parse_args(argv)


# ---- the model ------------------------------------------------------------------------------------

def build_model(args, seed):
    import transformers
    layers, hidden, heads, kv, head_dim, inter, vocab, _ = PRESETS[args.preset]
    torch.manual_seed(seed)
    cfg = transformers.Qwen3Config(vocab_size=vocab, hidden_size=hidden, intermediate_size=inter,
                                   num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv,
                                   head_dim=head_dim, max_position_embeddings=args.prompt_len + args.gen_len + 1,
                                   tie_word_embeddings=False)
    return transformers.Qwen3ForCausalLM(cfg).to(args.device, getattr(torch, args.dtype))


def cache_kw(model) -> str:
    """The KV cache's keyword: `cache` from transformers 5.2x, `past_key_values` before."""
    return "cache" if "cache" in inspect.signature(model.model.forward).parameters else "past_key_values"


def fingerprint(weight: torch.Tensor) -> str:
    """crc32 of the tensor's bytes: the weight version a side saw."""
    t = weight.detach().contiguous().cpu()
    return f"{zlib.crc32(t.view(torch.uint8).numpy().tobytes()):08x}"


# ---- the rollout ----------------------------------------------------------------------------------

def nucleus(logits: torch.Tensor, top_p: float) -> torch.Tensor:
    """The top-p keep mask [n, V] of fp32 logits (-inf at padded ids): the smallest set of the most
    likely ids whose probability reaches top_p (ties at the boundary by sort order)."""
    probs = logits.softmax(-1)
    p, order = probs.sort(-1, descending=True)
    before = p.cumsum(-1) - p
    keep_sorted = before < top_p
    keep = torch.zeros_like(keep_sorted).scatter_(-1, order, keep_sorted)
    return keep & torch.isfinite(logits)


def native_logits(model, hidden, real: int, temperature: float) -> torch.Tensor:
    """The engine's head: logits in the model dtype, then fp32 / T, padded ids at -inf."""
    z = model.lm_head(hidden).float() / temperature
    z[..., real:] = float("-inf")
    return z


def native_logp(logits, keep, ids):
    """log_softmax over the nucleus, at the ids (vime's native path with log_prob_keep_mask)."""
    return logits.masked_fill(~keep, float("-inf")).log_softmax(-1).gather(-1, ids[..., None])[..., 0]


class Scorer:
    """The engine's scoring of a decode step into static buffers (ScoreBuffers), eagerly or as a
    captured CUDA graph (one per batch size; the batch never shrinks in this task)."""

    def __init__(self, weight, rows: int, args, real: int, graphs: bool):
        dev, h = weight.device, weight.shape[1]
        self.weight, self.real, self.t = weight, real, args.temperature
        self.h = torch.zeros((rows, h), dtype=weight.dtype, device=dev)
        self.ids = torch.zeros((rows,), dtype=torch.int64, device=dev)
        self.keep = torch.ones((rows, weight.shape[0]), dtype=torch.bool, device=dev)
        self.bufs = rollout.score_buffers(rows, weight, nucleus=True)
        self.graph = None
        if graphs:
            self._call()
            torch.cuda.synchronize()
            self.graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(self.graph):
                self._call()

    def _call(self):
        rollout.score_sampled(self.h, self.weight, self.ids, temperature=self.t, real_vocab_size=self.real,
                              keep_mask=self.keep, out=self.bufs)

    def __call__(self, hidden, ids, keep):
        self.h.copy_(hidden), self.ids.copy_(ids), self.keep.copy_(keep)
        self._call() if self.graph is None else self.graph.replay()
        return self.bufs.logp.clone()


@torch.no_grad()
def sample(model, prompts, args, real, gen, scorer, head: str):
    """One rollout: completions [n, L], rollout logp [n, L] f32, the decode rows' hidden [n, L, H],
    the nuclei [n, L, V], the LM head's fingerprint as sampled from."""
    import transformers
    kw = {cache_kw(model): transformers.DynamicCache(), "use_cache": True}
    fp = fingerprint(model.lm_head.weight)
    toks, logps, hids, keeps = [], [], [], []
    h = model.model(input_ids=prompts, **kw).last_hidden_state[:, -1]
    for t in range(args.gen_len):
        z = native_logits(model, h, real, args.temperature)
        keep = nucleus(z, args.top_p)
        ids = torch.multinomial(z.masked_fill(~keep, float("-inf")).softmax(-1), 1, generator=gen)[:, 0]
        logp = scorer(h, ids, keep) if head == "fused" else native_logp(z, keep, ids)
        toks.append(ids), logps.append(logp), hids.append(h), keeps.append(keep)
        if t + 1 < args.gen_len:
            h = model.model(input_ids=ids[:, None], **kw).last_hidden_state[:, -1]
    return (torch.stack(toks, 1), torch.stack(logps, 1), torch.stack(hids, 1), torch.stack(keeps, 1), fp)


# ---- the trainer ----------------------------------------------------------------------------------

@dataclasses.dataclass
class TP:
    """The trainer's vocab-parallel layout: this rank's contiguous shard of the padded vocab."""
    group: object = None
    size: int = 1
    rank: int = 0

    def shard(self, x: torch.Tensor, dim: int = 0) -> torch.Tensor:
        v = x.shape[dim] // self.size
        return x.narrow(dim, self.rank * v, v)


def vime_request(hidden, weight, targets, keep, args, real: int, tp: TP):
    """A request shaped like vime's LinearLogpRequest (attributes only): flattened tokens, the
    output layer's context (this rank's LM-head shard), the nucleus shard, the rollout temperature."""
    v_local = weight.shape[0]
    return SimpleNamespace(
        logits=None, target_ids=targets.reshape(-1), tensor_parallel_group=tp.group,
        token_layout=SimpleNamespace(world_size=1, rank=0, layout="single"), with_entropy=False,
        with_entropy_grad=False, chunk_size=-1, log_prob_keep_mask=tp.shard(keep, -1).reshape(-1, v_local),
        temperature=args.temperature, metadata={"logits_are_temperature_scaled": True},
        context=SimpleNamespace(hidden=hidden.reshape(-1, hidden.shape[-1]),
                                projection=SimpleNamespace(weight=weight, bias=None),
                                vocab_partition=SimpleNamespace(local_start=tp.rank * v_local, local_size=v_local,
                                                                real_size=real, padded_size=v_local * tp.size)))


class Trainer:
    """The trainer's logp of the completion tokens through the head of its arm."""

    def __init__(self, head: str, args, real: int, tp: TP):
        self.head, self.args, self.real, self.tp = head, args, real, tp
        self.fallbacks = 0

    def logp(self, model, hidden, targets, keep):
        """[n, L] f32, differentiable in the model."""
        if self.head == "native":
            return native_logp(native_logits(model, hidden, self.real, self.args.temperature), keep, targets)
        weight = self.tp.shard(model.lm_head.weight)
        req = vime_request(hidden, weight, targets, keep, self.args, self.real, self.tp)
        try:  # as vime calls its provider: its native path only on the provider's unavailability marker
            res = vime.provider(req)
        except Exception as e:
            if not getattr(e, "linear_logp_provider_unavailable", False):
                raise
            self.fallbacks += 1
            if self.tp.size > 1:
                raise RuntimeError(f"provider unavailable under TP (vime's native path needs the logits): {e}")
            return native_logp(native_logits(model, hidden, self.real, self.args.temperature), keep, targets)
        return res.logp.reshape(targets.shape)


def body(model, prompts, completions):
    """The trainer's forward over prompt + completion: the hidden rows that predict each completion
    token, [n, L, H]."""
    full = torch.cat([prompts, completions], 1)
    p = prompts.shape[1]
    return model.model(input_ids=full).last_hidden_state[:, p - 1:-1]


def grpo_loss(logp, old, ref, adv, clip: float, kl_coef: float):
    """(loss, clip fraction, KL to the reference): token-mean clipped surrogate + kl_coef * k3."""
    ratio = torch.exp(logp - old)
    a = adv[:, None]
    surrogate = torch.minimum(ratio * a, ratio.clamp(1 - clip, 1 + clip) * a)
    d = ref - logp
    kl = torch.exp(d) - d - 1
    loss = (-surrogate + kl_coef * kl).mean()
    clipped = ((ratio - 1).abs() > clip).float().mean()
    return loss, float(clipped), float(kl.detach().mean())


class Optimizer:
    """AdamW on the model's parameters; for 16-bit models on fp32 main copies (as Megatron's
    bf16 training keeps them): the gradients are read in fp32, the step taken on the copies and
    the result rounded into the model's parameters."""

    def __init__(self, model, lr: float):
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.main = None
        if any(p.dtype != torch.float32 for p in self.params):
            self.main = [p.detach().float().requires_grad_() for p in self.params]
        self.opt = torch.optim.AdamW(self.main or self.params, lr=lr, weight_decay=0.0)

    @torch.no_grad()
    def step(self) -> None:
        if self.main is not None:
            for m, p in zip(self.main, self.params):
                m.grad = None if p.grad is None else p.grad.float()
        self.opt.step()
        if self.main is not None:
            for m, p in zip(self.main, self.params):
                p.copy_(m)


def drift_layers(model) -> dict:
    """The modules whose outputs the drift capture compares, in forward order: the embedding, per
    decoder layer its attention, its MLP and its output, the final norm."""
    mods = {"embed": model.model.embed_tokens}
    for i, layer in enumerate(model.model.layers):
        mods.update({f"layer{i}.attn": layer.self_attn, f"layer{i}.mlp": layer.mlp, f"layer{i}": layer})
    mods["norm"] = model.model.norm
    return mods


# ---- the loop -------------------------------------------------------------------------------------

def run(args, tp: TP | None = None):
    tp = tp or TP()
    if args.threads:
        torch.set_num_threads(args.threads)
    roll_head, train_head = ARMS[args.arm]
    real = PRESETS[args.preset][7]
    model = build_model(args, args.seed)
    ref_model = build_model(args, args.seed).requires_grad_(False)
    opt = Optimizer(model, args.lr)
    gen = torch.Generator(device=args.device).manual_seed(args.seed + 1)
    data = np.random.default_rng(args.seed + 2)
    n = args.prompts * args.group
    scorer = Scorer(model.lm_head.weight, n, args, real, args.graphs) if roll_head == "fused" else None
    trainer = Trainer(train_head, args, real, tp)
    lead = tp.rank == 0
    log = G.StepLog(args.out, vars(args)) if lead else None
    bar = G.Progress(args.steps, f"grpo_torch {args.arm} seed {args.seed}" + (f" tp {tp.size}" if tp.size > 1 else ""))
    vime.reset_stats()
    for step in range(args.steps):
        t0 = time.perf_counter()
        p_np = np.repeat(G.prompts(data, args.prompts, args.prompt_len, real), args.group, axis=0)
        prompts = torch.tensor(p_np, device=args.device)
        capture = args.drift_every and step % args.drift_every == 0
        model.eval()
        with CaptureLayers(drift_layers(model) if capture else {}) as dec:
            comp, roll_logp, roll_hidden, keep, fp_roll = sample(model, prompts, args, real, gen, scorer, roll_head)
        if tp.size > 1:  # one rollout (rank 0's) for every trainer rank
            for t in (comp, roll_logp, roll_hidden, keep):
                torch.distributed.broadcast(t, 0, group=tp.group)
        r = G.rewards(p_np, comp.cpu().numpy(), real)
        adv = torch.tensor(G.advantages(r, args.group), dtype=torch.float32, device=args.device)
        model.train()
        fp_train = fingerprint(model.lm_head.weight)
        with torch.no_grad():
            ref = trainer.logp(ref_model, body(ref_model, prompts, comp), comp, keep)
            same = trainer.logp(model, roll_hidden, comp, keep)  # (a): the trainer's head on the rollout's rows
        losses, clips, kls = [], [], []
        for epoch in range(args.epochs):
            with CaptureLayers(drift_layers(model) if capture and epoch == 0 else {}) as tr:
                hidden = body(model, prompts, comp)
            logp = trainer.logp(model, hidden, comp, keep)
            if epoch == 0:
                b_logp, train_acts = logp.detach(), {k: v[0][:, :-1] for k, v in tr.calls.items() if v}
            loss, clipped, kl = grpo_loss(logp, roll_logp, ref, adv, args.clip, args.kl_coef)
            model.zero_grad(set_to_none=True)
            loss.backward()
            if tp.size > 1:  # each rank's head gradient covers its vocab shard only
                torch.distributed.all_reduce(model.lm_head.weight.grad, group=tp.group)
            opt.step()
            losses.append(float(loss.detach())), clips.append(clipped), kls.append(kl)
        a = dlogp_stats(same, roll_logp)
        b = dlogp_stats(b_logp, roll_logp)
        drift = None
        if capture:
            drift = first_drift(dec.joined(1), train_acts)
        stats = vime.stats()
        row = {"step": step, "arm": args.arm, "seed": args.seed, "tp": tp.size, "reward": float(r.mean()),
               "loss": losses[0], "loss_last": losses[-1], "clip_frac": clips[-1], "kl_ref": kls[0],
               "fallback_total": int(stats["fallback_total"]) + trainer.fallbacks,
               "fingerprint_rollout": fp_roll, "fingerprint_trainer": fp_train,
               "step_s": time.perf_counter() - t0, "a": a.as_dict(), "b": b.as_dict(),
               "drift": None if drift is None else drift.as_dict(), "drift_checked": bool(capture)}
        if tp.size > 1:
            fps = [None] * tp.size
            torch.distributed.all_gather_object(fps, fingerprint(model.lm_head.weight), group=tp.group)
            row["replicas_equal"] = len(set(fps)) == 1
        if lead:
            log.write(row)
            bar(step, reward=row["reward"], a=a.mismatches, b=b.mismatches, loss=row["loss"])
    if lead:
        log.close()
        if not args.no_plot:
            G.plot({args.arm: G.load(log.path)}, os.path.join(args.out, "plot.png"))
        s = G.summary(G.load(log.path))
        print(f"grpo_torch {args.arm}: reward {s['reward_start']:.3f} -> {s['reward_end']:.3f}; (a) mismatch rate "
              f"{s['a']['mismatch_rate']:.3g}; (b) {s['b']['mismatch_rate']:.3g}; {s['step_s']:.3f} s/step",
              flush=True)
    return args.out


def _tp_worker(rank, args, port):
    """One trainer rank: gloo on the CPU; on CUDA one GPU per rank and NCCL."""
    import torch.distributed as dist
    backend = "gloo"
    if args.device.startswith("cuda"):
        torch.cuda.set_device(rank)
        args.device, backend = f"cuda:{rank}", "nccl"
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=args.tp)
    try:
        run(args, TP(group=dist.group.WORLD, size=args.tp, rank=rank))
    finally:
        dist.destroy_process_group()


def main(argv=None):
    args = parse_args(argv)
    if args.graphs and args.device != "cuda":
        raise SystemExit("--graphs needs --device cuda")
    if args.tp == 1:
        return run(args)
    if args.arm == "native":
        raise SystemExit("--tp > 1 runs the trainer's head through the provider: arms fused or mixed")
    import socket

    import torch.multiprocessing as mp
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_tp_worker, args=(args, port), nprocs=args.tp, join=True)
    return args.out


if __name__ == "__main__":
    main()
