"""Megatron-core glue: selected-token logp and entropy from a GPTModel's final hidden states and
its output layer, without Megatron ever producing the logits.

    with torch_bridge.integrations.megatron.hidden_states_only(model):
        hidden = model(input_ids, position_ids, attention_mask)     # [s(/TP with SP), b, h]
    logp, ent = torch_bridge.integrations.megatron.linear_logp(model, hidden, labels, return_entropy=True)

What Megatron's output layer would do, done here: the weight is the output layer's, or the input
embedding's when they are tied (model.shared_embedding_or_output_weight()); with sequence
parallelism the hidden rows are all-gathered over the tensor-parallel group (their gradient
reduce-scattered back), without it the gradient of the replicated hidden is all-reduced; the
vocab is this rank's shard of the padded vocab (ids >= real_vocab_size are padding); only the last
pipeline stage (model.post_process) has an output layer. Gradients reach the decoder (through
hidden) and the output (or embedding) weight.
"""
from __future__ import annotations

import contextlib

import torch

from ..linear_logp import linear_logp as _linear_logp


@contextlib.contextmanager
def hidden_states_only(model):
    """Inside, model(...) returns the decoder's final hidden states [s, b, h] (after the final
    layernorm; sequence-sharded under sequence parallelism) instead of logits: GPTModel skips its
    output layer when post_process is False, and the decoder built for the last stage keeps its
    final layernorm."""
    _check_last_stage(model)
    model.post_process = False
    try:
        yield model
    finally:
        model.post_process = True


def _check_last_stage(model):
    if not getattr(model, "post_process", False):
        raise ValueError("torch_bridge.integrations.megatron: the model has no output layer here (post_process is False): "
                         "call it on the last pipeline stage only")


def output_weight(model):
    """(weight [V_local, h], bias [V_local] or None) of the model's output projection."""
    layer = model.output_layer
    weight = model.shared_embedding_or_output_weight() if model.share_embeddings_and_output_weights \
        else layer.weight
    bias = layer.bias if getattr(layer, "bias", None) is not None and not layer.skip_bias_add else None
    return weight, bias


def _tp_group(layer):
    group = getattr(layer, "tp_group", None)
    if group is None:
        from megatron.core import parallel_state
        group = parallel_state.get_tensor_model_parallel_group()
    return group if torch.distributed.get_world_size(group) > 1 else None


def linear_logp(model, hidden, labels, *, temperature=1.0, return_entropy=False, real_vocab_size=None,
                ignore_index=-100, mode=None, backward="auto"):
    """logp [b, s] f32 (and entropy [b, s] with return_entropy) of labels [b, s] under the model's
    output layer applied to hidden [s, b, h] (the decoder's output; [s / TP, b, h] under sequence
    parallelism). model: a megatron-core GPTModel on its last pipeline stage (unwrapped from DDP /
    Float16Module: megatron.core.utils.unwrap_model). real_vocab_size:
    the tokenizer's vocab (default: the padded vocab, as Megatron scores it). temperature: a float
    or a [b, s] tensor; mode/backward as torch_bridge.linear_logp."""
    _check_last_stage(model)
    weight, bias = output_weight(model)
    return output_layer_logp(model.output_layer, hidden, labels, weight=weight, bias=bias, temperature=temperature,
                             return_entropy=return_entropy, real_vocab_size=real_vocab_size,
                             ignore_index=ignore_index, mode=mode, backward=backward)


def output_layer_logp(layer, hidden, labels, *, weight=None, bias=None, temperature=1.0, return_entropy=False,
                      real_vocab_size=None, ignore_index=-100, mode=None, backward="auto"):
    """linear_logp for a ColumnParallelLinear output layer (its weight unless `weight` is given,
    e.g. a tied embedding) and the hidden states [s, b, h] it would take; labels [b, s]."""
    group = _tp_group(layer)
    weight = layer.weight if weight is None else weight
    sequence_parallel = bool(getattr(layer, "sequence_parallel", False)) and group is not None
    if sequence_parallel:
        from megatron.core.tensor_parallel import gather_from_sequence_parallel_region
        hidden = gather_from_sequence_parallel_region(hidden, tensor_parallel_output_grad=True, group=group)
    s, b, h = hidden.shape
    if tuple(labels.shape) != (b, s):
        raise ValueError(f"labels must be [b, s] = ({b}, {s}) for hidden [s, b, h] = {tuple(hidden.shape)}, got "
                         f"{tuple(labels.shape)}")
    temp = temperature.transpose(0, 1) if isinstance(temperature, torch.Tensor) else temperature
    out = _linear_logp(hidden, weight, labels.transpose(0, 1), bias=bias, temperature=temp,
                       ignore_index=ignore_index, return_entropy=return_entropy, real_vocab_size=real_vocab_size,
                       tp_group=group, mode=mode, backward=backward,
                       # under SP the reduce-scatter of the gather sums the shards' dH partials
                       reduce_grad_hidden=not sequence_parallel)
    if return_entropy:
        return out[0].transpose(0, 1), out[1].transpose(0, 1)
    return out.transpose(0, 1)


__all__ = ["linear_logp", "output_layer_logp", "output_weight", "hidden_states_only"]
