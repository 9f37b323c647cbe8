"""The table and plots of a bench_gpu.py run, from its benchmarks.json.

    python benchmarks/plot_report.py docs/benchmarks.json             # writes next to the JSON
    python benchmarks/plot_report.py /tmp/out/benchmarks.json --out docs
    python benchmarks/plot_report.py g0/benchmarks.json g1/benchmarks.json --out docs   # merged runs

writes benchmarks_table.md (one table per shape), benchmarks_time.png (fwd and fwd+bwd time as a
ratio to the cuBLAS GEMM of the same shape, one panel per shape), benchmarks_memory.png (peak
extra memory of fwd+bwd, log scale) and benchmarks_tokens.png (fwd+bwd time and memory against
tokens, for the shapes that differ only in N: T1, T2, T3). bench_gpu.py calls write_report after
every shape.
"""
from __future__ import annotations

import argparse
import json
import math
import os

# the targets, as ratios to the GEMM: (label, value, colour)
TARGETS = (("fwd target 1.10", 1.10, "tab:blue"), ("fast fwd+bwd target 3.4", 3.4, "tab:green"),
           ("lean fwd+bwd target 4.5", 4.5, "tab:red"))
OURS = ("rlk_xla_", "torch_bridge_")
COLORS = {"rlk_xla_fast": "#1f4e9c", "rlk_xla_lean": "#7fa7e0", "torch_bridge_fast": "#1b7a3a",
          "torch_bridge_lean": "#8fd19e", "jax_ref": "#e08a1e", "jax_chunked": "#f3c27a", "tokamax": "#b5651d",
          "torch_native": "#7b4fa0", "liger": "#c0392b", "cce": "#e377c2"}
MEM_FLOOR = 0.1  # MB: the bottom of the log-scale memory plot
ORDER = ("T1", "T2", "T3", "T3-tp1", "Q8B-tp4", "L16k", "H200-pub")  # docs/design.md §6
COLUMNS = ("path", "fwd ms", "fwd/GEMM", "fwd TFLOP/s", "fwd+bwd ms", "fwd+bwd/GEMM", "fwd+bwd TFLOP/s",
           "fwd+bwd/floor", "peak extra MB", "torch peak reserved MB", "logp rel err", "dH rel", "dW rel")
# The fastest published peer we cannot run here (its own report, not our measurement).
PUBLISHED = {"H200-pub": "QuACK's fused linear cross-entropy reports 17.3 ms forward+backward at this shape on an "
                         "H200 (Liger's CuTe kernel 18.1 ms); published figures, not measured here."}


def path_order(rows):
    """Every path of the run, in the order of first appearance."""
    return list(dict.fromkeys(name for r in rows for name in r["paths"]))


def is_ours(name):
    return name.startswith(OURS)


# ---- the markdown table ----

def _num(x, fmt):
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, fmt)


def _mb(x):
    return _num(x, ",.0f" if x is not None and x >= 10 else ".1f")


def _ms(p, key):
    """A path's median ms, and with repeated timings their range."""
    runs = p.get(key + "_ms_all", [])
    spread = f" ({min(runs):.2f}–{max(runs):.2f})" if len(runs) > 1 else ""
    return _num(p.get(key + "_ms"), ".2f") + spread


def gemm_flop(row):
    """The FLOP of one GEMM of the shape: the forward does one, forward+backward three (the logits,
    dH, dW), whatever else a path spends."""
    return 2.0 * row["n"] * row["h"] * row["v"]


def floor_ms(row, sustained_tflops):
    """The three GEMMs of forward+backward at the sustained rate: what no path can beat."""
    return 3 * gemm_flop(row) / sustained_tflops / 1e9 if sustained_tflops else None


def _tflops(flop, ms):
    return flop / ms / 1e9 if ms else None


