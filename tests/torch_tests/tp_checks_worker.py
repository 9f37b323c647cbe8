"""One rank of test_torch_tp_checks.py: torch_bridge.linear_logp over a gloo group with arguments
that disagree across the ranks. Writes {case: outcome} as JSON, an outcome being "ok", or the
exception's class and message. Run as: python tp_checks_worker.py RANK WORLD PORT OUT."""
import json
import os
import sys

import torch

import torch_bridge
from subprocs import gloo_worker

V_GLOBAL = 1024


def call(n, h, v_local, dtype, rank, group, **kw):
    """One call on this rank's shard: n rows, hidden size h, v_local vocab rows; returns "ok" (after
    checking the values are finite) or the exception's "Class: message"."""
    g = torch.Generator().manual_seed(1)
    hidden = torch.randn(n, h, generator=g).to(dtype)
    weight = torch.randn(v_local, h, generator=g).to(dtype)
    targets = torch.randint(0, v_local, (n,), generator=g)
    try:
        logp = torch_bridge.linear_logp(hidden, weight, targets, tp_group=group, **kw)
    except (TypeError, ValueError, RuntimeError) as e:
        return f"{type(e).__name__}: {e}"
    return "ok" if bool(torch.isfinite(logp).all()) else "nonfinite"


def scenarios(rank, world, group):
    """Each case: (this rank's n, h, v_local, dtype, options): rank 0 the reference, the last rank
    differs."""
    last = rank == world - 1
    v = V_GLOBAL // world
    return {
        "agree": call(8, 16, v, torch.float32, rank, group),
        "rows": call(6 if last else 8, 16, v, torch.float32, rank, group),
        "widths": call(8, 16, v + 64 if last else v, torch.float32, rank, group),
        "hidden_size": call(8, 24 if last else 16, v, torch.float32, rank, group),
        "dtype": call(8, 16, v, torch.bfloat16 if last else torch.float32, rank, group),
        "keep_mask": call(8, 16, v, torch.float32, rank, group,
                          keep_mask=torch.ones(8, v, dtype=torch.bool) if last else None),
        "refused_locally": call(8, 16, v, torch.float32, rank, group,
                                temperature=torch.ones(3) if last else 1.0),
        "after": call(8, 16, v, torch.float32, rank, group),
    }


def properties(rank, world, group):
    """Derandomized hypothesis examples, the same sequence on every rank: each rank's (n, h, V_local,
    dtype) drawn per rank; every rank gets "ok" when all agree (equal shards), else every rank a
    ValueError. No shrinking: the ranks must walk the same examples."""
    from hypothesis import Phase, given, settings, strategies as st

    dtypes = [torch.float32, torch.bfloat16, torch.float16]
    outcomes = []

    @settings(derandomize=True, database=None, deadline=None, max_examples=25, phases=[Phase.generate])
    @given(st.lists(st.tuples(st.integers(1, 9), st.sampled_from([4, 8]), st.sampled_from([64, 128, 192]),
                              st.integers(0, 2)), min_size=world, max_size=world),
           st.booleans())
    def each(per_rank, same):
        if same:
            per_rank = [per_rank[0]] * world
        n, h, v, d = per_rank[rank]
        got = call(n, h, v, dtypes[d], rank, group)
        agree = len(set(per_rank)) == 1
        outcomes.append([agree, got.split(":")[0]])
        assert got == "ok" if agree else got.startswith("ValueError: tp_group"), (per_rank, got)

    each()
    return outcomes


def main():
    rank, world, port, out = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
    os.environ["RLK_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    with gloo_worker(rank, world, port) as group:
        res = scenarios(rank, world, group)
        res["properties"] = properties(rank, world, group)
        with open(out, "w") as f:
            json.dump(res, f)


if __name__ == "__main__":
    main()
