"""_rlk_core.platforms(): what this build runs, by platform, with a reason wherever it cannot; the
frontends read it (rlk_common.platform, platform_fallback) instead of naming devices."""
import _rlk_core as core

import rlk_common as common

KEYS = {"name", "xla_platform", "jax_backend", "jax_lowering", "dlpack_device", "workspace", "supported", "reason",
        "kernels"}


def test_every_platform_says_what_runs_and_why_not():
    platforms = core.platforms()
    assert set(platforms) == {"cpu", "cuda"}
    kernels = set()
    for name, p in platforms.items():
        assert set(p) == KEYS and p["name"] == name
        assert (p["reason"] is None) == p["supported"]
        for k in p["kernels"].values():
            assert (k["reason"] is None) == k["supported"] and (k["reason"] is None or k["reason"])
            assert p["supported"] or not k["supported"]
        kernels |= set(p["kernels"])
    assert kernels == set(core.route_counts())  # the kernels are the route counters' backends
    assert platforms["cpu"]["supported"] and platforms["cuda"]["supported"] == core.has_cuda


def test_a_device_index_adds_the_architecture_test():
    sm90 = core.platforms(cuda_device=0)["cuda"]["kernels"]["cuda_sm90"]
    assert (sm90["reason"] is None) == sm90["supported"]


def test_fallback_reasons_come_from_the_report():
    platforms = core.platforms()
    assert common.platform_fallback(platforms, "name", "cpu") is None
    assert "device mps" in common.platform_fallback(platforms, "name", "mps")
    cuda = common.platform_fallback(platforms, "name", "cuda")
    assert cuda is None if core.has_cuda else platforms["cuda"]["reason"] in cuda
    assert common.platform(platforms, "jax_backend", "gpu")["xla_platform"] == "CUDA"
