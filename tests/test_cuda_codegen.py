"""The CUDA backend's builds, checked where nvcc is (CI has it, no GPU needed): the SM90 kernel's
machine code, and the portable backend built without sm_90a (a toolkit before 12).

ptxas reports as mere info two things that cost the Hopper forward a lot: wgmma serialised around a
branch (C7518; a warpgroup-level skip inside the mainloop cost 15%) and register spills in the
consumers (128 fp32 accumulators per thread leave little room). Both must stay at zero.
"""
import os
import re
import shutil
import subprocess

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NVCC = shutil.which("nvcc")


@pytest.mark.skipif(NVCC is None, reason="nvcc not on PATH: the CUDA backend is not built here")
def test_sm90_forward_has_no_serialised_wgmma_and_no_spills(tmp_path):
    cmd = [NVCC, "-O3", "-std=c++17", "--expt-relaxed-constexpr", f"-I{ROOT}/include", f"-I{ROOT}/cuda",
           "-DRLK_HAVE_SM90=1", "-gencode=arch=compute_90a,code=sm_90a", "-Xptxas", "-v", "-c",
           os.path.join(ROOT, "cuda", "linear_logp_sm90.cu"), "-o", str(tmp_path / "sm90.o")]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    log = out.stdout + out.stderr
    kernels = re.findall(r"Compiling entry function '(\w*sm90_forward_kernel\w*)'", log)
    assert len(kernels) == 6, log[-2000:]  # bf16 / fp16 x the three epilogues (stats, kept logits, dlogit)
    assert "C7518" not in log and "serialized" not in log, log[-2000:]
    spills = re.findall(r"(\d+) bytes spill stores, (\d+) bytes spill loads", log)
    assert spills and all(s == ("0", "0") for s in spills), spills


@pytest.mark.skipif(NVCC is None, reason="nvcc not on PATH: the CUDA backend is not built here")
@pytest.mark.parametrize("src", ["linear_logp_bwd.cu", "linear_logp_cuda.cu"])
def test_cuda_backend_builds_without_sm90(tmp_path, src):
    """A toolkit without sm_90a (RLK_HAVE_SM90=0) still builds the portable backend, warning-free."""
    cmd = [NVCC, "-O3", "-std=c++17", "--expt-relaxed-constexpr", f"-I{ROOT}/include", f"-I{ROOT}/cuda",
           "-DRLK_HAVE_SM90=0", "-gencode=arch=compute_80,code=sm_80", "-c", os.path.join(ROOT, "cuda", src),
           "-o", str(tmp_path / "out.o")]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "warning" not in (out.stdout + out.stderr).lower(), out.stderr[-2000:]
