"""An event as the relay reads it (``StoredEvent``), and how a read's rows become one."""

from __future__ import annotations

import dataclasses
import functools
import json
import operator
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import psycopg


@dataclass(slots=True)
class StoredEvent:
    bucket: int
    xid: int
    seq: int
    id: uuid.UUID
    key: str
    topic: str | None
    type: str
    payload_text: str  # jsonb as text: Kafka sends it as is; projections parse it
    headers_text: str
    time: datetime  # occurred_at if the producer gave one, else when it was stored (created_at)
    attempts: int = 0  # failed attempts so far (parked events)
    blocked: bool = False  # an older event of this key is parked
    parked: bool = False  # read from outbox.parked (a retry), not from past the cursor
    # Which read of its bucket under the runner's fence returned it (1, 2, ...: SinkRunner._number_read);
    # 0: not read by a runner (a key rebuild, the testing kit). The ``read`` of a projection's FenceToken.
    read: int = 0
    last_error: str | None = None  # parked events: why the last attempt failed
    stored_at: datetime | None = None  # created_at: when its transaction stored it (the database's clock)
    # Monotonic time of the last read of its bucket that could not see it yet (SinkRunner): it became
    # visible to the relay after that. None: not known (a retry, a probe, a bucket just acquired).
    unseen_at: float | None = None
    # The Kafka sink's header values, formatted by the read query (None: formatted in Python).
    id_text: str | None = None
    time_text: str | None = None
    sequence_text: str | None = None
    version: int = 1  # schema_version: the version of the payload's schema as published

    @property
    def position(self) -> tuple[int, int]:
        return (self.xid, self.seq)

    @property
    def payload(self) -> Any:
        return json.loads(self.payload_text)

    @property
    def headers(self) -> dict[str, str]:
        return json.loads(self.headers_text) if self.headers_text != "{}" else {}


# Query column -> StoredEvent field: every query that reads events names its columns so.
EVENT_COLUMNS = {"bucket": "bucket", "xid": "xid", "seq": "seq", "id": "id", "partition_key": "key", "topic": "topic",
                 "type": "type", "payload": "payload_text", "headers": "headers_text", "time": "time",
                 "blocked": "blocked", "attempts": "attempts", "last_error": "last_error", "stored_at": "stored_at",
                 "id_text": "id_text", "time_text": "time_text", "sequence_text": "sequence_text",
                 "version": "version"}


def event_reader(cur: psycopg.Cursor[Any] | psycopg.AsyncCursor[Any]) -> tuple[
        Callable[..., StoredEvent], dict[str, int]]:
    """A function that turns one of ``cur``'s rows into a StoredEvent by column name (extra keyword
    arguments set more fields), and the index of every column by name (shared: not to be changed)."""
    # Built once per shape of result, not per read (a relay reads the same columns every cycle): the
    # names come from the result itself, which costs less than the cursor's description.
    result = getattr(cur, "pgresult", None)
    if result is not None:
        names = tuple((result.fname(i) or b"").decode() for i in range(result.nfields))
    else:
        names = tuple(d.name for d in cur.description or [])
    return _reader(names)


@functools.lru_cache(maxsize=64)
def _reader(names: tuple[str, ...]) -> tuple[Callable[..., StoredEvent], dict[str, int]]:
    column = {name: i for i, name in enumerate(names)}
    by_field = {EVENT_COLUMNS[name]: i for name, i in column.items() if name in EVENT_COLUMNS}
    # Every field goes in positionally, from its column or else its default (appended to the row): keyword
    # arguments cost half of building the event, once per event of every read.
    defaults: list[Any] = []
    indices: list[int] = []
    for f in _FIELD_DEFS:
        if f.name in by_field:
            indices.append(by_field[f.name])
        elif f.default is not dataclasses.MISSING:
            indices.append(len(column) + len(defaults))
            defaults.append(f.default)
        else:  # a required field no column gives: StoredEvent refuses the row, naming it
            return _event_by_name(by_field), column
    pick = operator.itemgetter(*indices)
    tail = tuple(defaults)

    def event(row: Sequence[Any], **extra: Any) -> StoredEvent:
        values = pick((row if type(row) is tuple else tuple(row)) + tail)
        if extra:
            changed = list(values)
            for name, value in extra.items():
                changed[_FIELD_INDEX[name]] = value
            return StoredEvent(*changed)
        return StoredEvent(*values)

    return event, column


def _event_by_name(by_field: dict[str, int]) -> Callable[..., StoredEvent]:
    def event(row: Sequence[Any], **extra: Any) -> StoredEvent:
        return StoredEvent(**{name: row[i] for name, i in by_field.items()}, **extra)

    return event


_FIELD_DEFS = dataclasses.fields(StoredEvent)
_FIELD_INDEX = {f.name: i for i, f in enumerate(_FIELD_DEFS)}


def stored_event(row: Sequence[Any], **extra: Any) -> StoredEvent:
    """A StoredEvent from a row that starts with: bucket, xid, seq, id, partition_key, topic, type,
    payload, headers, time (for rows without a cursor's description, e.g. through SQLAlchemy: the
    testing kit; the relay's own reads use ``event_reader``)."""
    payload = row[7] if isinstance(row[7], str) else json.dumps(row[7])
    headers = row[8] if isinstance(row[8], str) else json.dumps(row[8])
    return StoredEvent(row[0], row[1], row[2], row[3], row[4], row[5], row[6], payload, headers, row[9], **extra)
