"""One event as an AMQP 0-9-1 message: where it goes, its properties and headers.

CloudEvents AMQP binding, binary content mode: the payload (the stored JSON, as is) is the body, its media
type the ``content_type`` property, every other attribute an application property (an AMQP 0-9-1 header)
named ``cloudEvents_<attribute>``. The binding allows ``cloudEvents_`` or ``cloudEvents:`` and prefers
``_`` (JMS 2.0 selectors refuse ``:``); one message uses one of them for all its attributes.
``message_id`` is the event id too (what consumers dedupe by), ``delivery_mode`` 2 (persistent), the
routing key the partition key.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from ..cloudevents import CONTENT_TYPE, attributes
from ..user import GiveUp, SinkEvent
from .connection import AMQP_NAME

log = logging.getLogger("outbox_relay.rabbitmq")

CE_PREFIX = "cloudEvents_"
PERSISTENT = 2
MAX_SHORT_STRING = 255  # AMQP 0-9-1 shortstr: routing keys, header names, exchange names


@dataclass(frozen=True)
class Message:
    exchange: str
    routing_key: str
    body: bytes
    headers: dict[str, Any]
    timestamp: int  # seconds since the epoch (the AMQP timestamp property)

    def properties(self, event_id: str, pika: Any) -> Any:
        return pika.BasicProperties(
            content_type=CONTENT_TYPE, delivery_mode=PERSISTENT, message_id=event_id, timestamp=self.timestamp,
            headers=self.headers)


def exchange_of(event: SinkEvent, default_exchange: str | None) -> str | GiveUp:
    """The exchange of ``event``: its topic, else the sink's default, else GiveUp (as Kafka without a topic)."""
    exchange = event.topic or default_exchange
    if exchange is None:
        return GiveUp("the event has no topic and the sink has no default exchange (--rabbitmq-default-exchange)")
    if not AMQP_NAME.match(exchange):
        return GiveUp(f"topic {exchange[:64]!r} is not an AMQP exchange name (1-255 characters of A-Z a-z 0-9 . _ : -)")
    return exchange


def message_of(event: SinkEvent, *, sink: str, source: str, default_exchange: str | None,
               max_bytes: int) -> Message | GiveUp:
    """The message for ``event``, or GiveUp with why it can never be sent (the row never changes)."""
    exchange = exchange_of(event, default_exchange)
    if isinstance(exchange, GiveUp):
        return exchange
    key_bytes = len(event.key.encode())
    if key_bytes > MAX_SHORT_STRING:
        return GiveUp(f"the partition key is {key_bytes} bytes; an AMQP routing key is at most {MAX_SHORT_STRING}")
    body = event.payload_json.encode()
    if len(body) > max_bytes:
        return GiveUp(f"the message is {len(body)} bytes, over the broker's limit of {max_bytes} "
                      "(--rabbitmq-max-message-bytes)")
    headers: dict[str, Any] = {}
    for name, value in event.headers.items():
        if name.lower().startswith(CE_PREFIX.lower()) or name.lower().startswith("cloudevents:"):
            log.warning("rabbitmq sink %s: event %s has a header %r, a name the sink sets; sending the event without "
                        "it", sink, event.id, name)
            continue
        if len(name.encode()) > MAX_SHORT_STRING:
            return GiveUp(f"the event's header {name[:100]!r} is longer than an AMQP header name may be "
                          f"({MAX_SHORT_STRING} bytes)")
        headers[name] = value
    ce = attributes(event, source, event.topic)
    del ce["datacontenttype"]  # the content_type property
    headers.update({CE_PREFIX + name: value for name, value in ce.items()})
    timestamp = int(event.time.timestamp())
    return Message(exchange, event.key, body, headers, timestamp)


__all__ = ["CE_PREFIX", "Message", "exchange_of", "message_of"]
