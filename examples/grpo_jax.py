"""The JAX twin of grpo_torch.py: GRPO on a flax nnx decoder, the same bands task (grpo_common).

    python examples/grpo_jax.py --steps 200 --out runs/jax

Each step:
- rollout: a jitted decode step per token over a fixed [n, prompt + completion] buffer (each step
  recomputes the causal forward; no KV cache), the token sampled at temperature T from the top-p
  nucleus and scored on the step's final hidden row with
  rlk_xla.rollout.score_sampled(keep_mask=nucleus) inside the jitted step;
- trainer: one forward over prompt + completion, rlk_xla.linear_logp(keep_mask=the rollout's
  nuclei) under jax.grad, GRPO's clipped loss with the rollout logp as the old policy and a k3 KL
  term to the initial policy (over the same nuclei), optax AdamW.
The JSON line per step has grpo_torch's keys: (a) the trainer's op on the rollout's hidden rows,
(b) the full recompute against the rollout, and with --drift-every the first layer (sown
intermediates) whose output differs between the decode step and the recompute at the same tokens.
"""
from __future__ import annotations

import os
import sys
import time
import zlib

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import grpo_common as G
import jax
import jax.numpy as jnp
import optax
from flax import nnx

import rlk_xla
from rlk_common.diagnostics import first_drift
from rlk_xla import rollout
from rlk_xla.diagnostics import dlogp_stats

# layers, hidden, heads, intermediate, padded vocab, real vocab
TINY = (2, 64, 4, 128, 256, 250)


def parse_args(argv=None):
    ap = G.loop_parser(__doc__)
    return ap.parse_args(argv)


