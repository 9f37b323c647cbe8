"""A top-p nucleus (keep_mask) in the fused CPU kernels: logp over the nucleus, the entropy of the
whole distribution, and the gradients of both (hidden, weight, bias, temperature), against float64
at odd shapes for bf16 and fp32 with the lean and the fast backward; the edge cases (a target outside
its nucleus, an empty nucleus, NaN inputs); bits that do not depend on the row split or on the
mask for what the mask must not change; torch.compile(fullgraph=True). The same on CUDA (`-m gpu`),
where a mask runs the portable forward kernel also on Hopper and lean's cuBLAS path.
TP 2 and 4: test_torch_tp.py; the vime provider: test_vime.py."""
import pytest

pytest.importorskip("torch", reason="torch is not installed: these tests need it")

import numpy as np
import torch

import oracle
import torch_bridge
from torch_helpers import GPU, make_inputs, to_np

DEVICES = ["cpu", GPU]

F64 = torch.float64
NEG_INF = float("-inf")


def nucleus(d, kw, frac=0.3, seed=0):
    """A random keep mask [n, v] holding each row's target and argmax (as a top-p nucleus does), on
    the inputs' device."""
    h, w = d["hidden"].double().cpu(), d["weight"].double().cpu()
    z = h @ w.T + (kw["bias"].double().cpu() if "bias" in kw else 0.0)
    n, v = z.shape
    keep = torch.rand(n, v, generator=torch.Generator().manual_seed(seed)) < frac
    rows = torch.arange(n)
    keep[rows, z.argmax(dim=1)] = True
    t = d["targets"].cpu()
    ok = t >= 0
    keep[rows[ok], t[ok]] = True
    return keep.to(d["hidden"].device)


def run(d, kw, g, e, keep, backward, leaves=("hidden", "weight", "bias", "temperature"), drop_nonfinite=True):
    """logp, entropy and the gradients of sum g*logp + e*entropy (drop_nonfinite: rows of NaN or
    -inf logp left out, as a loss would)."""
    xs = {k: (d[k] if k in d else kw[k]).detach().clone().requires_grad_() for k in leaves
          if k in d or isinstance(kw.get(k), torch.Tensor)}
    kwargs = {**kw, **{k: xs[k] for k in ("bias", "temperature") if k in xs}}
    logp, ent = torch_bridge.linear_logp(xs["hidden"], xs["weight"], d["targets"], return_entropy=True,
                                         keep_mask=keep, mode="strict", backward=backward, **kwargs)
    if drop_nonfinite:
        logp_in, ent_in = logp.nan_to_num(0.0, 0.0, 0.0), ent.nan_to_num(0.0)
    else:
        logp_in, ent_in = logp, ent
    loss = (logp_in * g).sum() + (ent_in * e).sum()
    grads = dict(zip(xs, torch.autograd.grad(loss, list(xs.values()))))
    return logp.detach(), ent.detach(), grads


def ref_of(d, kw, g, e, keep, kept_fp16=False):
    """float64; on CUDA with dlogit rounded to the operand dtype before the gradient GEMMs."""
    temp = kw.get("temperature", 1.0)
    cuda = d["hidden"].device.type == "cuda"
    return oracle.linear_logp(to_np(d["hidden"]), to_np(d["weight"]), d["targets"].cpu().numpy(),
                              bias=to_np(kw["bias"]) if "bias" in kw else None,
                              temperature=to_np(temp) if isinstance(temp, torch.Tensor) else temp,
                              real_vocab=kw.get("real_vocab_size"), g=to_np(g), e=to_np(e),
                              nucleus=keep.cpu().numpy(), kept_fp16=kept_fp16,
                              dlogit_dtype=str(d["hidden"].dtype).split(".")[1] if cuda
                              else oracle.cpu_dlogit_dtype(str(d["hidden"].dtype).split(".")[1]))