def shape_table(row, sustained_tflops=None):
    """One shape: a heading, the table, and the paths that failed (with what they still measured).
    sustained_tflops: the run's sustained GEMM rate (the floor column; "-" without it)."""
    floor = floor_ms(row, sustained_tflops)
    lines = [f"## {row['shape']}: {row['n']} x {row['h']} x {row['v']} "
             f"(cuBLAS GEMM {row['gemm_ms']:.2f} ms, {row['gemm_tflops']:.0f} TFLOP/s"
             + (f"; three-GEMM floor {floor:.2f} ms at {sustained_tflops:.0f} TFLOP/s)" if floor else ")"), "",
             *([PUBLISHED[row["shape"]], ""] if row["shape"] in PUBLISHED else []),
             "| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    errors = []
    for name, p in row["paths"].items():
        label = f"**{name}**" if is_ours(name) else name
        if "route" in p:
            label += f" ({p['route']})"
        if "error" in p:
            label += " (failed)"
            errors.append(f"- {name}: `{p['error']}`")
        fb_ms = p.get("fb_ms")
        cells = [label, _ms(p, "fwd"), _num(p.get("fwd_x_gemm"), ".2f"),
                 _num(_tflops(gemm_flop(row), p.get("fwd_ms")), ".0f"), _ms(p, "fb"),
                 _num(p.get("fb_x_gemm"), ".2f"), _num(_tflops(3 * gemm_flop(row), fb_ms), ".0f"),
                 _num(fb_ms / floor if fb_ms and floor else None, ".2f"),
                 _mb(p.get("fb_mem_mb")), _mb(p.get("fb_reserved_mb")),
                 _num(p.get("logp_rel"), ".1e"),
                 _num(p.get("dh_rel"), ".1e"), _num(p.get("dw_rel"), ".1e")]
        lines.append("| " + " | ".join(cells) + " |")
    if errors:
        lines += ["", "Failed (the numbers shown were measured before the failure):"] + errors
    return "\n".join(lines) + "\n"


def header(meta):
    versions = ", ".join(f"{k} {v}" for k, v in meta["versions"].items() if v)
    missing = ", ".join(k for k, v in meta["versions"].items() if not v)
    not_run = "; ".join(f"`{k}` ({why})" for k, why in meta.get("unavailable", {}).items())
    grads = (f"dH / dW rel: ||grad - float64 grad|| / ||float64 grad|| on the first {meta['grad_rows']} rows "
             "(full vocab)." if meta.get("grad_rows") else "dH / dW: not measured (--skip-accuracy).")
    return "\n".join([
        "# linear_logp side by side", "",
        f"Measured {meta['date']} on {meta['gpu']}. Versions: {versions}" + (f" (not installed: {missing})."
                                                                             if missing else "."),
        *([f"Not run (could not be built here): {not_run}."] if not_run else []),
        *([f"Command: `{meta['command']}`"] if "runs" not in meta else
          ["Commands (the shapes split over GPUs or calls):"] +
          [f"- `{run['command']}` ({run['date']}, {run['gpu']})" for run in meta["runs"]]), "",
        "- **Paths:** `rlk_xla_*` (JAX) and `torch_bridge_*` (PyTorch) are this project's fused op with "
        "`backward=\"fast\"` (keeps a record of the forward's logits, docs/design.md §5) or `backward=\"lean\"` (recomputes them chunk "
        "by chunk); fast and lean share one forward, measured once. Peers: `jax_ref` (materialized logits), "
        "`jax_chunked` (lax.map + remat), `tokamax`, `torch_native` (materialized logits), `liger` (Liger FLCE), "
        "`cce` (Cut Cross-Entropy, exact). The route of rlk_xla is in brackets.",
        "- **Time:** median ms; x/GEMM is the ratio to the cuBLAS bf16 GEMM of the same shape (torch: "
        "triton do_bench; JAX: wall time per call over calls issued back to back; Python's garbage collector "
        "paused while timing, as timeit does). With --repeat, this project's paths were timed several times in "
        "turn: the median, and the range in brackets. Targets: fwd 1.10, fast fwd+bwd 3.4, "
        "lean fwd+bwd 4.5.",
        "- **TFLOP/s and the floor:** fwd TFLOP/s counts one GEMM of the shape (2 N H V), fwd+bwd three "
        "(the logits, dH, dW), whatever else a path does; fwd+bwd/floor is the ratio to those three GEMMs at the "
        "sustained bf16 rate "
        + (f"({meta['sustained']['tflops']:.0f} TFLOP/s, {meta['sustained']['gemm']}"
           + (f", measured {meta['sustained']['date']}" if "date" in meta["sustained"] else ", this run") + ")"
           if "sustained" in meta else "(not measured in this run: '-')") + ".",
        "- **Peak extra MB (fwd+bwd):** torch: peak allocated during one step beyond its inputs and gradients; "
        "JAX: XLA's temp bytes of the jitted step.",
        f"- **Accuracy:** logp rel: ||logp - float64|| / ||float64|| on {meta['logp_rows']} sampled rows. {grads}",
        ""])


def sustained_rate(meta):
    """The run's sustained GEMM TFLOP/s (bench_gpu.sustained_tflops), or None for a run without it."""
    return meta.get("sustained", {}).get("tflops")


def write_table(data, path):
    with open(path, "w") as f:
        rate = sustained_rate(data["meta"])
        f.write(header(data["meta"]) + "\n" + "\n".join(shape_table(r, rate) for r in data["rows"]))


# ---- the plots ----

def _pyplot():
    try:
        import matplotlib
    except ImportError:
        print("plot_report: matplotlib is not installed, no plots")
        return None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def _bold_ours(ax):
    for label in ax.get_yticklabels():
        if is_ours(label.get_text()):
            label.set_fontweight("bold")


def _time_panel(ax, row):
    names = list(row["paths"])
    y = range(len(names))
    low, high = 0.5, 5.0  # the targets stay in view
    for key, dy, color, label in (("fwd_x_gemm", -0.2, "tab:gray", "fwd / GEMM"),
                                  ("fb_x_gemm", 0.2, "tab:orange", "fwd+bwd / GEMM")):
        vals = [row["paths"][n].get(key) for n in names]
        ax.barh([i + dy for i in y], [v or 0 for v in vals], 0.4, color=color, label=label)
        for i, v in zip(y, vals):
            if v:
                ax.text(v * 1.03, i + dy, f"{v:.2f}", va="center", fontsize=7,
                        bbox=dict(facecolor="white", edgecolor="none", alpha=0.8, pad=0.5))
                low, high = min(low, v / 1.5), max(high, v)
    for i, n in zip(y, names):
        if "error" in row["paths"][n]:
            ax.text(low * 1.1, i + 0.2, "failed", va="center", color="red", fontsize=7)
    ax.axvline(1.0, color="black", lw=1.2, label="GEMM (1.0)")
    for label, x, color in TARGETS:
        ax.axvline(x, color=color, lw=1, ls="--", label=label)
    ax.set_xscale("log")
    ax.set_xlim(low, high * 1.6)
    ticks = [x for x in (0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1, 2, 3, 5, 10, 20, 50, 100, 200) if low <= x <= high * 1.6]
    ax.set_xticks(ticks, [f"{x:g}" for x in ticks], fontsize=8)
    ax.minorticks_off()
    ax.set_yticks(list(y), names, fontsize=8)
    ax.invert_yaxis()
    _bold_ours(ax)
    ax.set_title(f"{row['shape']}: {row['n']} x {row['h']} x {row['v']}, GEMM {row['gemm_ms']:.2f} ms", fontsize=9)
    ax.grid(axis="x", which="both", alpha=0.3)


def plot_time(rows, path):
    plt = _pyplot()
    if plt is None:
        return
    ncols = min(2, len(rows))
    nrows = math.ceil(len(rows) / ncols)
    npaths = max(len(r["paths"]) for r in rows)
    fig, axes = plt.subplots(nrows, ncols, figsize=(7 * ncols, (0.42 * npaths + 1.2) * nrows + 0.8), squeeze=False)
    for ax, row in zip(axes.flat, rows):
        _time_panel(ax, row)
    for ax in axes.flat[len(rows):]:
        ax.axis("off")
    height = fig.get_figheight()
    fig.suptitle("time / cuBLAS GEMM time of the same shape (log scale, lower is better)", fontsize=11,
                 y=1 - 0.15 / height)
    handles, labels = axes.flat[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="upper center", ncol=6, fontsize=8, frameon=False,
               bbox_to_anchor=(0.5, 1 - 0.4 / height))
    fig.tight_layout(rect=(0, 0, 1, 1 - 0.75 / height))
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)


