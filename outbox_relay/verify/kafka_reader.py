"""Reading a Kafka sink's topics back from the beginning, for ``verify``.

Every partition is ``assign()``-ed at its first offset: no consumer group is joined and no offset is
committed, so verifying changes nothing a real consumer sees. The event id comes from the header the
sink writes: ``ce_id`` (CloudEvents, message.py) or ``id`` (``--kafka-format debezium``, whose key is a
JSON string: decoded back to the partition key). The broker's end offsets are a first target only
(some brokers report wrong ones): reading goes on until nothing arrived for ``quiet_seconds``, and
ends after ``timeout_seconds`` without a message.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Sequence
from typing import Any

from confluent_kafka import OFFSET_BEGINNING, Consumer, KafkaError, KafkaException, TopicPartition

from ..errors import ConfigurationError
from ..sinks.kafka import LIBRDKAFKA_LOG
from .check import Received

QUIET_SECONDS = 1.0  # once every partition reached its end offset: this long without a message ends the read
READ_BATCH = 1_000


def consumer_config(producer_config: dict[str, Any]) -> dict[str, Any]:
    """The relay's librdkafka settings, less the producer's own, for a consumer that commits nothing."""
    config = {k: v for k, v in producer_config.items()
              if not k.startswith(("enable.idempotence", "acks", "linger", "message.timeout", "delivery.timeout",
                                   "partitioner", "compression", "queue.buffering", "batch.", "retries"))}
    return {**config, "group.id": f"outbox-relay-verify-{uuid.uuid4().hex[:12]}",  # required; never joined
            "logger": LIBRDKAFKA_LOG,  # librdkafka's lines through the relay's logging (redacted, --log-json)
            "enable.auto.commit": False, "enable.auto.offset.store": False, "enable.partition.eof": True,
            "auto.offset.reset": "earliest", "fetch.wait.max.ms": 50}


def read_topics(config: dict[str, Any], topics: Sequence[str], *, debezium: bool = False,
                timeout_seconds: float = 5.0, quiet_seconds: float = QUIET_SECONDS) -> list[Received]:
    """Every message of ``topics``, in partition order (a key lives in one partition of a topic)."""
    header = "id" if debezium else "ce_id"
    consumer = Consumer(consumer_config(config))
    got: list[Received] = []
    try:
        assigned = _partitions(consumer, topics, timeout_seconds)
        if not assigned:
            return got
        consumer.assign([TopicPartition(t, p, OFFSET_BEGINNING) for t, p in assigned])
        at_end: set[tuple[str | None, int | None]] = set()
        last = time.monotonic()
        while True:
            now = time.monotonic()
            if now - last >= timeout_seconds or (len(at_end) == len(assigned) and now - last >= quiet_seconds):
                return got
            for m in consumer.consume(num_messages=READ_BATCH, timeout=0.1):
                err = m.error()
                if err is not None:
                    if err.code() == KafkaError._PARTITION_EOF:
                        at_end.add((m.topic(), m.partition()))
                        continue
                    if err.fatal():
                        raise KafkaException(err)
                    continue  # e.g. a leader moving: the next consume retries
                last = time.monotonic()
                at_end.discard((m.topic(), m.partition()))
                got.append(_received(m, header, debezium))
    finally:
        consumer.close()


def _partitions(consumer: Consumer, topics: Sequence[str], timeout: float) -> list[tuple[str, int]]:
    found: list[tuple[str, int]] = []
    for topic in topics:
        md = consumer.list_topics(topic, timeout=max(timeout, 1.0)).topics.get(topic)
        if md is None or md.error is not None:
            if md is not None and md.error.code() == KafkaError.UNKNOWN_TOPIC_OR_PART:
                continue  # nothing was ever delivered to it
            raise ConfigurationError(f"topic {topic!r} can not be read: {md.error if md else 'no metadata'}")
        found.extend((topic, p) for p in sorted(md.partitions))
    return found


def _received(m: Any, header: str, debezium: bool) -> Received:
    headers = dict(m.headers() or [])
    raw_key = m.key() or b""
    key = raw_key.decode(errors="replace")
    if debezium:
        try:
            decoded = json.loads(key)
            key = decoded if isinstance(decoded, str) else key
        except ValueError:
            pass
    value = headers.get(header)
    try:
        event_id = uuid.UUID((value or b"").decode(errors="replace"))
    except ValueError:
        event_id = uuid.UUID(int=0)  # no id the relay writes: never stored, so a phantom
    return Received(event_id, key, f"{m.topic()}[{m.partition()}]")
