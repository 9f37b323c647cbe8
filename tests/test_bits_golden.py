"""Every output bit of a fixed set of CPU calls equals the committed golden digests (tests/bits_golden.py:
the calls, and the one-line command that refreshes a part after an intended change)."""
import pytest

pytest.importorskip("jax", reason="jax is not installed: the harness runs both frontends")
pytest.importorskip("torch", reason="torch is not installed: the harness runs both frontends")

import bits_golden as bg


@pytest.mark.parametrize("dtype", bg.DTYPES)
@pytest.mark.parametrize("frontend", ["jax", "torch"])
def test_bits_unchanged(frontend, dtype):
    want = {k: v for k, v in bg.load()[bg.part_of(dtype)].items() if k.startswith(f"{dtype}/{frontend}.")}
    got = bg.compute([dtype], [frontend])[bg.part_of(dtype)]
    assert want, f"no golden digests for {dtype}/{frontend}: run tests/bits_golden.py --write"
    changed = sorted(k for k in want if got.get(k) != want[k])
    assert set(got) == set(want) and not changed, (
        f"output bits changed in {changed or sorted(set(got) ^ set(want))}; if intended, refresh with "
        f"`PYTHONPATH=$PWD python3 tests/bits_golden.py --write {bg.part_of(dtype)}`")