def plot_memory(rows, path):
    plt = _pyplot()
    if plt is None:
        return
    names = path_order(rows)
    width = 0.85 / len(names)
    fig, ax = plt.subplots(figsize=(max(8, 1.8 * len(rows) + 4), 5.5))
    for j, name in enumerate(names):
        xs = [i + (j - (len(names) - 1) / 2) * width for i in range(len(rows))]
        vals = [r["paths"].get(name, {}).get("fb_mem_mb") for r in rows]
        ax.bar(xs, [max(v, MEM_FLOOR) if v is not None else 0 for v in vals], width, color=COLORS.get(name, "gray"),
               label=name, edgecolor="black" if is_ours(name) else "none", linewidth=0.6)
        for x, v in zip(xs, vals):
            if v is not None:
                ax.text(x, max(v, MEM_FLOOR) * 1.08, _mb(v).replace(",", ""), ha="center", va="bottom", rotation=90, fontsize=6)
    ax.set_yscale("log")
    ax.set_ylim(MEM_FLOOR, 10 ** math.ceil(math.log10(max(_mem_max(rows), 10)) + 0.6))
    ax.set_xticks(range(len(rows)), [f"{r['shape']}\n{r['n']}x{r['h']}x{r['v']}" for r in rows], fontsize=8)
    ax.set_ylabel(f"MB (log scale; under {MEM_FLOOR} MB drawn at {MEM_FLOOR})")
    ax.set_title("peak extra memory of fwd+bwd, MB (lower is better)\n"
                 "torch: allocated beyond inputs and gradients; JAX: XLA temp bytes", fontsize=9)
    ax.grid(axis="y", which="major", alpha=0.3)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1), frameon=False)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def families(rows):
    """Rows that differ only in the number of tokens (same h and v), for the plots against tokens."""
    fam = {}
    for r in rows:
        fam.setdefault((r["h"], r["v"]), []).append(r)
    return {k: sorted(v, key=lambda r: r["n"]) for k, v in fam.items() if len(v) > 1}


