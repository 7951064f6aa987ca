"""Kafka delivery with confluent-kafka: idempotent producer, acks=all, many messages in flight.

An event counts as delivered only once its delivery report arrived without error. Message
key = partition key, so Kafka keeps per-key order within a partition; the idempotent
producer keeps it across its own retries. ``message.timeout.ms=0`` (no timeout) by
default: while the broker is down the batch waits (leases keep being renewed) instead of
burning retry attempts.
"""

from __future__ import annotations

import logging
import threading
import uuid
from collections.abc import Sequence
from typing import Any

from confluent_kafka import KafkaError, KafkaException, Producer

from .dsn import redact_kafka_config
from .sink import Aborted, CommitFn, Failure, Outcomes
from .store import StoredEvent

log = logging.getLogger("outbox_relay.kafka")

PRODUCER_DEFAULTS: dict[str, Any] = {
    "enable.idempotence": True,
    "acks": "all",
    "linger.ms": 2,
    "message.timeout.ms": 0,
    "partitioner": "murmur2_random",  # same partition for a key as the Java client
    "compression.type": "none",
    "queue.buffering.max.messages": 200_000,
}

# Errors no retry can fix: dead-letter at once with the reason.
NON_RETRIABLE = {
    KafkaError.MSG_SIZE_TOO_LARGE,
    KafkaError.INVALID_MSG,
    KafkaError.INVALID_RECORD,
    KafkaError.RECORD_LIST_TOO_LARGE,
    KafkaError.UNKNOWN_TOPIC_OR_PART,
    KafkaError._UNKNOWN_TOPIC,
    KafkaError.TOPIC_AUTHORIZATION_FAILED,
    KafkaError.TOPIC_EXCEPTION,
    KafkaError._INVALID_ARG,
}


def _failure(err: KafkaError) -> Failure:
    return Failure(f"kafka: {err.name()}: {err.str()}", retriable=err.code() not in NON_RETRIABLE)


def sequence(xid: int, seq: int) -> str:
    """CloudEvents ``sequence``: compared as strings, increases with position (so per key)."""
    return f"{xid:020d}-{seq:020d}"


class KafkaSink:
    kind = "kafka"

    def __init__(self, name: str, config: dict[str, Any], default_topic: str | None, source: str) -> None:
        self.name = name
        self.default_topic = default_topic
        self.source = source.encode()
        self._config = {**PRODUCER_DEFAULTS, **config}
        log.info("kafka producer config %s", redact_kafka_config({k: str(v) for k, v in self._config.items()}))
        self._producer = Producer(self._config)

    def close(self) -> None:
        self._producer.purge()
        self._producer.flush(0)

    def deliver(self, events: Sequence[StoredEvent], fences: dict[int, int], commit: CommitFn,
                abort: threading.Event) -> set[int]:
        outcomes: Outcomes = {}
        pending = 0

        def report(event_id: uuid.UUID) -> Any:
            def on_delivery(err: KafkaError | None, _msg: Any) -> None:
                nonlocal pending
                pending -= 1
                outcomes[event_id] = None if err is None else _failure(err)
            return on_delivery

        for e in events:
            topic = e.topic or self.default_topic
            if topic is None:
                outcomes[e.id] = Failure("event has no topic and the relay has no --default-topic", retriable=False)
                continue
            headers: list[tuple[str, str | bytes | None]] = [
                ("ce_specversion", b"1.0"),
                ("ce_id", str(e.id).encode()),
                ("ce_source", self.source),
                ("ce_type", e.type.encode()),
                ("ce_time", e.created_at.isoformat().encode()),
                ("ce_sequence", sequence(e.xid, e.seq).encode()),
                ("ce_partitionkey", e.key.encode()),
                ("content-type", b"application/json"),
                ("outbox_fence", str(fences[e.bucket]).encode()),
            ]
            if e.headers_text != "{}":
                headers.extend((k, v.encode()) for k, v in e.headers.items())
            while True:
                try:
                    self._producer.produce(topic, e.payload_text.encode(), e.key.encode(), headers=headers,
                                           on_delivery=report(e.id))
                    pending += 1
                    break
                except BufferError:  # local queue full: let reports drain
                    self._producer.poll(0.05)
                except KafkaException as exc:
                    outcomes[e.id] = _failure(exc.args[0])
                    break
        # Wait for every delivery report. With no message timeout this waits out a broker
        # outage; the membership thread keeps renewing our leases meanwhile.
        while pending > 0:
            if abort.is_set():
                # Drop what is still queued so that nothing of ours lands after the next
                # owner has started (it redelivers from the same cursor).
                self._producer.purge()
                raise Aborted()
            self._producer.poll(0.05)
        return commit(outcomes, None)
