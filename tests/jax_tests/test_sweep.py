"""A seeded randomized sweep over shapes, dtypes, options and modes against the float64 oracle."""
import pytest

pytest.importorskip("jax", reason="jax is not installed: these tests need it")

import numpy as np

import rlk_xla
import oracle
from jax_helpers import DTYPES, make_inputs, value_and_grads

SEEDS = range(300)


def draw(seed):
    r = np.random.default_rng(10_000 + seed)
    v = int(r.choice([7, 64, 100, 129, 333, 512, 1000, 1111]))
    return dict(
        n=int(r.choice([1, 2, 3, 5, 17, 64, 65, 130])), h=int(r.choice([1, 8, 16, 33, 64, 96])), v=v,
        dtype=str(r.choice(list(DTYPES))), bias=bool(r.random() < 0.5),
        temp=str(r.choice(["scalar", "array", "none"])), ignore_frac=float(r.choice([0.0, 0.0, 0.3])),
        real_vocab=int(r.integers(1, v + 1)) if r.random() < 0.3 else None, entropy=bool(r.random() < 0.6),
        mode=str(r.choice(["auto", "strict", "audit", "off"])), scale=float(r.choice([0.5, 3.0, 12.0])),
        backward=str(r.choice(["auto", "fast", "lean"])))


@pytest.mark.parametrize("seed", SEEDS)
def test_random_case(seed):
    c = draw(seed)
    d, kw, g, e = make_inputs(seed, c["n"], c["h"], c["v"], c["dtype"], bias=c["bias"],
                              temp=None if c["temp"] == "none" else c["temp"], ignore_frac=c["ignore_frac"],
                              real_vocab=c["real_vocab"], scale=c["scale"])
    fn = lambda *a, **k: rlk_xla.linear_logp(*a, mode=c["mode"], backward=c["backward"], **k)
    # auto is fast at these sizes; "off" runs the reference, whose gradient keeps no logits
    kept_fp16 = c["backward"] != "lean" and c["mode"] != "off" and c["dtype"] != "float32"
    logp, ent, grads = value_and_grads(fn, d, kw, g, e, with_entropy=c["entropy"])
    ref = oracle.linear_logp(d["hidden"], d["weight"], d["targets"], bias=kw.get("bias"),
                             temperature=kw.get("temperature", 1.0), real_vocab=c["real_vocab"], g=g,
                             e=e if c["entropy"] else None, kept_fp16=kept_fp16,
                             dlogit_dtype=oracle.cpu_dlogit_dtype(c["dtype"]) if c["mode"] != "off" else None)
    oracle.assert_values(logp, ref["logp"], f"logp {c}")
    if c["entropy"]:
        oracle.assert_values(ent, ref["entropy"], f"entropy {c}")
    oracle.assert_grads(grads, ref, c["dtype"], f"{c} ")
