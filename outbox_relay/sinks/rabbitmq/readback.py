"""What the broker holds for a RabbitMQ sink, read without taking it away (``outbox-relay verify``).

AMQP 0-9-1 can not list a queue's bindings, so the queues to read are named (``rabbitmq_queues``). Each is
consumed with manual acknowledgement and nothing acknowledged; closing the channel puts every message back
where it was (RabbitMQ requeues to the original position), marked redelivered. Only messages the sink
wrote (a ``cloudEvents_id`` header) are listed. Read while no consumer takes from those queues: a consumer
would be handed what this read puts back, and what it acknowledged is gone.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Collection
from typing import TYPE_CHECKING, Any

from ...errors import ConfigurationError
from .connection import Broker, client, read_password
from .message import CE_PREFIX

if TYPE_CHECKING:
    from ...rabbitmq_settings import RabbitMQFields

QUIET_SECONDS = 0.2  # after a queue's counted messages arrived: nothing more for this long ends its read


def read_back(fields: RabbitMQFields, *, topics: Collection[str] | None = None,
              timeout_seconds: float = 5.0) -> list[tuple[uuid.UUID, str, str]]:
    """(event id, partition key, queue) of every message of the sink in ``fields.rabbitmq_queues``, in each queue's
    order; only those published to an exchange in ``topics`` if given."""
    if not fields.rabbitmq_url:
        raise ConfigurationError("no RabbitMQ URL: pass --rabbitmq-url or set OUTBOX_RABBITMQ_URL")
    if not fields.rabbitmq_queues:
        raise ConfigurationError("reading back a RabbitMQ sink needs the queues bound to its exchanges: pass "
                                 "--rabbitmq-queues or set OUTBOX_RABBITMQ_QUEUES")
    password = (read_password(fields.rabbitmq_password_file) if fields.rabbitmq_password_file is not None
                else fields.rabbitmq_password.get_secret_value() if fields.rabbitmq_password is not None else None)
    broker = Broker(fields.rabbitmq_url, password=password, heartbeat_seconds=fields.rabbitmq_heartbeat_seconds,
                    connect_timeout_seconds=fields.rabbitmq_connect_timeout_seconds,
                    client_name=f"outbox-relay read-back {fields.rabbitmq_sink}")
    wanted = frozenset(topics) if topics is not None else None
    connection = broker.connect()
    try:
        found: list[tuple[uuid.UUID, str, str]] = []
        for queue in fields.rabbitmq_queues:
            found.extend(_read_queue(connection, queue, wanted, time.monotonic() + timeout_seconds))
        return found
    finally:
        connection.close()


def _read_queue(connection: Any, queue: str, topics: frozenset[str] | None,
                deadline: float) -> list[tuple[uuid.UUID, str, str]]:
    errors = client().exceptions
    channel = connection.channel()
    try:
        try:
            count = channel.queue_declare(queue, passive=True).method.message_count
        except errors.ChannelClosedByBroker as exc:
            raise ConfigurationError(f"rabbitmq read-back: queue {queue!r}: {exc.reply_text}") from None
        found: list[tuple[uuid.UUID, str, str]] = []
        seen = 0
        if count:
            channel.basic_qos(prefetch_count=0)
            for method, properties, _ in channel.consume(queue, auto_ack=False, inactivity_timeout=QUIET_SECONDS):
                if method is None:
                    if seen >= count or time.monotonic() > deadline:
                        break
                    continue
                seen += 1
                headers = properties.headers or {}
                event_id = headers.get(f"{CE_PREFIX}id")
                if event_id is not None and (topics is None or method.exchange in topics):
                    key = headers.get(f"{CE_PREFIX}partitionkey", method.routing_key)
                    found.append((uuid.UUID(_text(event_id)), _text(key), queue))
                if time.monotonic() > deadline:
                    break
        return found
    finally:
        if channel.is_open:
            channel.close()  # nothing acknowledged: every message goes back to its place


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


__all__ = ["read_back"]
