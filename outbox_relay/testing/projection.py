"""``apply_projection``: a projection's handler run in a test's transaction over events published in
it, by the relay's own batch walk (projections/walk.py), so the kit can not drift from the relay."""

from __future__ import annotations

import uuid
from collections.abc import Iterable, Sequence
from contextlib import nullcontext
from typing import Any

import psycopg
from psycopg import pq

from outbox_relay.errors import EventDeadLettered, OutboxError, UnknownEvent
from outbox_relay.publish import Published
from outbox_relay.sinks.engine import Failure
from outbox_relay.sqlfiles import query
from outbox_relay.store import StoredEvent, stored_event
from projections import Projection, ProjectionEvent
from projections.walk import SWALLOWED_ERROR, Batch, Delivered, Redo, adrive, drive, max_runs, redo_known, walk

from .published import PublishedEvent, _areader, _local, _params, _reader, _refuse_async, _with_uuid

# -- projections -----------------------------------------------------------------------------------

EventRef = Published | PublishedEvent | uuid.UUID



def apply_projection(conn: Any, projection: Projection, events: EventRef | Iterable[EventRef] | None = None, *,
                     key: str | None = None, topic: str | None = None, fence: int = 1) -> list[ProjectionEvent[Any]]:
    """Run ``projection``'s handler on ``conn``, in its transaction, over published events, as a relay
    would apply them; return the ``ProjectionEvent`` each handler call got, in order.

    ``events``: ``Published`` results, ``PublishedEvent``s or ids (one, or an iterable); None: every
    event the connection can see. ``key`` / ``topic`` narrow either. The events are read from
    ``outbox.events`` (an id the connection can not see raises ``UnknownEvent``) and applied by the
    relay's own walk (projections/walk.py): in position order, only the types and topics the
    projection takes, each payload upcast and decoded or validated into the declared model,
    ``replay=False``, ``attempt=1``, ``token=FenceToken(fence, 1, xid, seq)`` (as from a relay's
    first read of a bucket it just took), each event under a savepoint, so that a failing handler's
    writes are undone alone. A ``batch=True`` projection gets all the events in one call first, as
    the relay's fast path; if that call fails, its writes are undone and the events are applied one
    at a time, as the relay does.

    The handler gets the connection itself (a SQLAlchemy one's psycopg driver connection), so its
    writes are part of the test's transaction. A connection with no transaction open (autocommit)
    gets one for the call, committed at its end, like a relay's batch.

    Failures end as the relay's first attempt would end: every other event is applied (except the
    later events of a key whose handler raised: they wait behind it), then the first failure is
    raised, with notes naming the others: the handler's own exception, or ``EventDeadLettered`` for
    an event the relay dead-letters without calling the handler (a payload its model refuses, a type
    refused by ``on_unknown="reject"``). Not simulated: leases and fencing (the token is made up),
    checkpoints (applying an event twice applies it twice), retries and backoff, the relay's commit
    guard (a handler that ends the transaction is reported, but what it committed stays committed),
    the session settings of the relay's connection, rebuilds.
    """
    _check_handler(projection, conn, want_async=False)
    _refuse_async(conn, "apply_projection", "await aapply_projection(conn, ...)")
    params, ids = _selection(events, key, topic)
    stored = _select(projection, _reader(conn)(query("testing", "published"), params), ids, key, topic)
    tx = _psycopg_connection(conn)
    with tx.transaction() if tx.info.transaction_status == pq.TransactionStatus.IDLE else nullcontext():
        known: dict[Any, Failure] | None = None if projection.batch else {}
        for _ in range(max_runs(stored)):
            batch = _batch(projection, stored, fence, known)
            fast = known is None
            if fast:
                tx.execute(_SAVEPOINT)
            try:
                drive(walk(batch, careful=not fast, end=False), tx, projection.handler)
            except Redo as redo:
                if fast:
                    _undo(projection, tx.info.transaction_status)
                    tx.execute(_ROLLBACK)
                known = _next(projection, stored, known, redo)
                continue
            if fast:
                tx.execute(_RELEASE)
            break
        else:
            raise AssertionError("unreachable: a careful walk is redone only when a handler ended the transaction")
    return _result(projection, batch)  # after the commit of a transaction begun here: failures keep the rest


