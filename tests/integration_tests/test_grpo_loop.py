"""The whole RL loop, short (examples/grpo_torch.py, examples/grpo_jax.py; docs/rl_loop.md): rollout
with a KV cache scored by score_sampled under the sampler's nucleus, the trainer through the vime
provider, GRPO updates, sampling again with the new weights. At every step: (a) 0 mismatches (the
trainer's op on the rollout's hidden rows), fallback_total 0, the rollout and the trainer saw the
same LM-head weights, the loss finite; at TP 2 (gloo) too, the replicas in step. The first drifting
layer is reported where (b) differs. And the capture helper itself (rlk_common.diagnostics)."""
import os
import sys

import numpy as np
import pytest

pytest.importorskip("torch", reason="torch is not installed: these tests need it")
pytest.importorskip("transformers", reason="transformers is not installed: the loop's model needs it")

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "examples"))
import grpo_common as G

from rlk_common.diagnostics import CaptureLayers, first_drift


def test_torch_loop_short(tmp_path):
    import grpo_torch
    grpo_torch.main(["--steps", "20", "--out", str(tmp_path), "--no-plot", "--drift-every", "10"])
    rows = G.load(str(tmp_path))
    assert len(rows) == 20
    G.check_short_run(rows)
    assert all(r["a"]["rlk_dlogp_tokens"] == 64 * 8 for r in rows)
    assert all(r["b"]["rlk_dlogp_nonfinite"] == 0 and r["b"]["rlk_dlogp_max_abs"] < 1e-3 for r in rows)
    # where the recompute's logp drifts, the capture names the first layer whose output differs
    checked = [r for r in rows if r["drift_checked"]]
    assert [r["step"] for r in checked] == [0, 10]
    for r in checked:
        if r["b"]["rlk_dlogp_mismatches"]:
            assert r["drift"] is not None and r["drift"]["differing"] > 0, r
    assert len({r["fingerprint_rollout"] for r in rows}) == 20  # the weights move every step


def test_torch_loop_tp2_short(tmp_path):
    import grpo_torch
    grpo_torch.main(["--steps", "6", "--tp", "2", "--out", str(tmp_path), "--no-plot", "--drift-every", "0"])
    rows = G.load(str(tmp_path))
    assert len(rows) == 6
    G.check_short_run(rows)
    assert all(r["tp"] == 2 and r["replicas_equal"] for r in rows)


def test_mixed_arm_reports_the_native_rollouts_gap(tmp_path):
    """A fused trainer against a native rollout: (a) is the native head's own gap, reported as measured
    (not asserted 0), every other check holds."""
    import grpo_torch
    grpo_torch.main(["--arm", "mixed", "--steps", "3", "--out", str(tmp_path), "--no-plot", "--drift-every", "0"])
    rows = G.load(str(tmp_path))
    G.check_short_run(rows, head_aligned=False)
    assert all(r["a"]["rlk_dlogp_max_abs"] < 1e-3 for r in rows)


def test_jax_loop_short(tmp_path):
    pytest.importorskip("flax", reason="flax is not installed: the JAX twin needs it")
    pytest.importorskip("optax", reason="optax is not installed: the JAX twin needs it")
    import grpo_jax
    grpo_jax.main(["--steps", "5", "--out", str(tmp_path), "--no-plot", "--drift-every", "2"])
    rows = G.load(str(tmp_path))
    G.check_short_run(rows)


def test_first_drift_names_the_first_differing_layer():
    a = {"embed": np.ones((2, 3, 4), np.float32), "layer0": np.zeros((2, 3, 4), np.float32),
         "layer1": np.zeros((2, 3, 4), np.float32)}
    assert first_drift(a, {k: v.copy() for k, v in a.items()}) is None
    b = {k: v.copy() for k, v in a.items()}
    b["layer0"][1, 2, 3] = np.float32(-0.0)  # a sign bit: equal as numbers, not as bits
    b["layer1"][0, 0, 0] = 1.0
    d = first_drift(a, b)
    assert (d.layer, d.differing, d.elements, d.sample, d.position, d.feature, d.max_abs) == ("layer0", 1, 24, 1, 2, 3, 0.0)
    with pytest.raises(ValueError, match="shape"):
        first_drift({"x": np.zeros((2, 3))}, {"x": np.zeros((2, 4))})
    with pytest.raises(ValueError, match="decode side only"):
        first_drift({"x": np.zeros(2)}, {})


def test_capture_layers_decode_against_the_full_forward():
    """Hooks on a Qwen3's layers: a prefill plus one call per decoded token, concatenated along the
    positions, against one forward over the whole sequence; a bf16 activation compared by its bits."""
    import transformers
    torch.manual_seed(0)
    cfg = transformers.Qwen3Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, head_dim=8)
    model = transformers.Qwen3ForCausalLM(cfg).eval()
    mods = {"embed": model.model.embed_tokens, **{f"layer{i}": m for i, m in enumerate(model.model.layers)}}
    ids = torch.randint(0, 64, (3, 6))
    kw = {"cache": transformers.DynamicCache(), "use_cache": True}
    with torch.no_grad(), CaptureLayers(mods) as dec:
        model.model(input_ids=ids[:, :4], **kw)
        for t in (4, 5):
            model.model(input_ids=ids[:, t:t + 1], **kw)
    with torch.no_grad(), CaptureLayers(mods) as full:
        model.model(input_ids=ids)
    joined = dec.joined(1)
    assert joined["layer1"].shape == (3, 6, 32) and len(dec.calls["embed"]) == 3
    assert not model.model.embed_tokens._forward_hooks  # removed on exit
    trained = {k: v[0] for k, v in full.calls.items()}
    assert first_drift({"embed": joined["embed"]}, {"embed": trained["embed"]}) is None
    shifted = {k: v.clone() for k, v in trained.items()}
    shifted["layer1"] = (shifted["layer1"].bfloat16() + 1).float()
    d = first_drift({k: joined[k].bfloat16() for k in ("embed", "layer1")},
                    {k: shifted[k].bfloat16() for k in ("embed", "layer1")})
    assert d is not None and d.layer == "layer1"
