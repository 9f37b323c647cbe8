"""The rollout tests' shared pieces (test_rollout_torch.py, test_torch_tp.py): a trainer batch, a decode
batch made of some of its rows padded to a capture size, score_sampled on it and the trainer's
linear_logp on the whole batch."""
import numpy as np
import torch

import torch_bridge
from torch_bridge.integrations import rollout
from torch_helpers import make_inputs

LIVE = (1, 3, 8, 64, 256)
CAPTURE = (1, 4, 8, 64, 256)  # the engine's capture sizes: each live batch is padded to the next one
H, V, REAL = 64, 1024, 1000   # the vocab padded to 1024 (engine and trainer alike), 1000 real ids
# name: (dtype, temperature, entropy, bias)
CASES = {"bf16": ("bfloat16", None, False, False),
         "bf16_temp_entropy": ("bfloat16", "scalar", True, False),
         "bf16_temp_array_bias_entropy": ("bfloat16", "array", True, True),
         "f32": ("float32", None, False, False),
         "f32_temp_bias_entropy": ("float32", "scalar", True, True),
         "f32_temp_array": ("float32", "array", False, False)}


def capture_size(live):
    return min(c for c in CAPTURE if c >= live)


def same_bits(a, b):
    return a.shape == b.shape and torch.equal(a.contiguous().view(torch.int32), b.contiguous().view(torch.int32))


def trainer_inputs(name, rows, device="cpu", h=H, v=V, real=REAL):
    """The trainer's batch of `rows` tokens: inputs and options as linear_logp takes them."""
    dtype, temp, _, bias = CASES[name]
    d, kw, _, _ = make_inputs(7, rows, h, v, dtype, bias=bias, temp=temp, real_vocab=real, device=device)
    return d, kw


def decode_batch(d, kw, live, seed):
    """`live` rows of the trainer's batch (from a seed-chosen offset) padded to their capture size:
    padding rows get huge or NaN hidden values, padding or real ids and their own temperature."""
    cap = capture_size(live)
    rng = np.random.default_rng(seed)
    off = int(rng.integers(0, d["hidden"].shape[0] - live + 1))
    rows = slice(off, off + live)
    pad = cap - live
    dev, dt = d["hidden"].device, d["hidden"].dtype
    junk = torch.tensor(rng.standard_normal((pad, d["hidden"].shape[1])) * 1e4, dtype=dt, device=dev)
    if pad:
        junk[0, 0] = float("nan")
    hidden = torch.cat([d["hidden"][rows], junk])
    real = kw["real_vocab_size"]
    pad_ids = torch.tensor(np.where(rng.random(pad) < 0.5, rollout.PAD_ID, rng.integers(0, real, pad)), device=dev)
    ids = torch.cat([d["targets"][rows], pad_ids])
    t = kw.get("temperature")
    if isinstance(t, torch.Tensor):
        t = torch.cat([t[rows], torch.tensor(rng.uniform(0.1, 5.0, pad), dtype=t.dtype, device=dev)])
    return hidden, ids, t, rows


def score(name, d, kw, live, seed, *, tp_group=None, rank=0, world=1):
    """score_sampled on the padded decode batch through fresh buffers for its capture size, with
    this rank's vocab shard: (logp, entropy or None) of the live rows, and the trainer's row slice."""
    _, _, with_entropy, _ = CASES[name]
    hidden, ids, t, rows = decode_batch(d, kw, live, seed)
    v_local = d["weight"].shape[0] // world
    shard = slice(rank * v_local, (rank + 1) * v_local)
    weight = d["weight"][shard].contiguous()
    bias = kw["bias"][shard].contiguous() if "bias" in kw else None
    bufs = rollout.score_buffers(hidden.shape[0], weight, bias=bias, tp_group=tp_group, return_entropy=with_entropy)
    out = rollout.score_sampled(hidden, weight, ids, temperature=1.0 if t is None else t, bias=bias,
                                tp_group=tp_group, real_vocab_size=kw["real_vocab_size"], return_entropy=with_entropy,
                                out=bufs)
    logp, ent = out if with_entropy else (out, None)
    assert logp.data_ptr() == bufs.logp.data_ptr()
    return logp[:live].clone(), None if ent is None else ent[:live].clone(), rows


def trainer(name, d, kw):
    """The trainer's linear_logp over the whole batch, with gradients."""
    _, _, with_entropy, _ = CASES[name]
    h = d["hidden"].clone().requires_grad_()
    out = torch_bridge.linear_logp(h, d["weight"], d["targets"], return_entropy=with_entropy, mode="strict", **kw)
    logp, ent = out if with_entropy else (out, None)
    (logp.sum() + (0 if ent is None else ent.sum())).backward()
    assert h.grad is not None
    return logp.detach(), None if ent is None else ent.detach()


def assert_rows_equal(name, got, ref, live, prefix=""):
    logp, ent, rows = got
    assert same_bits(logp, ref[0][rows]), f"{prefix}{name} live={live}: logp differs from the trainer's rows"
    if ent is not None:
        assert same_bits(ent, ref[1][rows]), f"{prefix}{name} live={live}: entropy differs"
