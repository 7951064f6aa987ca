"""An event's delivery ledger: where it is in every sink (delivered, parked, dead-lettered, waiting), by id,
or for a key's newest events."""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from ..errors import ConfigurationError
from .table import Conn, fetch_table

KEY_EVENTS_LIMIT = (1, 100)  # a key's newest events on one page
LEDGER_ROWS = 2000  # events x sinks of one page (100 events and 20 sinks)


@dataclass(frozen=True)
class SinkEntry:
    """One event in one sink. ``state``: delivered, dead-lettered, paused, retrying, pending, not-read
    (the sink does not read the event's topic). The database keeps no delivery time per event: ``owner``,
    ``fence`` and ``cursor_moved_at`` are the bucket's cursor now (who holds it, when it last moved)."""

    sink: str
    kind: str
    state: str
    owner: str | None
    fence: int
    cursor_moved_at: datetime | None
    attempts: int | None
    last_error: str | None
    next_retry: datetime | None
    parked_at: datetime | None
    dead_at: datetime | None
    paused_by: str | None


@dataclass(frozen=True)
class EventLedger:
    """A stored event (``event``: id, key, type, topic, payload, headers, times, position; ``kept``: a copy
    kept after retention dropped its partition) and its entry in every live sink."""

    event: dict[str, Any]
    sinks: list[SinkEntry]


def _entry(r: dict[str, Any]) -> SinkEntry:
    if not r["reads_topic"]:
        state = "not-read"
    elif r["dead_at"] is not None:
        state = "dead-lettered"
    elif r["parked_attempts"] is not None:
        state = "paused" if r["paused_at"] is not None else "retrying"
    elif r["cursor_passed"]:
        state = "delivered"
    else:
        state = "paused" if r["paused_at"] is not None else "pending"
    dead = r["dead_at"] is not None
    return SinkEntry(sink=r["sink"], kind=r["kind"], state=state, owner=r["owner"], fence=r["fence"],
                     cursor_moved_at=r["advanced_at"],
                     attempts=r["dead_attempts"] if dead else r["parked_attempts"],
                     last_error=r["dead_error"] if dead else r["parked_error"],
                     next_retry=None if dead else r["parked_next_retry"], parked_at=r["parked_at"],
                     dead_at=r["dead_at"], paused_by=r["paused_by"])


def _ledgers(conn: Conn, ids: list[uuid.UUID]) -> dict[uuid.UUID, list[SinkEntry]]:
    rows = fetch_table(conn, "event_ledger", {"ids": ids, "limit": LEDGER_ROWS}, group="console").records()
    found: dict[uuid.UUID, list[SinkEntry]] = {i: [] for i in ids}
    for r in rows:
        found.setdefault(r["event_id"], []).append(_entry(r))
    return found


def event_ledger(conn: Conn, event_id: uuid.UUID | str) -> EventLedger | None:
    """The event ``event_id`` and where it is in every sink; None if no such event is stored (never
    published, or removed by retention). ConfigurationError for a malformed id."""
    try:
        eid = uuid.UUID(str(event_id))
    except ValueError:
        raise ConfigurationError(f"{str(event_id)[:80]!r} is not an event id (a UUID)") from None
    with conn.transaction():
        found = fetch_table(conn, "event_detail", {"event": eid}, group="console").records()
        if not found:
            return None
        return EventLedger(event=found[0], sinks=_ledgers(conn, [eid])[eid])


def key_ledger(conn: Conn, key: str, *, limit: int = 20) -> list[EventLedger]:
    """The newest ``limit`` stored events of ``key``, newest first, each with where it is in every sink."""
    low, high = KEY_EVENTS_LIMIT
    if not low <= limit <= high:
        raise ConfigurationError(f"a key's ledger shows {low}-{high} events, not {limit}")
    with conn.transaction():
        fetch_table(conn, "ordered_scans", group="console")
        events = fetch_table(conn, "key_events", {"key": key, "limit": limit}, group="console").records()
        if not events:
            return []
        ids = [e["id"] for e in events]
        entries = _ledgers(conn, ids)
    return [EventLedger(event=e, sinks=entries[e["id"]]) for e in events]
