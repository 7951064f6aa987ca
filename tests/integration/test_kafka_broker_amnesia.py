"""The Kafka sink against a broker that forgot its state (Tansu's memory storage, restarted).

After such a restart the broker hands out producer ids again from 1, so a producer that survived the
restart can share its id with a new one. The survivor's next batches are then answered
DUPLICATE_SEQUENCE_NUMBER, which librdkafka reports as delivered although nothing was stored. These
tests make that happen on purpose: right after the restart, fresh producers take the low ids and
write a few messages to every partition, so any survivor's batch is a "duplicate".
"""

from __future__ import annotations

import contextlib
import threading
import uuid
from collections.abc import Iterator
from typing import Any, ClassVar

import pytest
from confluent_kafka import Producer

from outbox_relay.sinks.engine import Outcomes
from outbox_relay.sinks.kafka import LIBRDKAFKA_LOG, KafkaSink
from outbox_relay.sinks.kafka.flight import Flight, Session
from tests.integration.test_relay_kafka import deliver_once, stored_events
from tests.servers import KafkaServer, consume_all, create_topic, require_restartable, wait_until

KAFKA = "kafka"


def take_producer_ids(bootstrap: str, topic: str, count: int, per_partition: int, partitions: int = 4) -> None:
    """``count`` new idempotent producers, one after the other, each writing ``per_partition``
    messages (key ``thief``) to every partition of ``topic``. Right after a restart of a broker that
    forgot its state they hold producer ids 1..count, with sequence numbers up to ``per_partition - 1``
    on every partition: a survivor of the restart that uses one of those ids is answered
    DUPLICATE_SEQUENCE_NUMBER."""
    for _ in range(count):
        producer = Producer({"bootstrap.servers": bootstrap, "enable.idempotence": True, "linger.ms": 5,
                             "log_level": 3})
        for partition in range(partitions):
            for _ in range(per_partition):
                producer.produce(topic, b"not an outbox event", b"thief", partition=partition)
        assert producer.flush(15) == 0, "a thief's messages were not acknowledged"


def restart_forgetting(kafka_server: KafkaServer, topic: str) -> None:
    """Restart the broker (memory storage: topics, messages and producer ids are gone) and create
    ``topic`` again, as a real cluster would still have it."""
    kafka_server.restart()
    with contextlib.suppress(RuntimeError):  # a client's metadata request may auto-create it first
        create_topic(kafka_server.bootstrap, topic, partitions=4)


@pytest.fixture
def fresh_broker(kafka_server: KafkaServer) -> Iterator[KafkaServer]:
    """The session's broker, restarted so that the next producer id it hands out is 1."""
    require_restartable(kafka_server)
    kafka_server.restart()
    yield kafka_server


def ids_on_topic(bootstrap: str, topic: str, expected: int) -> set[str]:
    messages = consume_all(bootstrap, topic, expected, timeout=20, settle=0.5)
    return {m.headers["ce_id"] or "" for m in messages if "ce_id" in m.headers}


def test_a_survivor_whose_producer_id_was_handed_out_again_loses_nothing(fresh_broker: KafkaServer) -> None:
    """The sink's producer gets id 1, the broker restarts without its state, three new producers
    take ids 1-3 and write to every partition, then the sink delivers a batch: every event it reports
    delivered must be on the topic."""
    topic = f"amnesia-{uuid.uuid4().hex[:8]}"
    create_topic(fresh_broker.bootstrap, topic, partitions=4)
    keys = [f"amnesia-{i}" for i in range(8)]
    sink = KafkaSink(KAFKA, {"bootstrap.servers": fresh_broker.bootstrap}, topic, "urn:test", stall_seconds=5.0)
    try:
        before = stored_events(keys, 5, first_seq=1)
        assert deliver_once(sink, before) == dict.fromkeys((e.id for e in before), None)

        restart_forgetting(fresh_broker, topic)
        take_producer_ids(fresh_broker.bootstrap, topic, count=3, per_partition=50)
        after = stored_events(keys, 25, first_seq=1000)
        outcomes = deliver_once(sink, after)
    finally:
        sink.close()

    reported = {str(event_id) for event_id, outcome in outcomes.items() if outcome is None}
    on_topic = ids_on_topic(fresh_broker.bootstrap, topic, len(after))
    missing = reported - on_topic
    assert not missing, f"{len(missing)} of {len(reported)} events reported delivered never reached the topic"
    assert reported == {str(e.id) for e in after}, "an event failed instead of being sent again"


