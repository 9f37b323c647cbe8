"""vocab_parallel_linear_logp: linear_logp over a mesh, the LM head sharded over `vocab_axis`."""
from __future__ import annotations


from jax.sharding import PartitionSpec as P

from ._compat import shard_map
from .linear_logp import linear_logp


def vocab_parallel_linear_logp(hidden, weight, targets, *, mesh, vocab_axis="tp", token_axis=None, bias=None,
                               temperature=1.0, ignore_index=-100, real_vocab_size=None, return_entropy=False,
                               mode=None, backward="auto", backward_memory_budget=None):
    """linear_logp with `weight` [V, H] (and `bias` [V]) sharded over the mesh axis `vocab_axis`
    on its first dimension and, optionally, the tokens (the first dimension of hidden, targets and
    a temperature array) sharded over `token_axis` (a dp x tp mesh). V is the padded global vocab;
    ids at or past `real_vocab_size` are padding. Returns what linear_logp returns, sharded like
    the tokens. backward / backward_memory_budget: as linear_logp, per device (its shard's saved
    logits are n_local * V_local)."""
    tok = P(token_axis)
    names, args, specs = ["hidden", "weight", "targets"], [hidden, weight, targets], [tok, P(vocab_axis), tok]
    if bias is not None:
        names.append("bias"), args.append(bias), specs.append(P(vocab_axis))
    if not isinstance(temperature, (int, float)):
        names.append("temperature"), args.append(temperature), specs.append(tok)
    options = dict(ignore_index=ignore_index, real_vocab_size=real_vocab_size, return_entropy=return_entropy,
                   mode=mode, axis_name=vocab_axis, backward=backward, backward_memory_budget=backward_memory_budget)
    if isinstance(temperature, (int, float)):
        options["temperature"] = temperature

    def local(*xs):
        kw = dict(zip(names, xs))
        return linear_logp(kw.pop("hidden"), kw.pop("weight"), kw.pop("targets"), **kw, **options)

    out_specs = (tok, tok) if return_entropy else tok
    f = shard_map(local, mesh=mesh, in_specs=tuple(specs), out_specs=out_specs)
    return f(*args)
