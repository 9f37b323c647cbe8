"""A rollout engine's decode loop against the trainer, end to end, with a Qwen3 causal LM built from
a config (random weights, nothing downloaded).

Rollout: prompts are prefilled into a KV cache, then one token per live sequence per step is
sampled from the native logits (padded vocab masked, temperature T) and scored from that step's
final hidden state with torch_bridge.integrations.rollout.score_sampled, the decode batch padded to a capture
size; sequences finish at different steps and leave the batch (and the cache). On the GPU the
scoring runs as one CUDA graph per capture size.
Trainer: one forward over the full sequences, linear_logp with gradients over the generated tokens.
dlogp_stats is reported twice, each beside the native logits + log_softmax on the same rows:
(a) on the rollout's own hidden states: ours must be bitwise equal on every token;
(b) on the trainer's recomputed hidden states: the honest figure of what the model body adds.
Run with -s to see the figures."""
import pytest

pytest.importorskip("torch", reason="torch is not installed: these tests need it")
transformers = pytest.importorskip("transformers", reason="transformers is not installed: this test needs it")

import dataclasses
import inspect

import torch

import _rlk_core
import torch_bridge
from torch_bridge.integrations import rollout
from torch_bridge.diagnostics import dlogp_stats


@dataclasses.dataclass(frozen=True)
class Setup:
    device: str
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    inter: int
    vocab: int            # the LM head's rows: the padded vocab, the same in engine and trainer
    real_vocab: int
    prompt: int
    gen_lengths: tuple    # generated tokens per sequence: they finish at different steps
    capture: tuple        # the engine's padded batch sizes
    temperature: float
    graphs: bool


CPU_TINY = Setup("cpu", layers=2, hidden=64, heads=4, kv_heads=2, inter=128, vocab=1024, real_vocab=1000, prompt=5,
                 gen_lengths=(3, 9, 1, 6, 9, 4), capture=(1, 2, 4, 8), temperature=0.8, graphs=False)
GPU_REAL = Setup("cuda", layers=28, hidden=1024, heads=16, kv_heads=8, inter=3072, vocab=151936, real_vocab=151643,
                 prompt=32, gen_lengths=tuple(8 + (37 * i) % 121 for i in range(64)),
                 capture=(1, 2, 4, 8, 16, 24, 32, 48, 64), temperature=0.9, graphs=True)


def build_model(s: Setup):
    torch.manual_seed(0)
    cfg = transformers.Qwen3Config(vocab_size=s.vocab, hidden_size=s.hidden, intermediate_size=s.inter,
                                   num_hidden_layers=s.layers, num_attention_heads=s.heads,
                                   num_key_value_heads=s.kv_heads, head_dim=s.hidden // s.heads,
                                   max_position_embeddings=s.prompt + max(s.gen_lengths) + 1,
                                   tie_word_embeddings=False, initializer_range=0.1)
    return transformers.Qwen3ForCausalLM(cfg).to(s.device, torch.bfloat16).eval()


class Scorer:
    """The engine's scoring of one decode step: the live rows copied into static buffers of the
    next capture size (padding rows keep whatever earlier steps left there), score_sampled into
    that size's ScoreBuffers, eagerly or by replaying its CUDA graph."""

    def __init__(self, s: Setup, weight):
        self.s, self.weight = s, weight
        self.static = {}
        for cap in s.capture:
            h = torch.zeros((cap, s.hidden), dtype=weight.dtype, device=s.device)
            ids = torch.full((cap,), rollout.PAD_ID, dtype=torch.int64, device=s.device)
            bufs = rollout.score_buffers(cap, weight, return_entropy=True)
            self.static[cap] = [h, ids, bufs, None]
            if s.graphs:
                self._call(cap)  # warm-up outside the graph
                torch.cuda.synchronize()
                g = torch.cuda.CUDAGraph()
                with torch.cuda.graph(g):
                    self._call(cap)
                self.static[cap][3] = g

    def _call(self, cap):
        h, ids, bufs, _ = self.static[cap]
        return rollout.score_sampled(h, self.weight, ids, temperature=self.s.temperature,
                                     real_vocab_size=self.s.real_vocab, return_entropy=True, out=bufs)

    def __call__(self, hidden, ids):
        n = hidden.shape[0]
        cap = min(c for c in self.s.capture if c >= n)
        h, static_ids, bufs, graph = self.static[cap]
        h[:n].copy_(hidden), static_ids[:n].copy_(ids)
        if graph is None:
            self._call(cap)
        else:
            graph.replay()
        return bufs.logp[:n].clone()


def native_logits(model, hidden, s: Setup):
    """The engine's own path: the LM head's logits (model dtype, then fp32), padded ids cut, / T."""
    return model.lm_head(hidden).float()[..., :s.real_vocab] / s.temperature


def native_logp(logits, ids):
    return logits.log_softmax(-1).gather(-1, ids.clamp(min=0).unsqueeze(-1)).squeeze(-1)


@torch.no_grad()
def _cache_kw(model):
    """The KV cache's keyword: `cache` from transformers 5.2x, `past_key_values` before."""
    return "cache" if "cache" in inspect.signature(model.model.forward).parameters else "past_key_values"


