"""Publish events inside the caller's transaction (psycopg 3 sync/async, SQLAlchemy).

The insert is one statement for any number of events, so it costs one round trip. If the
caller's transaction rolls back, the events never existed (G1); a connection that would commit
the events on their own (autocommit, no transaction open) is refused. A repeated idempotency
key yields the stored event and ``created=False`` (G2); the same key for another event raises
``IdempotencyConflict`` and writes nothing.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Callable, Generator, Iterable, Mapping, Sequence
from datetime import UTC, datetime
from typing import Any

from .errors import InvalidEvent, OutboxError
from .event import MAX_HEADERS_BYTES, MAX_PAYLOAD_BYTES, Event, dump_payload, make_event, plain_fields_valid, uuid7
from .publish_drivers import executor, run
from .publish_drivers_async import executor_async, run_async
from .publish_outcomes import Published as Published  # what Outbox.publish returns: part of this module's API
from .publish_outcomes import id_taken, key_just_taken, key_stands_for_another, results_per_input
from .sqlfiles import query
from .tracing import with_trace

# json.dumps of a str, without its Python layers (the C encoder when there is one).
_quote: Callable[[str], str] = json.encoder.encode_basestring_ascii

# A NUL written by json.dumps: "\\u0000" after an even number of backslashes (an odd number
# means the backslash itself was escaped). jsonb refuses it, as text columns refuse a NUL.
_JSON_NUL = re.compile(r"(?<!\\)(?:\\\\)*\\u0000")


# The array parameter of a batch statement for each field of a row (Outbox._rows).
# The fields a dict in publish_many may have for the quick path (Outbox._plain_rows).
_PLAIN_FIELDS = frozenset({"type", "key", "payload", "topic", "idempotency_key", "time", "version"})

_ARRAYS = {"id": "ids", "topic": "topics", "key": "keys", "type": "types", "payload": "payloads",
           "headers": "headers", "idempotency_key": "idempotency_keys", "time": "times", "version": "versions"}

# One statement to run and its parameters; the rows it returned are sent back (a statement that returns
# none: one empty row per row it wrote, so an INSERT that a trigger skipped sends back []).
_Step = tuple[str, dict[str, Any]]
_Plan = Generator[_Step, list[Any], list[Published]]


class Outbox:
    """Producer side. ``default_topic`` applies to events published without one."""

    def __init__(self, default_topic: str | None = None) -> None:
        self.default_topic = default_topic

    # -- building -------------------------------------------------------------------------

    def event(
        self, *, type: str, key: str, payload: Any, topic: str | None = None,
        headers: Mapping[str, str] | None = None, idempotency_key: str | None = None,
        time: datetime | None = None, id: uuid.UUID | None = None, version: int = 1,
    ) -> Event:
        """A validated Event (``InvalidEvent`` names what is wrong); see ``publish`` for the fields."""
        return self._event(_fields(type, key, payload, topic, headers, idempotency_key, time, id, version))

    def _event(self, fields: dict[str, Any]) -> Event:
        if fields.get("topic") is None:
            fields["topic"] = self.default_topic
        # The caller's span (OpenTelemetry), if one is current: consumers continue its trace.
        headers = with_trace(fields.get("headers"))
        if headers is not None:
            fields["headers"] = headers
        event = make_event(**fields)
        if event.topic is None:
            raise InvalidEvent(
                f"{event.type!r} event (key {event.key!r}) has no topic and the Outbox has no default_topic")
        return event

    def _events(self, events: Iterable[Event | dict[str, Any]]) -> list[Event]:
        out = []
        for e in events:
            if isinstance(e, dict):
                out.append(self._event(dict(e)))
            elif e.topic is None:
                out.append(self._event(e.model_dump()))
            else:
                headers = with_trace(e.headers)
                out.append(e if headers is e.headers else e.model_copy(update={"headers": headers}))
        if not out:
            raise InvalidEvent("publish_many needs at least one event")
        return out

    @staticmethod
    def _distinct(events: Sequence[Event]) -> tuple[list[Event], list[int]]:
        """The events to insert, and for each input the index of its insert (the same Event twice is one)."""
        first: dict[uuid.UUID, int] = {}
        unique: list[Event] = []
        where: list[int] = []
        for e in events:
            i = first.get(e.id)
            if i is None:
                first[e.id] = i = len(unique)
                unique.append(e)
            elif unique[i] != e:
                raise InvalidEvent(f"two different events in one batch have the id {e.id}")
            where.append(i)
        return unique, where

    @staticmethod
    def _rows(events: Sequence[Event]) -> list[dict[str, Any]]:
        """Each event as the statements' text parameters; raises ``InvalidEvent`` before anything is sent."""
        rows = []
        for e in events:
            payload = e.payload_json()
            check_storable(e, payload)
            rows.append({"id": str(e.id), "topic": e.topic, "key": e.key, "type": e.type, "payload": payload,
                         "headers": json.dumps(e.headers) if e.headers else "{}",
                         "idempotency_key": e.idempotency_key, "time": _utc_text(e.time),
                         "version": e.version})
        return rows

    @staticmethod
    def _arrays(rows: Sequence[dict[str, Any]], *, keys: bool = True) -> dict[str, list[Any]]:
        """The rows as the array parameters of a batch statement (``ids``, ``topics``, ...)."""
        names = _ARRAYS if keys else {k: v for k, v in _ARRAYS.items() if k != "idempotency_key"}
        return {plural: [r[name] for r in rows] for name, plural in names.items()}

    def _plain_rows(
        self, events: Sequence[Event | dict[str, Any]],
    ) -> tuple[list[dict[str, Any]], list[uuid.UUID]] | None:
        """The rows and new ids of a batch of dicts in ``publish``'s usual shape (no headers, no id, plain
        values), made without an Event each: building the model was half of publish_many's time per
        event. None: not every event is such a dict, and the general path judges the batch (its errors
        name the problem)."""
        if with_trace(None) is not None:  # the caller's span goes into every event's headers
            return None
        rows = []
        ids = []
        default_topic = self.default_topic
        for e in events:
            if type(e) is not dict or not _PLAIN_FIELDS.issuperset(e):
                return None
            topic = e.get("topic")
            row = _plain_row(e.get("type"), e.get("key"), e.get("payload"), default_topic if topic is None else topic,
                             e.get("idempotency_key"), e.get("time"), e.get("version", 1))
            if row is None:
                return None
            rows.append(row)
            ids.append(row.pop("uuid"))
        return rows, ids

    def _plan(self, events: Iterable[Event | dict[str, Any]]) -> _Plan:
        """The statements of one publish call, for either driver loop (publish_drivers.py).

        Normally one. Without idempotency keys, a plain INSERT (ids the caller chose are checked in it,
        and one more statement names a stored one). With keys, the publish statement, which also finds
        idempotency conflicts with what it can see and then inserts nothing. A key whose event a
        concurrent transaction committed after that statement's snapshot comes back without an id;
        one more statement looks it up.
        """
        events = list(events)
        plain = self._plain_rows(events)
        if plain is not None:
            if not events:
                raise InvalidEvent("publish_many needs at least one event")
            rows, ids = plain
            where: Sequence[int] | None = None  # every event is one insert
            made = True
        else:
            # Events this call makes get a new UUIDv7 (``made``): nothing stored can have their ids.
            made = not any(isinstance(e, Event) or "id" in e for e in events)
            batch, where = self._distinct(self._events(events))
            rows = self._rows(batch)
            ids = [e.id for e in batch]
        if made and len(rows) == 1:
            return results_per_input((yield from _plan_one(rows[0], ids[0])), where)
        if not any(r["idempotency_key"] for r in rows):
            # The common case, and what the SQL path of other languages writes: a plain INSERT (G2 costs
            # nothing without a key). Ids the caller chose are checked in the same statement.
            if made:
                yield query("publish", "insert_many"), {"rows": _batch_json(rows)}
            else:
                inserted = yield query("publish", "insert_checked"), self._arrays(rows, keys=False)
                if not inserted:
                    stored = yield query("publish", "stored_ids"), {"ids": [r["id"] for r in rows]}
                    raise id_taken(stored[0][0] if stored else "?")
            return results_per_input([Published(i, True) for i in ids], where)
        params = {"rows": _batch_json(rows, keys=True), "ids_new": made}
        answers = yield query("publish", "publish"), params
        for event_id, row, answer in zip(ids, rows, answers, strict=True):
            if answer[3]:
                raise id_taken(event_id)
            if answer[2]:
                raise key_stands_for_another(row)
        results = [Published(_uuid(r[0]), bool(r[1])) if r[0] is not None else None for r in answers]
        late = [i for i, r in enumerate(results) if r is None]
        if late:
            found = yield query("publish", "find_by_idempotency_keys"), {
                "topics": [rows[i]["topic"] for i in late],
                "idempotency_keys": [rows[i]["idempotency_key"] for i in late],
                "types": [rows[i]["type"] for i in late],
                "keys": [rows[i]["key"] for i in late],
                "payloads": [rows[i]["payload"] for i in late],
            }
            bad = [i for i, (event_id, same) in zip(late, found, strict=True) if event_id is None or not same]
            if bad:
                row = rows[bad[0]]
                if not any(r is not None and r.created for r in results):
                    # Retention may remove the other event in between (id NULL): publishing again works.
                    raise key_just_taken(row, "nothing of this call was written")
                # The rest of the batch is written and can not be taken back (producers may not
                # delete): fail the transaction so that it can never commit.
                try:
                    yield query("publish", "abort_transaction"), {}
                except Exception as exc:
                    raise key_just_taken(row, "the other events of this call were already written, so the "
                                          "transaction was failed on purpose and must be rolled back") from exc
                raise OutboxError("abort_transaction did not fail the transaction")  # not reached
            for i, (event_id, _same) in zip(late, found, strict=True):
                results[i] = Published(_uuid(event_id), False)
        return results_per_input([r for r in results if r is not None], where)

    # -- sync -----------------------------------------------------------------------------

    def _quick(
        self, type: Any, key: Any, payload: Any, topic: Any, headers: Any, idempotency_key: Any, time: Any, id: Any,
        version: Any,
    ) -> _Plan | None:
        """The plan of ``publish``'s usual call (no headers, no id, plain values) made without an Event:
        validating through the model and its copies was about half of publish's own time per call.
        None: not that call, or a value to be judged by ``Event`` (whose error names the problem)."""
        if headers is not None or id is not None:
            return None
        cls = self.__class__  # (type is a parameter here)
        if cls is not Outbox and (cls.publish_many is not Outbox.publish_many
                                  or cls.apublish_many is not Outbox.apublish_many):
            return None  # a subclass that overrides them (FakeOutbox, a user's wrapper) sees every publish
        row = _plain_row(type, key, payload, self.default_topic if topic is None else topic, idempotency_key, time,
                         version)
        if row is None:
            return None
        return _plan_one(row, row.pop("uuid"))

    def publish(
        self, conn: Any, *, type: str, key: str, payload: Any, topic: str | None = None,
        headers: Mapping[str, str] | None = None, idempotency_key: str | None = None,
        time: datetime | None = None, id: uuid.UUID | None = None, version: int = 1,
    ) -> Published:
        """Publish one event in the transaction of ``conn`` (psycopg Connection/Cursor, SQLAlchemy
        Connection/Session); it exists iff that transaction commits.

        ``key`` orders it (one key, one order, in every sink); ``topic`` defaults to ``default_topic``;
        ``headers`` go with the Kafka message (names the relay sets are refused); ``idempotency_key``:
        publishing the same event with it again returns the stored one with ``created=False``, another
        event with it raises ``IdempotencyConflict``; ``time`` (timezone-aware, within
        ``EARLIEST_TIME``-``LATEST_TIME``: years 1-9999 in every time zone) is when the event
        happened, sent as ``ce_time``, never what retention counts from (created_at, the database's
        clock when the event is stored);
        ``id`` defaults to a new UUIDv7; ``version`` is the version of the payload's schema (1 unless
        its shape changed: upcasters turn older versions into the current one for projections).
        Raises ``InvalidEvent`` naming the problem before anything is written, and ``NoTransaction``
        for an autocommit connection outside a transaction.
        """
        plan = self._quick(type, key, payload, topic, headers, idempotency_key, time, id, version)
        if plan is not None:
            return run(plan, next(plan), executor(conn))[0]
        # A dict, not an Event: publish_many validates it, and knows the id is a new one unless given.
        return self.publish_many(conn, [_fields(type, key, payload, topic, headers, idempotency_key, time, id,
                                                version)])[0]

    def publish_many(self, conn: Any, events: Iterable[Event | dict[str, Any]]) -> list[Published]:
        """Publish events (``Event`` objects or dicts of ``publish``'s fields) in one statement, in order."""
        plan = self._plan(events)
        step = next(plan)  # validates everything before the connection is looked at
        return run(plan, step, executor(conn))

    # -- async ----------------------------------------------------------------------------
    # Thin drivers, like publish/publish_many: the plan (no I/O) is shared, and the statements run
    # by publish_drivers_async.py (publish_drivers.py is generated from it).

    async def apublish(
        self, conn: Any, *, type: str, key: str, payload: Any, topic: str | None = None,
        headers: Mapping[str, str] | None = None, idempotency_key: str | None = None,
        time: datetime | None = None, id: uuid.UUID | None = None, version: int = 1,
    ) -> Published:
        """``publish`` with an async connection (psycopg AsyncConnection/AsyncCursor, SQLAlchemy async)."""
        plan = self._quick(type, key, payload, topic, headers, idempotency_key, time, id, version)
        if plan is not None:
            return (await run_async(plan, next(plan), await executor_async(conn)))[0]
        return (await self.apublish_many(conn, [_fields(type, key, payload, topic, headers, idempotency_key, time,
                                                        id, version)]))[0]

    async def apublish_many(self, conn: Any, events: Iterable[Event | dict[str, Any]]) -> list[Published]:
        """``publish_many`` with an async connection."""
        plan = self._plan(events)
        step = next(plan)
        return await run_async(plan, step, await executor_async(conn))