def check(out, ref, dtype, what, plain=None):
    """Values and gradients against the oracle; dT against `plain` (lean's tolerance) when given:
    the fast backward's dT comes from fp32 moments, not from the fp16 record."""
    logp, ent, grads = out
    oracle.assert_values(to_np(logp), ref["logp"], f"{what} logp")
    oracle.assert_values(to_np(ent), ref["entropy"], f"{what} entropy")
    for name, key in (("hidden", "dh"), ("weight", "dw"), ("bias", "db"), ("temperature", "dtemp")):
        if name in grads:
            r = plain if (plain is not None and key == "dtemp") else ref
            oracle.assert_grad(to_np(grads[name]), r[key], "float32" if key == "dtemp" else dtype,
                               f"{what} d{name}", r[key + "_abs"])


# V = 1000: chunks of 125 (the CPU's 64-column tiles cut them); h = 128: the sm90 kernel's shapes,
# which a masked call leaves for the portable kernel
SHAPES = [(1, 24, 1000), (3, 40, 4097), (127, 40, 1000), (300, 128, 4097)]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize("n,h,v", SHAPES)
def test_nucleus_against_float64(n, h, v, dtype, device):
    d, kw, g, e = make_inputs(n, n, h, v, dtype, bias=True, temp="array", ignore_frac=0.1 if n > 1 else 0.0,
                              real_vocab=v - 37 if n == 127 else None, device=device)
    keep = nucleus(d, kw, seed=n)
    ref = ref_of(d, kw, g, e, keep)
    lean = run(d, kw, g, e, keep, "lean")
    fast = run(d, kw, g, e, keep, "fast")
    check(lean, ref, dtype, "lean")
    check(fast, ref_of(d, kw, g, e, keep, kept_fp16=dtype != "float32"), dtype, "fast", plain=ref)
    assert torch.equal(lean[0], fast[0]) and torch.equal(lean[1], fast[1])
    if dtype == "float32" and device == "cpu":  # fast reads the very z lean recomputes
        assert all(torch.equal(lean[2][k], fast[2][k]) for k in lean[2])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("backward", ["lean", "fast"])
def test_nucleus_is_all_the_mask_changes(backward, device):
    """The entropy (and the statistics under it) are the unmasked call's bits (on CUDA, h = 32: the
    portable kernel either way); an all-True mask gives the unmasked logp; rows are independent:
    any row split gives the same bits."""
    d, kw, g, e = make_inputs(5, 70, 32, 1024, "bfloat16", bias=True, temp="array", ignore_frac=0.2, device=device)
    keep = nucleus(d, kw)
    masked = run(d, kw, g, e, keep, backward)
    plain = torch_bridge.linear_logp(d["hidden"], d["weight"], d["targets"], return_entropy=True, **kw)
    assert torch.equal(masked[1], plain[1])
    everything = run(d, kw, g, e, torch.ones_like(keep), backward)
    np.testing.assert_allclose(to_np(everything[0]), to_np(plain[0]), rtol=0, atol=2e-6)
    parts = [torch_bridge.linear_logp(d["hidden"][sl], d["weight"], d["targets"][sl], return_entropy=True,
                                      keep_mask=keep[sl], bias=kw["bias"], temperature=kw["temperature"][sl])
             for sl in (slice(0, 1), slice(1, 38), slice(38, 70))]
    assert torch.equal(torch.cat([p[0] for p in parts]), masked[0])
    assert torch.equal(torch.cat([p[1] for p in parts]), masked[1])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("backward", ["lean", "fast"])
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_nucleus_edge_cases(dtype, backward, device):
    """A target outside its nucleus: logp -inf (its row's gradient: -g p_kept, finite); a row that
    keeps nothing: logp NaN (entropy unmasked, finite) and NaN gradients on its row; NaN hidden:
    NaN logp and entropy."""
    d, kw, g, e = make_inputs(11, 9, 16, 300, dtype, bias=True, temp="array", device=device)
    keep = nucleus(d, kw)
    t = d["targets"]
    keep[1, t[1]] = False
    keep[1, (t[1] + 1) % 300] = True
    out = run(d, kw, g, e, keep, backward, drop_nonfinite=False)  # g reaches the -inf row
    ref = ref_of(d, kw, g, e, keep)
    assert out[0][1] == NEG_INF and ref["logp"][1] == NEG_INF
    check(out, ref, dtype, "target outside", plain=ref)

    empty = keep.clone()
    empty[2] = False
    logp, ent, grads = run(d, kw, g, e, empty, backward)
    assert torch.isnan(logp[2]) and torch.isfinite(ent).all()
    assert torch.isnan(grads["hidden"][2]).all() and torch.isfinite(grads["hidden"][[0, 1, 3]]).all()
    assert torch.isfinite(logp[[0, 3, 4]]).all()

    # a nucleus whose kept logits all underflow against the row max (the target kept, > 87 nats
    # below it): NaN, not the +inf - clamped to 0 - that its empty sum would give
    far = keep.clone()
    far[3] = False
    far[3, t[3]] = True
    kw_far = dict(kw, bias=kw["bias"].clone())
    kw_far["bias"][t[3]] = -1000.0
    logp, ent, grads = run(d, kw_far, g, e, far, backward)
    assert torch.isnan(logp[3]) and torch.isfinite(ent[3]) and torch.isnan(grads["hidden"][3]).all()

    d["hidden"] = d["hidden"].clone()
    d["hidden"][4, 3] = float("nan")
    logp, ent, _ = run(d, kw, g, e, keep, backward)
    assert torch.isnan(logp[4]) and torch.isnan(ent[4]) and torch.isfinite(logp[[0, 2, 3]]).all()


