"""One event as a Kafka message: its topic and headers (CloudEvents ``ce_*``, the fence, the event's own)."""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from typing import Any, NamedTuple

from ...event import RESERVED_HEADER_PREFIX, RESERVED_HEADERS
from ...store import StoredEvent
from ..engine import Failure

log = logging.getLogger("outbox_relay.kafka")

# The header names the relay sets on every message (event.RESERVED_HEADERS) and every name starting with
# event.RESERVED_HEADER_PREFIX (outbox_fence, outbox_replay, ...): an event's own header of such a name would
# reach consumers next to the relay's value; the events table's trigger refuses them at insert, and the
# sink drops them from older rows.


def sequence(xid: int, seq: int) -> str:
    """CloudEvents ``sequence``: the event's position, sortable as a string.

    Not a per-key counter: a key's events are delivered in the order their transactions became
    visible, which can put a larger position first (README, "The order one key gets").
    """
    return f"{xid:020d}-{seq:020d}"


def is_reserved_header(name: str) -> bool:
    """A header name only the relay sets (as the trigger of migration 0005 compares: lower-case)."""
    lowered = name.lower()
    return lowered in RESERVED_HEADERS or lowered.startswith(RESERVED_HEADER_PREFIX)


def json_type(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int | float):
        return "number"
    if isinstance(value, str):
        return "string"
    return "array" if isinstance(value, list) else "object"


class Message(NamedTuple):
    """One event's Kafka message (a tuple: one is made per event of every batch)."""

    event: StoredEvent
    topic: str
    headers: list[tuple[str, str | bytes | None]]
    key: bytes
    value: bytes


class MessageHeaders:
    """The headers of a sink's messages: the relay's own, the event's, then the sink's ``extra`` ones."""

    def __init__(self, sink: str, source: bytes, extra: Sequence[tuple[str, bytes]]) -> None:
        self.sink = sink  # for the log line about a dropped header
        self.source = source
        self.extra = list(extra)

    def of(self, e: StoredEvent, fence: int) -> list[tuple[str, str | bytes | None]] | Failure:
        """The message's headers, or why the event's own headers can not be sent (non-retriable:
        the row never changes). Never raises: one bad event must not fail the batch."""
        headers: list[tuple[str, str | bytes | None]] = [
            ("ce_specversion", b"1.0"),
            ("ce_id", e.id_text or str(e.id)),
            ("ce_source", self.source),
            ("ce_type", e.type),
            ("ce_time", e.time_text or e.time.isoformat()),
            ("ce_sequence", e.sequence_text or sequence(e.xid, e.seq)),
            ("ce_partitionkey", e.key),
            ("content-type", b"application/json"),
            ("outbox_fence", str(fence)),
        ]
        if e.headers_text != "{}":
            own = self.own(e)
            if isinstance(own, Failure):
                return own
            headers.extend(own)
        headers.extend(self.extra)
        return headers

    def own(self, e: StoredEvent) -> list[tuple[str, bytes]] | Failure:
        """The event's own headers, less the names reserved for the relay."""
        # Rows written before migration 0005's trigger (or past it, by a superuser) may hold
        # anything the jsonb column takes.
        try:
            value = json.loads(e.headers_text)
        except ValueError as exc:
            return Failure(f"the event's headers are not JSON: {exc}", retriable=False)
        if not isinstance(value, dict):
            return Failure(f"the event's headers must be a JSON object of strings, not a JSON {json_type(value)}",
                           retriable=False)
        own: list[tuple[str, bytes]] = []
        for name, header in value.items():
            if not isinstance(header, str):
                return Failure(f"the event's header {name!r} is a JSON {json_type(header)}, not a string "
                               "(headers must be a JSON object of strings)", retriable=False)
            if is_reserved_header(name):
                # The relay's own value is the one consumers rely on; the event goes out without this one.
                log.warning("kafka sink %s: event %s has a header %r, a name reserved for the relay; sending the "
                            "event without it", self.sink, e.id, name)
                continue
            try:
                own.append((name, header.encode()))
            except UnicodeError as exc:
                return Failure(f"the event's header {name!r} can not be encoded as UTF-8: {exc}", retriable=False)
        return own
