"""torch_bridge.linear_logp under torch.autocast (F.linear's rule): fp32 master weights with bf16
activations give the bits of the same call with every operand cast to bf16 first, forward and
gradients (dW and the bias gradient back in fp32, as the parameters); fp32 activations are cast
too; fp64 is not (the call is the one without autocast); autocast off inside, or no autocast, and mixed dtypes raise."""
import pytest

pytest.importorskip("torch", reason="torch is not installed: these tests need it")

import torch

import torch_bridge

BF16 = torch.bfloat16


def _inputs(hidden_dtype, n=37, h=24, v=301, seed=0):
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, h, generator=gen).to(hidden_dtype).requires_grad_()
    weight = (torch.randn(v, h, generator=gen) * 2).requires_grad_()  # fp32 master weights
    bias = torch.randn(v, generator=gen).requires_grad_()
    targets = torch.randint(0, v, (n,), generator=gen)
    return hidden, weight, bias, targets


def _run(hidden, weight, bias, targets):
    logp, ent = torch_bridge.linear_logp(hidden, weight, targets, bias=bias, temperature=0.7, return_entropy=True)
    (logp.sum() + 0.5 * ent.sum()).backward()
    return logp, ent


@pytest.mark.parametrize("hidden_dtype", [BF16, torch.float32])
def test_autocast_casts_like_f_linear(hidden_dtype):
    hidden, weight, bias, targets = _inputs(hidden_dtype)
    with torch.autocast("cpu", dtype=BF16):
        logp, ent = _run(hidden, weight, bias, targets)
    leaves = [t.detach().clone().requires_grad_() for t in (hidden, weight, bias)]
    ref_logp, ref_ent = _run(*(t.to(BF16) for t in leaves), targets)
    assert torch.equal(logp, ref_logp) and torch.equal(ent, ref_ent)
    for got, ref in zip((hidden, weight, bias), leaves, strict=True):
        assert got.grad.dtype == got.dtype
        assert torch.equal(got.grad, ref.grad)


def test_no_autocast_mixed_dtypes_raise():
    hidden, weight, _, targets = _inputs(BF16)
    with pytest.raises(TypeError, match="dtype"):
        torch_bridge.linear_logp(hidden, weight, targets)
    with torch.autocast("cpu", dtype=BF16), torch.autocast("cpu", enabled=False), \
            pytest.raises(TypeError, match="dtype"):
        torch_bridge.linear_logp(hidden, weight, targets)


def test_float64_is_not_cast():
    hidden, weight, _, targets = _inputs(torch.float64)
    weight = weight.detach().double()
    with torch.autocast("cpu", dtype=BF16):
        inside = torch_bridge.linear_logp(hidden, weight, targets)
    assert torch.equal(inside, torch_bridge.linear_logp(hidden, weight, targets))
