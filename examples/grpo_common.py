"""What both GRPO examples (grpo_torch.py, grpo_jax.py) share, framework-neutral (numpy only): the toy
task and its reward, group advantages, the per-step JSON line, a progress line that stays plain in a
log, the per-run plot and the report over several runs (table + PNG for docs/rl_loop.md).

The task ("bands"): the real vocab is cut into BANDS equal bands; a prompt's first token k in
[0, BANDS) names band k; the reward of a completion is the fraction of its tokens inside band k. A
policy that ignores the prompt scores 1 / BANDS on average, so a reward above that is learned
conditioning on the prompt, which a 2-layer model picks up in a few hundred steps.
"""
from __future__ import annotations

import json
import math
import os
import sys
import time

import numpy as np

BANDS = 4


def loop_parser(doc: str):
    """The arguments both GRPO examples take (the run, the task, the GRPO step); each adds its own."""
    import argparse
    ap = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--out", required=True)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--prompts", type=int, default=8, help="prompts per step")
    ap.add_argument("--group", type=int, default=8, help="completions per prompt")
    ap.add_argument("--prompt-len", type=int, default=4)
    ap.add_argument("--gen-len", type=int, default=8)
    ap.add_argument("--temperature", type=float, default=0.9)
    ap.add_argument("--top-p", type=float, default=0.95)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--clip", type=float, default=0.2)
    ap.add_argument("--kl-coef", type=float, default=0.02)
    ap.add_argument("--epochs", type=int, default=2, help="passes over each step's batch (the first on-policy)")
    ap.add_argument("--drift-every", type=int, default=50, help="capture the layers every N steps (0: never)")
    ap.add_argument("--no-plot", action="store_true")
    return ap


def prompts(rng: np.random.Generator, n: int, length: int, real_vocab: int) -> np.ndarray:
    """[n, length] int64: the band id, then random real ids."""
    out = rng.integers(0, real_vocab, size=(n, length))
    out[:, 0] = rng.integers(0, BANDS, size=n)
    return out


