"""A published event as a test sees it (``PublishedEvent``), and the reading kit's parts without I/O:
rows to events, a source that needs no database, filters, the async check."""

from __future__ import annotations

import inspect
import uuid
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from outbox_relay.store import StoredEvent, stored_event


@dataclass(frozen=True)
class PublishedEvent:
    """One published event as a test sees it. ``payload`` and ``headers`` are decoded JSON, as a
    consumer gets them; ``time`` is what the producer passed (None if nothing); ``position`` is
    ``(xid, seq)``, per key the order the relays deliver in (except for two overlapping
    transactions of one key: docs/design-read-path.md, "What order one key gets"); a ``FakeOutbox``
    numbers its events ``(0, 1)``, ``(0, 2)``, ... in publish order."""

    id: uuid.UUID
    type: str
    key: str
    topic: str | None
    payload: Any
    headers: dict[str, str]
    idempotency_key: str | None
    time: datetime | None
    position: tuple[int, int]


Source = Any  # a connection (see the module docstring), a FakeOutbox, or a list or tuple of PublishedEvent


def params(key: str | None, type: str | None, topic: str | None,
            ids: Sequence[uuid.UUID] | None = None) -> dict[str, Any]:
    return {"key": key, "type": type, "topic": topic, "ids": [str(i) for i in ids] if ids is not None else None}


def from_rows(rows: Iterable[Sequence[Any]]) -> list[PublishedEvent]:
    return [published_event(stored_event(with_uuid(r)), r[10], r[11]) for r in rows]


def with_uuid(row: Sequence[Any]) -> list[Any]:
    # psycopg2 (through SQLAlchemy) returns uuid columns as text.
    out = list(row)
    out[3] = out[3] if isinstance(out[3], uuid.UUID) else uuid.UUID(str(out[3]))
    return out


def published_event(e: StoredEvent, idempotency_key: str | None, time: datetime | None) -> PublishedEvent:
    return PublishedEvent(id=e.id, type=e.type, key=e.key, topic=e.topic, payload=e.payload, headers=e.headers,
                          idempotency_key=idempotency_key, time=time, position=e.position)


def local(source: Source) -> list[PublishedEvent] | None:
    """The events of a source that needs no database (a FakeOutbox, a list), else None."""
    from .fake import FakeOutbox  # here: fake.py builds on this module

    if isinstance(source, FakeOutbox):
        return source.events
    if isinstance(source, list | tuple) and all(isinstance(e, PublishedEvent) for e in source):
        return sorted(source, key=lambda e: e.position)
    return None


def filter_events(events: Iterable[PublishedEvent], *, key: str | None, type: str | None,
            topic: str | None) -> list[PublishedEvent]:
    return [e for e in events
            if (key is None or e.key == key) and (type is None or e.type == type)
            and (topic is None or e.topic == topic)]


def is_async_connection(conn: Any) -> bool:
    return inspect.iscoroutinefunction(getattr(conn, "execute", None))


def refuse_other_flavour(conn: Any, name: str, instead: str, *, async_wanted: bool) -> None:
    """Refuse an async connection where a sync one is wanted, or the other way round."""
    got_async = is_async_connection(conn)
    if got_async and not async_wanted:
        raise TypeError(f"{name} was given an async {type(conn).__name__}: use {instead}")
    if async_wanted and not got_async:
        raise TypeError(f"{name} was given a {type(conn).__name__}, which is not async: use {instead}")
