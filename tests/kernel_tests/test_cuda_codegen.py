"""The CUDA backend's builds, checked where nvcc is (CI has it, no GPU needed): the SM90 kernel's
machine code, and the portable backend built without sm_90a (RLK_SM90=OFF: what a toolkit before
12 builds).

ptxas reports as mere info two things that cost the Hopper forward a lot: wgmma serialised around a
branch (C7518; a warpgroup-level skip inside the mainloop cost 15%) and register spills in the
consumers (128 fp32 accumulators per thread leave little room). Both must stay at zero.

The compile commands are CMake's own (compile_commands.json of a configured build), so the flags
checked here are the flags the module is built with; this file states none.
"""
import json
import re
import os
import shlex
import shutil
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
NVCC = shutil.which("nvcc")
CMAKE = shutil.which("cmake")

pytestmark = pytest.mark.skipif(NVCC is None or CMAKE is None,
                                reason="nvcc or cmake not on PATH: the CUDA backend is not built here")


def configure(build, *options):
    """Source file name -> (argv, directory) of its compile in a CUDA configure of this tree."""
    gen = ["-G", "Ninja"] if shutil.which("ninja") else []
    out = subprocess.run([CMAKE, "-S", ROOT, "-B", str(build), *gen, "-DRLK_CUDA=ON",
                          f"-DPython_EXECUTABLE={sys.executable}", *options], capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    entries = json.loads((build / "compile_commands.json").read_text())
    return {os.path.basename(e["file"]): (shlex.split(e["command"]), e["directory"]) for e in entries}


@pytest.fixture(scope="module")
def commands(tmp_path_factory):
    return configure(tmp_path_factory.mktemp("cmake"))


def compile_to(argv, directory, obj, extra=()):
    """Run one compile command with its output redirected to `obj` and `extra` flags appended."""
    argv = list(argv)
    argv[argv.index("-o") + 1] = str(obj)
    out = subprocess.run(argv + list(extra), cwd=directory, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout + out.stderr


def test_sm90_forward_has_no_serialised_wgmma_and_no_spills(commands, tmp_path):
    argv, directory = commands["linear_logp_sm90.cu"]
    log = compile_to(argv, directory, tmp_path / "sm90.o", extra=["-Xptxas", "-v"])
    kernels = re.findall(r"Compiling entry function '(\w*sm90_forward_kernel\w*)'", log)
    assert len(kernels) == 6, log[-2000:]  # bf16 / fp16 x the three epilogues (stats, saved logits, dlogit)
    assert "C7518" not in log and "serialized" not in log, log[-2000:]
    spills = re.findall(r"(\d+) bytes spill stores, (\d+) bytes spill loads", log)
    assert spills and all(s == ("0", "0") for s in spills), spills


@pytest.fixture(scope="module")
def commands_without_sm90(tmp_path_factory):
    return configure(tmp_path_factory.mktemp("cmake_nosm90"), "-DRLK_SM90=OFF")


def test_without_sm90_no_file_is_built_for_sm90a(commands_without_sm90):
    assert "linear_logp_sm90.cu" not in commands_without_sm90
    for argv, _ in commands_without_sm90.values():
        assert "-DRLK_HAVE_SM90=1" not in argv and not any("sm_90a" in f for f in argv), argv


@pytest.mark.parametrize("src", ["linear_logp_bwd.cu", "linear_logp_cuda.cu"])
def test_cuda_backend_builds_without_sm90(commands_without_sm90, tmp_path, src):
    """Without sm_90a (RLK_HAVE_SM90=0) the portable backend still builds, warning-free."""
    argv, directory = commands_without_sm90[src]
    assert "-DRLK_HAVE_SM90=0" in argv
    log = compile_to(argv, directory, tmp_path / "out.o")
    assert "warning" not in log.lower(), log[-2000:]