def _plain_row(type: Any, key: Any, payload: Any, topic: Any, idempotency_key: Any, time: Any,
               version: Any) -> dict[str, Any] | None:
    """An event's statement row (and its new id as ``uuid``) from plain fields, checked by the same rules as
    ``Event`` without building one. None: not that shape, or a value to be judged by ``Event`` (whose
    error names the problem)."""
    try:
        # Before the checks, which then walk the payload's depth only if its text could be too deep. A
        # payload json refuses (a set, NaN, a cycle, nesting past its recursion limit) goes to Event.
        payload_json = dump_payload(payload)
    except (TypeError, ValueError, RecursionError):
        return None
    if not plain_fields_valid(type, key, payload, topic, idempotency_key, time, version, payload_json):
        return None
    _check_text(type, key, topic, idempotency_key, None, payload_json)
    event_id = uuid7()
    return {"id": str(event_id), "topic": topic, "key": key, "type": type, "payload": payload_json, "headers": "{}",
            "idempotency_key": idempotency_key, "time": _utc_text(time),
            "version": version, "uuid": event_id}


def _utc_text(time: datetime | None) -> str | None:
    """An event's time as the statement sends it: in UTC. PostgreSQL's timestamptz input takes offsets
    up to 15:59 only, Python's up to 23:59 (the stored value is an instant either way); in range by
    ``Event``'s rule, so the conversion can not leave years 1-9999."""
    return time.astimezone(UTC).isoformat() if time is not None else None


