"""One progress line for long commands (rebuild, replay): done/total, rate and ETA.

On a terminal the line is redrawn in place; otherwise each update is a line of its own, so
logs and CI output stay readable.
"""

from __future__ import annotations

import time
from typing import TextIO


class ProgressLine:
    def __init__(self, stream: TextIO | None, label: str, total: int) -> None:
        self.stream = stream
        self.label = label
        self.total = total
        self.started = time.monotonic()
        self._tty = bool(stream is not None and stream.isatty())

    def update(self, done: int, rate: float | None = None) -> None:
        if self.stream is None:
            return
        elapsed = time.monotonic() - self.started
        rate = rate if rate is not None else done / elapsed if elapsed > 0 else 0.0
        left = max(0, self.total - done)
        share = 100.0 * done / self.total if self.total else 100.0
        eta = f", ETA {duration(left / rate)}" if rate > 0 and left else ""
        self._write(f"{self.label}: {done:,}/{self.total:,} events ({share:.1f}%), {rate:,.0f} ev/s{eta}",
                    transient=True)

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
