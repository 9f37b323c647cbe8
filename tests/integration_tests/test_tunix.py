"""rlk_xla.integrations.tunix against the real google-tunix package (CPU, Tunix's own Qwen3 flax nnx
model at a tiny random config): Tunix's registered GRPO and PPO policy losses, called as its
learners call them, give the loss, the entropy and every parameter's gradient of Tunix's own path
within the error each has against the same model in float64 (ours at most twice Tunix's, up to fp32
rounding); the packed layout and the no-gradient calls (old and reference logps) agree; a few
optimizer steps run fused with no fallback; the compiled gradient holds no [B, T, V] logits."""
import pytest

jax = pytest.importorskip("jax", reason="jax is not installed: these tests need it")
pytest.importorskip("tunix", reason="google-tunix is not installed: the Tunix integration is tested against it")

import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from tunix.models.qwen3 import model as qwen3
from jax_helpers import collectives
from tunix.rl import common, function_registry
from tunix.rl.grpo.grpo_learner import GRPOConfig, TrainExample
from tunix.rl.ppo.ppo_learner import PPOConfig

import rlk_xla
from rlk_xla.integrations.tunix import use_rlk

PAD, EOS = 0, 1
TEMPERATURE = 0.7


def _config(dtype=jnp.float32, vocab=97):
    return qwen3.ModelConfig(num_layers=2, vocab_size=vocab, embed_dim=32, hidden_dim=64, num_heads=4, head_dim=8,
                             num_kv_heads=2, rope_theta=10000, norm_eps=1e-6, use_tied_embedding=False, dtype=dtype,
                             param_dtype=dtype)


@pytest.fixture(scope="module")
def params():
    """A random model's parameters, built once (an eager nnx init is slow); the head scaled to logits of
    std about 5."""
    model = qwen3.Qwen3(_config(), rngs=nnx.Rngs(0))
    model.lm_head.w[...] = model.lm_head.w[...] * 20
    return nnx.state(model, nnx.Param)


def _model(params, dtype=jnp.float32):
    """Tunix's Qwen3 holding `params` in `dtype` (abstract init, then the values)."""
    model = nnx.eval_shape(lambda: qwen3.Qwen3(_config(dtype), rngs=nnx.Rngs(0)))
    nnx.update(model, jax.tree.map(lambda x: jnp.asarray(x, dtype), params))
    return model


def _example(b=4, p=5, c=7, vocab=97, seed=0, token_advantages=False):
    rng = np.random.default_rng(seed)
    prompt = jnp.asarray(rng.integers(2, vocab, (b, p)), jnp.int32).at[0, :2].set(PAD)
    comp = jnp.asarray(rng.integers(2, vocab, (b, c)), jnp.int32).at[1, c - 2:].set(PAD)
    f32 = lambda x: jnp.asarray(x, jnp.float32)
    return TrainExample(prompt_ids=prompt, prompt_mask=prompt != PAD, completion_ids=comp,
                        completion_mask=comp != PAD, advantages=f32(rng.standard_normal((b, c) if token_advantages else b)),
                        ref_per_token_logps=f32(-rng.random((b, c)) * 5),
                        old_per_token_logps=f32(-rng.random((b, c)) * 5))


def _loss_and_grads(name, algo, model, ex):
    """The learner's policy loss, its aux and the parameters' gradients, in one compiled call."""
    loss_fn = function_registry.get_policy_loss_fn(name)
    graphdef, state = nnx.split(model)
    f = lambda s: loss_fn(nnx.merge(graphdef, s), ex, algo_config=algo, pad_id=PAD, eos_id=EOS)
    (loss, aux), grads = jax.jit(jax.value_and_grad(f, has_aux=True))(state)
    return loss, aux, grads


def _to64(tree):
    return jax.tree.map(lambda x: np.asarray(x, np.float64), tree)


def _err(x, ref):
    return float(np.max(np.abs(np.asarray(x, np.float64) - ref)))


