"""One event as an SQS message: the body is the payload as stored, the CloudEvents fields are message
attributes named as in the CloudEvents HTTP binding (``ce-id``, ``ce-type``, ...; SQS has no official
binding), the event's own headers one JSON attribute (``outbox-headers``): SQS takes at most 10
attributes per message, and these are 10 at most.

On a FIFO queue ``MessageGroupId`` is the partition key (SQS keeps each group in order) and
``MessageDeduplicationId`` the event id (SQS drops a copy sent within 5 minutes: a resend after a crash
or a timeout is not delivered twice in that window; later, consumers dedupe by ``ce-id``).
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass
from typing import Any

from .. import cloudevents
from ..user import GiveUp, SinkEvent

HEADERS_ATTRIBUTE = "outbox-headers"
# What SQS accepts in a body or a string attribute (XML 1.0 characters); anything else is refused with
# InvalidMessageContents, so it is checked here, before the event can fail a whole batch.
_INVALID = re.compile("[^\x09\x0a\x0d\x20-\ud7ff\ue000-\ufffd\U00010000-\U0010ffff]")
# MessageGroupId: 1-128 printable ASCII characters (no space).
_GROUP_ID = re.compile(r"^[\x21-\x7e]{1,128}\Z")


def group_id(key: str) -> str:
    """The key itself when SQS takes it as a MessageGroupId, else a digest of it (``ce-partitionkey`` keeps
    the key as it is). Two keys sharing a group only share its order: each still keeps its own."""
    if _GROUP_ID.match(key):
        return key
    return "sha256:" + hashlib.sha256(key.encode()).hexdigest()


@dataclass(frozen=True)
class Message:
    """An event's SendMessage(Batch) entry, without its batch ``Id``, and its size as SQS counts it."""

    entry: dict[str, Any]
    size: int


def message_of(event: SinkEvent, source: str, fifo: bool) -> Message | GiveUp:
    """The message of ``event``, or GiveUp if SQS could never take it (never retried: the row never changes)."""
    attributes = {f"ce-{name}": value for name, value in cloudevents.attributes(event, source, event.topic).items()}
    if event.headers:
        # ASCII JSON: any header value round-trips, even one with characters SQS refuses.
        attributes[HEADERS_ATTRIBUTE] = json.dumps(dict(event.headers), separators=(",", ":"))
    for name, value in (("the payload", event.payload_json), *attributes.items()):
        bad = _INVALID.search(value)
        if bad is not None:
            what = name if name == "the payload" else f"attribute {name}"
            return GiveUp(f"sqs: {what} holds the character U+{ord(bad.group()):04X}, which SQS refuses "
                          "(InvalidMessageContents)")
    entry: dict[str, Any] = {
        "MessageBody": event.payload_json,
        "MessageAttributes": {name: {"DataType": "String", "StringValue": value} for name, value in attributes.items()},
    }
    if fifo:
        entry["MessageGroupId"] = group_id(event.key)
        entry["MessageDeduplicationId"] = str(event.id)
    # SQS counts the body and each attribute's name, type and value against its size limits.
    size = len(event.payload_json.encode()) + sum(len(n.encode()) + len("String") + len(v.encode())
                                                  for n, v in attributes.items())
    return Message(entry, size)
