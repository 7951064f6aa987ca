"""What the command prints: JSON with numbers as numbers, plain text with nothing a terminal would act on,
and tables cut to the terminal's width."""

from __future__ import annotations

import json
import os
import re
import shutil
import sys
from collections.abc import Sequence
from datetime import date, datetime
from decimal import Decimal
from typing import Any, TextIO

from ..dsn import one_line


def _json_value(value: Any) -> Any:
    """Numbers as numbers, times in ISO 8601, ids as strings."""
    if isinstance(value, Decimal):
        return int(value) if value == value.to_integral_value() else float(value)
    if isinstance(value, datetime | date):
        return value.isoformat()
    if isinstance(value, dict):
        return {str(k): _json_value(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_json_value(v) for v in value]
    if value is None or isinstance(value, bool | int | float | str):
        return value
    return str(value)


def print_json(value: Any) -> None:
    print(json.dumps(_json_value(value), indent=2))


# What a terminal would act on rather than show: C0 controls but tab and newline (ESC, BEL, CR, ...), DEL,
# C1 controls, and the bidirectional overrides and isolates (text that reads other than it is stored).
_UNPRINTABLE = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f\u061c\u200e\u200f\u202a-\u202e\u2066-\u2069]")


def _escape(match: re.Match[str]) -> str:
    c = ord(match.group())
    return f"\\x{c:02x}" if c <= 0xFF else f"\\u{c:04x}"


def printable(text: str) -> str:
    """``text`` with every character a terminal would act on escaped (``\\x1b``, ``\\u202e``): producers
    write keys, types, topics, headers and errors, and an operator's terminal must only show them.
    Tabs and newlines stay (table cells fold them into spaces)."""
    return _UNPRINTABLE.sub(_escape, text)


def say(text: str, file: TextIO | None = None, end: str = "\n") -> None:
    """Print plain text (every line a command prints, but JSON, goes through here)."""
    print(printable(text), file=file, end=end)


def table_cell(value: Any) -> str:
    """A table cell: no Python reprs (lists and mappings as plain text), nothing a terminal acts on."""
    if value is None:
        return ""
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, datetime):
        return value.isoformat(sep=" ", timespec="seconds")
    if isinstance(value, dict):
        return ", ".join(f"{k}: {table_cell(v)}" for k, v in value.items())
    if isinstance(value, list | tuple):
        return ", ".join(table_cell(v) for v in value)
    return " ".join(printable(str(value)).split())  # one line per row


ELLIPSIS = "\u2026"
MIN_COLUMN = 8  # a column is never cut narrower than this (or its header)
WHOLE_COLUMN = 36  # columns this narrow (ids, times, counts) are cut only when cutting the others is not enough


def _terminal_width() -> int | None:
    """The terminal's width, or None when the output goes to a pipe or file (nothing is cut there)."""
    if os.environ.get("COLUMNS") or sys.stdout.isatty():
        return shutil.get_terminal_size().columns
    return None


def _fit(widths: list[int], floors: list[int], room: int) -> list[int]:
    """Column widths within ``room``: the widest columns are cut to one common cap, none below its floor."""
    if sum(widths) <= room:
        return widths
    low, high = 0, max(widths)
    while low < high:  # the largest cap that fits
        cap = (low + high + 1) // 2
        if sum(min(w, max(cap, f)) for w, f in zip(widths, floors, strict=True)) <= room:
            low = cap
        else:
            high = cap - 1
    return [min(w, max(low, f)) for w, f in zip(widths, floors, strict=True)]


def _cut(text: str, width: int) -> str:
    return text if len(text) <= width else text[:max(0, width - 1)] + ELLIPSIS


def print_table(rows: Sequence[Sequence[Any]], headers: Sequence[str]) -> None:
    """A table cut to the terminal's width (long cells end in an ellipsis; --json has the full values)."""
    cells = [[str(h) for h in headers]] + [[table_cell(v) for v in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    terminal = _terminal_width()
    if terminal is not None:
        room = terminal - 2 * (len(widths) - 1)
        floors = [min(w, max(MIN_COLUMN, len(str(h)))) for w, h in zip(widths, headers, strict=True)]
        whole = [w if w <= WHOLE_COLUMN else f for w, f in zip(widths, floors, strict=True)]
        widths = _fit(widths, whole if sum(whole) <= room else floors, room)
    for i, r in enumerate(cells):
        say("  ".join(_cut(c, w).ljust(w) for c, w in zip(r, widths, strict=True)).rstrip())
        if i == 0:
            say("  ".join("-" * w for w in widths))


def say_error(message: str) -> None:
    say(f"outbox-relay: {one_line(message)}", file=sys.stderr)