def plot_tokens(rows, path):
    """fwd+bwd time and peak extra memory against tokens, one pair of panels per shape family."""
    plt = _pyplot()
    fams = families(rows)
    if plt is None or not fams:
        return
    fig, axes = plt.subplots(len(fams), 2, figsize=(13, 4.8 * len(fams)), squeeze=False)
    for (h, v), (ax_t, ax_m) in zip(fams, axes):
        fam = fams[(h, v)]
        ns = [r["n"] for r in fam]
        label = f"H = {h}, V = {v} ({', '.join(r['shape'] for r in fam)})"
        ax_t.plot(ns, [r["gemm_ms"] for r in fam], color="black", lw=2, ls="--", label="cuBLAS GEMM (fwd floor)")
        for name in path_order(fam):
            style = dict(color=COLORS.get(name, "gray"), marker="o", lw=2.2 if is_ours(name) else 1.2,
                         label=name)
            t = [r["paths"].get(name, {}).get("fb_ms") for r in fam]
            m = [r["paths"].get(name, {}).get("fb_mem_mb") for r in fam]
            ax_t.plot([n for n, x in zip(ns, t) if x], [x for x in t if x], **style)
            ax_m.plot([n for n, x in zip(ns, m) if x is not None], [max(x, MEM_FLOOR) for x in m if x is not None],
                      **style)
        for ax, what in ((ax_t, "fwd+bwd time, ms"), (ax_m, f"peak extra memory of fwd+bwd, MB (floor {MEM_FLOOR})")):
            ax.set_xscale("log")
            ax.set_yscale("log")
            ax.set_xticks(ns, [str(n) for n in ns])
            ax.minorticks_off()
            ax.set_xlabel("tokens N")
            ax.set_title(f"{what}\n{label}", fontsize=9)
            ax.grid(alpha=0.3)
        ax_m.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1), frameon=False)
    fig.suptitle("against tokens (log-log, lower is better)", fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)


def _mem_max(rows):
    return max((p["fb_mem_mb"] for r in rows for p in r["paths"].values() if p.get("fb_mem_mb") is not None),
               default=1.0)


def write_report(data, out):
    os.makedirs(out, exist_ok=True)
    write_table(data, os.path.join(out, "benchmarks_table.md"))
    if data["rows"]:
        plot_time(data["rows"], os.path.join(out, "benchmarks_time.png"))
        plot_memory(data["rows"], os.path.join(out, "benchmarks_memory.png"))
        plot_tokens(data["rows"], os.path.join(out, "benchmarks_tokens.png"))


def merge(datas):
    """One report of several bench_gpu.py runs (shapes split over GPUs or calls): the rows in
    docs/design.md §6 order, a later run's row replacing an earlier one of the same shape; each run's
    command kept."""
    rows = {}
    for d in datas:
        rows.update({r["shape"]: r for r in d["rows"]})
    rank = {name: i for i, name in enumerate(ORDER)}
    rows = dict(sorted(rows.items(), key=lambda kv: rank.get(kv[0], len(ORDER))))
    meta = dict(datas[0]["meta"])
    meta["runs"] = [dict(command=d["meta"]["command"], date=d["meta"]["date"], gpu=d["meta"]["gpu"]) for d in datas]
    return dict(meta=meta, rows=list(rows.values()))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("json", nargs="+", help="benchmarks.json of one or more bench_gpu.py runs")
    ap.add_argument("--out", help="output folder (default: the first JSON's folder)")
    args = ap.parse_args()
    datas = []
    for path in args.json:
        with open(path) as f:
            datas.append(json.load(f))
    data = datas[0] if len(datas) == 1 else merge(datas)
    out = args.out or os.path.dirname(os.path.abspath(args.json[0]))
    if len(datas) > 1:
        os.makedirs(out, exist_ok=True)
        with open(os.path.join(out, "benchmarks.json"), "w") as f:
            json.dump(data, f, indent=1)
    write_report(data, out)


if __name__ == "__main__":
    main()
