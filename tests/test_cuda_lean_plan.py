"""The CUDA lean backward's plan, checked on the host (no GPU needed): the memory it promises and
the way it cuts the vocab (cuda/linear_logp_bwd.cu, lean_layout and lean_next_piece).

All that the lean backward adds to the caller's buffers is its workspace; with dH in the operand
dtype (the whole vocab) that includes half of dH's fp32 accumulator. It must stay within 256 MiB at
the shapes of DESIGN.md section 6. A piece's tiles either sit in the workspace or borrow dW's rows
past the piece (not written yet): they must fit there and never reach the piece's own rows.
"""
import pytest

import _rlk_core as core

pytestmark = pytest.mark.skipif(not core.has_cuda, reason="this build of _rlk_core has no CUDA backend")

BF16 = 2
MIB = 1 << 20
SHAPES = {"T1": (796, 2048, 75968), "T2": (1820, 2048, 75968), "T3": (6827, 2048, 75968),
          "T3-tp1": (6827, 2048, 151936), "Q8B-tp4": (4096, 4096, 37984), "H200-pub": (4096, 4096, 128256),
          "L16k": (16384, 4096, 151936)}
ODD = {"n1": (1, 64, 1000), "n3": (3, 2048, 151936), "n127-v7013": (127, 64, 7013),
       "n4097": (4097, 2048, 151936), "passes": (80000, 64, 7013), "borrow": (16384, 2048, 151936)}


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
                assert tile_bytes + 256 <= (v - c0 - cols) * h * BF16
            else:
                assert tile_bytes <= plan["ws_tile_bytes"]
            col += cols
        assert col == v
        assert plan["rows_per_pass"] % 128 == 0


def test_l16k_borrows_wide_pieces():
    """At L16k the workspace alone would hold 2816-column pieces (54 of them); borrowing dW's
    unwritten rows makes the first pieces 16384 wide, each saving an fp32 read-modify-write of
    the [n, h] dH accumulator."""
    plan = _plan(*SHAPES["L16k"], dhidden_f32=False, fused=True)
    widths = [p[2] for p in plan["pieces"]]
    assert plan["rows_per_pass"] == 16384 and max(widths) == 16384 and len(widths) <= 20
    assert any(p[3] for p in plan["pieces"]) and not plan["pieces"][-1][3]