def _plan_one(row: dict[str, Any], event_id: uuid.UUID) -> _Plan:
    """The statement that publishes one event this library made (a new id, so no stored id to check): a
    plain INSERT (G2 costs nothing without a key). With a key, the row count says whether the key was
    free; only if it was not, one more statement tells a retry from a reuse."""
    plain = row["headers"] == "{}" and row["time"] is None and row["version"] == 1
    inserted = yield query("publish", "insert_plain" if plain else "insert_one"), row
    if inserted or row["idempotency_key"] is None:
        return [Published(event_id, True)]
    found = yield query("publish", "find_by_idempotency_keys"), {
        "topics": [row["topic"]], "idempotency_keys": [row["idempotency_key"]], "types": [row["type"]],
        "keys": [row["key"]], "payloads": [row["payload"]]}
    stored_id, same = found[0]
    if stored_id is None:  # committed after this statement's snapshot, or removed meanwhile
        raise key_just_taken(row, "nothing of this call was written")
    if not same:
        raise key_stands_for_another(row)
    return [Published(_uuid(stored_id), False)]


def _batch_json(rows: Sequence[dict[str, Any]], *, keys: bool = False) -> str:
    """Rows as one JSON array for insert_many (``keys``: and publish, with their idempotency keys); each
    payload's JSON text (already made and checked by ``_rows``) is spliced in as it is, not parsed and
    dumped again. Strings are quoted by json's C encoder directly (what json.dumps of a str returns,
    without its Python layers), topics and types once per batch."""
    quote = _quote
    memo: dict[str, str] = {}
    parts = []
    for r in rows:
        topic, type_, time = r["topic"], r["type"], r["time"]
        t = memo.get(topic)
        if t is None:
            t = memo[topic] = quote(topic)
        y = memo.get(type_)
        if y is None:
            y = memo[type_] = quote(type_)
        ikey = ""
        if keys:
            ikey = f',"idempotency_key":{"null" if r["idempotency_key"] is None else quote(r["idempotency_key"])}'
        parts.append(f'{{"id":"{r["id"]}","topic":{t},"key":{quote(r["key"])},"type":{y},"payload":{r["payload"]},'
                     f'"headers":{r["headers"]},"time":{"null" if time is None else quote(time)},'
                     f'"version":{int(r["version"])}{ikey}}}')
    return "[" + ",".join(parts) + "]"