def test_an_acknowledgement_without_an_offset_does_not_count(fresh_broker: KafkaServer) -> None:
    """What librdkafka reports for a DUPLICATE_SEQUENCE_NUMBER answer, seen through the sink's
    delivery-report handler: no error, no offset for the first message of the batch, made-up
    offsets for the rest. None of them counts, and the producer is marked for replacement."""
    topic = f"dupseq-{uuid.uuid4().hex[:8]}"
    create_topic(fresh_broker.bootstrap, topic, partitions=1)
    config = {"bootstrap.servers": fresh_broker.bootstrap, "enable.idempotence": True, "acks": "all",
              "linger.ms": 50, "log_level": 3}
    survivor = Producer(config)  # producer id 1
    for _ in range(5):
        survivor.produce(topic, b"before", b"k", partition=0)
    assert survivor.flush(15) == 0

    restart_forgetting(fresh_broker, topic)
    take_producer_ids(fresh_broker.bootstrap, topic, count=1, per_partition=20, partitions=1)  # id 1, seq 0-19

    outcomes: Outcomes = {}
    flight = Flight(outcomes, Session())
    ids = [uuid.uuid4() for _ in range(10)]
    for event_id in ids:  # sequence numbers 5-14: "duplicates" of the thief's
        survivor.produce(topic, b"after", b"k", partition=0, on_delivery=flight.report(event_id))
        flight.pending += 1
    assert survivor.flush(15) == 0
    assert flight.pending == 0
    assert outcomes == {}, "an acknowledgement without an offset counted as a delivery"
    assert flight.session_error is not None and "offset" in flight.session_error
    on_topic = consume_all(fresh_broker.bootstrap, topic, 20, timeout=10, settle=0.5)
    assert [m.value for m in on_topic] == [b"not an outbox event"] * 20, "the broker stored the survivor's batch"


class SlowToShutDown(Producer):
    """A real producer whose destruction blocks until ``released`` (at most 20 s), as ``rd_kafka_destroy``
    did after a broker restart under CPU load (the relay's sink thread sat in ``rd_kafka_destroy_app``
    -> ``thrd_join`` for over 30 s). Records the thread that destroys it."""

    released: ClassVar[threading.Event] = threading.Event()
    destroyed_on: ClassVar[list[str]] = []

    def __del__(self) -> None:
        self.destroyed_on.append(threading.current_thread().name)
        self.released.wait(20)


class SlowProducersSink(KafkaSink):
    def _new_producer(self, session: Session) -> Producer:
        config: dict[str, Any] = {**self._config, "error_cb": session.on_error, "logger": LIBRDKAFKA_LOG}
        return SlowToShutDown(config)


def test_a_replaced_producer_slow_to_shut_down_holds_nothing_up(fresh_broker: KafkaServer) -> None:
    """After a broker restart the sink replaces its producer before the next batch; the old one's
    shutdown may take long, and the batch must not wait for it (a runner waiting there checks no stop
    flag and counts as stuck after --handler-timeout-seconds)."""
    topic = f"slowdestroy-{uuid.uuid4().hex[:8]}"
    create_topic(fresh_broker.bootstrap, topic, partitions=4)
    keys = [f"slow-{i}" for i in range(4)]
    SlowToShutDown.released.clear()
    SlowToShutDown.destroyed_on.clear()
    sink = SlowProducersSink(KAFKA, {"bootstrap.servers": fresh_broker.bootstrap}, topic, "urn:test",
                             stall_seconds=5.0)
    try:
        before = stored_events(keys, 3, first_seq=1)
        assert deliver_once(sink, before) == dict.fromkeys((e.id for e in before), None)
        restart_forgetting(fresh_broker, topic)
        wait_until(lambda: sink.idle() or sink._session.brokers_lost, 15, 0.05, "the producer noticing the restart")

        after = stored_events(keys, 5, first_seq=100)
        outcomes = deliver_once(sink, after)
        # The old producer is being destroyed, still blocked, and not by the thread that delivers.
        assert SlowToShutDown.destroyed_on, "the replaced producer was not destroyed"
        assert threading.current_thread().name not in SlowToShutDown.destroyed_on, (
            "the batch waited for the replaced producer to shut down")
        assert not SlowToShutDown.released.is_set()
    finally:
        SlowToShutDown.released.set()
        sink.close()
    assert outcomes == dict.fromkeys((e.id for e in after), None)
    assert ids_on_topic(fresh_broker.bootstrap, topic, len(after)) >= {str(e.id) for e in after}
