"""rlk_xla.rollout.score_sampled: padded decode batches give bitwise the rows of one large trainer
linear_logp call (jit, TP 1 and vocab-parallel TP 2 under shard_map; bf16 and fp32; with and
without temperature and entropy), and a flax decoder's jax.lax decode loop scored per step equals
the trainer's linear_logp with gradients on the same hidden states (dlogp_stats also on the
trainer's recomputed hidden states, beside the native logits + log_softmax); a torch engine and a
JAX trainer agree to the bit. Run with -s to see the figures."""
import pytest

pytest.importorskip("jax", reason="jax is not installed: these tests need it")
pytest.importorskip("flax", reason="flax is not installed: the decode test needs it (scripts/test.sh installs it)")

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, PartitionSpec as P

import rlk_xla
from jax_helpers import make_inputs
from rlk_xla import rollout
from rlk_xla._compat import shard_map
from rlk_xla.diagnostics import dlogp_stats

LIVE = (1, 3, 8, 64, 256)
CAPTURE = (1, 4, 8, 64, 256)
H, V, REAL = 64, 1024, 1000
CASES = {"bf16": ("bfloat16", None, False, False),
         "bf16_temp_array_bias_entropy": ("bfloat16", "array", True, True),
         "f32_temp_bias_entropy": ("float32", "scalar", True, True)}


def _torch(torch, x, dtype=None):
    """A JAX array as a torch tensor of dtype (bfloat16 by default), through numpy."""
    dtype = torch.bfloat16 if dtype is None else dtype
    return torch.tensor(np.asarray(x, np.float32) if dtype.is_floating_point else np.asarray(x)).to(dtype)


def _bits(x):
    return np.asarray(x, np.float32).view(np.uint32)


def decode_batch(d, kw, live, seed):
    """`live` rows of the trainer's batch padded to their capture size with poisoned rows."""
    real = kw["real_vocab_size"]
    cap = min(c for c in CAPTURE if c >= live)
    rng = np.random.default_rng(seed)
    off = int(rng.integers(0, d["hidden"].shape[0] - live + 1))
    pad = cap - live
    junk = rng.standard_normal((pad, d["hidden"].shape[1])) * 1e4
    junk[:1, :1] = np.nan
    hidden = jnp.concatenate([d["hidden"][off:off + live], jnp.asarray(junk, d["hidden"].dtype)])
    pad_ids = np.where(rng.random(pad) < 0.5, rollout.PAD_ID, rng.integers(0, real, pad)).astype(np.int32)
    ids = jnp.concatenate([d["targets"][off:off + live], jnp.asarray(pad_ids)])
    t = kw.get("temperature", 1.0)
    if not isinstance(t, float):
        t = jnp.concatenate([t[off:off + live], jnp.asarray(rng.uniform(0.1, 5.0, pad), jnp.float32)])
    return hidden, ids, t, slice(off, off + live)


@functools.partial(jax.jit, static_argnames=("real", "entropy", "tp"))
def score(hidden, weight, ids, t, bias, *, real, entropy, tp):
    def f(h, w, i, t, b):
        return rollout.score_sampled(h, w, i, temperature=t, bias=b, real_vocab_size=real, return_entropy=entropy,
                                     axis_name="tp" if tp > 1 else None)
    if tp == 1:
        return f(hidden, weight, ids, t, bias)
    mesh = Mesh(np.array(jax.devices("cpu")[:tp]), ("tp",))
    out = (P(), P()) if entropy else P()
    return shard_map(f, mesh=mesh, in_specs=(P(), P("tp"), P(), P(), P() if bias is None else P("tp")),
                     out_specs=out)(hidden, weight, ids, t, bias)


def check_rows(name, rows, tps, h=H, v=V, real=REAL):
    dtype, temp, entropy, bias = CASES[name]
    d, kw, _, _ = make_inputs(7, rows, h, v, dtype, bias=bias, temp=temp, real_vocab=real)
    ref = rlk_xla.linear_logp(d["hidden"], d["weight"], d["targets"], return_entropy=True, mode="strict", **kw)
    for i, live in enumerate(LIVE):
        hidden, ids, t, rows = decode_batch(d, kw, live, seed=i)
        for tp in tps:
            out = score(hidden, d["weight"], ids, jnp.float32(t) if isinstance(t, float) else t, kw.get("bias"),
                        real=real, entropy=entropy, tp=tp)
            got = out if entropy else (out,)
            for g, r in zip(got, ref):
                assert np.array_equal(_bits(g[:live]), _bits(r[rows])), (name, live, tp)


def _has_gpu():
    try:
        return bool(jax.devices("gpu"))
    except RuntimeError:
        return False