def _algo(name):
    if name == "ppo":  # its loss scores at temperature 1
        return PPOConfig(entropy_coef=0.01)
    algo = GRPOConfig(num_generations=2, beta=0.04)
    algo.temperature = TEMPERATURE  # the learner sets it from the rollout config
    return algo


@pytest.mark.parametrize("name", ["grpo", "ppo"])
def test_policy_loss_and_gradients_match_tunix(params, name):
    algo, ex = _algo(name), _example(token_advantages=name == "ppo")  # PPO's advantages are per token
    model = _model(params)
    loss_t, aux_t, g_t = _loss_and_grads(name, algo, model, ex)
    with jax.enable_x64(True):
        m64 = _model(params, jnp.float64)
        ex64 = jax.tree.map(lambda x: x.astype(jnp.float64) if x.dtype == jnp.float32 else x, ex)
        loss_64, aux_64, g_64 = _to64(_loss_and_grads(name, algo, m64, ex64))
    rlk_xla.reset_route_stats()
    with use_rlk():
        loss_r, aux_r, g_r = _loss_and_grads(name, algo, model, ex)
    assert rlk_xla.route_stats()["fallback_total"] == 0

    floor = 64 * 2.0 ** -24
    assert _err(loss_r, loss_64) <= max(2 * _err(loss_t, loss_64), floor * abs(float(loss_64)))
    key = "entropy" if name == "grpo" else "loss/entropy"
    assert _err(aux_r[key], aux_64[key]) <= max(2 * _err(aux_t[key], aux_64[key]), floor * abs(float(aux_64[key])))
    flat = lambda g: [np.asarray(x, np.float64) for x in jax.tree.leaves(g)]
    for ours, theirs, ref in zip(flat(g_r), flat(g_t), flat(g_64), strict=True):
        scale = float(np.max(np.abs(ref)))
        assert _err(ours, ref) <= max(2 * _err(theirs, ref), floor * scale)


def test_packed_and_no_gradient_calls_match_tunix(params):
    model = _model(params)
    graphdef, state = nnx.split(model)
    ex = _example()
    tokens = jnp.concatenate([ex.prompt_ids, ex.completion_ids], axis=1)
    seg = (tokens != PAD).astype(jnp.int32)
    pos = jnp.broadcast_to(jnp.arange(tokens.shape[1]), tokens.shape)
    calls = [{"prompt_tokens": ex.prompt_ids, "completion_tokens": ex.completion_ids},
             {"prompt_tokens": tokens[:, :0], "completion_tokens": tokens, "segment_ids": seg, "segment_positions": pos}]
    for kw in calls:
        theirs = common.compute_per_token_logps(graphdef, state, pad_id=PAD, eos_id=EOS, temperature=TEMPERATURE, **kw)
        with use_rlk():
            ours = common.compute_per_token_logps(graphdef, state, pad_id=PAD, eos_id=EOS, temperature=TEMPERATURE,
                                                  **kw)
        assert ours.shape == theirs.shape
        np.testing.assert_allclose(ours, theirs, rtol=0, atol=2e-5 * float(jnp.max(jnp.abs(theirs))))


def test_a_few_steps_run_fused_with_no_fallback(params):
    graphdef, state = nnx.split(_model(params))
    algo, loss_fn, opt = _algo("grpo"), function_registry.get_policy_loss_fn("grpo"), optax.sgd(1e-2)
    f = lambda s, ex: loss_fn(nnx.merge(graphdef, s), ex, algo_config=algo, pad_id=PAD, eos_id=EOS)[0]
    rlk_xla.reset_route_stats()
    with use_rlk():
        step = jax.jit(jax.value_and_grad(f))
        opt_state = opt.init(state)
        for i in range(3):
            loss, grads = step(state, _example(seed=i))
            updates, opt_state = opt.update(grads, opt_state)
            state = optax.apply_updates(state, updates)
            assert np.isfinite(float(loss))
    stats = rlk_xla.route_stats()
    assert stats["fallback_total"] == 0 and stats["reference"]["calls"] == 0
    assert stats["backends"]["cpu"]["bwd_calls"] == 3