async def aapply_projection(conn: Any, projection: Projection, events: EventRef | Iterable[EventRef] | None = None,
                            *, key: str | None = None, topic: str | None = None,
                            fence: int = 1) -> list[ProjectionEvent[Any]]:
    """``apply_projection`` for a projection with an ``async def`` handler, on an async connection
    (psycopg AsyncConnection or AsyncCursor, SQLAlchemy AsyncConnection or AsyncSession over psycopg)."""
    _check_handler(projection, conn, want_async=True)
    params, ids = _selection(events, key, topic)
    read = await _areader(conn)
    stored = _select(projection, await read(query("testing", "published"), params), ids, key, topic)
    tx = await _apsycopg_connection(conn)
    async with tx.transaction() if tx.info.transaction_status == pq.TransactionStatus.IDLE else nullcontext():
        known: dict[Any, Failure] | None = None if projection.batch else {}
        for _ in range(max_runs(stored)):
            batch = _batch(projection, stored, fence, known)
            fast = known is None
            if fast:
                await tx.execute(_SAVEPOINT)
            try:
                await adrive(walk(batch, careful=not fast, end=False), tx, projection.handler)
            except Redo as redo:
                if fast:
                    _undo(projection, tx.info.transaction_status)
                    await tx.execute(_ROLLBACK)
                known = _next(projection, stored, known, redo)
                continue
            if fast:
                await tx.execute(_RELEASE)
            break
        else:
            raise AssertionError("unreachable: a careful walk is redone only when a handler ended the transaction")
    return _result(projection, batch)  # after the commit of a transaction begun here: failures keep the rest


# Around a batched handler's one call (the relay's fast path): undone if the call fails.
_SAVEPOINT = "SAVEPOINT outbox_testing_batch"
_ROLLBACK = "ROLLBACK TO SAVEPOINT outbox_testing_batch; RELEASE SAVEPOINT outbox_testing_batch"
_RELEASE = "RELEASE SAVEPOINT outbox_testing_batch"


def _batch(projection: Projection, stored: Sequence[StoredEvent], fence: int,
           known: dict[Any, Failure] | None) -> Batch:
    return Batch(projection, stored, {e.bucket: fence for e in stored}, known=known or {}, name=projection.name)


def _undo(projection: Projection, status: pq.TransactionStatus) -> None:
    """Before undoing a failed batch call: the test's transaction must still be there."""
    if status == pq.TransactionStatus.IDLE:
        raise OutboxError(
            f"apply_projection({projection.name!r}): the batched handler ended the transaction it was given (COMMIT, "
            "END or ROLLBACK through tx); the relay dead-letters the event whose call does so and keeps nothing of "
            "its batch (its commit guard), but apply_projection has no commit guard: what was committed stays "
            "committed, and the test's transaction is gone")


def _next(projection: Projection, stored: Sequence[StoredEvent], known: dict[Any, Failure] | None,
          redo: Redo) -> dict[Any, Failure]:
    """What the next (careful) run starts from; a handler that ended the transaction is reported."""
    if redo.ended is not None:
        e = next(e for e in stored if e.id == redo.ended)
        raise _ended(projection, e) from redo.__cause__
    return redo_known(stored, known, redo)


def _ended(projection: Projection, e: StoredEvent) -> EventDeadLettered:
    # The relay's commit guard would have failed the batch, keeping nothing of it; here the test's
    # transaction is already gone.
    return EventDeadLettered(projection.name, e.id, (
        "the handler ended the transaction it was given (COMMIT, END or ROLLBACK through tx); the relay dead-letters "
        "such an event and keeps nothing of its batch (its commit guard), but apply_projection has no commit guard: "
        "what was committed stays committed, and the test's transaction is gone"), 1)


def _result(projection: Projection, batch: Batch) -> list[ProjectionEvent[Any]]:
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


