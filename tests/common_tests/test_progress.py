"""The long runs' progress bar (rlk_common.progress): an ETA, fractional steps, and plain lines in a log."""
import io

from rlk_common.progress import Progress


class Tty(io.StringIO):
    def isatty(self):
        return True


def test_in_a_log_one_plain_line_per_update_with_an_eta():
    out = io.StringIO()
    bar = Progress(4, stream=out, log_every_s=0)
    for i in range(8):
        bar.advance(0.5, f"step {i}")  # a unit in two halves: the bar moves within it
    lines = out.getvalue().splitlines()
    assert "\r" not in out.getvalue() and len(lines) == 8
    assert "ETA" in lines[0] and " 12%" in lines[0] and lines[0].endswith("step 0")
    assert "100%" in lines[-1] and "ETA" not in lines[-1]


def test_in_a_log_updates_are_throttled_but_the_last_is_kept():
    out = io.StringIO()
    bar = Progress(100, stream=out, log_every_s=3600)
    for _ in range(100):
        bar.advance()
    assert len(out.getvalue().splitlines()) == 2  # the first update and the last


def test_on_a_terminal_the_bar_is_redrawn_in_place():
    out = Tty()
    bar = Progress(2, stream=out)
    bar.advance(1, "a")
    bar.advance(1, "b")
    assert out.getvalue().count("\r") == 2 and out.getvalue().endswith("b\n")
