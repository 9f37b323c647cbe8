"""benchmarks/plot_report.py's table (no GPU, no matplotlib needed): repeated timings show their
median and range, single timings a plain number."""
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
import plot_report  # noqa: E402


def test_table_shows_median_and_range_of_repeated_timings():
    row = dict(shape="T3", n=6827, h=2048, v=75968, gemm_ms=3.0, gemm_tflops=700.0, paths={
        "rlk_xla_fast": dict(fwd_ms=3.3, fwd_ms_all=[3.3, 3.25, 3.4], fwd_x_gemm=1.1, fb_ms=10.0,
                             fb_ms_all=[10.0, 9.9, 10.2], fb_x_gemm=10.0 / 3.0, route="cuda_sm90"),
        "liger": dict(fwd_ms=4.4, fwd_x_gemm=4.4 / 3.0, fb_ms=20.5, fb_x_gemm=20.5 / 3.0),
    })
    lines = plot_report.shape_table(row).splitlines()
    ours = next(s for s in lines if s.startswith("| **rlk_xla_fast**"))
    peer = next(s for s in lines if s.startswith("| liger"))
    assert "| 3.30 (3.25–3.40) | 1.10 | 644 | 10.00 (9.90–10.20) | 3.33 | 637 | - |" in ours
    assert "| 4.40 | 1.47 | 483 | 20.50 | 6.83 | 311 | - |" in peer


def test_tflops_and_the_three_gemm_floor():
    """fwd counts one GEMM's FLOP, fwd+bwd three; the floor is those three at the sustained rate."""
    n, h, v = 4096, 4096, 128256
    flop = 2.0 * n * h * v
    row = dict(shape="H200-pub", n=n, h=h, v=v, gemm_ms=6.27, gemm_tflops=flop / 6.27e9, paths={
        "rlk_xla_fast": dict(fwd_ms=6.37, fwd_x_gemm=6.37 / 6.27, fb_ms=19.35, fb_x_gemm=19.35 / 6.27)})
    floor = 3 * flop / 790.0 / 1e9
    assert abs(plot_report.floor_ms(row, 790.0) - floor) < 1e-12 and plot_report.floor_ms(row, None) is None
    text = plot_report.shape_table(row, 790.0)
    assert f"three-GEMM floor {floor:.2f} ms at 790 TFLOP/s" in text and "QuACK" in text
    cells = next(s for s in text.splitlines() if s.startswith("| **rlk_xla_fast**")).split(" | ")
    assert cells[3] == f"{flop / 6.37e9:.0f}" and cells[6] == f"{3 * flop / 19.35e9:.0f}"
    assert cells[7] == f"{19.35 / floor:.2f}"


def test_header_names_a_peer_that_could_not_be_built():
    """A peer whose import failed is named in the report with the reason, not silently left out."""
    meta = dict(date="2026-12-04T14:14", gpu="NVIDIA H200", versions={"tokamax": "0.0.17", "liger-kernel": None},
                command="python benchmarks/bench_gpu.py", logp_rows=256,
                unavailable={"tokamax": "ModuleNotFoundError(\"No module named 'einshape'\")"})
    text = plot_report.header(meta)
    assert "(not installed: liger-kernel)" in text
    assert "Not run (could not be built here): `tokamax` (ModuleNotFoundError(\"No module named 'einshape'\"))" in text
    assert "Not run" not in plot_report.header(dict(meta, unavailable={}))