def rewards(prompt: np.ndarray, completion: np.ndarray, real_vocab: int) -> np.ndarray:
    """[n] f64: the fraction of each completion's tokens in the band its prompt names."""
    band = real_vocab // BANDS
    want = prompt[:, :1]
    return ((completion // band == want) & (completion < band * BANDS)).mean(axis=1)


def advantages(r: np.ndarray, group: int) -> np.ndarray:
    """GRPO's group-normalized advantage per completion: (r - group mean) / (group std + 1e-4)."""
    g = r.reshape(-1, group)
    return ((g - g.mean(1, keepdims=True)) / (g.std(1, keepdims=True) + 1e-4)).reshape(-1)


class Progress:
    """One plain line every `every` steps (no carriage returns: it reads the same in a log)."""

    def __init__(self, total: int, label: str, lines: int = 20):
        self.total, self.label, self.every = total, label, max(1, total // lines)
        self.t0 = time.perf_counter()

    def __call__(self, step: int, **figures) -> None:
        done = step + 1
        if done % self.every and done != self.total:
            return
        width = 20
        bar = "#" * (width * done // self.total) + "-" * (width - width * done // self.total)
        rate = (time.perf_counter() - self.t0) / done
        text = " ".join(f"{k} {v:.3g}" if isinstance(v, float) else f"{k} {v}" for k, v in figures.items())
        print(f"{self.label} [{bar}] {done}/{self.total} {text} ({rate:.2f} s/step, "
              f"eta {rate * (self.total - done):.0f} s)", flush=True)


class StepLog:
    """DIR/steps.jsonl, one JSON object per step (and DIR/run.json: the run's arguments)."""

    def __init__(self, out: str, args: dict):
        os.makedirs(out, exist_ok=True)
        self.path = os.path.join(out, "steps.jsonl")
        with open(os.path.join(out, "run.json"), "w") as f:
            json.dump({**args, "argv": sys.argv}, f, indent=1)
        self.f = open(self.path, "w")

    def write(self, row: dict) -> None:
        self.f.write(json.dumps(row, allow_nan=True) + "\n")
        self.f.flush()

    def close(self) -> None:
        self.f.close()


def load(path: str) -> list[dict]:
    if os.path.isdir(path):
        path = os.path.join(path, "steps.jsonl")
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def check_short_run(rows: list[dict], *, head_aligned: bool = True) -> None:
    """The CI short run's assertions: AssertionError naming the first failing step."""
    for r in rows:
        s = r["step"]
        assert math.isfinite(r["loss"]), f"step {s}: loss {r['loss']}"
        assert r["fallback_total"] == 0, f"step {s}: fallback_total {r['fallback_total']}"
        assert r["fingerprint_rollout"] == r["fingerprint_trainer"], f"step {s}: the trainer saw other weights"
        if head_aligned:
            assert r["a"]["rlk_dlogp_mismatches"] == 0, f"step {s}: (a) {r['a']['rlk_dlogp_mismatches']} mismatches"


def summary(rows: list[dict], first: int = 20, last: int = 20) -> dict:
    """One run's figures for the table: reward at the start and the end (means of `first` / `last`
    steps), (a) and (b) over all steps, step time."""
    def col(key, part=None):
        return np.array([(r[part][key] if part else r[key]) for r in rows], dtype=np.float64)

    out = {"steps": len(rows), "reward_start": float(col("reward")[:first].mean()),
           "reward_end": float(col("reward")[-last:].mean()),
           "step_s": float(np.median(col("step_s"))),
           "fallback_total": int(rows[-1]["fallback_total"]),  # counted since the run's start
           "fingerprints_equal": all(r["fingerprint_rollout"] == r["fingerprint_trainer"] for r in rows),
           "loss_finite": bool(np.isfinite(col("loss")).all())}
    for part in ("a", "b"):
        tok = col("rlk_dlogp_tokens", part)
        mism = col("rlk_dlogp_mismatches", part)
        out[part] = {"mismatch_rate": float(mism.sum() / tok.sum()), "steps_with_mismatch": int((mism > 0).sum()),
                     "mean_abs": float((col("rlk_dlogp_mean_abs", part) * tok).sum() / tok.sum()),
                     "max_abs": float(col("rlk_dlogp_max_abs", part).max()),
                     "approx_kl": float((col("rlk_dlogp_approx_kl", part) * tok).sum() / tok.sum())}
    drift = [r for r in rows if r.get("drift")]
    checked = sum(bool(r.get("drift_checked")) for r in rows)
    out["first_drift"] = f"{drift[0]['drift']['layer']} (step {drift[0]['step']})" if drift else None
    out["drift_steps"] = f"{len(drift)} of {checked}"
    return out


def plot(runs: dict, path: str) -> bool:
    """reward and (a) / (b) mismatches per step, one line per run ({label: rows}); False without
    matplotlib."""
    try:
        import matplotlib
    except ImportError:
        print("grpo: matplotlib is not installed, no plot", flush=True)
        return False
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(1, 3, figsize=(15, 4))
    colors: dict = {}
    for label, rows in runs.items():
        arm = label.rsplit(" s", 1)[0]  # a run's seeds share their arm's color
        color = colors.setdefault(arm, f"C{len(colors)}")
        kw = dict(color=color, lw=1, alpha=0.8, label=label)
        steps = [r["step"] for r in rows]
        rw = np.cumsum([r["reward"] for r in rows])
        k = 10
        trailing = (rw - np.concatenate([np.zeros(k), rw])[:len(rw)]) / np.minimum(np.arange(1, len(rw) + 1), k)
        ax[0].plot(steps, trailing, **kw)
        ax[1].plot(steps, [r["a"]["rlk_dlogp_mismatches"] for r in rows], **kw)
        ax[2].plot(steps, [r["b"]["rlk_dlogp_mismatches"] for r in rows], **kw)
    ax[0].axhline(1 / BANDS, color="gray", ls=":", lw=1)
    for a, title in zip(ax, ("reward (trailing 10-step mean; dotted: a prompt-blind policy)",
                             "(a) mismatches per step: the head alone", "(b) mismatches per step: full recompute")):
        a.set_title(title, fontsize=9)
        a.set_xlabel("step")
    ax[0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True