GPU = [pytest.mark.gpu, pytest.mark.skipif(not _has_gpu(), reason="needs a GPU backend for jax "
                                                                  "(jax.devices('gpu') is empty)")]


@pytest.mark.parametrize("name", list(CASES))
def test_padded_decode_rows_equal_trainer_rows_tp1_and_tp2(name):
    check_rows(name, 16384, tps=(1, 2))


@pytest.mark.parametrize("name", [pytest.param(n, marks=GPU) for n in CASES])
def test_gpu_padded_decode_rows_equal_16384_trainer_rows(name):
    with jax.default_device(jax.devices("gpu")[0]):
        check_rows(name, 16384, tps=(1,), h=2048, v=151936, real=151643)


def test_torch_engine_and_jax_trainer_agree():
    """An engine in torch (torch_bridge.integrations.rollout) and a trainer in JAX (rlk_xla.linear_logp) on the
    same rows: the same compiled kernels, the same bits."""
    torch = pytest.importorskip("torch", reason="torch is not installed")
    from torch_bridge.integrations import rollout as torch_rollout
    d, kw, _, _ = make_inputs(3, 96, H, V, "bfloat16", bias=True, temp="array", real_vocab=REAL)
    ref = rlk_xla.linear_logp(d["hidden"], d["weight"], d["targets"], return_entropy=True, **kw)
    t = functools.partial(_torch, torch)
    got = torch_rollout.score_sampled(t(d["hidden"][:8]), t(d["weight"]), t(d["targets"][:8], torch.int64),
                                      temperature=t(kw["temperature"][:8], torch.float32), bias=t(kw["bias"]),
                                      real_vocab_size=REAL, return_entropy=True)
    for g, r in zip(got, ref):
        assert np.array_equal(g.numpy().view(np.uint32), _bits(r[:8]))


def test_arguments_are_checked():
    d, _, _, _ = make_inputs(0, 8, H, V, "float32")
    with pytest.raises(ValueError, match=r"hidden must be \[n, H\]"):
        rollout.score_sampled(d["hidden"].reshape(2, 4, H), d["weight"], d["targets"].reshape(2, 4))
    with pytest.raises(RuntimeError, match="needs the fused kernels"):
        rollout.score_sampled(d["hidden"].astype(jnp.float8_e4m3fn), d["weight"].astype(jnp.float8_e4m3fn),
                              d["targets"])


# ---- a flax decoder's decode loop ---------------------------------------------------------------

import flax.linen as nn  # noqa: E402

@dataclasses.dataclass(frozen=True)
class Setup:
    layers: int
    hidden: int
    heads: int
    vocab: int
    real_vocab: int
    prompt: int
    gen_lengths: tuple
    temperature: float


CPU_TINY = Setup(layers=2, hidden=64, heads=4, vocab=1024, real_vocab=1000, prompt=5, gen_lengths=(3, 9, 1, 6, 9, 4),
                 temperature=0.8)
GPU_REAL = Setup(layers=8, hidden=1024, heads=16, vocab=151936, real_vocab=151643, prompt=32,
                 gen_lengths=tuple(8 + (37 * i) % 57 for i in range(32)), temperature=0.9)


BF16 = dict(dtype=jnp.bfloat16, param_dtype=jnp.bfloat16)


