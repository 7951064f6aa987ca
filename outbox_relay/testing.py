"""Testing kit for code that publishes events and for projection handlers (no relay needed).

    from outbox_relay.testing import FakeOutbox, apply_projection, assert_published, published

- ``published(conn, key=..., type=..., topic=...)``: the events the test's connection can see (its
  own open transaction's included), in the relay's order; ``apublished`` for async connections.
- ``assert_published(conn, [("OrderPlaced", {...}), "OrderPaid"], key="order:1")``: exactly these
  events, in this order, with a readable report when not; ``assert_not_published``.
- ``apply_projection(conn, projection)``: run a projection's handler in the test's transaction over
  events published in it, with each ``ProjectionEvent`` built as the relay builds it;
  ``aapply_projection`` for async handlers.
- ``RecordingSink``: a sink a real relay (``Worker``) delivers to in a test, recording each event
  (and failing the ones you say), to test a whole relay without Kafka.
- ``FakeOutbox``: an ``Outbox`` that keeps events in memory, for code tested without PostgreSQL. It
  validates exactly as ``Outbox`` does (tests/integration/test_outbox_contract.py runs the same
  scenarios against both).

The helpers take a psycopg connection or cursor (sync or async), a SQLAlchemy Connection or Session
(sync or async), a ``FakeOutbox``, or a list of ``PublishedEvent``. Reading needs no transaction:
unlike ``publish``, an autocommit connection is fine.
"""

from __future__ import annotations

import inspect
import json
import threading
import time
import uuid
from collections import Counter
from collections.abc import Awaitable, Callable, Generator, Iterable, Mapping, Sequence
from contextlib import nullcontext
from dataclasses import dataclass
from datetime import datetime
from decimal import Decimal
from typing import Any

import psycopg
from psycopg import pq

from projections import Projection, ProjectionEvent
from projections.declare import describe
from projections.sink import SWALLOWED_ERROR

from .errors import (
    EventDeadLettered,
    NonRetriableDelivery,
    OutboxError,
    UnknownEvent,
)
from .event import Event
from .publish import Outbox, Published, _id_taken, _key_stands_for_another
from .sink import Commit, Failure, KeyHold, Outcomes
from .sqlfiles import query
from .store import StoredEvent, stored_event

__all__ = [
    "Delivery",
    "FakeOutbox",
    "PublishedEvent",
    "RecordingSink",
    "aapply_projection",
    "apply_projection",
    "apublished",
    "assert_not_published",
    "assert_published",
    "published",
]

# The fields an expected event may name (``assert_published``), all attributes of PublishedEvent.
FIELDS = ("type", "key", "topic", "payload", "headers", "idempotency_key", "id", "time")
_SHOWN = 20  # events listed in a failure message before "... and N more"
_PAYLOAD_CHARS = 300