def test_compiled_gradient_holds_no_logits():
    b, t, v = 2, 16, 4099
    model = nnx.eval_shape(lambda: qwen3.Qwen3(_config(vocab=v), rngs=nnx.Rngs(0)))  # compiled, never run
    algo, ex = _algo("grpo"), _example(b=b, p=8, c=t, vocab=v)
    graphdef, state = nnx.split(model)

    def temp_bytes():
        loss_fn = function_registry.get_policy_loss_fn("grpo")
        f = lambda s: loss_fn(nnx.merge(graphdef, s), ex, algo_config=algo, pad_id=PAD, eos_id=EOS)[0]
        return jax.jit(jax.grad(f)).lower(state).compile().memory_analysis().temp_size_in_bytes

    theirs = temp_bytes()
    with use_rlk():
        ours = temp_bytes()
    logits = b * (8 + t) * v * 4
    assert ours + logits < theirs, (ours, theirs)


def test_restore_puts_tunix_back():
    native = common.compute_per_token_logps
    handle = use_rlk()
    assert common.compute_per_token_logps is not native
    with pytest.raises(RuntimeError, match="already in effect"):
        use_rlk()
    handle.restore()
    assert common.compute_per_token_logps is native


def test_a_vocab_sharded_head_under_plain_jit_is_not_gathered():
    """Tunix's learner over a model whose LM head ([D, V] einsum) is sharded over the vocab on 4
    CPU devices, called as Tunix calls it (jax.jit over placed arrays, no mesh set): the op
    partitions itself (rlk_xla.gspmd), so the compiled gradient gathers nothing vocab-sized, and the
    loss has the unsharded call's bits (the op is TP invariant)."""
    from jax.sharding import NamedSharding, PartitionSpec as P
    if len(jax.devices("cpu")) < 4:
        pytest.skip("needs 4 CPU devices (tests/conftest.py)")
    v = 128  # divisible by the 4 shards
    mesh = jax.make_mesh((4,), ("tp",), axis_types=(jax.sharding.AxisType.Auto,), devices=jax.devices("cpu")[:4])
    model = qwen3.Qwen3(_config(vocab=v), rngs=nnx.Rngs(1))
    model.lm_head.w[...] = model.lm_head.w[...] * 20
    graphdef, state = nnx.split(model)
    algo, ex = _algo("grpo"), _example(vocab=v)
    loss_fn = function_registry.get_policy_loss_fn("grpo")
    f = jax.jit(jax.value_and_grad(lambda s: loss_fn(nnx.merge(graphdef, s), ex, algo_config=algo, pad_id=PAD,
                                                     eos_id=EOS)[0]))
    replicated = NamedSharding(mesh, P())
    placed = jax.tree.map(lambda x: jax.device_put(x, replicated), state)
    placed["lm_head"]["w"] = jax.device_put(state["lm_head"]["w"], NamedSharding(mesh, P(None, "tp")))
    rlk_xla.reset_route_stats()
    with use_rlk():
        loss, grads = f(placed)
        hlo = f.lower(placed).compile().as_text()
        loss_1, grads_1 = f(state)  # one device
    gathers = [shape for op, shapes in collectives(hlo) if op == "all-gather" for shape in shapes]
    assert not [s for s in gathers if str(v) in s], gathers  # neither the head nor logits
    assert rlk_xla.route_stats()["fallback_total"] == 0
    assert np.asarray(loss).tobytes() == np.asarray(loss_1).tobytes()
    for ours, one in zip(jax.tree.leaves(grads), jax.tree.leaves(grads_1), strict=True):
        np.testing.assert_allclose(np.asarray(ours), np.asarray(one), rtol=1e-5, atol=1e-6)
    assert grads["lm_head"]["w"].sharding.is_equivalent_to(placed["lm_head"]["w"].sharding, 2)
