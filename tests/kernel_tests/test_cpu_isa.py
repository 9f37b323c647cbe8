"""The CPU kernels' ISA levels (cpu/dispatch.h): a wheel's module carries the x86-64 baseline, AVX2,
AVX-512 and AVX512-BF16 builds and runs the highest this CPU has; RLK_CPU_ISA forces a lower one.
Every level this CPU runs gives logp and gradients within the dtype's tolerance of float64 and the
same bits on every run. The levels with FMA (AVX2 and up) give the same fp32 bits, and AVX2 and
AVX-512 the same bf16 bits (AVX512-BF16 has its own bf16 dot products); the baseline has no FMA
instruction, so the products and sums the compiler would fuse round twice: its bits are its own.
`python tests/kernel_tests/test_cpu_isa.py` prints each level's bit fingerprint (on an AVX512-BF16 machine the
default level's equal a -march=native build's, 2026-12-07)."""
import json
import os
import subprocess
import sys

import pytest

core = pytest.importorskip("_rlk_core", reason="_rlk_core is not built")
pytest.importorskip("jax", reason="jax is not installed: the probe runs rlk_xla")

from subprocs import cpu_env  # noqa: E402

LEVELS = list(core.cpu_isas)
pytestmark = pytest.mark.skipif(LEVELS == ["native"], reason="a -march=native build (RLK_NATIVE=ON) has one "
                                "CPU level; a wheel (scripts/build_wheel.sh, RLK_NATIVE=OFF) has four")

# One run per level, in a fresh process: logp, entropy and both gradients at an odd shape, fp32 and
# bf16, both backward strategies; their errors against float64 and a fingerprint of their bits.
PROBE = r"""
import hashlib, json, sys
import jax, jax.numpy as jnp, numpy as np
import _rlk_core, rlk_xla

n, h, v = 127, 96, 1000
r = np.random.default_rng(0)
h64, w64 = r.standard_normal((n, h)) * 2, r.standard_normal((v, h)) * 3 / np.sqrt(h)
t = jnp.asarray(r.integers(0, v, n), jnp.int32)
out = {"isa": _rlk_core.cpu_isa}
for dt in ("float32", "bfloat16"):
    hh, ww = jnp.asarray(h64, dt), jnp.asarray(w64, dt)
    hx, wx = np.asarray(hh, np.float64), np.asarray(ww, np.float64)
    z = hx @ wx.T
    lse = z.max(1) + np.log(np.exp(z - z.max(1, keepdims=True)).sum(1))
    ref = z[np.arange(n), np.asarray(t)] - lse
    bits = hashlib.sha256()
    for backward in ("fast", "lean"):
        f = lambda a, b: jnp.sum(rlk_xla.linear_logp(a, b, t, mode="strict", backward=backward))
        logp = rlk_xla.linear_logp(hh, ww, t, mode="strict")
        dh, dw = jax.grad(f, argnums=(0, 1))(hh, ww)
        again = jax.grad(f, argnums=(0, 1))(hh, ww)
        assert all(np.array_equal(np.asarray(a), np.asarray(b)) for a, b in zip((dh, dw), again)), "not deterministic"
        for x in (logp, dh, dw):
            bits.update(np.asarray(x).tobytes())
    out[dt] = {"logp_err": float(np.max(np.abs(np.asarray(logp, np.float64) - ref))), "bits": bits.hexdigest()[:16]}
print(json.dumps(out))
"""


def probe(level=None):
    env = cpu_env()
    env.pop("RLK_CPU_ISA", None)
    if level:
        env["RLK_CPU_ISA"] = level
    r = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


def test_the_highest_level_this_cpu_runs_is_the_default():
    assert LEVELS[0] == "baseline" and core.cpu_isa == (os.environ.get("RLK_CPU_ISA") or LEVELS[-1])


def test_a_level_this_build_lacks_fails_the_import_naming_the_levels():
    env = dict(cpu_env(), RLK_CPU_ISA="sse9")
    r = subprocess.run([sys.executable, "-c", "import _rlk_core"], env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode != 0
    assert "RLK_CPU_ISA=sse9 is not a CPU level of this build (baseline, avx2, avx512, avx512bf16)" in r.stderr


def test_every_level_is_exact_and_deterministic():
    runs = {level: probe(level) for level in LEVELS}
    for level, out in runs.items():
        assert out["isa"] == level
        assert out["float32"]["logp_err"] < 2e-5, (level, out)
        assert out["bfloat16"]["logp_err"] < 2e-5, (level, out)  # the logits in fp32 from bf16 operands
    fma = [runs[level]["float32"]["bits"] for level in ("avx2", "avx512", "avx512bf16") if level in runs]
    assert len(set(fma)) <= 1, runs
    if {"avx2", "avx512"} <= set(runs):
        assert runs["avx2"]["bfloat16"]["bits"] == runs["avx512"]["bfloat16"]["bits"], runs

if __name__ == "__main__":
    for level in [None] + LEVELS:
        print(level or "default", json.dumps(probe(level)))