def test_keep_mask_is_checked():
    d, kw, g, e = make_inputs(1, 6, 16, 100, "float32")
    h, w, t = d["hidden"], d["weight"], d["targets"]
    with pytest.raises(TypeError, match="keep_mask must be a bool"):
        torch_bridge.linear_logp(h, w, t, keep_mask=torch.ones(6, 100))
    with pytest.raises(ValueError, match="keep_mask must be shaped"):
        torch_bridge.linear_logp(h, w, t, keep_mask=torch.ones(6, 99, dtype=torch.bool))
    # leading dims like the targets', and the reference (mode off) applies the mask alike
    keep = nucleus(d, kw).reshape(2, 3, 100)
    got = torch_bridge.linear_logp(h.reshape(2, 3, 16), w, t.reshape(2, 3), keep_mask=keep, mode="strict")
    off = torch_bridge.linear_logp(h.reshape(2, 3, 16), w, t.reshape(2, 3), keep_mask=keep, mode="off")
    assert got.shape == (2, 3)
    np.testing.assert_allclose(got.numpy(), off.numpy(), rtol=2e-5, atol=2e-5)


def test_torch_compile_fullgraph_with_a_nucleus():
    torch._dynamo.reset()
    d, kw, g, e = make_inputs(4, 37, 32, 500, "bfloat16", bias=True, temp="array", ignore_frac=0.2)
    keep = nucleus(d, kw)

    def f(h, w, b, t, keep):
        logp, ent = torch_bridge.linear_logp(h, w, t, bias=b, temperature=kw["temperature"], keep_mask=keep,
                                             return_entropy=True, backward="fast")
        return (logp * g).sum() + (ent * e).sum(), logp, ent

    outs = []
    for fn in (f, torch.compile(f, fullgraph=True)):
        leaves = [x.detach().clone().requires_grad_() for x in (d["hidden"], d["weight"], kw["bias"])]
        loss, logp, ent = fn(*leaves, d["targets"], keep)
        outs.append([logp, ent, *torch.autograd.grad(loss, leaves)])
    assert all(torch.equal(a, b) for a, b in zip(*outs))