class Block(nn.Module):
    heads: int

    @nn.compact
    def __call__(self, x):
        b, n, d = x.shape
        dense = functools.partial(nn.Dense, use_bias=False, **BF16)
        qkv = dense(3 * d)(nn.RMSNorm(**BF16)(x))
        q, k, v = (y.reshape(b, n, self.heads, d // self.heads) for y in jnp.split(qkv, 3, -1))
        causal = jnp.tril(jnp.ones((n, n), bool))
        x = x + dense(d)(nn.dot_product_attention(q, k, v, mask=causal).reshape(b, n, d))
        return x + dense(d)(jax.nn.silu(dense(4 * d)(nn.RMSNorm(**BF16)(x))))


class Decoder(nn.Module):
    """Embedding, pre-norm blocks, final RMSNorm and an untied LM head [V, H] (its `lm_head` param).
    Returns the final hidden states [B, L, H] (after the final norm)."""
    s: Setup

    @nn.compact
    def __call__(self, tokens):
        s = self.s
        self.param("lm_head", nn.initializers.normal(3.0 / np.sqrt(s.hidden)), (s.vocab, s.hidden), jnp.bfloat16)
        x = nn.Embed(s.vocab, s.hidden, **BF16)(tokens)
        for _ in range(s.layers):
            x = Block(s.heads)(x)
        return nn.RMSNorm(**BF16)(x)


def init_params(s: Setup, tokens):
    """Random weights drawn with numpy (compiling flax's initializers costs seconds on a CPU): norm
    scales 1, embeddings N(0, 1), kernels N(0, 1 / fan_in), the LM head N(0, 9 / H)."""
    rng = np.random.default_rng(0)

    def draw(path, x):
        name = jax.tree_util.keystr(path)
        if x.ndim == 1:
            return jnp.ones(x.shape, x.dtype)
        std = (3.0 / np.sqrt(s.hidden) if "lm_head" in name else 1.0 if "embedding" in name
               else 1.0 / np.sqrt(x.shape[0]))
        return jnp.asarray(rng.standard_normal(x.shape) * std, x.dtype)

    return jax.tree_util.tree_map_with_path(draw, jax.eval_shape(Decoder(s).init, jax.random.key(0), tokens))


def native_logp(hidden, w, ids, s: Setup):
    """The sampler's own path: bf16 logits, padded ids cut, fp32 / T, log_softmax, gather."""
    logits = (hidden @ w.T).astype(jnp.float32)[..., :s.real_vocab] / s.temperature
    return jnp.take_along_axis(jax.nn.log_softmax(logits), jnp.maximum(ids, 0)[..., None], -1)[..., 0], logits


@functools.partial(jax.jit, static_argnums=2)
def decode(params, prompts, s: Setup):
    """jax.lax decode loop (recompute per step over a fixed [B, P + T] buffer): sample, score.
    A finished sequence stays in the fixed-size batch as a padding row (id PAD_ID)."""
    b, t = prompts.shape[0], max(s.gen_lengths)
    lengths = jnp.asarray(s.gen_lengths)
    w = params["params"]["lm_head"]
    buf = jnp.zeros((b, s.prompt + t), jnp.int32).at[:, :s.prompt].set(prompts)
    rec = dict(ours=jnp.zeros((b, t)), native=jnp.zeros((b, t)), hidden=jnp.zeros((b, t, s.hidden), w.dtype))

    def step(i, carry):
        buf, rec, key = carry
        h = Decoder(s).apply(params, buf)[:, s.prompt - 1 + i]
        key, sub = jax.random.split(key)
        _, logits = native_logp(h, w, jnp.zeros((b,), jnp.int32), s)
        ids = jnp.where(i < lengths, jax.random.categorical(sub, logits).astype(jnp.int32), rollout.PAD_ID)
        ours = rollout.score_sampled(h, w, ids, temperature=s.temperature, real_vocab_size=s.real_vocab)
        native = native_logp(h, w, ids, s)[0]
        rec = dict(ours=rec["ours"].at[:, i].set(ours), native=rec["native"].at[:, i].set(native),
                   hidden=rec["hidden"].at[:, i].set(h))
        return buf.at[:, s.prompt + i].set(jnp.maximum(ids, 0)), rec, key

    buf, rec, _ = jax.lax.fori_loop(0, t, step, (buf, rec, jax.random.key(1)))
    return buf, rec


def check(s: Setup):
    b, t = len(s.gen_lengths), max(s.gen_lengths)
    prompts = jax.random.randint(jax.random.key(2), (b, s.prompt), 0, s.real_vocab, jnp.int32)
    params = init_params(s, prompts)
    buf, rec = decode(params, prompts, s)
    mask = np.arange(t)[None, :] < np.asarray(s.gen_lengths)[:, None]
    targets = jnp.where(mask, buf[:, s.prompt:], rollout.PAD_ID)
    assert int(jnp.max(jnp.where(mask, targets, 0))) < s.real_vocab

    def trainer_logp(hidden, w):
        return rlk_xla.linear_logp(hidden, w, targets, temperature=s.temperature, real_vocab_size=s.real_vocab,
                                   mode="strict")

    @jax.jit
    def trainer(hidden, w):  # linear_logp over one [B, T] batch, with gradients in hidden and the LM head
        (_, logp), grads = jax.value_and_grad(lambda h, w: (lambda lp: (jnp.sum(lp * mask), lp))(trainer_logp(h, w)),
                                              (0, 1), has_aux=True)(hidden, w)
        return logp, native_logp(hidden, w, targets, s)[0], grads

    w = params["params"]["lm_head"]
    ours_a, native_a, grads_a = trainer(rec["hidden"], w)  # (a) the sampler's own hidden rows
    recomputed = jax.jit(Decoder(s).apply)(params, buf)[:, s.prompt - 1:-1]  # (b) one full forward
    ours_b, native_b, grads_b = trainer(recomputed, w)
    assert all(bool(jnp.isfinite(g).all()) for g in jax.tree.leaves((grads_a, grads_b)))
    figures = {"same hidden, ours": dlogp_stats(ours_a, rec["ours"], mask),
               "same hidden, native": dlogp_stats(native_a, rec["native"], mask),
               "recomputed hidden, ours": dlogp_stats(ours_b, rec["ours"], mask),
               "recomputed hidden, native": dlogp_stats(native_b, rec["native"], mask)}
    print()
    for k, v in figures.items():
        print(f"[jax {jax.default_backend()} decode] {k:26s} {v}")
    same = figures["same hidden, ours"]
    assert same.tokens == sum(s.gen_lengths) and same.mismatches == 0 and same.bitwise_equal_frac == 1.0, same
    assert float(jnp.max(jnp.abs(rec["ours"] - rec["native"]) * mask)) < 0.1
    assert figures["recomputed hidden, ours"].nonfinite == 0


def test_cpu_flax_decode_loop_rollout_equals_trainer():
    check(CPU_TINY)


@pytest.mark.parametrize("setup", [pytest.param(GPU_REAL, marks=GPU)])
def test_gpu_flax_decode_loop_rollout_equals_trainer(setup):
    with jax.default_device(jax.devices("gpu")[0]):
        check(setup)


@functools.partial(jax.jit, static_argnames=("real", "tp", "as_ids"))
def score_nucleus(hidden, weight, ids, t, bias, keep, *, real, tp, as_ids):
    def f(h, w, i, t, b, k):
        nucleus = dict(keep_ids=k) if as_ids else dict(keep_mask=k)
        return rollout.score_sampled(h, w, i, temperature=t, bias=b, real_vocab_size=real, return_entropy=True,
                                     axis_name="tp" if tp > 1 else None, **nucleus)
    if tp == 1:
        return f(hidden, weight, ids, t, bias, keep)
    mesh = Mesh(np.array(jax.devices("cpu")[:tp]), ("tp",))
    return shard_map(f, mesh=mesh, in_specs=(P(), P("tp"), P(), P(), P("tp"), P() if as_ids else P(None, "tp")),
                     out_specs=(P(), P()))(hidden, weight, ids, t, bias, keep)


def test_nucleus_decode_rows_equal_trainer_rows():
    """The sampler's top-p nucleus, as a mask or as kept ids: padded decode rows (TP 1 and TP 2)
    give bitwise the trainer's linear_logp(keep_mask=) rows, a target outside the nucleus -inf and
    an empty nucleus NaN included; a torch engine scores the same bits."""
    rows, k = 256, 7
    d, kw, _, _ = make_inputs(5, rows, H, V, "bfloat16", bias=True, temp="array", real_vocab=REAL)
    rng = np.random.default_rng(0)
    kept = rng.integers(0, REAL, (rows, k))
    kept[:, 0] = np.asarray(d["targets"])  # the sampled id is in its nucleus ...
    kept[1, 0] = (int(d["targets"][1]) + 1) % REAL  # ... but row 1's (-inf)
    kept[2] = -1  # row 2 keeps nothing (NaN)
    kept[3, 3:] = -1  # ragged
    mask = np.zeros((rows, V), bool)
    for r in range(rows):
        mask[r, kept[r][kept[r] >= 0]] = True
    ref = rlk_xla.linear_logp(d["hidden"], d["weight"], d["targets"], return_entropy=True, mode="strict",
                              keep_mask=jnp.asarray(mask), **kw)
    assert np.isneginf(ref[0][1]) and np.isnan(ref[0][2])
    for i, live in enumerate((1, 3, 64)):
        hidden, ids, t, sl = decode_batch(d, kw, live, seed=i)
        cap = hidden.shape[0]
        pad_keep = rng.integers(-1, REAL, (cap - live, k))
        ids_k = jnp.asarray(np.concatenate([kept[sl], pad_keep]), jnp.int32)
        pad_mask = np.zeros((cap - live, V), bool)
        mask_k = jnp.asarray(np.concatenate([mask[sl], pad_mask]))
        for tp in (1, 2):
            for as_ids, keep in ((False, mask_k), (True, ids_k)):
                got = score_nucleus(hidden, d["weight"], ids, t, kw["bias"], keep, real=REAL, tp=tp, as_ids=as_ids)
                for g, r in zip(got, ref):
                    assert np.array_equal(_bits(g[:live]), _bits(r[sl])), (live, tp, as_ids)
    torch = pytest.importorskip("torch", reason="torch is not installed")
    from torch_bridge.integrations import rollout as torch_rollout
    t = functools.partial(_torch, torch)
    got = torch_rollout.score_sampled(t(d["hidden"][:8]), t(d["weight"]), t(d["targets"][:8], torch.int64),
                                      temperature=t(kw["temperature"][:8], torch.float32), bias=t(kw["bias"]),
                                      real_vocab_size=REAL, return_entropy=True, keep_mask=torch.tensor(mask[:8]))
    for g, r in zip(got, ref):
        assert np.array_equal(g.numpy().view(np.uint32), _bits(r[:8]))
