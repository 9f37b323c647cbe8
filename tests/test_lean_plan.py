"""The CUDA lean backward's plan (cuda/lean_plan.cc: lean_layout, lean_next_piece, the dH sweeps),
checked on the host: the planner is host C++, in every build of _rlk_core, CUDA or not.

All that the lean backward adds to the caller's buffers is its workspace; with dH in the operand
dtype (the whole vocab) that includes up to half of dH's fp32 accumulator. It must stay within
256 MiB whatever n and v: where that half would not fit, dH comes in row sweeps, which must cover
the rows in order and keep their fp32 rows within dhidden's bytes. At the shapes of docs/design.md
§6 there is one sweep. A piece's tiles either sit in the workspace or borrow dW's rows
past the piece (not written yet): they must fit there and never reach the piece's own rows.
Also: the shape functions take the operand dtype as a named code (core.DType), never a bare int.
"""
import itertools

import pytest

import _rlk_core as core
import rlk_common as common
from rlk_common import SHAPES  # docs/design.md §6

F32, F16, BF16 = core.DType.float32, core.DType.float16, core.DType.bfloat16
MIB = 1 << 20
ODD = {"n1": (1, 64, 1000), "n3": (3, 2048, 151936), "n127-v7013": (127, 64, 7013),
       "n4097": (4097, 2048, 151936), "passes": (80000, 64, 7013), "borrow": (16384, 2048, 151936)}


def test_dtype_codes_are_named():
    assert {d.name: d.value for d in core.DType} == {"float32": 0, "float16": 1, "bfloat16": 2}  # rlk::DType
    assert common.dtype_code(core, "bfloat16") is BF16
    with pytest.raises(ValueError, match="float64: the kernels take float32, float16, bfloat16"):
        common.dtype_code(core, "float64")
    for call in (lambda: core.saved_logits_bytes(1, 64, 64, 2, "cpu"), lambda: core.cuda_lean_plan(1, 64, 64, 2, False, True),
                 lambda: core.cuda_workspace_bytes(1, 64, 64, 64, 2, False, False, True)):
        with pytest.raises(TypeError):
            call()
    assert common.saved_logits_bytes(core, 3, 64, 64, "float32", "cpu") == 3 * core.saved_logits_bytes(1, 64, 64, F32, "cpu")
    assert set(common.cuda_workspace_bytes(core, 1, 64, 64, 64, "bfloat16", False, False, True)) == {
        "forward", "lean", "fast"}


def _plan(n, h, v, dhidden_f32, fused):
    return core.cuda_lean_plan(n, h, v, BF16, dhidden_f32, fused)


@pytest.mark.parametrize("fused", [True, False], ids=["sm90", "gemm"])
@pytest.mark.parametrize("name", list(SHAPES))
def test_lean_workspace_within_256_mib(name, fused):
    n, h, v = SHAPES[name]
    for dhidden_f32 in (False, True):  # the whole vocab (dH in bf16), a vocab shard (f32 partial)
        assert _plan(n, h, v, dhidden_f32, fused)["workspace_bytes"] <= 256 * MIB


@pytest.mark.parametrize("fused", [True, False], ids=["sm90", "gemm"])
@pytest.mark.parametrize("name", list(SHAPES) + list(ODD))
def test_lean_pieces_cover_the_vocab_and_fit(name, fused):
    n, h, v = {**SHAPES, **ODD}[name]
    for dhidden_f32 in (False, True):
        plan = _plan(n, h, v, dhidden_f32, fused)
        assert plan == _plan(n, h, v, dhidden_f32, fused)  # shapes only: every run cuts alike
        col = 0
        for c0, cols, width, borrowed, tile_bytes in plan["pieces"]:
            assert c0 == col and 0 < cols <= width and width % 256 == 0
            assert cols == width or c0 + cols == v  # only the vocab's end is narrower than its tiles
            if borrowed:  # dW's rows [c0 + cols, v), after aligning the start to 256 bytes
                assert tile_bytes + 256 <= (v - c0 - cols) * h * 2  # bf16 dW rows
            else:
                assert tile_bytes <= plan["ws_tile_bytes"]
            col += cols
        assert col == v
        assert plan["rows_per_pass"] % 128 == 0


@pytest.mark.parametrize("h", [64, 72, 2048, 4096, 8192, 16384, 32768])
def test_lean_workspace_within_256_mib_whatever_n_and_v(h):
    for n in (1, 127, 16384, 24000, 32768, 65536, 1 << 18, 1 << 20, 1 << 22):
        for v in (1000, 151936, 1 << 20):
            for dtype in (F32, BF16):
                for dhidden_f32 in (False, True):
                    for fused in (True, False):
                        plan = core.cuda_lean_plan(n, h, v, dtype, dhidden_f32, fused)
                        assert plan["workspace_bytes"] <= 256 * MIB, (n, h, v, dtype, dhidden_f32, fused)
                        _check_sweeps(plan["dh_sweeps"], n, 4 if dhidden_f32 or dtype == F32 else 2)
                        _check_later_sweep_tiles(plan, v, 4 if dtype == F32 else 2, fused)


