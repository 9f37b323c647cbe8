"""rlk_common's rules that both frontends call (their behaviour through each frontend is
test_jax_modes.py / test_torch_modes.py, test_rollout*.py, test_shard_map.py)."""
import pytest

import rlk_common as common
from rlk_common import Route, route_call


def test_route_call_for_every_mode():
    assert route_call("auto", 5, None, "f") == Route(fused=True, audit=False, counted=False, reason=None)
    assert route_call("strict", 5, None, "f") == Route(fused=True, audit=False, counted=False, reason=None)
    assert route_call("audit", 5, None, "f") == Route(fused=True, audit=True, counted=False, reason=None)
    assert route_call("off", 5, None, "f") == Route(fused=False, audit=False, counted=True, reason=None)
    for mode in ("auto", "audit"):
        assert route_call(mode, 5, "dtype x", "f") == Route(fused=False, audit=False, counted=True, reason="dtype x")
    with pytest.raises(RuntimeError, match=r"^f\(mode='strict'\): the fused kernels cannot run this call: dtype x$"):
        route_call("strict", 5, "dtype x", "f")
    assert route_call("off", 5, "dtype x", "f").reason is None  # off is no fallback


@pytest.mark.parametrize("mode", common.MODES)
def test_a_call_of_no_rows_runs_the_reference_uncounted(mode):
    assert route_call(mode, 0, "dtype x", "f") == Route(fused=False, audit=False, counted=False, reason=None)


def test_kernel_dtypes_are_the_compiled_modules():
    from _rlk_core import DType
    assert set(common.KERNEL_DTYPES) == set(DType.__members__)
    assert [common.dtype_fallback(n) for n in common.KERNEL_DTYPES] == [None] * 3
    assert common.dtype_fallback("float64") == "dtype float64 (supported: bfloat16, float16, float32)"


def test_shard_chunk_and_invalid_id():
    assert common.shard_chunk(128, 256) == 128     # whole canonical chunks: the canonical chunk
    assert common.shard_chunk(128, 200) == 200     # otherwise the shard is one chunk
    assert (common.invalid_id(-100), common.invalid_id(-1)) == (-1, -2)
    assert common.id_rule(-2 ** 63, 2 ** 63 - 1, -1).invalid == -2


def test_check_decode_batch():
    common.check_decode_batch((3,), (3, 8), None, "f")
    with pytest.raises(ValueError, match="one row per sequence"):
        common.check_decode_batch((3, 1), (3, 1, 8), None, "f")
    with pytest.raises(RuntimeError, match=r"^f needs the fused kernels \(the trainer's bits\): dtype x$"):
        common.check_decode_batch((3,), (3, 8), "dtype x", "f")


def test_bad_targets_names_the_first_id_and_the_count():
    e = common.bad_targets(3, 70000, 50000, -100, 2)
    assert isinstance(e, ValueError)
    assert str(e) == "targets[3] = 70000 is outside [0, 50000) and is not ignore_index=-100 (2 bad ids in all)"
