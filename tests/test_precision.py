"""Per-element precision at large logits, and references that ignore the global matmul precision.

logp is formed as (z_t - m) - log s from row-max-relative quantities: per element, at |z| up to
200, it is at least as close to float64 as torch's fp32 log_softmax(z).gather on the same fp32
logits (plus one fp32 ulp of |logp|), also on rows whose target is the row max (logp near 0). The
logits are made exact in fp32 (small integers over powers of two, short dot products), so both
sides start from the same z and the comparison is of the log-softmax alone; a second case uses
ordinary normal inputs."""
import pytest

pytest.importorskip("torch", reason="torch is not installed: these tests need it")

import numpy as np
import torch

import torch_bridge
from torch_helpers import GPU, saved_z
from torch_bridge import reference

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _exact_inputs(dtype, n=256, h=48, v=3000, zmax=200.0, seed=0):
    """hidden, weight with values k / 8 (|k| <= 64: exact in bf16, fp16, fp32) whose products are
    multiples of 1/64 and whose h-term sums stay far below 2^24 / 64: every logit is exact in fp32,
    whatever the order of the sum. Rows scaled (by powers of two) to |z| up to about zmax; a third
    of the targets are the row's argmax."""
    rng = np.random.default_rng(seed)
    hid = rng.integers(-64, 65, size=(n, h)) / 8.0
    w = rng.integers(-64, 65, size=(v, h)) / 8.0
    z = hid @ w.T
    # a power-of-two scale per row keeps the products exact: |z| max of each row in (zmax/4, zmax]
    scale = 2.0 ** np.floor(np.log2(zmax / np.abs(z).max(axis=1)))
    scale = np.minimum(scale, 1.0)  # integers over 8 only get coarser upward: keep them exact
    hid = hid * scale[:, None]
    z = hid @ w.T
    t = rng.integers(0, v, size=n)
    t[::3] = z[::3].argmax(axis=1)
    to = lambda x: torch.tensor(x, dtype=torch.float64).to(DTYPES[dtype])  # noqa: E731
    hid_t, w_t = to(hid), to(w)
    assert torch.equal(hid_t.double(), torch.tensor(hid)) and torch.equal(w_t.double(), torch.tensor(w))
    return hid_t, w_t, torch.tensor(t), z


def _truth(z, t):
    z = torch.tensor(z, dtype=torch.float64)
    return torch.log_softmax(z, dim=1).gather(1, t[:, None])[:, 0]


def _ulp32(x):
    x = np.abs(np.asarray(x, np.float32))
    return np.spacing(np.maximum(x, np.float32(1e-30))).astype(np.float64)


def _assert_at_least_as_close_as_torch(ours, z32, t, truth, what):
    """max_i (|ours_i - truth_i| - ulp32(truth_i)) <= max_i |torch_i - truth_i|."""
    theirs = torch.log_softmax(z32.float(), dim=1).gather(1, t[:, None])[:, 0].double()
    ours, truth = ours.double().cpu(), truth.double()
    err_ours = (ours - truth).abs().numpy()
    err_torch = (theirs.cpu() - truth).abs().numpy()
    slack = err_ours - _ulp32(truth.numpy())
    assert slack.max() <= err_torch.max(), (
        f"{what}: our max error {err_ours.max():.3g} (worst row {slack.argmax()}, logp {truth[slack.argmax()]:.6g}) "
        f"vs torch fp32 log_softmax {err_torch.max():.3g}")
    print(f"[precision] {what:22s} max |logp - float64|: ours {err_ours.max():.3g}, torch fp32 log_softmax "
          f"{err_torch.max():.3g}")  # the record in docs/benchmarks.md (pytest -s)
    return err_ours.max(), err_torch.max()


def _check_exact(ours, t, z, what):
    """All rows, then the rows whose target is the argmax (logp near 0: rounded at its own magnitude,
    not at |m|'s)."""
    truth, z32 = _truth(z, t), torch.tensor(z, dtype=torch.float32)  # exact
    ours = ours.cpu()
    _assert_at_least_as_close_as_torch(ours, z32, t, truth, what)
    at_max = torch.arange(len(t)) % 3 == 0
    _assert_at_least_as_close_as_torch(ours[at_max], z32[at_max], t[at_max], truth[at_max], f"{what} argmax")


@pytest.mark.parametrize("device", ["cpu", GPU])
@pytest.mark.parametrize("dtype", list(DTYPES))
def test_logp_per_element_at_least_as_close_as_torch_log_softmax(dtype, device):
    hid, w, t, z = _exact_inputs(dtype)
    _check_exact(torch_bridge.linear_logp(hid.to(device), w.to(device), t.to(device), mode="strict"), t, z,
                 f"{device} {dtype}")