def _check_later_sweep_tiles(plan, v, eb, fused):
    """A later sweep's tile holds its rows (or a pass's) in the workspace tile's bytes, at least as
    wide as the first sweep's workspace pieces and never wider than the vocab needs."""
    per_col = eb + (0 if fused else 4)  # dlogit, and z on the gemm path
    first_width = plan["ws_tile_bytes"] // (plan["rows_per_pass"] * per_col)
    for (r0, _, r1), (rows, width) in list(zip(plan["dh_sweeps"], plan["dh_sweep_tiles"]))[1:]:
        assert rows % 128 == 0 and rows >= min(r1 - r0, plan["rows_per_pass"]) and rows <= plan["rows_per_pass"]
        assert width % 256 == 0 and first_width <= width <= max(first_width, -(-v // 256) * 256)
        assert rows * width * per_col <= plan["ws_tile_bytes"]


def _check_sweeps(sweeps, n, dh_bytes):
    """The sweeps cover rows [0, n) in order; a sweep's fp32 rows inside dhidden fit its bytes from
    the sweep's first row on; later sweeps start on 128-row blocks (256-byte aligned fp32 rows)."""
    assert sweeps[0][0] == 0 and sweeps[-1][2] == n
    for (r0, inside, r1), nxt in zip(sweeps, sweeps[1:] + [None]):
        assert r0 < r1 and 0 <= inside <= r1 - r0
        assert inside * 4 <= (n - r0) * dh_bytes
        if nxt is not None:
            assert nxt[0] == r1 and r1 % 128 == 0
    if dh_bytes == 4:
        assert sweeps == [(0, n, n)]  # an fp32 dhidden holds its own accumulator


@pytest.mark.parametrize("name", list(SHAPES) + list(ODD))
def test_design_shapes_take_one_sweep(name):
    """The sm90 path takes one sweep. The gemm fallback's tiles are three times wider per column:
    rather than several row passes it may add a short sweep (L16k: 512 of 16384 rows recomputed)."""
    n, h, v = {**SHAPES, **ODD}[name]
    assert len(_plan(n, h, v, False, fused=True)["dh_sweeps"]) == 1
    later = _plan(n, h, v, False, fused=False)["dh_sweeps"][1:]
    assert sum(r1 - r0 for r0, _, r1 in later) <= 0.05 * n


def test_small_dh_accumulator_stays_whole():
    """While dH's fp32 accumulator takes at most 32 MiB it sits whole in the workspace: one dH GEMM
    of all n rows per piece (T1's 796 rows halved fill less than a wave of an H200); past that,
    dhidden's own bytes hold its first half."""
    for n, h in ((1, 64), (796, 2048), (1820, 2048), (4096, 2048), (2048, 4096)):
        for fused in (True, False):
            assert _plan(n, h, 75968, False, fused)["dh_sweeps"] == [(0, 0, n)], (n, h)
            assert _plan(n, h, 75968, True, fused)["dh_sweeps"] == [(0, n, n)]  # an fp32 dhidden: itself
    assert _plan(4097, 2048, 75968, False, True)["dh_sweeps"] == [(0, 4097 // 2, 4097)]
    assert _plan(*SHAPES["T3"], False, True)["dh_sweeps"][0][1] == SHAPES["T3"][0] // 2


def test_no_rows_no_plan():
    assert _plan(0, 4096, 1000, dhidden_f32=False, fused=True)["workspace_bytes"] == 0


def test_large_n_sweeps_dh():
    """32768 x 4096 (lptest's case): dH's fp32 half (256 MiB) does not fit; two sweeps."""
    plan = _plan(32768, 4096, 7013, dhidden_f32=False, fused=True)
    assert plan["workspace_bytes"] <= 256 * MIB and len(plan["dh_sweeps"]) == 2


def test_sweeps_keep_one_row_pass():
    """Past one sweep, the tiles keep one row pass while it fits, so most pieces borrow dW's rows
    (L32k: 530 ms with 32 MiB of tiles in 29 row passes, 285 ms in one pass, on an H200); past
    that, several passes in half the budget."""
    n, h, v = 32768, 4096, 151936
    plan = _plan(n, h, v, dhidden_f32=False, fused=True)
    assert plan["rows_per_pass"] == n and len(plan["dh_sweeps"]) == 2
    assert sum(p[3] for p in plan["pieces"]) > len(plan["pieces"]) / 2
    assert plan["dh_sweep_tiles"][1][1] >= 4096  # the second sweep's 6912 rows: 4.5x wider pieces
    plan = _plan(4 * n, h, v, dhidden_f32=False, fused=True)
    assert plan["rows_per_pass"] < 4 * n and plan["workspace_bytes"] <= 256 * MIB


def test_l16k_borrows_wide_pieces():
    """At L16k the workspace alone would hold 2816-column pieces (54 of them); borrowing dW's
    unwritten rows makes the first pieces 16384 wide, each saving an fp32 read-modify-write of
    the [n, h] dH accumulator."""
    plan = _plan(*SHAPES["L16k"], dhidden_f32=False, fused=True)
    widths = [p[2] for p in plan["pieces"]]
    assert plan["rows_per_pass"] == 16384 and max(widths) == 16384 and len(widths) <= 20
    assert any(p[3] for p in plan["pieces"]) and not plan["pieces"][-1][3]


# ---- the workspace's layout -----------------------------------------------------------------------
GRID_N = (1, 3, 127, 796, 4097, 16384, 131072)
GRID_H = (64, 2048, 4096)
GRID_V = (1000, 7013, 75968, 151936)


def _ceil_to(x, m):
    return -(-x // m) * m


def _check_layout(plan, n, h, v, dtype, dhidden_f32, fused):
    """What cuda/lean_plan.h's LeanLayout says of its fields, and lean_place of its parts."""
    L = plan["layout"]
    eb = 4 if dtype == F32 else 2
    P, P_max, R = L["P"], L["P_max"], L["R"]
    assert L["fused"] == fused and L["total"] == plan["workspace_bytes"] <= 256 * MIB
    # pieces: whole 256-column tiles, never wider than the vocab needs; P_max the widest
    assert P % 256 == 0 and 256 <= P <= _ceil_to(v, 256)
    assert P_max % 256 == 0 and P_max >= P
    assert max(pc[2] for pc in plan["pieces"]) <= P_max
    # row passes of whole 128-row blocks; several passes sum dW in an fp32 accumulator of a piece
    assert R % 128 == 0 and R == plan["rows_per_pass"]
    if L["dwacc"] == 0:
        assert R >= n
    if R < n:
        assert L["dwacc"] >= P_max * h * 4
    # dH's fp32 rows: an fp32 dhidden holds all of them; a 16-bit one at most its own bytes
    if dhidden_f32 or dtype == F32:
        assert L["dh_in"] == n
    else:
        assert 0 <= L["dh_in"] and L["dh_in"] * 4 <= n * eb
    if len(plan["dh_sweeps"]) == 1:
        assert L["dh_in"] + L["dh_ws"] >= n
    if dtype != F32 and not dhidden_f32:
        assert R * P // h >= 1  # the rounding of dH goes through the dlogit tile (finish_rows)
    # the parts, from the 256-aligned tile base: aligned, each as large as what it holds, disjoint,
    # and inside the workspace after cuBLAS's part and the base's alignment
    need = {"dh": L["dh_ws"] * h * 4, "dlog": R * P * eb, "dwacc": L["dwacc"]}
    need.update({"dzz": R * -(-P_max // 512) * 4} if fused else {"z": R * P * 4})
    assert set(L["parts"]) == set(need)
    end = 0
    for name, off in sorted(L["parts"].items(), key=lambda kv: (kv[1], need[kv[0]])):
        assert off % 256 == 0 and off >= end, (name, L)
        end = off + need[name]
    assert L["cublas_bytes"] + 256 + end <= L["total"]


@pytest.mark.parametrize("dtype", [F32, F16, BF16], ids=["f32", "f16", "bf16"])
def test_layout_parts_fit_and_do_not_overlap(dtype):
    for n, h, v, dhidden_f32, fused in itertools.product(GRID_N, GRID_H, GRID_V, (False, True), (True, False)):
        plan = core.cuda_lean_plan(n, h, v, dtype, dhidden_f32, fused)
        _check_layout(plan, n, h, v, dtype, dhidden_f32, fused)
        assert plan == core.cuda_lean_plan(n, h, v, dtype, dhidden_f32, fused)  # shapes, dtypes, path only


@pytest.mark.parametrize("name", ["T3", "H200-pub", "L16k"])
def test_common_shapes_take_one_row_pass(name):
    """One row pass, the common case (lean_tiles): dW goes straight to the dtype, no fp32 accumulator."""
    n, h, v = SHAPES[name]
    for dhidden_f32, fused in itertools.product((False, True), (True, False)):
        L = _plan(n, h, v, dhidden_f32, fused)["layout"]
        assert L["dwacc"] == 0 and L["R"] >= n, (dhidden_f32, fused, L)
