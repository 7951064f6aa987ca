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
from dataclasses import dataclass

from ..cloudevents import attributes, header_value
from ..user import GiveUp, SinkEvent
from .subjects import MAX_SUBJECT_BYTES, subject, topic_problem

log = logging.getLogger("outbox_relay.nats")

MSG_ID = "Nats-Msg-Id"
# A NATS header name: an HTTP token (what the client accepts; a colon or space would end the name early).
_NAME = re.compile(r"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")
_RESERVED_PREFIXES = ("ce-", "nats-")
_HEADER_LINE = len(": \r\n")
_HEADER_BLOCK = len("NATS/1.0\r\n\r\n")


@dataclass(frozen=True)
class Message:
    subject: str
    headers: dict[str, str]
    payload: bytes

    @property
    def size(self) -> int:
        """What the server counts against its max_payload: the header block and the payload."""
        headers = sum(len(k.encode()) + len(v.encode()) + _HEADER_LINE for k, v in self.headers.items())
        return _HEADER_BLOCK + headers + len(self.payload)


def message(event: SinkEvent, *, sink: str, prefix: str, default_topic: str | None, source: str) -> Message | GiveUp:
    """The message of ``event``, or why it can not be sent (a fault of the event: the row never changes)."""
    topic = event.topic or default_topic
    if topic is None:
        return GiveUp("the event has no topic and the sink has no default topic (--default-topic)")
    problem = topic_problem(topic)
    if problem is not None:
        return GiveUp(problem)
    to = subject(prefix, topic, event.key)
    if len(to.encode()) > MAX_SUBJECT_BYTES:
        return GiveUp(f"the subject for key {event.key[:60]!r}... is {len(to.encode())} bytes once escaped, over the "
                      f"{MAX_SUBJECT_BYTES} a NATS protocol line leaves it")
    headers: dict[str, str] = {}
    for name, value in event.headers.items():
        if name.lower().startswith(_RESERVED_PREFIXES):
            log.warning("nats sink %s: event %s has a header %r, a name the sink sets or the server acts on; sending "
                        "the event without it", sink, event.id, name)
            continue
        if not _NAME.fullmatch(name):
            return GiveUp(f"the event's header {name[:100]!r} is not a valid NATS header name")
        if any(c in value for c in "\r\n\0"):
            return GiveUp(f"the event's header {name!r} holds a line break or NUL (not allowed in NATS headers)")
        headers[name] = value
    headers[MSG_ID] = str(event.id)
    headers.update({f"ce-{name}": header_value(value) for name, value in attributes(event, source, topic).items()})
    return Message(to, headers, event.payload_json.encode())


__all__ = ["MSG_ID", "Message", "message"]
