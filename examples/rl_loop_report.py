"""The table and the plot of several GRPO runs (grpo_torch.py / grpo_jax.py output folders).

    python examples/rl_loop_report.py runs/fused_s0 runs/native_s0 ... --png docs/rl_loop.png

Prints a markdown table (one row per run: reward at the start and the end, (a) and (b) apart with
the seed's columns: mismatch rate, mean and max |dlogp|, approx KL; step time, fallbacks, weight
fingerprints, the first drifting layer) and the per-arm means, and writes the PNG: reward and
mismatches per step per run.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import grpo_common as G


def label(run_dir: str) -> str:
    with open(os.path.join(run_dir, "run.json")) as f:
        a = json.load(f)
    frontend = "jax" if "grpo_jax" in " ".join(a.get("argv", [])) else "torch"
    tp = a.get("tp", 1)
    extra = [x for x in (a.get("preset", "tiny"), a.get("dtype", "float32")) if x not in ("tiny", "float32")]
    extra += [f"tp{tp}"] if tp > 1 else []
    return " ".join([frontend, a.get("arm", "fused"), *extra, f"s{a['seed']}"])


def table(runs: dict) -> str:
    cols = ["run", "reward first 20 -> last 20", "(a) mismatch rate", "(a) mean / max \\|dlogp\\|", "(a) KL",
            "(b) mismatch rate", "(b) mean / max \\|dlogp\\|", "(b) KL", "step s", "fallbacks", "fingerprints equal",
            "first drift", "steps drifting / captured"]
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for name, rows in runs.items():
        s = G.summary(rows)
        a, b = s["a"], s["b"]
        lines.append(f"| {name} | {s['reward_start']:.3f} -> {s['reward_end']:.3f} | {a['mismatch_rate']:.3g} | "
                     f"{a['mean_abs']:.2e} / {a['max_abs']:.2e} | {a['approx_kl']:.1e} | {b['mismatch_rate']:.3g} | "
                     f"{b['mean_abs']:.2e} / {b['max_abs']:.2e} | {b['approx_kl']:.1e} | {s['step_s']:.3f} | "
                     f"{s['fallback_total']} | {'yes' if s['fingerprints_equal'] else 'NO'} | "
                     f"{s['first_drift'] or 'none'} | {s['drift_steps']} |")
    return "\n".join(lines)


def trailing(x: np.ndarray, k: int = 10) -> np.ndarray:
    c = np.cumsum(x)
    return (c - np.concatenate([np.zeros(k), c])[:len(c)]) / np.minimum(np.arange(1, len(c) + 1), k)


def spread(runs: dict) -> str:
    """Per arm over its seeds: the final reward (mean of the last 20 steps) and its range; for two arms
    with several seeds, how far apart their seed-mean reward curves (trailing 10-step means) get,
    against the range of each arm's seeds at the same step."""
    arms: dict = {}
    for name, rows in runs.items():
        arms.setdefault(name.rsplit(" s", 1)[0], []).append(trailing(np.array([r["reward"] for r in rows])))
    out = []
    for arm, curves in arms.items():
        ends = [c[-20:].mean() for c in curves]
        out.append(f"- {arm}: {len(curves)} seed(s), final reward {np.mean(ends):.3f} "
                   f"(min {np.min(ends):.3f}, max {np.max(ends):.3f})")
    multi = {a: np.stack(c) for a, c in arms.items() if len(c) > 1 and len({len(x) for x in c}) == 1}
    names = list(multi)
    for i, a in enumerate(names):
        for b in names[i + 1:]:
            if multi[a].shape != multi[b].shape:
                continue
            gap = np.abs(multi[a].mean(0) - multi[b].mean(0))
            rng = np.maximum(np.ptp(multi[a], 0), np.ptp(multi[b], 0))
            out.append(f"- {a} vs {b}: seed-mean curves apart by at most {gap.max():.3f} (step "
                       f"{int(gap.argmax())}); the seeds' range there {rng[gap.argmax()]:.3f}; steps where the gap "
                       f"exceeds the seeds' range: {int((gap > rng).sum())} of {gap.size}")
    return "\n".join(out)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("runs", nargs="+")
    ap.add_argument("--png", default=None)
    args = ap.parse_args(argv)
    runs = {label(d): G.load(d) for d in args.runs}
    print(table(runs))
    print()
    print(spread(runs))
    if args.png:
        G.plot(runs, args.png)


if __name__ == "__main__":
    main()