def _check_handler(projection: Any, conn: Any, *, want_async: bool) -> None:
    if not isinstance(projection, Projection):
        raise TypeError(f"not a projection: {projection!r} (decorate the handler with @projection)")
    if _local(conn) is not None:
        raise TypeError(f"projection {projection.name!r} is applied on a database connection (its handler writes "
                        f"through it), not on a {type(conn).__name__}")
    if projection.is_async and not want_async:
        raise TypeError(f"projection {projection.name!r} has an async handler: use await aapply_projection(conn, ...) "
                        "with an async connection")
    if not projection.is_async and want_async:
        raise TypeError(f"projection {projection.name!r} has a sync handler: use apply_projection(conn, ...) with a "
                        "sync connection")


def _selection(events: EventRef | Iterable[EventRef] | None, key: str | None,
               topic: str | None) -> tuple[dict[str, Any], list[uuid.UUID] | None]:
    """The read's parameters, and the ids asked for (None: all events, of ``key``/``topic``)."""
    if events is None:
        return _params(key, None, topic), None
    refs = [events] if isinstance(events, Published | PublishedEvent | uuid.UUID) else list(events)
    ids = list(dict.fromkeys(_event_id(r) for r in refs))
    return _params(None, None, None, ids), ids


def _event_id(ref: Any) -> uuid.UUID:
    if isinstance(ref, Published | PublishedEvent):
        return ref.id
    if isinstance(ref, uuid.UUID):
        return ref
    raise TypeError(f"events: {ref!r} is not a published event: give Published results (of publish), "
                    "PublishedEvents (of published) or event ids")


def _select(projection: Projection, rows: Iterable[Sequence[Any]], ids: list[uuid.UUID] | None, key: str | None,
            topic: str | None) -> list[StoredEvent]:
    """The events the relay would hand this projection, in position order."""
    stored = [stored_event(_with_uuid(r), read=1, version=r[12]) for r in rows]  # one read, as a relay's first
    if ids is not None:
        found = {e.id for e in stored}
        missing = [i for i in ids if i not in found]
        if missing:
            raise UnknownEvent(missing)
        stored = [e for e in stored if (key is None or e.key == key) and (topic is None or e.topic == topic)]
    wanted = projection.event_filter
    return [e for e in stored
            if (wanted.types is None or e.type in wanted.types) and (wanted.topics is None or e.topic in wanted.topics)]


def _psycopg_connection(conn: Any) -> psycopg.Connection[Any]:
    """The psycopg connection a handler gets: ``conn``, a cursor's, or a SQLAlchemy one's driver connection."""
    if isinstance(conn, psycopg.Cursor):
        conn = conn.connection
    if isinstance(conn, psycopg.Connection):
        return conn
    if hasattr(conn, "exec_driver_sql"):
        driver = conn.connection.driver_connection
    elif hasattr(conn, "get_bind") and hasattr(conn, "connection"):
        driver = conn.connection().connection.driver_connection
    else:
        raise TypeError(f"cannot apply a projection on a {type(conn).__name__}: pass a psycopg connection or cursor, "
                        "or a SQLAlchemy Connection or Session")
    if not isinstance(driver, psycopg.Connection):
        raise TypeError(_not_psycopg(conn, driver))
    return driver


async def _apsycopg_connection(conn: Any) -> psycopg.AsyncConnection[Any]:
    """``_psycopg_connection`` for async connections."""
    if isinstance(conn, psycopg.AsyncCursor):
        conn = conn.connection
    if isinstance(conn, psycopg.AsyncConnection):
        return conn
    if hasattr(conn, "exec_driver_sql"):
        driver = (await conn.get_raw_connection()).driver_connection
    elif hasattr(conn, "get_bind") and hasattr(conn, "connection"):
        driver = (await (await conn.connection()).get_raw_connection()).driver_connection
    else:
        raise TypeError(f"cannot apply a projection on a {type(conn).__name__}: pass a psycopg AsyncConnection or "
                        "cursor, or a SQLAlchemy AsyncConnection or AsyncSession")
    if not isinstance(driver, psycopg.AsyncConnection):
        raise TypeError(_not_psycopg(conn, driver))
    return driver


def _not_psycopg(conn: Any, driver: Any) -> str:
    return (f"projection handlers get a psycopg connection, as the relay gives them; this {type(conn).__name__} "
            f"runs on {type(driver).__module__}.{type(driver).__name__}: use a postgresql+psycopg:// engine")

