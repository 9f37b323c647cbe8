"""The main job's two commands (`python -m rlk_xla check`, `bench`) run and report."""
import os
import subprocess
import sys

import pytest

pytest.importorskip("jax", reason="jax is not installed: the CLI needs it")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run(*args):
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    return subprocess.run([sys.executable, "-m", "rlk_xla", *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=600)


def test_check_passes_on_this_machine():
    r = run("check", "--device", "cpu")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "check: PASS" in r.stdout and "| cpu " in r.stdout


def test_bench_prints_a_table():
    r = run("bench", "--shape", "64,32,500", "--device", "cpu", "--iters", "1")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "fused f+b temp MB" in r.stdout and "64x32x500" in r.stdout


def test_time_ms_cancels_a_samples_latency(monkeypatch):
    """time_ms (the JAX timings of the CLI and of benchmarks/bench_gpu.py) counts the calls, not
    what a sample pays once: here 2 ms per call and 30 ms of sync latency per sample."""
    import time

    import jax

    from rlk_xla.cli import time_ms

    def sync(x):
        time.sleep(0.030)
        return x

    monkeypatch.setattr(jax, "block_until_ready", sync)
    t = time_ms(lambda: time.sleep(0.002), iters=5)
    assert 1.0 < t < 15.0, t  # one call per sample would read 32 ms