def run_rollout(model, s: Setup):
    """Returns prompts [B, P], per sequence its tokens, our logp, native logp and hidden rows."""
    gen = torch.Generator(device=s.device).manual_seed(1)
    b = len(s.gen_lengths)
    prompts = torch.randint(0, s.real_vocab, (b, s.prompt), generator=gen, device=s.device)
    scorer = Scorer(s, model.lm_head.weight)
    rec = {k: [[] for _ in range(b)] for k in ("tokens", "ours", "native", "hidden")}
    cache = transformers.DynamicCache()
    h = model.model(input_ids=prompts, **{_cache_kw(model): cache}, use_cache=True).last_hidden_state[:, -1]
    live = list(range(b))
    for step in range(max(s.gen_lengths)):
        logits = native_logits(model, h, s)
        ids = torch.multinomial(logits.softmax(-1), 1, generator=gen)[:, 0]
        ours, native = scorer(h, ids), native_logp(logits, ids)
        for row, seq in enumerate(live):
            for key, val in (("tokens", ids), ("ours", ours), ("native", native), ("hidden", h)):
                rec[key][seq].append(val[row])
        keep = [row for row, seq in enumerate(live) if s.gen_lengths[seq] > step + 1]
        if not keep:
            break
        if len(keep) < len(live):  # finished sequences leave the decode batch and the KV cache
            idx = torch.tensor(keep, device=s.device)
            cache.batch_select_indices(idx)
            ids, live = ids[idx], [live[row] for row in keep]
        h = model.model(input_ids=ids[:, None], **{_cache_kw(model): cache}, use_cache=True).last_hidden_state[:, -1]
    return prompts, rec


def padded(rows_per_seq, t, fill):
    """[B, T] (or [B, T, H]) from per-sequence lists of rows, `fill` past each sequence's end."""
    b = len(rows_per_seq)
    out = torch.full((b, t, *rows_per_seq[0][0].shape), fill, dtype=rows_per_seq[0][0].dtype,
                     device=rows_per_seq[0][0].device)
    for i, rows in enumerate(rows_per_seq):
        out[i, :len(rows)] = torch.stack(rows)
    return out


def train_and_compare(model, s: Setup, prompts, rec):
    t = max(s.gen_lengths)
    lengths = torch.tensor(s.gen_lengths, device=s.device)
    mask = torch.arange(t, device=s.device)[None, :] < lengths[:, None]
    targets = padded(rec["tokens"], t, rollout.PAD_ID)
    rollout_ours, rollout_native = padded(rec["ours"], t, 0.0), padded(rec["native"], t, 0.0)
    weight = model.lm_head.weight

    def trainer_logp(hidden):
        return torch_bridge.linear_logp(hidden, weight, targets, temperature=s.temperature,
                                        real_vocab_size=s.real_vocab, mode="strict")

    # (a) the rollout's own hidden rows, trained on as one [B, T] batch
    same = padded(rec["hidden"], t, 0.0).detach().requires_grad_()
    ours_a = trainer_logp(same)
    (ours_a * mask).sum().backward()
    assert same.grad is not None and torch.isfinite(same.grad).all()
    with torch.no_grad():
        native_a = native_logp(native_logits(model, same, s), targets)
    # (b) the trainer's recomputed hidden rows: one forward over prompt + generated tokens
    full = torch.cat([prompts, targets.clamp(min=0)], 1)
    attn = torch.cat([torch.ones_like(prompts, dtype=torch.bool), mask], 1).long()
    hidden_b = model.model(input_ids=full, attention_mask=attn).last_hidden_state[:, s.prompt - 1:-1]
    ours_b = trainer_logp(hidden_b)
    model.zero_grad(set_to_none=True)
    (ours_b * mask).sum().backward()
    assert model.lm_head.weight.grad is not None
    with torch.no_grad():
        native_b = native_logp(native_logits(model, hidden_b, s), targets)
    figures = {
        "same hidden, ours": dlogp_stats(ours_a, rollout_ours, mask),
        "same hidden, native": dlogp_stats(native_a, rollout_native, mask),
        "recomputed hidden, ours": dlogp_stats(ours_b, rollout_ours, mask),
        "recomputed hidden, native": dlogp_stats(native_b, rollout_native, mask),
    }
    print()
    for k, v in figures.items():
        print(f"[{s.device} decode] {k:26s} {v}")
    return figures, (rollout_ours - rollout_native).abs()[mask].max().item()


def check(s: Setup):
    model = build_model(s)
    prompts, rec = run_rollout(model, s)
    assert [len(x) for x in rec["tokens"]] == list(s.gen_lengths)
    assert all(int(tok) < s.real_vocab for seq in rec["tokens"] for tok in seq)
    figures, ours_vs_native = train_and_compare(model, s, prompts, rec)
    same = figures["same hidden, ours"]
    assert same.tokens == sum(s.gen_lengths)
    assert same.mismatches == 0 and same.bitwise_equal_frac == 1.0, same
    assert ours_vs_native < 0.1  # both score the sampled token (bf16 logits on the native side)
    recomputed = figures["recomputed hidden, ours"]
    assert recomputed.nonfinite == 0
    # the trainer recomputes the same sequences: a rollout that lost its KV cache shows here
    assert recomputed.mean_abs < 1.0, recomputed  # bf16 body: 0.09 on the H200; without context: 12


def test_cpu_decode_loop_rollout_equals_trainer():
    check(CPU_TINY)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (torch.cuda.is_available() is False)")
@pytest.mark.skipif(not _rlk_core.has_cuda, reason="this build of _rlk_core has no CUDA backend")
def test_gpu_decode_loop_under_cuda_graphs_rollout_equals_trainer():
    check(GPU_REAL)
