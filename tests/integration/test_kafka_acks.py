"""``Observer.acknowledged``: the Kafka sink tells its observer which events the broker acknowledged,
as the delivery reports arrive and before the batch's checkpoint (what bench/run.py times as commit ->
ack, now that a Kafka cursor is written at most every ``--cursor-flush-seconds``). Real broker."""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Sequence
from datetime import UTC, datetime
from typing import Any

from outbox_relay.observer import Observer, Observers
from outbox_relay.sinks.engine import CommitAtEnd, Outcomes
from outbox_relay.sinks.kafka import KafkaSink
from outbox_relay.store import StoredEvent


class AckLog(Observer):
    def __init__(self) -> None:
        self.acks: list[tuple[float, uuid.UUID]] = []

    def acknowledged(self, sink: str, event_ids: Sequence[uuid.UUID]) -> None:
        assert sink == "kafka"
        now = time.monotonic()
        self.acks.extend((now, i) for i in event_ids)


def _event(n: int, payload: str = "{}") -> StoredEvent:
    return StoredEvent(bucket=5, xid=1000 + n, seq=n, id=uuid.uuid4(), key=f"k-{n % 3}", topic=None, type="t",
                       payload_text=payload, headers_text="{}", time=datetime.now(UTC))


def test_the_observer_hears_each_acknowledged_event_once_before_the_checkpoint(
        kafka_bootstrap: str, kafka_topic: str) -> None:
    events = [_event(n) for n in range(20)]
    too_big = _event(20, '{"x": "' + "y" * 1_100_000 + '"}')  # refused by the client: not acknowledged
    log = AckLog()
    committed: list[tuple[float, Outcomes]] = []

    def commit(outcomes: Outcomes, tx: Any) -> set[int]:
        committed.append((time.monotonic(), dict(outcomes)))
        return {5}

    sink = KafkaSink("kafka", {"bootstrap.servers": kafka_bootstrap}, kafka_topic, "urn:test")
    sink.observer = Observers(Observer(), log)  # as `outbox-relay run` composes it
    try:
        sink.deliver([*events, too_big], {5: 1}, CommitAtEnd.of(commit), threading.Event())
    finally:
        sink.close()
    (at, outcomes), = committed
    assert outcomes[too_big.id] is not None and all(outcomes[e.id] is None for e in events)
    assert sorted(i for _, i in log.acks) == sorted(e.id for e in events)  # each once, the refused one never
    assert all(t <= at for t, _ in log.acks)
