"""torch_bridge.integrations.trl against the real trl package (GRPOTrainer, CPU, a tiny random
Qwen3ForCausalLM, a local word-level tokenizer, no downloads): on the same completions, the policy's
loss and every parameter's gradient, and the reference model's logps, equal TRL's own fused head
within the error each path has against a float64 head (ours at most that of TRL's, up to fp32
rounding); a few GRPO steps run with no fallback; the heads it cannot serve are refused."""
import tempfile

import pytest

pytest.importorskip("torch", reason="torch is not installed: these tests need it")
trl = pytest.importorskip("trl", reason="trl is not installed: the TRL integration is tested against it")

import torch
from datasets import Dataset
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast, Qwen3Config, Qwen3ForCausalLM

import torch_bridge
from torch_bridge.integrations.trl import add_fused_lm_head, use_rlk

F64 = torch.float64
WORDS = [f"w{i}" for i in range(90)]
TEMPERATURE = 0.7


def _tokenizer():
    vocab = {w: i for i, w in enumerate(["<pad>", "<eos>", "<unk>", *WORDS])}
    tk = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tk, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>")


def _model(dtype=torch.float32):
    # V = 97 (no tile's multiple); logits of std about 5 once the head is scaled up
    config = Qwen3Config(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=64,
                         tie_word_embeddings=False, pad_token_id=0, eos_token_id=1, bos_token_id=None)
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(config).to(dtype)
    with torch.no_grad():
        model.lm_head.weight.mul_(150)
    return model


def _reward(completions, **_):
    return [float(sum(w in c for w in ("w3", "w7", "w11")) + 0.1 * len(c)) for c in completions]


def _trainer(model, max_steps=1):
    """A GRPOTrainer with a reference model (beta > 0: TRL loads it from the policy's path) and an
    entropy bonus (the entropy's gradient flows)."""
    path = tempfile.mkdtemp(prefix="rlk-trl-model-")
    model.save_pretrained(path)
    model.config._name_or_path = path
    ds = Dataset.from_dict({"prompt": [" ".join(WORDS[i:i + 3]) for i in range(0, 48, 3)]})
    args = trl.GRPOConfig(output_dir=tempfile.mkdtemp(prefix="rlk-trl-"), per_device_train_batch_size=4,
                          num_generations=4, max_completion_length=6, max_steps=max_steps, learning_rate=1e-3,
                          logging_steps=1, report_to=[], save_strategy="no", use_cpu=True, temperature=TEMPERATURE,
                          seed=0, bf16=False, beta=0.04, entropy_coef=0.01, disable_tqdm=True)
    tr = trl.GRPOTrainer(model=model, reward_funcs=_reward, args=args, train_dataset=ds, processing_class=_tokenizer())
    tr.current_gradient_accumulation_steps = 1  # set by train(); compute_loss reads it
    return tr


def _float64_head(model, temperature):
    """The fused-head contract computed from the full logits in float64 (the oracle)."""
    from trl.trainer.utils import FusedCausalLMOutput

    def forward(*args, fused_lm_head, labels, **kwargs):
        hidden = model.base_model(*args, **kwargs).last_hidden_state[:, :-1]
        labels = labels[:, 1:]
        mask = labels != -100
        logits = (hidden @ model.lm_head.weight.T) / temperature
        lsm = logits.log_softmax(-1)
        logp = lsm.gather(-1, labels.clamp(min=0)[..., None])[..., 0].masked_fill(~mask, 0)
        ent = -(lsm.exp() * lsm).sum(-1).masked_fill(~mask, 0)
        return FusedCausalLMOutput(loss=-logp.sum() / mask.sum(), log_probs=logp, entropy=ent, label_mask=mask)

    model.forward = forward


def _loss_and_grads(tr, model, inputs):
    model.zero_grad()
    loss = tr.compute_loss(model, inputs)
    loss.backward()
    return loss.detach().to(F64), {n: p.grad.detach().to(F64) for n, p in model.named_parameters()}


def _err(x, ref):
    return (x - ref).abs().max().item()


