"""``--kafka-format debezium``: the messages a consumer written against Debezium's outbox event router reads,
byte for byte (topic, key, the ``id`` header, value), from a real broker."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest
from psycopg_pool import ConnectionPool

from outbox_relay.compose import debezium_format
from outbox_relay.publish import Outbox
from outbox_relay.sinks.kafka import KafkaSink
from outbox_relay.verify import verify
from tests.integration.relay_helpers import (  # noqa: F401  (pool_fixture provides `pool`)
    dead_letters,
    make_settings,
    parked_ids,
    pool_fixture,
    run_until,
    runner_for,
    undelivered,
)
from tests.servers import consume_all, create_topic, delete_topic

SINK = "kafka-dbz"


@pytest.fixture
def aggregate(kafka_bootstrap: str) -> Iterator[str]:
    """An aggregate type (our topic) whose Debezium topic outbox.event.<it> exists."""
    name = f"order{uuid.uuid4().hex[:8]}"
    create_topic(kafka_bootstrap, f"outbox.event.{name}", partitions=2)
    yield name
    delete_topic(kafka_bootstrap, f"outbox.event.{name}")


def test_messages_are_what_debeziums_outbox_event_router_emits(
        dsn: str, pool: ConnectionPool[Any], kafka_bootstrap: str, aggregate: str) -> None:
    settings = make_settings(dsn, "relay-dbz", kafka_format="debezium")
    sink = KafkaSink(SINK, {"bootstrap.servers": kafka_bootstrap}, None, "urn:test", debezium=debezium_format(settings))
    with psycopg.connect(dsn) as conn:
        first, second = (p.id for p in Outbox().publish_many(conn, [
            {"key": "1", "type": "OrderCreated", "topic": aggregate,
             "payload": {"id": 1, "lineItems": [{"item": "Debezium in Action", "quantity": 2}], "customerId": 123}},
            {"key": 'o"42\\', "type": "OrderShipped", "topic": aggregate,
             "payload": {"note": 'say "hi"\\ \u00e9 \u2028', "nl": "a\nb"}, "headers": {"trace": "t-1"}},
        ]))
        # Without a topic and without --default-topic there is nothing to route by: a dead letter, with why.
        # (a producer in another language wrote the row without one).
        (unroutable,) = conn.execute("INSERT INTO outbox.events (partition_key, type, payload) "
                                     "VALUES ('k', 't', '{}') RETURNING id").fetchone() or ()
    try:
        runner = runner_for(sink, pool, settings)
        run_until(runner, lambda: undelivered(dsn, SINK) == 0 and not parked_ids(dsn, SINK), timeout=20)
    finally:
        sink.close()
    messages = consume_all(kafka_bootstrap, f"outbox.event.{aggregate}", 2, timeout=20, settle=0.3)
    got = sorted(((m.topic, m.key, sorted(m.headers.items()), m.value) for m in messages), key=lambda m: m[1] or "")
    assert got == [
        (f"outbox.event.{aggregate}", '"1"', [("id", str(first))],
         b'"{\\"id\\": 1, \\"lineItems\\": [{\\"item\\": \\"Debezium in Action\\", \\"quantity\\": 2}], '
         b'\\"customerId\\": 123}"'),
        (f"outbox.event.{aggregate}", '"o\\"42\\\\"', [("id", str(second))],
         # jsonb's own text (keys by length, then bytes; its escapes), then JSON-quoted as Jackson does.
         '"{\\"nl\\": \\"a\\\\nb\\", \\"note\\": \\"say \\\\\\"hi\\\\\\"\\\\\\\\ \u00e9 \u2028\\"}"'.encode()),
    ]
    letters = dead_letters(dsn, SINK)
    assert set(letters) == {unroutable} and "no topic to route by" in letters[unroutable][1]

    # verify reads the format back: the id header, the key decoded from its JSON string.
    settings = make_settings(dsn, "verify", kafka_format="debezium", kafka_bootstrap_servers=kafka_bootstrap)
    with psycopg.connect(dsn, autocommit=True) as conn:
        report = verify(conn, SINK, settings, topics=[aggregate])
    assert report.ok and (report.stored, report.delivered, report.received) == (2, 2, 2), report


def test_the_routed_topic_and_the_route_by_field_follow_the_options(
        dsn: str, pool: ConnectionPool[Any], kafka_bootstrap: str) -> None:
    routed = f"Shipped{uuid.uuid4().hex[:8]}"
    create_topic(kafka_bootstrap, f"{routed}.events", partitions=1)
    settings = make_settings(dsn, "relay-dbz", kafka_format="debezium", kafka_debezium_route_by="type",
                             kafka_debezium_topic="${routedByValue}.events")
    sink = KafkaSink(SINK, {"bootstrap.servers": kafka_bootstrap}, None, "urn:test", debezium=debezium_format(settings))
    with psycopg.connect(dsn) as conn:
        shipped = Outbox().publish(conn, type=routed, key="7", topic="orders", payload=[1]).id
        bad = Outbox().publish(conn, type="order shipped", key="7", topic="orders", payload=[2]).id
    try:
        run_until(runner_for(sink, pool, settings), lambda: undelivered(dsn, SINK) == 0 and not parked_ids(dsn, SINK),
                  timeout=20)
        (message,) = consume_all(kafka_bootstrap, f"{routed}.events", 1, timeout=20)
    finally:
        sink.close()
        delete_topic(kafka_bootstrap, f"{routed}.events")
    assert (message.key, message.headers, message.value) == ('"7"', {"id": str(shipped)}, b'"[1]"')
    letters = dead_letters(dsn, SINK)
    assert set(letters) == {bad} and "'order shipped.events' is not a Kafka topic name" in letters[bad][1]
