"""The progress bar of the long runs (`python -m rlk_xla bench`, benchmarks/bench_gpu.py): a bar with
an ETA redrawn in place on a terminal; in a log (stream not a terminal), plain lines, one per update
(at most one every `log_every_s` seconds, and always the last), with no carriage returns."""
from __future__ import annotations

import sys
import time


def _clock(seconds: float) -> str:
    s = round(seconds)
    return f"{s // 3600}:{s // 60 % 60:02d}:{s % 60:02d}" if s >= 3600 else f"{s // 60}:{s % 60:02d}"


class Progress:
    """`total` units of work (a unit may be advanced in fractions, so a long step can move the bar
    before it ends). The ETA assumes the units left take as long as the ones done."""

    def __init__(self, total: float, stream=None, width: int = 30, log_every_s: float = 5.0):
        self.total, self.done, self.width, self.log_every_s = max(float(total), 1e-9), 0.0, width, log_every_s
        self.stream = stream if stream is not None else sys.stderr
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self.t0 = time.monotonic()
        self.last_line = -float("inf")

    def line(self, label: str) -> str:
        frac = min(self.done / self.total, 1.0)
        elapsed = time.monotonic() - self.t0
        eta = f"ETA {_clock(elapsed * (1 - frac) / frac)}" if 0 < frac < 1 else ""
        bar = "#" * int(self.width * frac) + "." * (self.width - int(self.width * frac))
        return f"[{bar}] {100 * frac:3.0f}% {_clock(elapsed)} {eta:>11} {label[:48]}".rstrip()

    def advance(self, units: float = 1.0, label: str = "") -> None:
        self.set(self.done + units, label)

    def set(self, done: float, label: str = "") -> None:
        self.done = min(float(done), self.total)
        finished = self.done >= self.total
        if self.tty:
            self.stream.write("\r\033[K" + self.line(label) + ("\n" if finished else ""))
        else:
            now = time.monotonic()
            if not finished and now - self.last_line < self.log_every_s:
                return
            self.last_line = now
            self.stream.write(self.line(label) + "\n")
        self.stream.flush()
