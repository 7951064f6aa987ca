"""The Kafka sink against a real Kafka-protocol broker (``kafka_bootstrap``) and a real PostgreSQL.

What reaches the topic is read back with a consumer: message key = partition key, value = payload,
CloudEvents headers, per-key order; events the broker can never take are dead-lettered at once.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import uuid
from collections import defaultdict
from collections.abc import Iterator, Sequence
from datetime import UTC, datetime
from typing import Any

import psycopg
import pytest
from psycopg_pool import ConnectionPool

from outbox_relay.publish import Outbox
from outbox_relay.sinks.engine import Aborted, CommitAtEnd, Outcomes
from outbox_relay.sinks.kafka import KafkaSink, sequence
from outbox_relay.store import StoredEvent
from tests.integration.relay_helpers import (  # noqa: F401  (pool_fixture provides `pool`)
    cursor_row,
    dead_letters,
    fetch_all,
    keys_in_bucket,
    make_settings,
    parked_ids,
    pool_fixture,
    run_until,
    runner_for,
    undelivered,
)
from tests.servers import KafkaServer, consume_all, create_topic

KAFKA = "kafka"


@pytest.fixture
def kafka_sink(kafka_bootstrap: str) -> Iterator[KafkaSink]:
    sink = KafkaSink(KAFKA, {"bootstrap.servers": kafka_bootstrap}, None, "urn:outbox-relay:test")
    try:
        yield sink
    finally:
        sink.close()


def all_handled(dsn: str) -> bool:
    """Every event is behind the Kafka sink's cursor and nothing is parked."""
    return undelivered(dsn, KAFKA) == 0 and not parked_ids(dsn, KAFKA)


def test_messages_carry_the_partition_key_and_cloudevents_headers_in_key_order(
        dsn: str, pool: ConnectionPool[Any], kafka_bootstrap: str, kafka_topic: str, kafka_sink: KafkaSink) -> None:
    keys = ["order-1", "order-2", "order-3", "customer-9", "x"]
    outbox = Outbox(default_topic=kafka_topic)
    published: dict[str, list[Any]] = defaultdict(list)
    for tx in range(4):
        with psycopg.connect(dsn) as conn:
            batch = [{"key": k, "type": f"order.v{tx}", "payload": {"tx": tx, "key": k, "text": "é"},
                      "headers": {"trace-id": f"trace-{tx}-{k}"}} for k in keys]
            for e, p in zip(batch, outbox.publish_many(conn, batch), strict=True):
                published[e["key"]].append(p.id)
    runner = runner_for(kafka_sink, pool, make_settings(dsn, "relay-k"))
    run_until(runner, lambda: all_handled(dsn), timeout=20)
    stored = {r[0]: r[1:] for r in fetch_all(
        dsn, "SELECT id, partition_key, type, payload, created_at, xid::text::bigint, seq, bucket FROM outbox.events")}

    messages = consume_all(kafka_bootstrap, kafka_topic, 20, timeout=20, settle=0.5)
    assert len(messages) == 20
    by_key: dict[str, list[Any]] = defaultdict(list)
    for m in sorted(messages, key=lambda m: (m.partition, m.offset)):
        h = m.headers
        event_id = next(i for i in stored if str(i) == h["ce_id"])
        key, type_, payload, created_at, xid, seq, bucket = stored[event_id]
        assert m.key == key, "message key = partition key"
        assert m.json() == payload
        assert h["ce_specversion"] == "1.0" and h["ce_source"] == "urn:outbox-relay:test"
        assert h["ce_type"] == type_ and h["ce_partitionkey"] == key
        assert h["content-type"] == "application/json"
        assert h["ce_sequence"] == sequence(xid, seq)
        assert datetime.fromisoformat(h["ce_time"] or "") == created_at
        assert h["outbox_fence"] == str(cursor_row(dsn, bucket, KAFKA)["fence"]) == "1"
        assert h["trace-id"] == f"trace-{payload['tx']}-{key}", "the event's own headers ride along"
        by_key[key].append(m)
    for key, ms in by_key.items():
        assert len({m.partition for m in ms}) == 1, f"{key} spread over partitions"
        assert [next(i for i in stored if str(i) == m.headers["ce_id"]) for m in ms] == published[key]
        seqs = [m.headers["ce_sequence"] for m in ms]
        assert seqs == sorted(seqs) and len(set(seqs)) == len(seqs), "ce_sequence increases per key"
    assert dead_letters(dsn, KAFKA) == {}


