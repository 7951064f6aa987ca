"""The argument types of the command: each turns one command-line value into what the command uses, or
raises ``argparse.ArgumentTypeError`` naming what is wrong with it (argparse prints it with the option)."""

from __future__ import annotations

import argparse
import uuid
from collections.abc import Callable
from datetime import datetime

from ..event import MAX_KEY_BYTES
from ..settings import TOPIC_NAME

LOG_LEVELS = ("debug", "info", "warning", "error")
MAX_ATTEMPTS = (1, 1000)  # RelaySettings.max_attempts


def log_level(text: str) -> str:
    level = text.lower()
    if level not in LOG_LEVELS:
        raise argparse.ArgumentTypeError(f"{text!r} is not a log level ({', '.join(LOG_LEVELS)})")
    return level


def event_id(text: str) -> str:
    try:
        return str(uuid.UUID(text))
    except ValueError:
        raise argparse.ArgumentTypeError(f"an event id is a UUID, not {text[:100]!r}") from None


def partition_key(text: str) -> str:
    if not text:
        raise argparse.ArgumentTypeError("a partition key is not empty")
    if len(text.encode()) > MAX_KEY_BYTES:
        raise argparse.ArgumentTypeError(f"a partition key is at most {MAX_KEY_BYTES} bytes, not "
                                         f"{len(text.encode())}")
    return text


def int_between(low: int, high: int) -> Callable[[str], int]:
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not an integer: {text[:100]!r}") from None
        if not low <= value <= high:
            raise argparse.ArgumentTypeError(f"must be {low}-{high}, not {value}")
        return value
    return parse


def seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number of seconds: {text[:100]!r}") from None
    if not 0.02 <= value <= 3600:
        raise argparse.ArgumentTypeError(f"must be 0.02-3600 seconds, not {text[:100]}")
    return value


_UNITS = {"s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}


def retention_keep(text: str) -> float | str:
    """A retention: seconds, a number with a unit (s, m, h, d), 'forever' or 'relays'."""
    word = text.strip().lower()
    if word in ("forever", "relays"):
        return word
    unit = _UNITS.get(word[-1:])
    try:
        value = float(word[:-1] if unit else word) * (unit or 1.0)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a duration: {text[:100]!r} (seconds, 7d, 12h, 30m, 'forever' or "
                                         "'relays')") from None
    if not 0 <= value <= 3650 * 86400:  # also refuses nan
        raise argparse.ArgumentTypeError(f"must be 0 to 3650 days, not {text[:100]}")
    return value


MAX_RETENTION_SECONDS = 3650 * 86400.0  # RelaySettings.retention_seconds' bound


def retention_seconds(text: str) -> float:
    """The relays' --retention-seconds as they accept it: 0 to 3650 days (NaN, infinite and negative refused)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number of seconds: {text[:100]!r}") from None
    if not 0 <= value <= MAX_RETENTION_SECONDS:  # also refuses nan
        raise argparse.ArgumentTypeError(f"must be 0 to {MAX_RETENTION_SECONDS:.0f} seconds (3650 days), "
                                         f"not {text[:100]}")
    return value


def topic_name(text: str) -> str:
    if not TOPIC_NAME.match(text) or text in (".", ".."):
        raise argparse.ArgumentTypeError(f"{text[:300]!r} is not a valid topic name (1-249 of A-Z a-z 0-9 . _ -, "
                                         "not . or ..)")
    return text


def iso_time(text: str) -> datetime:
    try:
        value = datetime.fromisoformat(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an ISO-8601 time: {text!r}") from None
    return value if value.tzinfo else value.astimezone()


def position(text: str) -> tuple[int, int]:
    xid, sep, seq = text.partition(":")
    if not (sep and xid.isdigit() and seq.isdigit()):
        raise argparse.ArgumentTypeError(f"a position is XID:SEQ (two integers, as in ce_sequence), not {text!r}")
    return int(xid), int(seq)