@pytest.mark.parametrize("device", ["cpu", GPU])
def test_logp_per_element_with_normal_inputs(device):
    """Unscaled normal fp32 hidden and weight (|z / T| up to about 200): our error per element against
    float64 is within that of torch's fp32 log_softmax on the same fp32 logits, ours (what the fast
    backward keeps for fp32 operands), + one ulp of |logp|. (The logits' own accumulation error is
    the GEMM's, common to both sides here.)"""
    g = torch.Generator().manual_seed(1)
    n, h, v, temp = 128, 1024, 5000, 0.9
    hid, w = torch.randn(n, h, generator=g), torch.randn(v, h, generator=g)
    z64 = hid.double() @ w.double().T / temp
    t = torch.randint(0, v, (n,), generator=g)
    t[::3] = z64[::3].argmax(dim=1)
    truth = torch.log_softmax(z64, dim=1).gather(1, t[:, None])[:, 0]
    T = torch.full((n,), temp, device=device)
    logp, _, _, _, kept, _ = torch.ops.rlk.linear_logp(hid.to(device), w.to(device), None, t.int().to(device), T, v,
                                                       v // 8, -100, False, True)
    ours = torch_bridge.linear_logp(hid.to(device), w.to(device), t.to(device), temperature=temp, mode="strict")
    assert torch.equal(ours, logp)
    z32 = saved_z(kept, n, v, device).cpu()  # fp32 operands: the kept buffer holds z in fp32
    assert z64.abs().max() > 150
    _assert_at_least_as_close_as_torch(ours, z32, t, truth, f"{device} normal fp32")


@pytest.mark.parametrize("device", ["cpu", GPU])
@pytest.mark.parametrize("h", [64, 256, 1024, 4096, 8192])
def test_logp_with_the_gemm_per_element_at_least_as_close_as_torch(h, device):
    """fp32 operands, the GEMM included: per element, no farther from float64 than torch's fp32
    log_softmax(x @ W.T) (+ one ulp of |logp|) at hidden size h, rows scaled to |z| up to 200 (a
    third of the targets the row's argmax). The logits' sums along h are blocked (chains of 128
    steps summed pairwise; CUDA: chains of 128 added in order), so the error stays flat in h where
    one chain over h grew with it (issue 44: 1.2e-4 against torch's 2.1e-5 at h = 4096)."""
    g = torch.Generator().manual_seed(h)
    n, v = 64, 3001
    hid, w = torch.randn(n, h, generator=g), torch.randn(v, h, generator=g)
    hid = hid * (200.0 / (hid.double() @ w.double().T).abs().max(dim=1).values)[:, None].float()
    z64 = hid.double() @ w.double().T
    assert z64.abs().max() > 190
    t = torch.randint(0, v, (n,), generator=g)
    t[::3] = z64[::3].argmax(dim=1)
    truth = torch.log_softmax(z64, dim=1).gather(1, t[:, None])[:, 0]
    ours = torch_bridge.linear_logp(hid.to(device), w.to(device), t.to(device), mode="strict").cpu()
    z32 = (hid.to(device) @ w.to(device).T).cpu()  # torch's own GEMM (MKL / cuBLAS, fp32)
    _assert_at_least_as_close_as_torch(ours, z32, t, truth, f"{device} gemm h={h}")


def test_jax_logp_per_element_at_least_as_close_as_torch_log_softmax():
    pytest.importorskip("jax", reason="jax is not installed")
    import jax.numpy as jnp
    import rlk_xla
    for dtype in DTYPES:
        hid, w, t, z = _exact_inputs(dtype, seed=2)
        jd = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}[dtype]
        ours = rlk_xla.linear_logp(jnp.asarray(hid.double().numpy(), jd), jnp.asarray(w.double().numpy(), jd),
                                   jnp.asarray(t.numpy(), jnp.int32))
        _check_exact(torch.tensor(np.asarray(ours)), t, z, f"jax {dtype}")


# ---- the references ignore the global matmul precision -------------------------------------------

def _torch_reference(dtype):
    g = torch.Generator().manual_seed(3)
    hid, w = torch.randn(96, 256, generator=g).to(dtype), (torch.randn(700, 256, generator=g) / 4).to(dtype)
    t = torch.randint(0, 700, (96,), generator=g)
    return reference.linear_logp(hid, w, t, temperature=0.7, return_entropy=True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_torch_reference_ignores_float32_matmul_precision(dtype):
    """fp32/fp16: the same bits under "high" (TF32) and "medium" (bf16) as under "highest". bf16
    operands are exact in either internal format and accumulate in fp32; "medium" may sum in
    another order (a few fp32 ulps)."""
    before = torch.get_float32_matmul_precision()
    want = _torch_reference(dtype)
    try:
        for precision in ("high", "medium"):
            torch.set_float32_matmul_precision(precision)
            got = _torch_reference(dtype)
            if dtype == torch.bfloat16 and precision == "medium":
                for a, b in zip(got, want):
                    torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-5)
            else:
                assert all(torch.equal(a, b) for a, b in zip(got, want)), precision
    finally:
        torch.set_float32_matmul_precision(before)


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_jax_reference_ignores_default_matmul_precision(dtype):
    jax = pytest.importorskip("jax", reason="jax is not installed")
    import jax.numpy as jnp
    import rlk_xla
    rng = np.random.default_rng(4)
    jd = getattr(jnp, dtype)
    hid, w = jnp.asarray(rng.standard_normal((96, 256)), jd), jnp.asarray(rng.standard_normal((700, 256)) / 4, jd)
    t = jnp.asarray(rng.integers(0, 700, 96), jnp.int32)
    f = lambda: rlk_xla.reference.linear_logp(hid, w, t, temperature=0.7, return_entropy=True)  # noqa: E731
    want = f()
    for precision in ("default", "bfloat16"):
        with jax.default_matmul_precision(precision):
            got = f()
        assert all(np.array_equal(np.asarray(a), np.asarray(b)) for a, b in zip(got, want)), precision
    # and they equal the pinned computation
    pinned = jnp.dot(hid, w.T, preferred_element_type=jnp.float32,
                     precision=None if dtype == "bfloat16" else jax.lax.Precision.HIGHEST) / 0.7
    logp = jax.nn.log_softmax(pinned, axis=1)[jnp.arange(96), t]
    np.testing.assert_allclose(np.asarray(want[0]), np.asarray(logp), rtol=1e-6, atol=1e-5)