def test_message_larger_than_the_broker_accepts_is_dead_lettered_at_once(
        dsn: str, pool: ConnectionPool[Any], kafka_bootstrap: str, kafka_topic: str, kafka_sink: KafkaSink) -> None:
    outbox = Outbox(default_topic=kafka_topic)
    with psycopg.connect(dsn) as conn:
        big, small, other = (p.id for p in outbox.publish_many(conn, [
            {"key": "doc-1", "type": "doc.scanned", "payload": {"blob": "x" * 1_100_000}},  # > message.max.bytes
            {"key": "doc-1", "type": "doc.indexed", "payload": {"n": 2}},
            {"key": "doc-2", "type": "doc.indexed", "payload": {"n": 3}},
        ]))
    runner = runner_for(kafka_sink, pool, make_settings(dsn, "relay-k", max_attempts=10))
    run_until(runner, lambda: all_handled(dsn), timeout=20)
    letters = dead_letters(dsn, KAFKA)
    assert set(letters) == {big}
    attempts, error = letters[big]
    assert attempts == 1, "a message too large is not retriable"
    assert "MSG_SIZE_TOO_LARGE" in error
    messages = consume_all(kafka_bootstrap, kafka_topic, 2, timeout=20, settle=0.5)
    assert sorted(m.headers["ce_id"] or "" for m in messages) == sorted([str(small), str(other)])


def test_event_with_no_topic_and_no_default_topic_is_dead_lettered_with_the_reason(
        dsn: str, pool: ConnectionPool[Any], kafka_bootstrap: str, kafka_topic: str, kafka_sink: KafkaSink) -> None:
    (key,) = keys_in_bucket(dsn, 12, 1)
    with psycopg.connect(dsn) as conn:  # a producer in another language wrote the row without a topic
        (lost,) = conn.execute("INSERT INTO outbox.events (partition_key, type, payload) "
                               "VALUES (%s, 'no.topic', '{}') RETURNING id", (key,)).fetchone() or ()
    with psycopg.connect(dsn) as conn:
        after = Outbox(default_topic=kafka_topic).publish(conn, type="t", key=key, payload={"n": 2}).id
    runner = runner_for(kafka_sink, pool, make_settings(dsn, "relay-k"))
    run_until(runner, lambda: all_handled(dsn), timeout=20)
    letters = dead_letters(dsn, KAFKA)
    assert set(letters) == {lost}
    attempts, error = letters[lost]
    assert attempts == 1 and "no topic" in error and "default-topic" in error
    messages = consume_all(kafka_bootstrap, kafka_topic, 1, timeout=20, settle=0.5)
    assert [m.headers["ce_id"] for m in messages] == [str(after)]


def test_event_with_no_topic_goes_to_the_default_topic(
        dsn: str, pool: ConnectionPool[Any], kafka_bootstrap: str, kafka_topic: str) -> None:
    with psycopg.connect(dsn) as conn:
        (event_id,) = conn.execute("INSERT INTO outbox.events (partition_key, type, payload) "
                                   "VALUES ('k', 'no.topic', '{\"a\": 1}') RETURNING id").fetchone() or ()
    sink = KafkaSink(KAFKA, {"bootstrap.servers": kafka_bootstrap}, kafka_topic, "urn:test")
    try:
        run_until(runner_for(sink, pool, make_settings(dsn, "relay-k")), lambda: all_handled(dsn), timeout=20)
    finally:
        sink.close()
    messages = consume_all(kafka_bootstrap, kafka_topic, 1, timeout=20, settle=0.3)
    assert [(m.key, m.json(), m.headers["ce_id"]) for m in messages] == [("k", {"a": 1}, str(event_id))]
    assert dead_letters(dsn, KAFKA) == {}


