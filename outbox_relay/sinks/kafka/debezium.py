"""One event as Debezium's outbox event router emits it (``--kafka-format debezium``).

What a consumer written against Debezium reads, with the router's defaults and the converters of
Debezium's own outbox example (``JsonConverter`` with ``schemas.enable=false`` for key and value,
Kafka Connect's ``SimpleHeaderConverter`` for headers):

- topic: ``route.topic.replacement`` (default ``outbox.event.${routedByValue}``), the routed-by value
  being the event's topic (our aggregate type; or its type, ``--kafka-debezium-route-by type``);
- key: the aggregate id (our partition key) as a JSON string: ``"order-1"``, quotes included. Kafka
  Connect's producer partitions by murmur2 of those bytes, as ours does, so a key keeps its partition;
- value: the payload column as a JSON string (``table.expand.json.payload=false``): the stored jsonb's
  text, quoted and escaped as Jackson does;
- one header, ``id``: the event id as plain text. Nothing else: no ``ce_*`` headers, no fence, not the
  event's own headers (an ``id`` of its own would shadow the event's).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from ...settings_base import TOPIC_NAME
from ...store import StoredEvent
from ..engine import Failure

ROUTED_BY_VALUE = "${routedByValue}"
DEFAULT_TOPIC_REPLACEMENT = "outbox.event." + ROUTED_BY_VALUE
ROUTE_BY = ("topic", "type")
# Jackson's escapes (com.fasterxml.jackson.core.io.CharTypes): the two-character ones, \u00XX in upper-case
# hex for the other controls; everything else (non-ASCII too) as UTF-8.
_SHORT = {'"': '\\"', "\\": "\\\\", "\b": "\\b", "\t": "\\t", "\n": "\\n", "\f": "\\f", "\r": "\\r"}
_ESCAPED = re.compile(r'["\\\x00-\x1f]')


def json_string(text: str) -> bytes:
    """``text`` as Kafka Connect's JsonConverter writes a string: a JSON string literal, byte for byte."""
    return ('"' + _ESCAPED.sub(lambda m: _SHORT.get(m.group(), f"\\u{ord(m.group()):04X}"), text) + '"').encode()


@dataclass(frozen=True)
class DebeziumFormat:
    topic_replacement: str = DEFAULT_TOPIC_REPLACEMENT
    route_by: str = "topic"  # Debezium's route.by.field: the event's topic or its type

    def topic(self, e: StoredEvent, default_topic: str | None) -> str | Failure:
        """The event's topic, or why it has none (non-retriable: the row never changes)."""
        routed = e.type if self.route_by == "type" else (e.topic or default_topic)
        if routed is None:
            return Failure("event has no topic to route by and the relay has no --default-topic", retriable=False)
        topic = self.topic_replacement.replace(ROUTED_BY_VALUE, routed)
        if not TOPIC_NAME.match(topic) or topic in (".", ".."):
            return Failure(f"the routed topic {topic[:300]!r} is not a Kafka topic name (1-249 of A-Z a-z 0-9 . _ -)",
                           retriable=False)
        return topic

    @staticmethod
    def key(e: StoredEvent) -> bytes:
        return json_string(e.key)

    @staticmethod
    def value(e: StoredEvent) -> bytes:
        return json_string(e.payload_text)

    @staticmethod
    def headers(e: StoredEvent) -> list[tuple[str, str | bytes | None]]:
        return [("id", e.id_text or str(e.id))]