def _fields(type: str, key: str, payload: Any, topic: str | None, headers: Mapping[str, str] | None,
            idempotency_key: str | None, time: datetime | None, id: uuid.UUID | None, version: int) -> dict[str, Any]:
    """``publish``'s arguments as an event's fields (headers and id only when given)."""
    fields: dict[str, Any] = {"type": type, "key": key, "payload": payload, "topic": topic,
                              "idempotency_key": idempotency_key, "time": time, "version": version}
    if headers is not None:
        fields["headers"] = headers
    if id is not None:
        fields["id"] = id
    return fields


def check_storable(event: Event, payload: str) -> None:
    """``_check_text`` for an Event."""
    _check_text(event.type, event.key, event.topic, event.idempotency_key, event.headers, payload)


def _check_text(type: str, key: str, topic: str | None, idempotency_key: str | None,
                headers: Mapping[str, str] | None, payload: str) -> None:
    """Refuse text PostgreSQL would reject mid-statement, which would abort the caller's transaction.
    Runs for every event published, so the common case (ASCII, no NUL) costs a few C-level scans."""
    fields: list[tuple[str, str | None]] = [
        ("type", type), ("key", key), ("topic", topic), ("idempotency_key", idempotency_key)]
    if headers:
        fields += [(f"headers name {name!r}", name) for name in headers]
        fields += [(f"headers.{name}", value) for name, value in headers.items()]
    for field, value in fields:
        if value is None or (value.isascii() and "\x00" not in value):
            continue
        if "\x00" in value:
            raise InvalidEvent(f"invalid event: {field}: contains a NUL character, which PostgreSQL can not store")
        if not _encodable(value):
            raise InvalidEvent(f"invalid event: {field}: is not valid Unicode (a lone surrogate)")
    if headers:
        # Every name and value is valid Unicode by now (checked above).
        held = sum(len(name.encode()) + len(value.encode()) for name, value in headers.items())
        if held > MAX_HEADERS_BYTES:
            raise InvalidEvent(f"invalid event: headers of {type!r} event (key {key!r}) hold {held:,} bytes of names "
                               f"and values; the limit is MAX_HEADERS_BYTES = {MAX_HEADERS_BYTES:,} (PostgreSQL's "
                               "jsonb refuses values near 256 MB, and a sink's own limit is far lower: Kafka's default "
                               "message size is 1 MB, HTTP servers take some KB of headers)")
    if "\\u0000" in payload and _JSON_NUL.search(payload):
        raise InvalidEvent(f"invalid event: payload of {type!r} event (key {key!r}) contains a NUL "
                           "character (\\u0000), which PostgreSQL jsonb can not store")
    size = len(payload)
    if not payload.isascii():
        try:
            size = len(payload.encode())
        except UnicodeEncodeError:
            raise InvalidEvent(f"invalid event: payload of {type!r} event (key {key!r}) is not valid "
                               "Unicode (a lone surrogate)") from None
    if size > MAX_PAYLOAD_BYTES:
        raise InvalidEvent(f"invalid event: payload of {type!r} event (key {key!r}) is {size:,} bytes "
                           f"as JSON; the limit is MAX_PAYLOAD_BYTES = {MAX_PAYLOAD_BYTES:,} (PostgreSQL's jsonb "
                           "refuses values near 256 MB, and a sink's own limit is usually far lower: Kafka's "
                           "default is 1 MB)")


def _encodable(text: str) -> bool:
    try:
        text.encode()
    except UnicodeEncodeError:
        return False
    return True


def _uuid(value: Any) -> uuid.UUID:
    return value if isinstance(value, uuid.UUID) else uuid.UUID(str(value))
