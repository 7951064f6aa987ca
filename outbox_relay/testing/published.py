"""Published-event assertions: what a test's connection (or a ``FakeOutbox``) shows was published.

- ``published(conn, key=..., type=..., topic=...)``: the events the test's connection can see (its
  own open transaction's included), in the relay's order; ``apublished`` for async connections.
- ``assert_published(conn, [("OrderPlaced", {...}), "OrderPaid"], key="order:1")``: exactly these
  events, in this order, with a readable report when not; ``assert_not_published``.
"""

from __future__ import annotations

import inspect
import json
import uuid
from collections import Counter
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from outbox_relay.publish import Published
from outbox_relay.sqlfiles import query
from outbox_relay.store import StoredEvent, stored_event

FIELDS = ("type", "key", "topic", "payload", "headers", "idempotency_key", "id", "time")
_SHOWN = 20  # events listed in a failure message before "... and N more"
_PAYLOAD_CHARS = 300


@dataclass(frozen=True)
class PublishedEvent:
    """One published event as a test sees it. ``payload`` and ``headers`` are decoded JSON, as a
    consumer gets them; ``time`` is what the producer passed (None if nothing); ``position`` is
    ``(xid, seq)``, per key the order the relays deliver in (except for two overlapping
    transactions of one key: docs/design/read-path.md, "What order one key gets"); a ``FakeOutbox``
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
    from .fake import FakeOutbox  # here: fake.py builds on this module

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

