"""An event's CloudEvents attributes: the one list the broker sinks' bindings (NATS, RabbitMQ, Redis, SQS,
webhook) send, each in its own wire format (``ce-`` headers, ``cloudEvents_`` AMQP headers, stream fields,
message attributes). The Kafka sink's ``ce_*`` headers are the engine's (sinks/kafka/message.py): they carry the
stored texts of a row and a sequence, not a ``SinkEvent``.
"""

from __future__ import annotations

import re
import urllib.parse
from datetime import UTC, datetime

from .user import SinkEvent

SPEC_VERSION = "1.0"
CONTENT_TYPE = "application/json"  # the payload is the stored JSON
# CloudEvents HTTP and NATS bindings 3.1.3.2: a header value is percent-encoded outside printable ASCII, and
# space, '"' and '%' are encoded too.
_HEADER_SAFE = "".join(chr(c) for c in range(0x21, 0x7F) if chr(c) not in '"%')
_HEADER_UNSAFE = re.compile(r'[^\x21-\x7e]|["%]')


def rfc3339(when: datetime) -> str:
    """``when`` in UTC as CloudEvents' ``time`` (a naive time is read as UTC)."""
    if when.tzinfo is not UTC:  # what a read gives is UTC already: no conversion
        when = when.replace(tzinfo=UTC) if when.tzinfo is None else when.astimezone(UTC)
    return when.isoformat().replace("+00:00", "Z")


def header_value(value: str) -> str:
    """An attribute's value as the HTTP and NATS bindings put it in a header."""
    if not _HEADER_UNSAFE.search(value):  # most values (a type, a key, a topic): nothing to encode, no quote() call
        return value
    return urllib.parse.quote(value, safe=_HEADER_SAFE)


def attributes(event: SinkEvent, source: str, topic: str | None) -> dict[str, str]:
    """The attributes of ``event`` by name, in the order the bindings send them: ``specversion``, ``id``,
    ``source``, ``type``, ``time``, ``partitionkey`` (the key), ``schemaversion``, ``datacontenttype``, and
    ``topic`` (the event's, or the sink's default) if there is one. A binding that carries the content type
    its own way (a property, an HTTP header) leaves ``datacontenttype`` out."""
    found = {
        "specversion": SPEC_VERSION,
        "id": str(event.id),
        "source": source,
        "type": event.type,
        "time": rfc3339(event.time),
        "partitionkey": event.key,
        "schemaversion": str(event.version),
        "datacontenttype": CONTENT_TYPE,
    }
    if topic is not None:
        found["topic"] = topic
    return found
