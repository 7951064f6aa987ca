"""The progress line of rebuild and replay: plain lines every few seconds off a terminal, a bar
redrawn in place (no wider than the terminal) on one. Time is a fake clock: no sleeps."""

from __future__ import annotations

import io
import re

import pytest

from outbox_relay.progress_line import PLAIN_SECONDS, TTY_SECONDS, ProgressLine


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_off_a_terminal_a_plain_line_every_few_seconds() -> None:
    out, clock = io.StringIO(), Clock()
    line = ProgressLine(out, "replay orders", 10_000, clock=clock)
    for done in range(1, 1001):  # a thousand pages reported within a second
        clock.now += 0.001
        line.update(done)
    assert out.getvalue().count("\n") == 1, "the first report, then nothing until PLAIN_SECONDS passed"
    clock.now += PLAIN_SECONDS
    line.update(2000)
    line.update(2001)
    line.update(10_000)  # complete: always written
    line.finish("10,000 events sent")
    lines = out.getvalue().splitlines()
    assert lines[0].startswith("replay orders: 1/10,000 events (0.0%)")
    assert lines[1].startswith("replay orders: 2,000/10,000 events (20.0%)") and "ETA" in lines[1]
    assert lines[2].startswith("replay orders: 10,000/10,000 events (100.0%)") and "ETA" not in lines[2]
    assert lines[3] == "replay orders: 10,000 events sent"
    assert len(lines) == 4
    assert "\r" not in out.getvalue() and "\x1b" not in out.getvalue()


def test_on_a_terminal_a_bar_redrawn_in_place_within_its_width(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("COLUMNS", "100")
    out, clock = Terminal(), Clock()
    line = ProgressLine(out, "rebuild order_totals", 1_000_000, clock=clock)
    clock.now += 30
    line.update(450_000, rate=15_000.0)
    line.update(460_000, rate=15_000.0)  # too soon: not drawn
    clock.now += TTY_SECONDS + 0.01
    line.update(500_000, rate=15_000.0)
    draws = out.getvalue().split("\r\x1b[2K")[1:]
    assert len(draws) == 2
    first = draws[0]
    bar = re.match(r"rebuild order_totals \[(#+)(-+)\] 450,000/1,000,000 events \(45\.0%\)", first)
    assert bar is not None, first
    assert abs(len(bar[1]) / (len(bar[1]) + len(bar[2])) - 0.45) < 0.05
    assert len(first) <= 99
    assert first.endswith("15,000 ev/s, ETA 36s")
    assert "\n" not in out.getvalue(), "redrawn in place until finish"
    line.finish("switched over")
    assert out.getvalue().endswith("\r\x1b[2Krebuild order_totals: switched over\n")

    monkeypatch.setenv("COLUMNS", "50")  # narrow: no bar, cut to the width
    narrow = Terminal()
    ProgressLine(narrow, "rebuild order_totals", 1_000_000, clock=clock).update(1, rate=1.0)
    text = narrow.getvalue().removeprefix("\r\x1b[2K")
    assert len(text) == 49 and "[" not in text


def test_no_stream_no_output() -> None:
    line = ProgressLine(None, "x", 1)
    line.update(1)
    line.finish("done")
