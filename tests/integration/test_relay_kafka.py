"""The Kafka sink against a real Kafka-protocol broker (``kafka_bootstrap``) and a real PostgreSQL.

What reaches the topic is read back with a consumer: message key = partition key, value = payload,
CloudEvents headers, per-key order; events the broker can never take are dead-lettered at once.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterator
from datetime import datetime
from typing import Any

import psycopg
import pytest
from psycopg_pool import ConnectionPool

from outbox_relay.kafka_sink import KafkaSink, sequence
from outbox_relay.publish import Outbox
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
)
from tests.servers import consume_all

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
    behind = fetch_all(dsn, "SELECT count(*) FROM outbox.events e JOIN outbox.cursors c ON c.sink = %s "
                            "AND c.bucket = e.bucket WHERE (e.xid, e.seq) > (c.position_xid, c.position_seq)",
                       (KAFKA,))
    return behind == [(0,)] and not parked_ids(dsn, KAFKA)


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