def test_grpo_loss_and_gradients_match_trls_head():
    tr = _trainer(_model())
    with torch.no_grad():  # the policy moves away from the reference model: a nonzero KL term
        for p in tr.model.parameters():
            p.add_(torch.randn_like(p) * 0.02 * p.abs().mean())
    batch = [tr.train_dataset[i] for i in range(4)]
    torch.manual_seed(1)
    inputs = tr._generate_and_score_completions(batch)
    loss_trl, g_trl = _loss_and_grads(tr, tr.model, inputs)

    m64 = _model(F64)
    m64.load_state_dict(tr.model.state_dict())
    _float64_head(m64, TEMPERATURE)
    loss_64, g_64 = _loss_and_grads(tr, m64, inputs)

    use_rlk(tr)
    torch_bridge.reset_route_stats()
    torch.manual_seed(1)
    inputs_rlk = tr._generate_and_score_completions(batch)  # the same completions; the ref logps through us
    assert torch.equal(inputs_rlk["completion_ids"], inputs["completion_ids"])
    loss_rlk, g_rlk = _loss_and_grads(tr, tr.model, inputs)
    stats = torch_bridge.route_stats()
    assert stats["fallback_total"] == 0 and stats["backends"]["cpu"]["bwd_calls"] == 1

    # Each path's error against float64 is the fp32 backbone's rounding (shared) plus its head's: ours
    # within twice TRL's, or under 64 fp32 roundings of the value's size
    floor = 64 * 2.0 ** -24
    assert _err(loss_rlk, loss_64) <= max(2 * _err(loss_trl, loss_64), floor * loss_64.abs().item())
    for name, ref in g_64.items():
        scale = ref.abs().max().item()
        assert _err(g_rlk[name], ref) <= max(2 * _err(g_trl[name], ref), floor * scale), name
    # the reference model's logps (no gradient), the same rows
    ref_trl, ref_rlk = inputs["ref_per_token_logps"], inputs_rlk["ref_per_token_logps"]
    assert _err(ref_rlk.to(F64), ref_trl.to(F64)) <= 1e-4 * ref_trl.abs().max().item()


def test_grpo_steps_run_fused_with_no_fallback():
    tr = use_rlk(_trainer(_model(), max_steps=3))
    torch_bridge.reset_route_stats()
    tr.train()
    stats = torch_bridge.route_stats()
    assert stats["fallback_total"] == 0 and stats["reference"]["calls"] == 0
    assert stats["backends"]["cpu"]["bwd_calls"] == 3
    assert all(torch.isfinite(p).all() for p in tr.model.parameters())


def test_generation_and_plain_forward_unchanged():
    model = _model()
    ids = torch.tensor([[3, 4, 5, 6]])
    before = model(input_ids=ids).logits
    add_fused_lm_head(model, 0.5)
    assert torch.equal(model(input_ids=ids).logits, before)
    out = model(input_ids=ids, labels=torch.tensor([[-100, 4, -100, 6]]), fused_lm_head=True)
    assert out.log_probs.shape == (1, 3) and out.entropy is None
    # the labels shift by one: rows 0 and 2 are scored, row 1 is zero (TRL's contract)
    assert out.log_probs[0, 1] == 0 and out.log_probs[0, 0] < 0 and out.log_probs[0, 2] < 0
    assert out.label_mask.tolist() == [[True, False, True]]


@pytest.mark.parametrize("softcap, outputs, match", [
    (30.0, ("log_probs",), "final_logit_softcapping"),
    (None, ("log_probs", "is_top1"), "is_top1"),
])
def test_refused_heads(softcap, outputs, match):
    model = _model()
    model.config.final_logit_softcapping = softcap
    with pytest.raises(ValueError, match=match):
        add_fused_lm_head(model, 1.0, outputs=outputs)


def test_not_a_trl_trainer():
    with pytest.raises(TypeError, match="GRPOTrainer"):
        use_rlk(object())


def test_bf16_autocast_as_trl_runs_an_fp32_model():
    """TRL with bf16=True runs an fp32 model under torch.autocast: bf16 activations meet the fp32 head,
    which the op casts as F.linear does. On the same (bf16) final hidden states, the logps and the head's
    gradient are within twice TRL's own error against a float64 head of the bf16-rounded operands."""
    ids = torch.randint(3, 93, (2, 12), generator=torch.Generator().manual_seed(0))
    labels = ids.clone()
    labels[:, :5] = -100
    out, hidden = {}, {}
    for name in ("trl", "rlk"):
        model = _model()
        (trl.trainer.utils.add_fused_lm_head if name == "trl" else add_fused_lm_head)(model, temperature=TEMPERATURE)
        model.model.norm.register_forward_hook(lambda m, i, o, name=name: hidden.__setitem__(name, o.detach()))
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logp = model(input_ids=ids, labels=labels, fused_lm_head=True).log_probs
        logp.sum().backward()
        out[name] = (logp.detach().to(F64), model.lm_head.weight.grad.to(F64))
    assert torch.equal(hidden["trl"], hidden["rlk"])
    # the float64 head of the bf16-rounded operands (autocast's cast passes the gradient straight to W)
    w = _model().lm_head.weight.detach().to(F64).requires_grad_()
    w_bf16 = w + (w.to(torch.bfloat16).to(F64) - w).detach()
    h = hidden["trl"][:, :-1].to(torch.bfloat16).to(F64)
    mask = labels[:, 1:] != -100
    lsm = (h @ w_bf16.T / TEMPERATURE).log_softmax(-1)
    logp = lsm.gather(-1, labels[:, 1:].clamp(min=0)[..., None])[..., 0].masked_fill(~mask, 0)
    logp.sum().backward()
    for i, ref in enumerate((logp.detach(), w.grad)):
        assert _err(out["rlk"][i], ref) <= max(2 * _err(out["trl"][i], ref), 64 * 2.0 ** -24 * ref.abs().max().item())
