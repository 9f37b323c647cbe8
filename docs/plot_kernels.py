"""Plot of the CUDA kernels' standalone measurements (benchmarks/cuda/NOTES.md, one H200, 2026-11-30).

    python docs/plot_kernels.py   # -> docs/kernels_h200.png
"""
import matplotlib
matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

# shape, tokens, fwd ms, cuBLAS GEMM ms, bwd ms (benchmarks/cuda/results/bench.log)
ROWS = [("T1", 796, 0.435, 0.318, 2.93), ("T2", 1820, 0.838, 0.810, 4.26), ("T3", 6827, 2.957, 3.090, 14.61),
        ("T3-tp1", 6827, 6.653, 6.207, 29.27), ("H200-pub", 4096, 6.716, 6.139, 26.52),
        ("L16k", 16384, 31.49, 35.30, 131.2)]
TARGET = {"T1": 1.3, "T2": 1.3}

fig, ax = plt.subplots(1, 2, figsize=(12, 4))
names = [f"{r[0]}\nN={r[1]}" for r in ROWS]
ax[0].bar(names, [r[2] / r[3] for r in ROWS], color="tab:blue", label="rlk SM90 forward")
ax[0].plot(names, [TARGET.get(r[0], 1.1) for r in ROWS], "r_", markersize=30, mew=2, label="issue target")
ax[0].axhline(1.0, color="k", lw=0.8)
ax[0].set_title("forward time / cuBLAS bf16 GEMM time (lower is better)", fontsize=9)
ax[0].legend(fontsize=8)
ax[1].bar(names, [(r[2] + r[4]) / r[3] for r in ROWS], color="tab:orange", label="rlk fwd+bwd")
ax[1].axhline(3.0, color="k", lw=0.8, ls=":", label="3 GEMMs (the floor)")
ax[1].set_title("forward+backward time / GEMM time", fontsize=9)
ax[1].legend(fontsize=8)
for a in ax:
    a.tick_params(labelsize=8)
fig.tight_layout()
fig.savefig(__file__.replace("plot_kernels.py", "kernels_h200.png"), dpi=110)
