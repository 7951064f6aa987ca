"""The parts of ``apply_projection`` (testing.py, testing_async.py) without I/O: which events, the
batch the relay's walk gets, what a failure ends as."""

from __future__ import annotations

import uuid
from collections.abc import Iterable, Sequence
from typing import Any

from psycopg import pq

from outbox_relay.errors import EventDeadLettered, OutboxError, UnknownEvent
from outbox_relay.publish import Published
from outbox_relay.sinks.engine import Failure
from outbox_relay.store import StoredEvent, stored_event
from outbox_relay.testing.published_event import PublishedEvent, local, params, with_uuid

from .declare import Projection
from .event import ProjectionEvent
from .walk import SWALLOWED_ERROR, Batch, Delivered, Redo, redo_known

EventRef = Published | PublishedEvent | uuid.UUID

# Around a batched handler's one call (the relay's fast path): undone if the call fails.
SAVEPOINT = "SAVEPOINT outbox_testing_batch"
ROLLBACK = "ROLLBACK TO SAVEPOINT outbox_testing_batch; RELEASE SAVEPOINT outbox_testing_batch"
RELEASE = "RELEASE SAVEPOINT outbox_testing_batch"


def batch_of(projection: Projection, stored: Sequence[StoredEvent], fence: int,
           known: dict[Any, Failure] | None) -> Batch:
    return Batch(projection, stored, {e.bucket: fence for e in stored}, known=known or {}, name=projection.name)


def undo(projection: Projection, status: pq.TransactionStatus) -> None:
    """Before undoing a failed batch call: the test's transaction must still be there."""
    if status == pq.TransactionStatus.IDLE:
        raise OutboxError(
            f"apply_projection({projection.name!r}): the batched handler ended the transaction it was given (COMMIT, "
            "END or ROLLBACK through tx); the relay dead-letters the event whose call does so and keeps nothing of "
            "its batch (its commit guard), but apply_projection has no commit guard: what was committed stays "
            "committed, and the test's transaction is gone")


def next_known(projection: Projection, stored: Sequence[StoredEvent], known: dict[Any, Failure] | None,
          redo: Redo) -> dict[Any, Failure]:
    """What the next (careful) run starts from; a handler that ended the transaction is reported."""
    if redo.ended is not None:
        e = next(e for e in stored if e.id == redo.ended)
        raise ended(projection, e) from redo.__cause__
    return redo_known(stored, known, redo)


def ended(projection: Projection, e: StoredEvent) -> EventDeadLettered:
    # The relay's commit guard would have failed the batch, keeping nothing of it; here the test's
    # transaction is already gone.
    return EventDeadLettered(projection.name, e.id, (
        "the handler ended the transaction it was given (COMMIT, END or ROLLBACK through tx); the relay dead-letters "
        "such an event and keeps nothing of its batch (its commit guard), but apply_projection has no commit guard: "
        "what was committed stays committed, and the test's transaction is gone"), 1)


def result(projection: Projection, batch: Batch) -> list[ProjectionEvent[Any]]:
    failures: list[tuple[Delivered, Exception]] = []
    for e in batch.events:
        outcome = batch.outcomes.get(e.id)
        if outcome is None:
            continue
        exc = batch.errors.get(e.id)
        if exc is None:  # decided without the handler (dead-lettered at once), or a swallowed statement error
            exc = (OutboxError(outcome.error) if outcome is SWALLOWED_ERROR
                   else EventDeadLettered(projection.name, e.id, outcome.error, 1))
        failures.append((e, exc))
    if not failures:
        return batch.applied
    (first_event, first), *others = failures
    note = (f"apply_projection({projection.name!r}): event {first_event.id} ({first_event.type!r}, key "
            f"{first_event.key!r}) failed; {len(batch.applied)} event(s) were applied")
    if batch.waiting:
        note += f", {batch.waiting} wait behind a failed event of their key (not attempted)"
    first.add_note(note)
    for e, exc in others:
        first.add_note(f"also failed: event {e.id} ({e.type!r}, key {e.key!r}): {type(exc).__name__}: {exc}")
    raise first


def check_handler(projection: Any, conn: Any, *, async_wanted: bool) -> None:
    if not isinstance(projection, Projection):
        raise TypeError(f"not a projection: {projection!r} (decorate the handler with @projection)")
    if local(conn) is not None:
        raise TypeError(f"projection {projection.name!r} is applied on a database connection (its handler writes "
                        f"through it), not on a {type(conn).__name__}")
    if projection.is_async and not async_wanted:
        raise TypeError(f"projection {projection.name!r} has an async handler: use await aapply_projection(conn, ...) "
                        "with an async connection")
    if not projection.is_async and async_wanted:
        raise TypeError(f"projection {projection.name!r} has a sync handler: use apply_projection(conn, ...) with a "
                        "sync connection")


def selection(events: EventRef | Iterable[EventRef] | None, key: str | None,
               topic: str | None) -> tuple[dict[str, Any], list[uuid.UUID] | None]:
    """The read's parameters, and the ids asked for (None: all events, of ``key``/``topic``)."""
    if events is None:
        return params(key, None, topic), None
    refs = [events] if isinstance(events, Published | PublishedEvent | uuid.UUID) else list(events)
    ids = list(dict.fromkeys(event_id(r) for r in refs))
    return params(None, None, None, ids), ids


def event_id(ref: Any) -> uuid.UUID:
    if isinstance(ref, Published | PublishedEvent):
        return ref.id
    if isinstance(ref, uuid.UUID):
        return ref
    raise TypeError(f"events: {ref!r} is not a published event: give Published results (of publish), "
                    "PublishedEvents (of published) or event ids")


def select(projection: Projection, rows: Iterable[Sequence[Any]], ids: list[uuid.UUID] | None, key: str | None,
            topic: str | None) -> list[StoredEvent]:
    """The events the relay would hand this projection, in position order."""
    stored = [stored_event(with_uuid(r), read=1, version=r[12]) for r in rows]  # one read, as a relay's first
    if ids is not None:
        found = {e.id for e in stored}
        missing = [i for i in ids if i not in found]
        if missing:
            raise UnknownEvent(missing)
        stored = [e for e in stored if (key is None or e.key == key) and (topic is None or e.topic == topic)]
    wanted = projection.event_filter
    return [e for e in stored
            if (wanted.types is None or e.type in wanted.types) and (wanted.topics is None or e.topic in wanted.topics)]


def not_psycopg(conn: Any, driver: Any) -> str:
    return (f"projection handlers get a psycopg connection, as the relay gives them; this {type(conn).__name__} "
            f"runs on {type(driver).__module__}.{type(driver).__name__}: use a postgresql+psycopg:// engine")

