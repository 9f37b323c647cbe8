"""The main job's two commands (`python -m rlk_xla check`, `bench`) run and report."""
import subprocess
import sys
import tempfile

import pytest

pytest.importorskip("jax", reason="jax is not installed: the CLI needs it")

from subprocs import cpu_env  # noqa: E402


def run(*args):
    """`python -m rlk_xla ...` on the CPU, importing the packages this process imports (the source
    tree, or an installed wheel: scripts/test.sh --wheel), from an empty working directory."""
    with tempfile.TemporaryDirectory() as cwd:
        return subprocess.run([sys.executable, "-m", "rlk_xla", *args], cwd=cwd, env=cpu_env(), capture_output=True,
                              text=True, timeout=600)


def test_check_passes_on_this_machine():
    r = run("check", "--device", "cpu")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "check: PASS" in r.stdout and "| cpu " in r.stdout


def test_bench_prints_a_labelled_table():
    r = run("bench", "--shape", "64,32,500", "--device", "cpu", "--iters", "2")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "64x32x500" in r.stdout and "fused temp MB" in r.stdout
    assert "fused/ref (lower is better)" in r.stdout and "fused ms / reference ms" in r.stdout
    assert "jnp.dot" in r.stdout and "fp32 accumulation" in r.stdout  # what the GEMM column times
    rows = [line for line in r.stdout.splitlines() if line.startswith("| 64,32,500")]
    assert [row.split("|")[3].strip() for row in rows] == ["fwd", "fwd+bwd"]
    assert all("-" in cell and "%" in cell for row in rows for cell in row.split("|")[5:7])  # min-max, spread
    assert "100%" in r.stderr and "\r" not in r.stderr  # the progress bar, plain lines in a log


def usage_error(capsys, *argv):
    """(exit code, stderr) of the CLI's argument handling, in this process."""
    from rlk_xla.__main__ import main

    with pytest.raises(SystemExit) as e:
        main(list(argv))
    return e.value.code, capsys.readouterr().err


@pytest.mark.parametrize("shape", ["foo", "1,2", "0,8,8", "a,b,c"])
def test_bad_shape_is_a_usage_error(capsys, shape):
    code, err = usage_error(capsys, "bench", "--shape", shape)
    assert code == 2 and "Traceback" not in err
    assert "argument --shape" in err and "T3" in err and "N,H,V" in err, err


def test_missing_device_is_a_usage_error(capsys):
    import jax

    if any(d.platform == "gpu" for d in jax.devices()):
        pytest.skip("this machine has a GPU: --device gpu is valid here")
    for cmd in ("check", "bench"):
        code, err = usage_error(capsys, cmd, "--device", "gpu")
        assert code == 2 and "argument --device: no gpu device" in err, err


def test_usage_names_the_commands_not_the_dest(capsys):
    code, err = usage_error(capsys)
    assert code == 2 and "{check,bench}" in err and "cmd" not in err.replace("python -m", ""), err
    assert usage_error(capsys, "bench", "--iters", "0")[0] == 2


def test_help_explains_every_flag(capsys):
    import argparse

    from rlk_xla.__main__ import parser

    sub = next(a for a in parser()._actions if isinstance(a, argparse._SubParsersAction))
    for cmd, p in sub.choices.items():
        for a in p._actions:
            assert a.help, f"{cmd} {a.option_strings} has no help"
    with pytest.raises(SystemExit):
        parser().parse_args(["bench", "--help"])
    out = capsys.readouterr().out
    assert "T3=6827x2048x75968" in out and "small=512x1024x32000" in out and "lower is better" in out


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