@dataclass(frozen=True)
class PublishedEvent:
    """One published event as a test sees it. ``payload`` and ``headers`` are decoded JSON, as a
    consumer gets them; ``time`` is what the producer passed (None if nothing); ``position`` is
    ``(xid, seq)``, per key the order the relays deliver in (except for two overlapping
    transactions of one key: docs/architecture.md, "What order one key gets"); a ``FakeOutbox``
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
_Read = Callable[[str, dict[str, Any]], list[Any]]
_ARead = Callable[[str, dict[str, Any]], Awaitable[list[Any]]]


# -- reading ---------------------------------------------------------------------------------------


def published(source: Source, *, key: str | None = None, type: str | None = None,
              topic: str | None = None) -> list[PublishedEvent]:
    """The events ``source`` can see, of ``key``/``type``/``topic`` if given, in position order.

    On a connection inside a transaction that includes the events that transaction published and has
    not committed; other transactions' events only once committed (what the relays see, too).
    """
    local = _local(source)
    if local is not None:
        return _filter(local, key=key, type=type, topic=topic)
    _refuse_async(source, "published", "await apublished(conn, ...)")
    return _from_rows(_reader(source)(query("testing", "published"), _params(key, type, topic)))


async def apublished(source: Source, *, key: str | None = None, type: str | None = None,
                     topic: str | None = None) -> list[PublishedEvent]:
    """``published`` for an async connection (psycopg AsyncConnection/AsyncCursor, SQLAlchemy async)."""
    local = _local(source)
    if local is not None:
        return _filter(local, key=key, type=type, topic=topic)
    read = await _areader(source)
    return _from_rows(await read(query("testing", "published"), _params(key, type, topic)))


def _params(key: str | None, type: str | None, topic: str | None,
            ids: Sequence[uuid.UUID] | None = None) -> dict[str, Any]:
    return {"key": key, "type": type, "topic": topic, "ids": [str(i) for i in ids] if ids is not None else None}


def _from_rows(rows: Iterable[Sequence[Any]]) -> list[PublishedEvent]:
    return [_published_event(stored_event(_with_uuid(r)), r[10], r[11]) for r in rows]


def _with_uuid(row: Sequence[Any]) -> list[Any]:
    # psycopg2 (through SQLAlchemy) returns uuid columns as text.
    out = list(row)
    out[3] = out[3] if isinstance(out[3], uuid.UUID) else uuid.UUID(str(out[3]))
    return out


def _published_event(e: StoredEvent, idempotency_key: str | None, time: datetime | None) -> PublishedEvent:
    return PublishedEvent(id=e.id, type=e.type, key=e.key, topic=e.topic, payload=e.payload, headers=e.headers,
                          idempotency_key=idempotency_key, time=time, position=e.position)


def _local(source: Source) -> list[PublishedEvent] | None:
    """The events of a source that needs no database (a FakeOutbox, a list), else None."""
    if isinstance(source, FakeOutbox):
        return source.events
    if isinstance(source, list | tuple) and all(isinstance(e, PublishedEvent) for e in source):
        return sorted(source, key=lambda e: e.position)
    return None


def _filter(events: Iterable[PublishedEvent], *, key: str | None, type: str | None,
            topic: str | None) -> list[PublishedEvent]:
    return [e for e in events
            if (key is None or e.key == key) and (type is None or e.type == type)
            and (topic is None or e.topic == topic)]


def _is_async(conn: Any) -> bool:
    return inspect.iscoroutinefunction(getattr(conn, "execute", None))


def _refuse_async(conn: Any, name: str, instead: str) -> None:
    if _is_async(conn):
        raise TypeError(f"{name} was given an async {type(conn).__name__}: use {instead}")


def _reader(conn: Any) -> _Read:
    """Run a query on ``conn`` and return its rows (sync). Unlike ``publish``'s executor, no open
    transaction is required: reading commits nothing."""
    if hasattr(conn, "exec_driver_sql") or (hasattr(conn, "get_bind") and hasattr(conn, "connection")):
        sa = conn if hasattr(conn, "exec_driver_sql") else conn.connection()  # Connection, or a Session's
        return lambda sql, params: list(sa.exec_driver_sql(sql, params).fetchall())
    if hasattr(conn, "cursor"):  # psycopg Connection

        def on_connection(sql: str, params: dict[str, Any]) -> list[Any]:
            with conn.cursor() as cur:
                cur.execute(sql, params)
                return list(cur.fetchall())

        return on_connection
    if hasattr(conn, "execute") and hasattr(conn, "fetchall"):  # a cursor: a cursor of its connection
        return _reader(conn.connection)
    raise TypeError(f"cannot read events from a {type(conn).__name__}: pass a psycopg connection or cursor, a "
                    "SQLAlchemy Connection or Session, a FakeOutbox or a list of PublishedEvent")


async def _areader(conn: Any) -> _ARead:
    """``_reader`` for async connections."""
    if not _is_async(conn):
        raise TypeError(f"apublished was given a {type(conn).__name__}, which is not async: use published(...)")
    if hasattr(conn, "exec_driver_sql") or (hasattr(conn, "get_bind") and hasattr(conn, "connection")):
        sa = conn if hasattr(conn, "exec_driver_sql") else await conn.connection()  # AsyncConnection/Session

        async def on_sqlalchemy(sql: str, params: dict[str, Any]) -> list[Any]:
            return list((await sa.exec_driver_sql(sql, params)).fetchall())

        return on_sqlalchemy
    if hasattr(conn, "cursor"):  # psycopg AsyncConnection

        async def on_connection(sql: str, params: dict[str, Any]) -> list[Any]:
            async with conn.cursor() as cur:
                await cur.execute(sql, params)
                return list(await cur.fetchall())

        return on_connection
    if hasattr(conn, "execute") and hasattr(conn, "fetchall"):  # an AsyncCursor
        return await _areader(conn.connection)
    raise TypeError(f"cannot read events from a {type(conn).__name__}: pass a psycopg AsyncConnection or cursor, "
                    "or a SQLAlchemy AsyncConnection or AsyncSession")


# -- assertions ------------------------------------------------------------------------------------


def assert_published(source: Source, expected: Iterable[Any], *, key: str | None = None,
                     type: str | None = None, topic: str | None = None) -> list[PublishedEvent]:
    """Assert that the events of ``key``/``type``/``topic`` (all events if none is given) are exactly
    ``expected``, in this order, and return them.

    Order is ``(xid, seq)``, per key the relay's (but for overlapping transactions of one key, see
    ``PublishedEvent``). Without ``key`` the list is all matching events in ``(xid, seq)`` order,
    which in a test that publishes from one thread is the order of its publish calls; across keys
    that is more than the relay promises, so prefer ``key=``.

    Each expected event is a type name (``"OrderPaid"``), a ``(type, payload)`` pair, or a dict of
    the fields to compare (``type``, ``key``, ``topic``, ``payload``, ``headers``,
    ``idempotency_key``, ``id``, ``time``); fields left out are not compared, and
    ``unittest.mock.ANY`` matches anything, also inside a payload. Payloads compare as decoded JSON
    (a tuple was stored as a list). On a mismatch the AssertionError lists, event by event, what
    was expected and what was published.

    ``source``: a connection (sync; with an async one pass ``await apublished(conn)``), a
    ``FakeOutbox`` or a list of ``PublishedEvent``.
    """
    wanted = _expectations(expected)
    events = published(source, key=key, type=type, topic=topic)
    if len(events) == len(wanted) and all(_matches(e, w) for e, w in zip(events, wanted, strict=True)):
        return events
    raise AssertionError(_difference(source, events, wanted, _scope(key, type, topic)))


def assert_not_published(source: Source, *, key: str | None = None, type: str | None = None,
                         topic: str | None = None) -> None:
    """Assert that no event of ``key``/``type``/``topic`` is visible (with no filter: no event at all)."""
    events = published(source, key=key, type=type, topic=topic)
    if events:
        lines = [f"assert_not_published: {len(events)} event(s) {_scope(key, type, topic)} were published:"]
        lines += [f"  {_show_event(e, identify=True)}" for e in events[:_SHOWN]]
        lines += _more(events)
        raise AssertionError("\n".join(lines))


def _expectations(expected: Iterable[Any]) -> list[dict[str, Any]]:
    """Each expected event as the fields to compare; a malformed one is named (TypeError)."""
    if isinstance(expected, str | bytes | Mapping) or not isinstance(expected, Iterable):
        raise TypeError(f"expected must be a list of events, not a {type(expected).__name__} (write [{expected!r}])")
    out = []
    for n, item in enumerate(expected, 1):
        if isinstance(item, str):
            fields: dict[str, Any] = {"type": item}
        elif isinstance(item, tuple) and len(item) == 2 and isinstance(item[0], str):
            fields = {"type": item[0], "payload": item[1]}
        elif isinstance(item, Mapping):
            unknown = sorted(str(f) for f in item if f not in FIELDS)
            if unknown or not item:
                raise TypeError(f"expected event #{n} {dict(item)!r}: "
                                + (f"unknown field(s) {', '.join(unknown)}; " if unknown else "no fields; ")
                                + f"an expected event compares some of {', '.join(FIELDS)}")
            fields = dict(item)
            if isinstance(fields.get("id"), Published):
                fields["id"] = fields["id"].id
        else:
            raise TypeError(f"expected event #{n} is {item!r}: give a type name, a (type, payload) pair or a dict "
                            f"of fields ({', '.join(FIELDS)})")
        out.append(fields)
    return out


def _matches(event: PublishedEvent, wanted: Mapping[str, Any]) -> bool:
    # The expected value on the left: unittest.mock.ANY (there, or nested in it) then decides.
    return all(bool(value == getattr(event, name)) for name, value in wanted.items())


def _scope(key: str | None, type: str | None, topic: str | None) -> str:
    parts = [f"{name}={value!r}" for name, value in (("key", key), ("type", type), ("topic", topic))
             if value is not None]
    return f"with {', '.join(parts)}" if parts else "in the outbox"


def _json(value: Any) -> str:
    try:
        # Sorted keys: an expected payload and a stored one (jsonb orders keys its own way) line up.
        text = json.dumps(value, ensure_ascii=False, default=repr, sort_keys=True)
    except (TypeError, ValueError):
        text = repr(value)
    return text if len(text) <= _PAYLOAD_CHARS else text[:_PAYLOAD_CHARS] + "..."


def _show_expected(wanted: Mapping[str, Any]) -> str:
    parts = [str(wanted["type"])] if "type" in wanted else []
    if "payload" in wanted:
        parts.append(_json(wanted["payload"]))
    parts += [f"{name}={_json(value)}" for name, value in wanted.items() if name not in ("type", "payload")]
    return " ".join(parts)


def _show_event(event: PublishedEvent, fields: Iterable[str] = (), identify: bool = False) -> str:
    parts = [event.type, _json(event.payload)]
    extra = [f for f in FIELDS if f in fields and f not in ("type", "payload")]
    if identify:
        extra = ["key", "topic", *extra, "id"]
    parts += [f"{name}={_json(str(v) if isinstance(v, uuid.UUID | datetime) else v)}"
              for name in dict.fromkeys(extra) for v in [getattr(event, name)]]
    return " ".join(parts)


def _more(events: Sequence[Any]) -> list[str]:
    return [f"  ... and {len(events) - _SHOWN} more"] if len(events) > _SHOWN else []


def _difference(source: Source, events: list[PublishedEvent], wanted: list[dict[str, Any]], scope: str) -> str:
    """The failure message of assert_published: expected and published side by side, by position."""
    lines = [f"assert_published: the events {scope} are not the expected ones "
             f"({len(wanted)} expected, {len(events)} published), in position order:"]
    for i in range(max(len(events), len(wanted))):
        if i == _SHOWN:
            lines.append(f"  ... and {max(len(events), len(wanted)) - _SHOWN} more")
            break
        e = events[i] if i < len(events) else None
        w = wanted[i] if i < len(wanted) else None
        n = f"{i + 1:>3}"
        if e is not None and w is not None and _matches(e, w):
            lines.append(f"{n} ok         {_show_event(e, w)}")
        elif e is not None and w is not None:
            differ = [name for name, value in w.items() if not bool(value == getattr(e, name))]
            lines.append(f"{n} DIFFERS    expected:  {_show_expected(w)}")
            lines.append(f"               published: {_show_event(e, w)}   ({', '.join(differ)} "
                         f"differ{'s' if len(differ) == 1 else ''})")
        elif w is not None:
            lines.append(f"{n} MISSING    expected:  {_show_expected(w)}")
        elif e is not None:
            lines.append(f"{n} UNEXPECTED published: {_show_event(e, identify=True)}")
    if events and len(events) == len(wanted) and _same_events(events, wanted):
        lines.append("The same events were published, in another order.")
    if not events and scope != "in the outbox":
        everything = published(source)
        if everything:
            found = Counter(f"key={e.key!r} type={e.type!r} topic={e.topic!r}" for e in everything)
            lines.append(f"Nothing was published {scope}; the {len(everything)} event(s) visible are:")
            lines += [f"  {count} x {what}" for what, count in found.most_common(_SHOWN)]
    return "\n".join(lines)


def _same_events(events: list[PublishedEvent], wanted: list[dict[str, Any]]) -> bool:
    left = list(events)
    for w in wanted:
        hit = next((e for e in left if _matches(e, w)), None)
        if hit is None:
            return False
        left.remove(hit)
    return True


# -- projections -----------------------------------------------------------------------------------

EventRef = Published | PublishedEvent | uuid.UUID

# What the per-event walk asks its driver to do: ("execute", sql) or ("call", ProjectionEvent); and
# what it gets back: what that raised (or None) and the transaction's status afterwards.
_Step = tuple[str, Any]
_Reply = tuple[Exception | None, pq.TransactionStatus]


@dataclass
class _Outcome:
    applied: list[ProjectionEvent[Any]]
    failures: list[tuple[StoredEvent, Exception]]
    waiting: int = 0  # events not attempted: an earlier event of their key failed (retriably)


_Walk = Generator[_Step, _Reply, _Outcome]


def apply_projection(conn: Any, projection: Projection, events: EventRef | Iterable[EventRef] | None = None, *,
                     key: str | None = None, topic: str | None = None, fence: int = 1) -> list[ProjectionEvent[Any]]:
    """Run ``projection``'s handler on ``conn``, in its transaction, over published events, as a relay
    would apply them; return the ``ProjectionEvent`` each handler call got, in order.

    ``events``: ``Published`` results, ``PublishedEvent``s or ids (one, or an iterable); None: every
    event the connection can see. ``key`` / ``topic`` narrow either. The events are read from
    ``outbox.events`` (an id the connection can not see raises ``UnknownEvent``) and applied as the
    relay does: in position order, only the types and topics the projection takes, each payload
    decoded or validated into the declared model, ``replay=False``, ``attempt=1``,
    ``token=FenceToken(fence, 1, xid, seq)`` (as from a relay's first read of a bucket it just took),
    each event under a savepoint, so that a failing handler's writes are undone alone.

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

    def do(kind: str, arg: Any) -> None:
        if kind == "execute":
            tx.execute(arg)
        else:
            projection.handler(arg, tx)

    with tx.transaction() if tx.info.transaction_status == pq.TransactionStatus.IDLE else nullcontext():
        walk = _walk(projection, stored, fence)
        try:
            step = next(walk)
            while True:
                error: Exception | None = None
                try:
                    do(*step)
                except Exception as exc:
                    error = exc
                if error is not None and tx.broken:
                    raise error
                step = walk.send((error, tx.info.transaction_status))
        except StopIteration as done:
            outcome: _Outcome = done.value
    return _result(projection, outcome)


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

    async def do(kind: str, arg: Any) -> None:
        if kind == "execute":
            await tx.execute(arg)
        else:
            await projection.handler(arg, tx)

    async with tx.transaction() if tx.info.transaction_status == pq.TransactionStatus.IDLE else nullcontext():
        walk = _walk(projection, stored, fence)
        try:
            step = next(walk)
            while True:
                error: Exception | None = None
                try:
                    await do(*step)
                except Exception as exc:
                    error = exc
                if error is not None and tx.broken:
                    raise error
                step = walk.send((error, tx.info.transaction_status))
        except StopIteration as done:
            outcome: _Outcome = done.value
    return _result(projection, outcome)


def _walk(projection: Projection, stored: Sequence[StoredEvent], fence: int) -> _Walk:
    """The relay's careful walk over one batch (projections/sink.py), for either driver: per event a
    savepoint, the handler, then keep its writes or undo them."""
    outcome = _Outcome([], [])
    stuck: set[str] = set()  # keys whose event failed retriably: their later events wait
    for e in stored:
        if e.key in stuck:
            outcome.waiting += 1
            continue
        prepared = _prepare(projection, e, fence)
        if prepared is None:
            continue
        if isinstance(prepared, Failure):
            outcome.failures.append((e, EventDeadLettered(projection.name, e.id, prepared.error, 1)))
            if prepared.retriable:
                stuck.add(e.key)
            continue
        error, _ = yield "execute", query("projections", "event_savepoint")
        if error is not None:
            raise error
        error, status = yield "call", prepared
        if status == pq.TransactionStatus.IDLE:
            raise _ended(projection, e) from error
        keep = error is None and status == pq.TransactionStatus.INTRANS
        closed, _ = yield "execute", query("projections", "event_release" if keep else "event_rollback")
        if closed is not None:  # the savepoint is gone: the handler ended the transaction, then began one
            raise _ended(projection, e) from closed
        if keep:
            outcome.applied.append(prepared)
            continue
        # As the relay: the key waits behind a retriable failure, NonRetriableDelivery is dead-lettered.
        outcome.failures.append((e, error if error is not None else OutboxError(SWALLOWED_ERROR.error)))
        if not isinstance(error, NonRetriableDelivery):
            stuck.add(e.key)
    return outcome


def _prepare(projection: Projection, e: StoredEvent, fence: int) -> ProjectionEvent[Any] | Failure | None:
    """``Projection.prepare`` as the relay calls it: what it raises is charged to the event, for good."""
    try:
        return projection.prepare(e, fence, False)
    except Exception as exc:
        return Failure(f"the event could not be prepared for the handler: {describe(exc)}", retriable=False)


def _ended(projection: Projection, e: StoredEvent) -> EventDeadLettered:
    # The relay's commit guard would have failed the batch, keeping nothing of it; here the test's
    # transaction is already gone.
    return EventDeadLettered(projection.name, e.id, (
        "the handler ended the transaction it was given (COMMIT, END or ROLLBACK through tx); the relay dead-letters "
        "such an event and keeps nothing of its batch (its commit guard), but apply_projection has no commit guard: "
        "what was committed stays committed, and the test's transaction is gone"), 1)


def _result(projection: Projection, outcome: _Outcome) -> list[ProjectionEvent[Any]]:
    if not outcome.failures:
        return outcome.applied
    (first_event, first), *others = outcome.failures
    note = (f"apply_projection({projection.name!r}): event {first_event.id} ({first_event.type!r}, key "
            f"{first_event.key!r}) failed; {len(outcome.applied)} event(s) were applied")
    if outcome.waiting:
        note += f", {outcome.waiting} wait behind a failed event of their key (not attempted)"
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


# -- a sink for whole-relay tests ------------------------------------------------------------------


@dataclass(frozen=True)
class Delivery:
    """One attempt a ``RecordingSink`` saw: the event, its attempt number (1 on first delivery, counted
    by the relay across retries) and the error it was failed with (None: delivered)."""

    event: PublishedEvent
    attempt: int
    error: str | None


FailWith = Callable[[PublishedEvent, int], "str | Failure | None"]


class RecordingSink:
    """A sink that records what a real relay delivers to it, for tests of a whole relay without Kafka::

        sink = RecordingSink("kafka")
        worker = Worker(RelaySettings(dsn=test_dsn, kafka=False, worker_id="t"), sinks=[sink])
        worker.start()
        ...publish and commit...
        sink.wait_for(3)                         # three events delivered (AssertionError after the timeout)
        assert [e.type for e in sink.delivered(key="order:7")] == ["OrderPlaced", "OrderPaid", "OrderShipped"]
        worker.drain(); worker.wait()

    It follows the relay's rules like a real sink: it gets each bucket's events in order, and after a
    failure it leaves the rest of that key's batch alone (the relay parks them behind it). ``fail(event,
    attempt)`` makes an attempt fail: return an error text (retried with backoff, dead-lettered after
    ``--max-attempts``), a ``Failure(error, retriable=False)`` (dead-lettered at once) or None.

    ``delivered()`` lists each delivered event once, in the order of its first delivery (a relay
    redelivers a batch whose checkpoint did not land: at-least-once); ``deliveries`` every attempt.
    Thread-safe: the relay calls ``deliver`` on its runner thread.
    """

    event_filter = None  # every event, like the Kafka sink

    def __init__(self, name: str = "kafka", *, fail: FailWith | None = None, kind: str = "kafka") -> None:
        if kind not in ("kafka", "projection"):
            raise ValueError(f"kind must be 'kafka' or 'projection' (how the sink is registered), not {kind!r}")
        self.name, self.kind, self.fail = name, kind, fail
        self._deliveries: list[Delivery] = []
        self._lock = threading.Condition()

    def deliver(self, events: Sequence[StoredEvent], fences: dict[int, int], commit: Commit,
                abort: threading.Event) -> set[int]:
        outcomes: Outcomes = {}
        hold = KeyHold()
        attempts: list[Delivery] = []
        for e in events:
            if not hold.allows(e):
                continue
            event = _published_event(e, None, None)
            outcome = self._outcome(event, e.attempts + 1)
            outcomes[e.id] = outcome
            attempts.append(Delivery(event, e.attempts + 1, outcome.error if outcome else None))
            hold.record(e, outcome)
        landed = commit(outcomes, None)
        with self._lock:
            # Only what landed counts: a batch whose checkpoint was fenced out is delivered again.
            self._deliveries.extend(d for d in attempts if d.event.id in {e.id for e in events if e.bucket in landed})
            self._lock.notify_all()
        return landed

    def _outcome(self, event: PublishedEvent, attempt: int) -> Failure | None:
        result = self.fail(event, attempt) if self.fail is not None else None
        if result is None or isinstance(result, Failure):
            return result
        return Failure(str(result))

    def close(self) -> None:
        pass

    @property
    def deliveries(self) -> list[Delivery]:
        """Every attempt of a batch that landed, failed ones included, in order."""
        with self._lock:
            return list(self._deliveries)

    def delivered(self, *, key: str | None = None) -> list[PublishedEvent]:
        """Each delivered event once (of ``key``, if given), in the order of its first delivery."""
        seen: set[uuid.UUID] = set()
        out = []
        for d in self.deliveries:
            if d.error is None and d.event.id not in seen and (key is None or d.event.key == key):
                seen.add(d.event.id)
                out.append(d.event)
        return out

    def wait_for(self, count: int, timeout: float = 10.0) -> list[PublishedEvent]:
        """Block until ``count`` distinct events were delivered; returns them. AssertionError (what was
        delivered, and what failed) after ``timeout`` seconds."""
        deadline = time.monotonic() + timeout
        with self._lock:
            while len(self.delivered()) < count:
                left = deadline - time.monotonic()
                if left <= 0:
                    failed = [f"{d.event.type} {d.event.key!r} attempt {d.attempt}: {d.error}"
                              for d in self._deliveries if d.error is not None]
                    raise AssertionError(f"{len(self.delivered())} of {count} events delivered within {timeout:g}s"
                                         + (f"; failed attempts: {failed[:_SHOWN]}" if failed else ""))
                self._lock.wait(left)
        return self.delivered()


# -- the in-memory fake ----------------------------------------------------------------------------

_Scope = tuple[str, str]  # (topic or "", idempotency key): where an idempotency key is unique
_Fingerprint = tuple[str, str, Any]  # type, key, canonical payload: what makes two events "the same"


class FakeOutbox(Outbox):
    """An ``Outbox`` that keeps what it publishes in memory, for code tested without PostgreSQL.

    ``publish``, ``publish_many``, ``apublish`` and ``apublish_many`` take the same arguments and
    refuse the same input with the same errors as ``Outbox``: ``InvalidEvent`` naming the problem;
    ``IdempotencyConflict`` when an idempotency key of a topic already stands for another event
    (type, key or payload differ, payloads compared as PostgreSQL's jsonb does: ``1`` and ``1.0``
    differ, the order of object keys does not); a repeated key for the same event returns the first
    one with ``created=False``. A call that raises records nothing. ``events`` lists what was
    recorded, in publish order; the module's helpers (``published``, ``assert_published``, ...)
    take a FakeOutbox where they take a connection.

    The connection argument is not used (pass None, or whatever the code under test has). There are
    no transactions: an event is recorded at once and stays when the caller's transaction would roll
    back, and nothing is relayed.
    """

    def __init__(self, default_topic: str | None = None) -> None:
        super().__init__(default_topic)
        self._log: list[PublishedEvent] = []
        self._ids: set[uuid.UUID] = set()
        self._idempotent: dict[_Scope, tuple[uuid.UUID, _Fingerprint]] = {}

    @property
    def events(self) -> list[PublishedEvent]:
        """Every event recorded, in publish order (a copy)."""
        return list(self._log)

    def clear(self) -> None:
        """Forget every event (idempotency keys included), as a fresh database would."""
        self._log.clear()
        self._ids.clear()
        self._idempotent.clear()

    def publish_many(self, conn: Any, events: Iterable[Event | dict[str, Any]]) -> list[Published]:
        """``Outbox.publish_many``, recorded in memory (``conn`` is not used)."""
        return self._record(events)

    async def apublish_many(self, conn: Any, events: Iterable[Event | dict[str, Any]]) -> list[Published]:
        """``Outbox.apublish_many``, recorded in memory (``conn`` is not used)."""
        return self._record(events)

    def _record(self, events: Iterable[Event | dict[str, Any]]) -> list[Published]:
        """What sql/queries/publish.sql does, in memory: one conflict refuses the whole call; a known
        idempotency key (stored, or earlier in the batch) yields that event, created=False."""
        batch, where = self._distinct(self._events(events))
        payloads = [r["payload"] for r in self._rows(batch)]  # Outbox's checks: JSON, text PostgreSQL can store
        prints = [(e.type, e.key, _canonical(p)) for e, p in zip(batch, payloads, strict=True)]
        in_batch: dict[_Scope, set[_Fingerprint]] = {}
        for e, fp in zip(batch, prints, strict=True):
            if e.idempotency_key is not None:
                in_batch.setdefault((e.topic or "", e.idempotency_key), set()).add(fp)
        for e, fp in zip(batch, prints, strict=True):
            if e.idempotency_key is None:
                continue
            scope = (e.topic or "", e.idempotency_key)
            known = self._idempotent.get(scope)
            if (known is not None and known[1] != fp) or len(in_batch[scope]) > 1:
                raise _key_stands_for_another(e)
        results: list[Published] = []
        new: list[tuple[Event, str, _Fingerprint]] = []
        first: dict[_Scope, uuid.UUID] = {}
        for e, payload, fp in zip(batch, payloads, prints, strict=True):
            slot = (e.topic or "", e.idempotency_key) if e.idempotency_key is not None else None
            if slot is not None and slot in self._idempotent:
                results.append(Published(self._idempotent[slot][0], False))
            elif slot is not None and slot in first:
                results.append(Published(first[slot], False))
            else:
                if slot is not None:
                    first[slot] = e.id
                new.append((e, payload, fp))
                results.append(Published(e.id, True))
        for e, _, _ in new:
            if e.id in self._ids:
                # What Outbox raises (its statement finds the id stored and inserts nothing).
                raise _id_taken(e.id)
        for e, payload, fp in new:
            self._ids.add(e.id)
            if e.idempotency_key is not None:
                self._idempotent[(e.topic or "", e.idempotency_key)] = (e.id, fp)
            self._log.append(PublishedEvent(
                id=e.id, type=e.type, key=e.key, topic=e.topic, payload=json.loads(payload), headers=dict(e.headers),
                idempotency_key=e.idempotency_key, time=e.time, position=(0, len(self._log) + 1)))
        return self._expand(results, where)


def _canonical(payload: str) -> Any:
    """A JSON text as jsonb's equality sees it (outbox.fingerprint_v1 hashes jsonb's text): object key
    order and duplicate keys do not count, numbers keep their scale (``1`` is not ``1.0``, ``1e2``
    is ``100``, ``-0.0`` is ``0.0``)."""
    return _freeze(json.loads(payload, parse_float=_numeric, parse_int=_numeric))


def _numeric(literal: str) -> tuple[str, str]:
    d = Decimal(literal)
    exponent = d.as_tuple().exponent
    scale = max(0, -exponent) if isinstance(exponent, int) else 0
    return ("numeric", f"{abs(d) if d.is_zero() else d:.{scale}f}")


def _freeze(value: Any) -> Any:
    if isinstance(value, dict):
        return ("object", frozenset((k, _freeze(v)) for k, v in value.items()))
    if isinstance(value, list):
        return ("array", tuple(_freeze(v) for v in value))
    return value  # str, bool, None, or a numeric tuple