def stored_events(keys: list[str], per_key: int, first_seq: int) -> list[StoredEvent]:
    """Events as the relay reads them (the sink needs no database), keys interleaved."""
    now = datetime.now(UTC)
    return [StoredEvent(bucket=i % 4, xid=1, seq=first_seq + n * len(keys) + i, id=uuid.uuid4(), key=key, topic=None,
                        type="restart.counted", payload_text=f'{{"n": {n}}}', headers_text="{}", time=now)
            for n in range(per_key) for i, key in enumerate(keys)]


def deliver_once(sink: KafkaSink, events: Sequence[StoredEvent], timeout: float = 30.0) -> Outcomes:
    """One ``deliver`` call; returns the outcomes it committed (exactly once)."""
    commits: list[Outcomes] = []

    def commit(outcomes: Outcomes, tx: Any) -> set[int]:
        commits.append(dict(outcomes))
        return {e.bucket for e in events}

    abort = threading.Event()
    timer = threading.Timer(timeout, abort.set)  # a wedged producer would wait forever
    timer.start()
    try:
        sink.deliver(events, {e.bucket: 1 for e in events}, CommitAtEnd.of(commit), abort)
    except Aborted:
        pytest.fail(f"the batch was not delivered within {timeout:.0f}s")
    finally:
        timer.cancel()
    assert len(commits) == 1
    return commits[0]


def test_a_broker_that_forgot_the_producer_id_gets_a_new_producer_and_nothing_fails(
        kafka_server: KafkaServer, kafka_topic: str, caplog: pytest.LogCaptureFixture) -> None:
    """The broker restarts without the idempotent producer's state (Tansu keeps it in memory; a real
    cluster can expire it). Kept, the producer's id would be unknown and librdkafka would retry
    UNKNOWN_PRODUCER_ID forever without a delivery report. The sink replaces the producer that lost
    every broker connection (the stall detection is the fallback) and produces the batch on the new
    one: every event is reported delivered (a failure would burn a retry attempt) and each key's
    de-duplicated sequence on the topic is the published one."""
    if not kafka_server.restartable:
        pytest.skip(f"the {kafka_server.kind} broker can not be restarted by the tests")
    keys = [f"restart-{i}" for i in range(8)]
    sink = KafkaSink(KAFKA, {"bootstrap.servers": kafka_server.bootstrap}, kafka_topic, "urn:test",
                     stall_seconds=3.0)  # well above the ~0.5 s a new producer needs for its first ack
    try:
        before = stored_events(keys, 5, first_seq=1)
        assert deliver_once(sink, before) == dict.fromkeys((e.id for e in before), None)  # the producer has an id

        kafka_server.restart()  # memory storage: topics, messages and producer ids are gone
        with contextlib.suppress(RuntimeError):  # the producer's metadata request may auto-create it first
            create_topic(kafka_server.bootstrap, kafka_topic, partitions=4)
        after = stored_events(keys, 25, first_seq=1000)
        with caplog.at_level(logging.WARNING, logger="outbox_relay.kafka"):
            outcomes = deliver_once(sink, after)
        assert outcomes == dict.fromkeys((e.id for e in after), None), "an event failed instead of being resent"
        assert any("recreating the producer" in r.getMessage() for r in caplog.records), caplog.text
    finally:
        sink.close()

    messages = consume_all(kafka_server.bootstrap, kafka_topic, len(after), timeout=20, settle=0.5)
    by_key: dict[str, list[str]] = defaultdict(list)
    for m in sorted(messages, key=lambda m: (m.partition, m.offset)):
        event_id = m.headers["ce_id"] or ""
        if event_id not in by_key[m.key or ""]:  # duplicates are allowed, reordering is not
            by_key[m.key or ""].append(event_id)
    assert by_key == {k: [str(e.id) for e in after if e.key == k] for k in keys}
