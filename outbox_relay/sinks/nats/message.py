"""One event as a JetStream message: its subject, its headers (CloudEvents NATS binding, binary mode), its payload.

Headers: ``Nats-Msg-Id`` = the event id (the stream's duplicate window drops a redelivery within it),
``ce-specversion``, ``ce-id`` (the event id), ``ce-source``, ``ce-type``, ``ce-time``, ``ce-datacontenttype``
(``application/json``), ``ce-partitionkey`` (the key), ``ce-schemaversion``, ``ce-topic``; values percent-encoded
as the binding says (space, ``"``, ``%`` and everything outside printable ASCII). Then the event's own headers,
less the names the sink sets or the server acts on (every ``ce-*`` and ``Nats-*``: ``Nats-Rollup`` would purge
the subject, ``Nats-Expected-*`` would turn the publish into a conditional one). The payload is the stored JSON.
"""

from __future__ import annotations

import logging
import re
from typing import NamedTuple

from ..cloudevents import CONTENT_TYPE, SPEC_VERSION, header_value, rfc3339
from ..user import GiveUp, SinkEvent
from .subjects import MAX_SUBJECT_BYTES, subject, topic_problem

log = logging.getLogger("outbox_relay.nats")

MSG_ID = "Nats-Msg-Id"
EXPECTED_STREAM = "Nats-Expected-Stream"  # set when the sink names its stream: the server checks the subject's
_MAX_TOPICS = 4096  # topics whose checks are remembered
# A NATS header name: an HTTP token (what the client accepts; a colon or space would end the name early).
_NAME = re.compile(r"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")
_RESERVED_PREFIXES = ("ce-", "nats-")
_HEADER_LINE = len(": \r\n")
_HEADER_BLOCK = len("NATS/1.0\r\n\r\n")


class Message(NamedTuple):
    subject: str
    headers: dict[str, str]
    payload: bytes
    size: int  # what the server counts against its max_payload: the header block and the payload


def _header_bytes(name: str, value: str) -> int:
    return len(name.encode()) + len(value.encode()) + _HEADER_LINE


class Messages:
    """Builds one sink's messages: what is the same for every event (the source, the content type, the
    expected stream, the topics' checks) is worked out once."""

    def __init__(self, *, sink: str, prefix: str, default_topic: str | None, source: str,
                 stream: str | None = None) -> None:
        self.sink = sink
        self.prefix = prefix
        self.default_topic = default_topic
        self._source = header_value(source)
        self._stream = stream
        self._topics: dict[str, tuple[str | None, str]] = {}  # topic -> (why it can not be one, its header value)
        constant = {"ce-specversion": SPEC_VERSION, "ce-source": self._source, "ce-datacontenttype": CONTENT_TYPE}
        if stream is not None:
            constant[EXPECTED_STREAM] = stream
        self._constant_size = _HEADER_BLOCK + sum(_header_bytes(k, v) for k, v in constant.items())
        # The names of the headers set per event, with their lines' fixed bytes (Nats-Msg-Id and ce-id: the id).
        self._per_event = sum(len(name) + _HEADER_LINE for name in (MSG_ID, "ce-id", "ce-type", "ce-time",
                                                                    "ce-partitionkey", "ce-schemaversion"))

    def _topic(self, topic: str) -> tuple[str | None, str]:
        known = self._topics.get(topic)
        if known is None:
            known = (topic_problem(topic), header_value(topic))
            if len(self._topics) < _MAX_TOPICS:
                self._topics[topic] = known
        return known

    def build(self, event: SinkEvent) -> Message | GiveUp:
        """The message of ``event``, or why it can not be sent (a fault of the event: the row never changes)."""
        topic = event.topic or self.default_topic
        if topic is None:
            return GiveUp("the event has no topic and the sink has no default topic (--default-topic)")
        problem, topic_value = self._topic(topic)
        if problem is not None:
            return GiveUp(problem)
        to = subject(self.prefix, topic, event.key)
        if len(to) > MAX_SUBJECT_BYTES or not to.isascii():
            size = len(to.encode())
            if size > MAX_SUBJECT_BYTES:
                return GiveUp(f"the subject for key {event.key[:60]!r}... is {size} bytes once escaped, over the "
                              f"{MAX_SUBJECT_BYTES} a NATS protocol line leaves it")
        headers: dict[str, str] = {}
        size = self._constant_size
        if event.headers:
            for name, value in event.headers.items():
                if name.lower().startswith(_RESERVED_PREFIXES):
                    log.warning("nats sink %s: event %s has a header %r, a name the sink sets or the server acts on; "
                                "sending the event without it", self.sink, event.id, name)
                    continue
                if not _NAME.fullmatch(name):
                    return GiveUp(f"the event's header {name[:100]!r} is not a valid NATS header name")
                if "\r" in value or "\n" in value or "\0" in value:
                    return GiveUp(f"the event's header {name!r} holds a line break or NUL (not allowed in NATS "
                                  "headers)")
                headers[name] = value
                size += _header_bytes(name, value)
        event_id = str(event.id)
        kind, time, key, version = (header_value(event.type), header_value(rfc3339(event.time)),
                                    header_value(event.key), str(event.version))
        headers[MSG_ID] = event_id
        headers["ce-specversion"] = SPEC_VERSION
        headers["ce-id"] = event_id
        headers["ce-source"] = self._source
        headers["ce-type"] = kind
        headers["ce-time"] = time
        headers["ce-partitionkey"] = key
        headers["ce-schemaversion"] = version
        headers["ce-datacontenttype"] = CONTENT_TYPE
        headers["ce-topic"] = topic_value
        if self._stream is not None:
            headers[EXPECTED_STREAM] = self._stream
        payload = event.payload_json.encode()
        # Every value set here is ASCII (percent-encoded): its length is its size.
        size += (self._per_event + 2 * len(event_id) + len(kind) + len(time) + len(key) + len(version)
                 + _header_bytes("ce-topic", topic_value) + len(payload))
        return Message(to, headers, payload, size)


def message(event: SinkEvent, *, sink: str, prefix: str, default_topic: str | None, source: str) -> Message | GiveUp:
    """The message of ``event`` (``Messages.build``), for a sink of these settings."""
    return Messages(sink=sink, prefix=prefix, default_topic=default_topic, source=source).build(event)


__all__ = ["EXPECTED_STREAM", "MSG_ID", "Message", "Messages", "message"]
