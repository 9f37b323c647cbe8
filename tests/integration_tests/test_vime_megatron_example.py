"""examples/megatron_cpu.py runs as a user runs it (a fresh process, CPU only): a tiny megatron-core
GPTModel at TP = 2 over gloo, one training step with logp from its hidden states, checked against
Megatron's own logits path inside the script."""
import pathlib
import subprocess
import sys

import pytest

pytest.importorskip("torch", reason="torch is not installed: the example needs it")
pytest.importorskip("megatron.core", reason="megatron-core is not installed (pip install megatron-core)")

from subprocs import cpu_env

ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_megatron_cpu_example_runs():
    out = subprocess.run([sys.executable, "examples/megatron_cpu.py", "--tp", "2"], cwd=ROOT, env=cpu_env(),
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert out.stdout.strip().splitlines()[-1] == "ok", out.stdout[-3000:]
    assert "max |logp - Megatron's| after one step" in out.stdout
