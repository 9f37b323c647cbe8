"""Installation: `import rlk_xla` warns, naming the fix, when this build lacks the kernels of a
platform jax can run on (scripts/check_install.sh proves a wheel has them under two jax versions)."""
import os
import subprocess
import sys

import pytest

pytest.importorskip("jax", reason="jax is not installed: rlk_xla needs it")

from rlk_xla import _core  # noqa: E402


def import_rlk_xla(before="pass"):
    """`import rlk_xla` in a fresh process, with rlk_xla's warnings as errors."""
    code = f"import _rlk_core; {before}; import rlk_xla"
    return subprocess.run([sys.executable, "-W", "error:rlk_xla:RuntimeWarning", "-c", code],
                          env=dict(os.environ, JAX_PLATFORMS="cpu"), capture_output=True, text=True, timeout=120)


def test_this_build_imports_without_a_warning():
    r = import_rlk_xla()
    assert r.returncode == 0, r.stderr


def test_a_build_without_ffi_handlers_warns_at_import():
    r = import_rlk_xla("_rlk_core.has_xla_ffi = False")
    assert r.returncode != 0 and "RuntimeWarning: rlk_xla: this build of _rlk_core has no XLA FFI handlers" in r.stderr
    assert "`pip install .`" in r.stderr


NO_CUDA = "this build of _rlk_core has no CUDA backend (built without nvcc, or with RLK_CUDA=OFF)"


def without_cuda(platforms):
    """platforms() as a build without the CUDA backend reports it (whatever this build has)."""
    return dict(platforms, cuda=dict(platforms["cuda"], supported=False, reason=NO_CUDA))


def test_a_cuda_plugin_without_cuda_kernels_is_named(monkeypatch):
    monkeypatch.setattr(_core, "PLATFORMS", without_cuda(_core.PLATFORMS))
    monkeypatch.setattr(_core.importlib.util, "find_spec", lambda name: object() if name == "jax_cuda12_plugin" else None)
    msg = _core.missing_kernels()
    assert msg is not None and NO_CUDA in msg and "nvcc" in msg and "`pip install .`" in msg
    monkeypatch.setattr(_core.importlib.util, "find_spec", lambda name: None)
    assert _core.missing_kernels() is None


def test_the_extras_declare_jax_and_torch():
    """rlk_xla[jax] brings jax >= 0.6 (the oldest XLA FFI API the handlers are built against), rlk_xla[torch] torch."""
    import importlib.metadata as md

    try:
        requires = md.requires("rlk_xla") or []
    except md.PackageNotFoundError:
        pytest.skip("rlk_xla is not installed as a distribution here (a source-tree run): no metadata to read")
    extras = {r.split(";")[1].split("==")[1].strip().strip("'\""): r.split(";")[0].strip() for r in requires if "extra ==" in r}
    assert extras.get("jax", "").replace(" ", "") in ("jax>=0.6.0", "jax>=0.6"), requires
    assert extras.get("torch", "").startswith("torch"), requires
