"""Dead letters: pages of them, newest first; retry or discard them by event, key or all."""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ..errors import ConfigurationError, OutboxError
from .sink_lifecycle import live_sink
from .table import Conn, Table, fetch_table

DEAD_LETTERS_LIMIT = (1, 10_000)  # one page of dead_letters
# admin.sql dead_letters: the keyset position of the first page.
FIRST_PAGE: dict[str, Any] = {"after_dead_at": None, "after_sink": None, "after_event": None}


@dataclass(frozen=True)
class DeadLetterPage(Table):
    """One page of dead letters, newest first; ``more``: another page follows (ask for it with
    ``after=page.last_event_id``)."""

    more: bool

    @property
    def last_event_id(self) -> uuid.UUID | None:
        return self.rows[-1][self.columns.index("event_id")] if self.rows else None


@dataclass(frozen=True)
class DeadLettersChanged:
    """The dead letters a retry queued again, or a discard deleted (event ids sorted as text)."""

    sink: str
    count: int
    event_ids: list[str]


def dead_letters(conn: Conn, *, sink: str | None = None, key: str | None = None, limit: int = 50,
                 after: uuid.UUID | str | None = None) -> DeadLetterPage:
    """One page of dead letters (of ``sink``, of ``key``), newest first; ``after``: the event id of the
    last dead letter of the previous page. OutboxError if the sink is not live or ``after`` names no
    dead letter (retried or discarded since)."""
    low, high = DEAD_LETTERS_LIMIT
    if not low <= limit <= high:
        raise ConfigurationError(f"a page of dead letters holds {low}-{high}, not {limit}")
    with conn.transaction():
        if sink:  # a misspelt sink is an error, not "0 dead letters"
            live_sink(conn, sink)
        position = FIRST_PAGE
        if after is not None:
            found = fetch_table(conn, "dead_letter_position", {"event": str(after), "sink": sink}).rows
            if not found:
                of_sink = f" for sink {sink!r}" if sink else ""
                raise OutboxError(f"no dead letter of event {after}{of_sink} (--after takes an event id of the "
                                  "previous page; it may have been retried or discarded since: list again from the "
                                  "start)")
            position = dict(zip(position, found[0], strict=True))
        page = fetch_table(conn, "dead_letters", {"sink": sink, "key": key, "limit": limit + 1, **position})
    return DeadLetterPage(page.columns, page.rows[:limit], more=len(page.rows) > limit)


def _change_dead_letters(conn: Conn, name: str, sink: str, event_ids: Sequence[uuid.UUID | str] | None,
                         key: str | None, everything: bool) -> DeadLettersChanged:
    if not (event_ids or key or everything):
        raise ConfigurationError("say which dead letters: event ids, a key, or all")
    with conn.transaction():
        live_sink(conn, sink)
        ids = [str(e) for e in event_ids] if event_ids else None
        rows = fetch_table(conn, name, {"sink": sink, "event_ids": ids, "key": key}).rows
        if name == "retry_dead_letters":  # the buckets' owners look at their park now, not at their next check
            for bucket in sorted({r[1] for r in rows}):
                fetch_table(conn, "notify_parked", {"bucket": bucket})
    return DeadLettersChanged(sink=sink, count=len(rows), event_ids=sorted(str(r[0]) for r in rows))


def retry_dead_letters(conn: Conn, sink: str, *, event_ids: Sequence[uuid.UUID | str] | None = None,
                       key: str | None = None, all: bool = False) -> DeadLettersChanged:
    """Queue dead letters of ``sink`` again, due now: these events, this key's (in publish order), or
    ``all`` of them."""
    return _change_dead_letters(conn, "retry_dead_letters", sink, event_ids, key, all)


def discard_dead_letters(conn: Conn, sink: str, *, event_ids: Sequence[uuid.UUID | str] | None = None,
                         key: str | None = None, all: bool = False) -> DeadLettersChanged:
    """Delete dead letters of ``sink`` for good: these events, this key's, or ``all`` of them."""
    return _change_dead_letters(conn, "discard_dead_letters", sink, event_ids, key, all)
