"""One event as a Redis stream entry: the stream it goes to and its fields.

The fields are the CloudEvents attributes (``specversion``, ``id``, ``source``, ``type``, ``time``,
``subject`` = the partition key, ``datacontenttype``), ``data`` (the payload as stored) and the event's
own headers as ``header.<name>``: a CloudEvents attribute name is only ``[a-z0-9]``, so no header can
clash with one. Every value is encoded here, so that an event that can not be sent fails on its own
(a ``GiveUp``), never inside the client.
"""

from __future__ import annotations

import re

from ..cloudevents import attributes
from ..user import GiveUp, SinkEvent

HEADER_PREFIX = "header."
# Redis's default proto-max-bulk-len: a larger value is refused by the server (which then closes the
# connection, a failure that would look like an outage and hold the sink for good).
DEFAULT_MAX_ENTRY_BYTES = 512 * 1024 * 1024
# What a stream prefix may hold: printable ASCII without spaces (it is part of every stream's key).
PREFIX = re.compile(r"^[!-~]{0,200}\Z")
# Kafka's rule for topic names, also the events table trigger's (settings_base.TOPIC_NAME).
TOPIC = re.compile(r"^[A-Za-z0-9._-]{1,249}\Z")

Fields = dict[bytes, bytes]


def stream_of(prefix: str, topic: str | None, default_topic: str | None) -> str | GiveUp:
    """The stream an event goes to: ``prefix`` + its topic (or the default topic)."""
    chosen = topic if topic is not None else default_topic
    if chosen is None:
        return GiveUp("the event has no topic and the Redis sink has no default topic (--default-topic)")
    if not TOPIC.match(chosen):
        return GiveUp(f"the event's topic {chosen[:64]!r} is not a topic name (1-249 characters of A-Z a-z 0-9 . _ -)")
    return prefix + chosen


def entry(event: SinkEvent, source: str, max_bytes: int = DEFAULT_MAX_ENTRY_BYTES) -> Fields | GiveUp:
    """The entry's fields (bytes), or why this event can not be one (never retried: the row never changes)."""
    ce = attributes(event, source, None)  # no topic: the stream's name holds it
    del ce["schemaversion"]  # not among the entry's fields (docs/redis.md lists them)
    try:
        fields: Fields = {("subject" if name == "partitionkey" else name).encode(): value.encode()
                          for name, value in ce.items()}
        fields[b"data"] = event.payload_json.encode()
        for name, value in event.headers.items():
            fields[(HEADER_PREFIX + name).encode()] = value.encode()
    except UnicodeEncodeError as exc:
        return GiveUp(f"the event can not be encoded as UTF-8: {exc}")
    size = sum(len(k) + len(v) for k, v in fields.items())
    if size > max_bytes:
        return GiveUp(f"the stream entry is {size} bytes, over the Redis sink's limit of {max_bytes} "
                      "(--redis-max-entry-bytes; the server's proto-max-bulk-len)")
    return fields


__all__ = ["DEFAULT_MAX_ENTRY_BYTES", "HEADER_PREFIX", "PREFIX", "Fields", "entry", "stream_of"]