class Block(nnx.Module):
    def __init__(self, d: int, heads: int, inter: int, rngs: nnx.Rngs):
        self.heads = heads
        self.norm1, self.norm2 = nnx.RMSNorm(d, rngs=rngs), nnx.RMSNorm(d, rngs=rngs)
        self.qkv = nnx.Linear(d, 3 * d, use_bias=False, rngs=rngs)
        self.o = nnx.Linear(d, d, use_bias=False, rngs=rngs)
        self.up = nnx.Linear(d, 2 * inter, use_bias=False, rngs=rngs)
        self.down = nnx.Linear(inter, d, use_bias=False, rngs=rngs)

    def __call__(self, x):
        b, n, d = x.shape
        q, k, v = (y.reshape(b, n, self.heads, d // self.heads) for y in jnp.split(self.qkv(self.norm1(x)), 3, -1))
        att = nnx.dot_product_attention(q, k, v, mask=jnp.tril(jnp.ones((n, n), bool)))
        x = x + self.o(att.reshape(b, n, d))
        gate, up = jnp.split(self.up(self.norm2(x)), 2, -1)
        x = x + self.down(jax.nn.silu(gate) * up)
        self.sow(nnx.Intermediate, "out", x)
        return x


class Decoder(nnx.Module):
    """Embedding, pre-norm blocks, final RMSNorm; an untied LM head [V, H] (padded vocab)."""

    def __init__(self, seed: int):
        layers, d, heads, inter, vocab, _ = TINY
        rngs = nnx.Rngs(seed)
        self.embed = nnx.Embed(vocab, d, rngs=rngs)
        self.blocks = nnx.List([Block(d, heads, inter, rngs) for _ in range(layers)])
        self.norm = nnx.RMSNorm(d, rngs=rngs)
        self.lm_head = nnx.Param(jax.random.normal(rngs.params(), (vocab, d)) * 0.02)

    def __call__(self, tokens):
        x = self.embed(tokens)
        for blk in self.blocks:
            x = blk(x)
        return self.norm(x)


def _value(sown):
    """A sown intermediate's array (a tuple of one call's value)."""
    v = sown.get_value() if hasattr(sown, "get_value") else sown
    return v[0] if isinstance(v, tuple) else v


def fingerprint(w) -> str:
    return f"{zlib.crc32(np.asarray(w).tobytes()):08x}"


def nucleus(z, top_p: float):
    """The top-p keep mask [n, V] of fp32 logits (-inf at padded ids): the smallest set of the most
    likely ids whose probability reaches top_p (ties at the boundary by sort order)."""
    order = jnp.argsort(-z, axis=-1, stable=True)
    p = jnp.take_along_axis(jax.nn.softmax(z, axis=-1), order, axis=-1)
    keep_sorted = jnp.cumsum(p, axis=-1) - p < top_p
    rows = jnp.arange(z.shape[0])[:, None]
    return jnp.zeros(z.shape, bool).at[rows, order].set(keep_sorted) & jnp.isfinite(z)


def run(args):
    _, _, _, _, vocab, real = TINY
    model = Decoder(args.seed)
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    ref_params = params
    tx = optax.adamw(args.lr, weight_decay=0.0)
    opt_state = tx.init(params)
    n, p, L, T = args.prompts * args.group, args.prompt_len, args.gen_len, args.temperature

    def forward(params, tokens):
        """(final hidden [n, len, H], the blocks' sown outputs {name: [n, len, H]})."""
        m = nnx.merge(graphdef, params, rest)
        h, inter = nnx.capture(m, nnx.Intermediate)(tokens)
        acts = {f"block{i}": _value(inter["blocks"][i]["out"]) for i in range(len(m.blocks))}
        return h, acts

    @jax.jit
    def decode_step(params, buf, i, key):
        """Sample and score the token at position p + i (one jitted step): ids, rollout logp, the
        nucleus, the hidden row, the blocks' outputs at that row."""
        h, acts = forward(params, buf)
        h_i = jax.lax.dynamic_index_in_dim(h, p - 1 + i, 1, keepdims=False)
        w = params["lm_head"].get_value()
        z = (h_i @ w.T).astype(jnp.float32) / T
        z = jnp.where(jnp.arange(vocab) < real, z, -jnp.inf)
        keep = nucleus(z, args.top_p)
        ids = jax.random.categorical(key, jnp.where(keep, z, -jnp.inf)).astype(jnp.int32)
        logp = rollout.score_sampled(h_i, w, ids, temperature=T, real_vocab_size=real, keep_mask=keep)
        acts_i = {k: jax.lax.dynamic_index_in_dim(a, p - 1 + i, 1, keepdims=False) for k, a in acts.items()}
        return ids, logp, keep, h_i, acts_i

    def trainer_logp(params, buf, keep, hidden=None):
        w = params["lm_head"].get_value()
        acts = {}
        if hidden is None:
            h, acts = forward(params, buf)
            hidden = h[:, p - 1:-1]
        return rlk_xla.linear_logp(hidden, w, buf[:, p:], temperature=T, real_vocab_size=real, mode="strict",
                                   keep_mask=keep), acts

    @jax.jit
    def update(params, opt_state, buf, keep, old, ref, adv):
        def loss_fn(params):
            logp, acts = trainer_logp(params, buf, keep)
            ratio = jnp.exp(logp - old)
            a = adv[:, None]
            surrogate = jnp.minimum(ratio * a, jnp.clip(ratio, 1 - args.clip, 1 + args.clip) * a)
            d = ref - logp
            kl = jnp.exp(d) - d - 1
            loss = jnp.mean(-surrogate + args.kl_coef * kl)
            return loss, (logp, acts, jnp.mean(jnp.abs(ratio - 1) > args.clip), jnp.mean(kl))
        (loss, aux), grads = jax.value_and_grad(loss_fn, has_aux=True)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss, aux

    ref_logp = jax.jit(lambda params, buf, keep: trainer_logp(params, buf, keep)[0])
    same_logp = jax.jit(lambda params, buf, keep, hidden: trainer_logp(params, buf, keep, hidden)[0])
    data = np.random.default_rng(args.seed + 2)
    key = jax.random.key(args.seed + 1)
    log = G.StepLog(args.out, vars(args))
    bar = G.Progress(args.steps, f"grpo_jax seed {args.seed}")
    rlk_xla.reset_route_stats()
    for step in range(args.steps):
        t0 = time.perf_counter()
        p_np = np.repeat(G.prompts(data, args.prompts, p, real), args.group, axis=0)
        buf = jnp.zeros((n, p + L), jnp.int32).at[:, :p].set(jnp.asarray(p_np, jnp.int32))
        fp_roll = fingerprint(params["lm_head"].get_value())
        logps, keeps, hids, dec_acts = [], [], [], []
        for i in range(L):
            key, sub = jax.random.split(key)
            ids, logp, keep, h_i, acts_i = decode_step(params, buf, i, sub)
            buf = buf.at[:, p + i].set(ids)
            logps.append(logp), keeps.append(keep), hids.append(h_i), dec_acts.append(acts_i)
        roll_logp, roll_keep, roll_hidden = jnp.stack(logps, 1), jnp.stack(keeps, 1), jnp.stack(hids, 1)
        comp = np.asarray(buf[:, p:])
        r = G.rewards(p_np, comp, real)
        adv = jnp.asarray(G.advantages(r, args.group), jnp.float32)
        fp_train = fingerprint(params["lm_head"].get_value())
        ref = ref_logp(ref_params, buf, roll_keep)
        same = same_logp(params, buf, roll_keep, roll_hidden)
        losses = []
        for epoch in range(args.epochs):
            new_params, opt_state, loss, (logp, acts, clipped, kl) = update(params, opt_state, buf, roll_keep, roll_logp, ref, adv)
            if epoch == 0:
                b_logp, train_acts, kl0 = logp, acts, float(kl)
            params = new_params
            losses.append(float(loss))
        a, b = dlogp_stats(same, roll_logp), dlogp_stats(b_logp, roll_logp)
        drift = None
        capture = args.drift_every and step % args.drift_every == 0
        if capture:  # the decode steps' rows against the recompute's, at the completion's positions
            dec = {k: np.stack([np.asarray(d[k]) for d in dec_acts], 1) for k in dec_acts[0]}
            drift = first_drift(dec, {k: np.asarray(v)[:, p - 1:-1] for k, v in train_acts.items()})
        row = {"step": step, "arm": "fused", "seed": args.seed, "tp": 1, "reward": float(r.mean()),
               "loss": losses[0], "loss_last": losses[-1], "clip_frac": float(clipped), "kl_ref": kl0,
               "fallback_total": int(rlk_xla.route_stats()["fallback_total"]),
               "fingerprint_rollout": fp_roll, "fingerprint_trainer": fp_train, "step_s": time.perf_counter() - t0,
               "a": a.as_dict(), "b": b.as_dict(), "drift": None if drift is None else drift.as_dict(),
               "drift_checked": bool(capture)}
        log.write(row)
        bar(step, reward=row["reward"], a=a.mismatches, b=b.mismatches, loss=row["loss"])
    log.close()
    if not args.no_plot:
        G.plot({"jax fused": G.load(log.path)}, os.path.join(args.out, "plot.png"))
    s = G.summary(G.load(log.path))
    print(f"grpo_jax: reward {s['reward_start']:.3f} -> {s['reward_end']:.3f}; (a) mismatch rate "
          f"{s['a']['mismatch_rate']:.3g}; (b) {s['b']['mismatch_rate']:.3g}; {s['step_s']:.3f} s/step", flush=True)
    return args.out


def main(argv=None):
    return run(parse_args(argv))


if __name__ == "__main__":
    main()
