"""The ranks of a vocab-parallel torch_bridge.linear_logp agree on the call's shapes before any
collective (issue 44): 2 gloo processes pass different rows, unequal vocab shards (448 and 576 rows
were accepted and gave logp off by nats), hidden sizes, dtypes or a nucleus on one rank only, or one
rank's arguments are refused: every rank raises a ValueError naming what differs, where ranks with
different rows aborted inside gloo (SIGABRT); the group still works after. The same as a property
(hypothesis, derandomized, the same examples on both ranks). A garbage tp_group is a TypeError."""
import pytest

pytest.importorskip("torch", reason="torch is not installed: these tests need it")
pytest.importorskip("hypothesis", reason="hypothesis is not installed: the property part needs it")

import json
import pathlib

import torch

import torch_bridge
from subprocs import cpu_env, free_port, run_all

WORLD = 2
HERE = pathlib.Path(__file__).parent


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory):
    d = tmp_path_factory.mktemp("tp_checks")
    port = str(free_port())
    outs = [d / f"rank{r}.json" for r in range(WORLD)]
    failures = run_all([[str(HERE / "tp_checks_worker.py"), str(r), str(WORLD), port, str(outs[r])] for r in range(WORLD)],
                       [cpu_env() for _ in range(WORLD)], cwd=HERE, timeout_s=240)
    assert not failures, "\n".join(failures)
    return [json.loads(o.read_text()) for o in outs]


@pytest.mark.parametrize("case, what", [("rows", "the same rows"), ("widths", "equal vocab shards"),
                                        ("hidden_size", "the same hidden size"), ("dtype", "the same dtype"),
                                        ("keep_mask", "the same keep_mask")])
def test_ranks_that_disagree_all_refuse(outcomes, case, what):
    for rank, res in enumerate(outcomes):
        assert res[case].startswith(f"ValueError: tp_group: the ranks must pass {what}"), (rank, res[case])


def test_a_rank_that_refuses_makes_its_peers_refuse(outcomes):
    first, last = outcomes[0]["refused_locally"], outcomes[-1]["refused_locally"]
    assert last.startswith("ValueError: temperature array must be shaped like targets"), last
    assert first.startswith(f"ValueError: tp_group: rank(s) [{WORLD - 1}] refused this call"), first


def test_agreeing_calls_run_before_and_after(outcomes):
    assert all(res["agree"] == "ok" and res["after"] == "ok" for res in outcomes)


def test_property_every_rank_refuses_exactly_when_shapes_differ(outcomes):
    props = [res["properties"] for res in outcomes]
    assert props[0] == props[1] and len(props[0]) == 25
    assert {agree for agree, _ in props[0]} == {True, False}  # both kinds were drawn


def test_garbage_tp_group_is_a_type_error_naming_it():
    h, w, t = torch.randn(4, 8), torch.randn(16, 8), torch.arange(4)
    for group in ("tp", 2, object()):
        with pytest.raises(TypeError, match="tp_group .*must be a torch.distributed ProcessGroup or None, got"):
            torch_bridge.linear_logp(h, w, t, tp_group=group)
