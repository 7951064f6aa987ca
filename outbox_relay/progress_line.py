"""One progress line for long commands (rebuild, replay): a bar, done/total, rate and ETA.

On a terminal the line is redrawn in place, at most every ``TTY_SECONDS`` and never wider than the
terminal (a wrapped line can not be redrawn). Anywhere else (a log file, CI, a pipe) it is a plain
line of its own at most every ``PLAIN_SECONDS``, so the output stays readable however often the
command reports. ``finish`` always writes its line.

Hand-written rather than tqdm or rich: the part that matters most here, plain lines every few
seconds when the output is not a terminal, is something neither does (tqdm writes its ``\\r``
redraws into the file, or nothing with ``disable=None``; rich's live display prints only at the
end), so that part would be ours anyway; the terminal bar is a few lines, and rich would add several
packages to the relay's image for it.
"""

from __future__ import annotations

import shutil
import time
from collections.abc import Callable
from typing import TextIO

TTY_SECONDS = 0.2
PLAIN_SECONDS = 5.0
BAR_WIDTH = 24


class ProgressLine:
    def __init__(self, stream: TextIO | None, label: str, total: int, *,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.stream = stream
        self.label = label
        self.total = total
        self._clock = clock
        self.started = clock()
        self._tty = bool(stream is not None and stream.isatty())
        self._shown_at: float | None = None  # when a line was last written

    def update(self, done: int, rate: float | None = None) -> None:
        """Report ``done`` of ``total`` (``rate``: events per second, else the average since the start).
        Written only if the last line is old enough, or the work is complete."""
        if self.stream is None:
            return
        now = self._clock()
        every = TTY_SECONDS if self._tty else PLAIN_SECONDS
        if self._shown_at is not None and now - self._shown_at < every and done < self.total:
            return
        self._shown_at = now
        elapsed = now - self.started
        rate = rate if rate is not None else done / elapsed if elapsed > 0 else 0.0
        left = max(0, self.total - done)
        share = min(1.0, done / self.total) if self.total else 1.0
        eta = f", ETA {duration(left / rate)}" if rate > 0 and left else ""
        text = f"{done:,}/{self.total:,} events ({100 * share:.1f}%), {rate:,.0f} ev/s{eta}"
        if not self._tty:
            self._write(f"{self.label}: {text}", transient=False)
            return
        width = shutil.get_terminal_size().columns - 1  # the last column would wrap on some terminals
        line = f"{self.label}: {text}"
        room = width - len(line) - 3
        if room >= 10:
            filled = round(min(BAR_WIDTH, room) * share)
            line = f"{self.label} [{'#' * filled}{'-' * (min(BAR_WIDTH, room) - filled)}] {text}"
        self._write(line[:width], transient=True)

    def finish(self, text: str) -> None:
        if self.stream is not None:
            self._write(f"{self.label}: {text}", transient=False)

    def _write(self, text: str, transient: bool) -> None:
        assert self.stream is not None
        if self._tty:
            self.stream.write("\r\x1b[2K" + text + ("" if transient else "\n"))
        else:
            self.stream.write(text + "\n")
        self.stream.flush()


def duration(seconds: float) -> str:
    seconds = int(seconds)
    if seconds < 60:
        return f"{seconds}s"
    if seconds < 3600:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"
