"""Read-your-writes: wait until events have been applied by a sink (published to Kafka, or projected).

An API that published an event and must answer with state the event produces (a read model a
projection maintains), or a test that checks what reached Kafka, calls ``wait_for`` after its
transaction committed. Each poll is one statement (``event_progress`` in sql/queries/progress.sql)
that probes primary keys only, so polling is cheap however long the log is.

Every poll runs in its own short transaction, never one transaction across the wait:

- the events of the caller's own open transaction are invisible to the relays until it commits:
  the wait could only end in a timeout. That is why a connection inside a transaction is refused
  (a read-only one too, for the next two reasons).
- a snapshot kept across polls (REPEATABLE READ) would never see the cursors move;
- an open snapshot, even read-only, keeps vacuum from pruning the cursor rows the relays update
  once per batch, so they bloat for as long as the wait lasts.

The decisions (which events are still waiting, what to raise, how long to sleep) live in
``_Wait``, shared by ``wait_for`` and ``wait_for_async``; those two only run the query and sleep.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import psycopg
from psycopg import pq
from psycopg.rows import tuple_row

from .errors import ConfigurationError, EventDeadLettered, OpenTransaction, UnknownEvent, WaitTimeout
from .publish import Published
from .sqlfiles import query

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


def wait_for(conn: psycopg.Connection[Any], event_ids: EventRef | Iterable[EventRef], sink: str = "kafka",
             timeout: float = 10.0, poll: Poll = DEFAULT_POLL) -> None:
    """Return once ``sink`` has applied every given event (their transaction must have committed).

    Applied means the sink's cursor is past the event and it is neither parked nor dead-lettered: it was
    published (Kafka acknowledged it) or projected, or the sink does not take it (a projection that
    subscribes to other event types). An event of a key paused for the sink (``outbox-relay keys
    pause``) waits until the key is resumed; a timeout reports it as paused and names the pause.

    ``event_ids``: one id or ``Published`` (what ``Outbox.publish`` returns), or an iterable of them.
    ``conn`` must not be inside a transaction (``OpenTransaction``); each poll is its own
    transaction (autocommit, or committed at once). Raises ``EventDeadLettered`` as soon as one of the
    events was given up on, ``UnknownEvent`` for ids with no stored event, ``ConfigurationError``
    for a sink that was never registered, ``WaitTimeout`` after ``timeout`` seconds.
    """
    _check_idle(conn.info.transaction_status)
    wait = _Wait(event_ids, sink, timeout, poll)
    sql = query("progress", "event_progress")
    while True:
        with conn.cursor(row_factory=tuple_row) as cur:
            if conn.autocommit:
                rows = cur.execute(sql, wait.params()).fetchall()
            else:
                with conn.transaction():
                    rows = cur.execute(sql, wait.params()).fetchall()
        delay = wait.step(rows)
        if delay is None:
            return
        time.sleep(delay)


async def wait_for_async(aconn: psycopg.AsyncConnection[Any], event_ids: EventRef | Iterable[EventRef],
                         sink: str = "kafka", timeout: float = 10.0, poll: Poll = DEFAULT_POLL) -> None:
    """``wait_for`` on a psycopg AsyncConnection."""
    _check_idle(aconn.info.transaction_status)
    wait = _Wait(event_ids, sink, timeout, poll)
    sql = query("progress", "event_progress")
    while True:
        async with aconn.cursor(row_factory=tuple_row) as cur:
            if aconn.autocommit:
                rows = await (await cur.execute(sql, wait.params())).fetchall()
            else:
                async with aconn.transaction():
                    rows = await (await cur.execute(sql, wait.params())).fetchall()
        delay = wait.step(rows)
        if delay is None:
            return
        await asyncio.sleep(delay)


# -- shared decisions (no I/O) -------------------------------------------------------------


def _check_idle(status: pq.TransactionStatus) -> None:
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


class _Wait:
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
