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
    return f"{frontend} {a.get('arm', 'fused')}" + (f" tp{tp}" if tp > 1 else "") + f" s{a['seed']}"


def table(runs: dict) -> str:
    cols = ["run", "reward first 20 -> last 20", "(a) mismatch rate", "(a) mean / max \\|dlogp\\|", "(a) KL",
            "(b) mismatch rate", "(b) mean / max \\|dlogp\\|", "(b) KL", "step s", "fallbacks", "fingerprints equal",
            "first drift"]
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for name, rows in runs.items():
        s = G.summary(rows)
        a, b = s["a"], s["b"]
        lines.append(f"| {name} | {s['reward_start']:.3f} -> {s['reward_end']:.3f} | {a['mismatch_rate']:.3g} | "
                     f"{a['mean_abs']:.2e} / {a['max_abs']:.2e} | {a['approx_kl']:.1e} | {b['mismatch_rate']:.3g} | "
                     f"{b['mean_abs']:.2e} / {b['max_abs']:.2e} | {b['approx_kl']:.1e} | {s['step_s']:.3f} | "
                     f"{s['fallback_total']} | {'yes' if s['fingerprints_equal'] else 'NO'} | "
                     f"{s['first_drift'] or 'none'} |")
    return "\n".join(lines)


def spread(runs: dict) -> str:
    """Per arm over its seeds: the final reward's mean and spread, and the largest gap between two
    arms' seed-mean reward curves (10-step means) against the seeds' spread."""
    arms: dict = {}
    for name, rows in runs.items():
        arms.setdefault(name.rsplit(" s", 1)[0], []).append(np.array([r["reward"] for r in rows]))
    out = []
    for arm, curves in arms.items():
        ends = [c[-20:].mean() for c in curves]
        out.append(f"- {arm}: {len(curves)} seed(s), final reward {np.mean(ends):.3f} "
                   f"(min {np.min(ends):.3f}, max {np.max(ends):.3f})")
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
