"""What ``wait_for`` decides without I/O: which events still wait, what to raise, how long to sleep.

progress.py and progress_async.py only run its query and sleep.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from psycopg import pq

from .errors import ConfigurationError, EventDeadLettered, OpenTransaction, UnknownEvent, WaitTimeout
from .publish import Published

log = logging.getLogger("outbox_relay.progress")

EventRef = uuid.UUID | Published
Rows = Sequence[tuple[Any, ...]]


@dataclass(frozen=True)
class Poll:
    """Poll intervals: ``first`` seconds, doubling up to ``most``.

    Short at first because delivery usually takes milliseconds (a relay is woken by NOTIFY); capped so
    that a slow delivery is noticed within ``most`` and a waiter costs at most ``1/most`` queries a second.
    """

    first: float = 0.005
    most: float = 0.1

    def __post_init__(self) -> None:
        if not 0 < self.first <= self.most:
            raise ConfigurationError(f"poll intervals need 0 < first <= most, not {self.first!r}, {self.most!r}")

    def intervals(self) -> Iterator[float]:
        delay = self.first
        while True:
            yield delay
            delay = min(self.most, delay * 2)


DEFAULT_POLL = Poll()


# -- shared decisions (no I/O) -------------------------------------------------------------


def check_idle(status: pq.TransactionStatus) -> None:
    if status in (pq.TransactionStatus.INTRANS, pq.TransactionStatus.INERROR):
        raise OpenTransaction(
            "wait_for needs a connection outside any transaction: events are invisible to the relays until "
            "their transaction commits, so a wait inside it could only time out, and a snapshot held across "
            "polls would never see the sink's progress. Commit first (or use an autocommit connection)."
        )


def _event_ids(event_ids: EventRef | Iterable[EventRef]) -> list[uuid.UUID]:
    """The ids, each once, in the caller's order."""
    # One reference, or several. A string is one (iterating it would yield characters); it is refused below.
    refs: Iterable[object] = [event_ids] if isinstance(event_ids, uuid.UUID | Published | str | bytes) else event_ids
    ids: dict[uuid.UUID, None] = {}
    for ref in refs:
        if isinstance(ref, Published):
            ids[ref.id] = None
        elif isinstance(ref, uuid.UUID):
            ids[ref] = None
        else:
            raise TypeError(f"wait_for takes uuid.UUID or Published values, not {type(ref).__name__}: {ref!r}")
    return list(ids)


class Wait:
    """One wait: the events still outstanding, the deadline and the poll schedule."""

    def __init__(self, event_ids: EventRef | Iterable[EventRef], sink: str, timeout: float, poll: Poll) -> None:
        if not timeout >= 0:  # also refuses NaN
            raise ConfigurationError(f"timeout must be >= 0 seconds, not {timeout!r}")
        self.sink = sink
        self.timeout = timeout
        self.waiting = _event_ids(event_ids)
        self.started = time.monotonic()
        self.deadline = self.started + timeout
        self.intervals = poll.intervals()
        self.polls = 0

    def params(self) -> dict[str, Any]:
        # Only what is still outstanding: events already applied stay applied.
        return {"sink": self.sink, "event_ids": self.waiting}

    def step(self, rows: Rows) -> float | None:
        """Digest one poll: None when all events are applied, else the seconds to sleep before the next.

        Raises at once when waiting longer cannot help (unknown sink or event, dead letter).
        """
        self.polls += 1
        now = time.monotonic()
        if not rows or not rows[0][0]:
            # No relay has registered the sink yet (it may be starting), or the name is wrong.
            if now >= self.deadline:
                raise ConfigurationError(f"no sink named {self.sink!r} was registered within {self.timeout:g}s: "
                                         "check the name, or start a relay for it")
            return min(next(self.intervals), self.deadline - now)
        found = {r[1]: _Row(*r[1:]) for r in rows if r[1] is not None}
        events = [found[i] for i in self.waiting]  # in the caller's order, for stable messages
        unknown = [e.id for e in events if e.state == "unknown"]
        if unknown:
            raise UnknownEvent(unknown)
        for e in events:
            if e.state == "dead":
                raise EventDeadLettered(self.sink, e.id, e.last_error or "", e.attempts or 0)
        outstanding = [e for e in events if e.state != "done"]
        self.waiting = [e.id for e in outstanding]
        if not outstanding:
            log.debug("sink %s applied the awaited events after %.3fs (%d polls)", self.sink, now - self.started,
                      self.polls)
            return None
        if now >= self.deadline:
            raise _timeout(self.sink, self.timeout, outstanding)
        return min(next(self.intervals), self.deadline - now)


@dataclass(frozen=True)
class _Row:
    id: uuid.UUID
    state: str  # done, pending, parked, paused, dead, unknown
    attempts: int | None
    last_error: str | None
    leased: bool | None  # a live relay holds the event's bucket
    key: str | None
    paused_by: str | None  # the key is paused for the sink (outbox-relay keys pause): by whom
    pause_reason: str | None


PAUSED_KEYS_NAMED = 3  # a timeout names at most this many paused keys


def _timeout(sink: str, timeout: float, outstanding: Sequence[_Row]) -> WaitTimeout:
    pending = [e for e in outstanding if e.state == "pending"]
    retrying = [e for e in outstanding if e.state == "parked"]
    paused = [e for e in outstanding if e.state == "paused"]
    last_error = next((e.last_error for e in retrying if e.last_error), None)
    hints = []
    if any(not e.leased for e in outstanding):
        hints.append(f"no live relay holds the bucket of some of them (is a relay running sink {sink!r}?)")
    pauses = {e.key: e for e in paused}  # one line per key, in the caller's order
    for key, e in list(pauses.items())[:PAUSED_KEYS_NAMED]:
        why = f": {e.pause_reason}" if e.pause_reason else ""
        hints.append(f"key {key!r} is paused for sink {sink!r} by {e.paused_by}{why}; its events are held until "
                     f"`outbox-relay keys resume {key} --sink {sink}`")
    if len(pauses) > PAUSED_KEYS_NAMED:
        hints.append(f"and {len(pauses) - PAUSED_KEYS_NAMED} more paused key(s)")
    return WaitTimeout(sink, timeout, tuple(e.id for e in pending), tuple(e.id for e in retrying), last_error,
                       hints, paused=tuple(e.id for e in paused))
