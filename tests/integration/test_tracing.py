"""Tracing end to end, against a real PostgreSQL and the real broker, spans kept in memory.

Publish inside a span -> the stored event carries its ``traceparent`` -> the Kafka message carries it
as a header -> the relay's batch span links to the publishing span; a projection handler runs in a
span of its own, a child of its batch's span, linked to the publishing span.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanContext, SpanKind, StatusCode
from psycopg_pool import ConnectionPool

from outbox_relay import store
from outbox_relay.errors import NonRetriableDelivery
from outbox_relay.publish import Outbox
from outbox_relay.relay import SinkRunner
from outbox_relay.sinks.kafka import KafkaSink
from outbox_relay.tracing import TracingObserver
from projections import ProjectionEvent, projection
from projections.sink import ProjectionSink
from tests.integration.relay_helpers import (  # noqa: F401  (pool_fixture provides `pool`)
    ALL_BUCKETS,
    dead_letters,
    fetch_all,
    make_settings,
    parked_ids,
    pool_fixture,
    run_until,
    runner_for,
    undelivered,
)
from tests.servers import consume_all


@pytest.fixture
def spans() -> Iterator[tuple[TracerProvider, InMemorySpanExporter]]:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    try:
        yield provider, exporter
    finally:
        provider.shutdown()


def traceparent(context: SpanContext) -> str:
    return f"00-{context.trace_id:032x}-{context.span_id:016x}-{context.trace_flags:02x}"


def publish_in_span(dsn: str, provider: TracerProvider, topic: str,
                    events: list[dict[str, Any]]) -> tuple[SpanContext, list[uuid.UUID]]:
    """Publish ``events`` in one transaction inside a span of the "service"; its context and the ids."""
    tracer = provider.get_tracer("the-service")
    outbox = Outbox(default_topic=topic)
    with tracer.start_as_current_span("place order") as span, psycopg.connect(dsn) as conn:
        published = outbox.publish_many(conn, events)
    return span.get_span_context(), [p.id for p in published]


def stored_headers(dsn: str, ids: list[uuid.UUID]) -> dict[uuid.UUID, dict[str, str]]:
    return dict(fetch_all(dsn, "SELECT id, headers FROM outbox.events WHERE id = ANY(%s)", (ids,)))


def linked_to(span: ReadableSpan, context: SpanContext) -> bool:
    return any(link.context.trace_id == context.trace_id and link.context.span_id == context.span_id
               for link in span.links)


def test_kafka_message_carries_the_producers_traceparent_and_the_batch_span_links_to_it(
        dsn: str, pool: ConnectionPool[Any], kafka_bootstrap: str, kafka_topic: str,
        spans: tuple[TracerProvider, InMemorySpanExporter]) -> None:
    provider, exporter = spans
    producer, ids = publish_in_span(dsn, provider, kafka_topic, [
        {"type": "OrderPlaced", "key": "order-1", "payload": {"n": 1}},
        {"type": "OrderPlaced", "key": "order-2", "payload": {"n": 2}, "headers": {"tenant": "t1"}},
    ])
    # Published outside any span, and with the caller's own traceparent: both kept as they are.
    own = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
    with psycopg.connect(dsn) as conn:
        plain = Outbox(default_topic=kafka_topic).publish(conn, type="OrderPlaced", key="order-3", payload={})
        theirs = Outbox(default_topic=kafka_topic).publish(conn, type="OrderPlaced", key="order-4", payload={},
                                                          headers={"traceparent": own})

    headers = stored_headers(dsn, [*ids, plain.id, theirs.id])
    assert headers[ids[0]] == {"traceparent": traceparent(producer)}
    assert headers[ids[1]] == {"tenant": "t1", "traceparent": traceparent(producer)}
    assert headers[plain.id] == {}
    assert headers[theirs.id] == {"traceparent": own}

    sink = KafkaSink("kafka", {"bootstrap.servers": kafka_bootstrap}, None, "urn:outbox-relay:test")
    try:
        runner = runner_for(sink, pool, make_settings(dsn, "relay-t"))
        runner.observer = TracingObserver(provider)
        run_until(runner, lambda: undelivered(dsn, "kafka") == 0 and not parked_ids(dsn, "kafka"), timeout=20)
    finally:
        sink.close()

    messages = {m.headers["ce_id"]: m for m in consume_all(kafka_bootstrap, kafka_topic, 4, timeout=20)}
    assert messages[str(ids[0])].headers["traceparent"] == traceparent(producer)
    assert messages[str(ids[1])].headers["traceparent"] == traceparent(producer)
    assert "traceparent" not in messages[str(plain.id)].headers
    assert messages[str(theirs.id)].headers["traceparent"] == own

    batches = [s for s in exporter.get_finished_spans() if s.name == f"send {kafka_topic}"]
    assert batches, [s.name for s in exporter.get_finished_spans()]
    assert all(s.kind == SpanKind.PRODUCER for s in batches)
    assert sum(s.attributes["messaging.batch.message_count"] for s in batches) == 4  # type: ignore[index,misc]
    assert sum(s.attributes["outbox_relay.delivered"] for s in batches) == 4  # type: ignore[index,misc]
    linked = [s for s in batches if linked_to(s, producer)]
    assert linked, "the batch span links to the span that published its events"
    first = linked[0]
    assert first.attributes is not None
    assert first.attributes["messaging.system"] == "kafka"
    assert first.attributes["messaging.destination.name"] == kafka_topic
    assert first.attributes["outbox_relay.sink"] == "kafka"
    assert first.status.status_code == StatusCode.UNSET
    # The caller's own traceparent is linked too (a valid context), the event without one adds nothing.
    assert any(link.context.span_id == 0xB7AD6B7169203331 for s in batches for link in s.links)
    assert sum(len(s.links) for s in batches) == 2


ORDERS = "CREATE TABLE orders_seen (id uuid PRIMARY KEY, key text NOT NULL)"


def test_projection_handler_runs_in_a_span_linked_to_the_producer(
        dsn: str, pool: ConnectionPool[Any], spans: tuple[TracerProvider, InMemorySpanExporter]) -> None:
    provider, exporter = spans
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(ORDERS)

    @projection("orders_seen", events=["OrderPlaced", "Poison"], tables=["orders_seen"])
    def seen(event: ProjectionEvent[Any], tx: Any) -> None:
        if event.type == "Poison":
            raise NonRetriableDelivery("this event can not be applied")
        tx.execute("INSERT INTO orders_seen VALUES (%s, %s)", (event.id, event.key))

    producer, ids = publish_in_span(dsn, provider, "orders", [
        {"type": "OrderPlaced", "key": "order-1", "payload": {}},
        {"type": "Poison", "key": "order-2", "payload": {}},
    ])
    observer = TracingObserver(provider)
    sink = ProjectionSink(seen, dsn)
    sink.observer = observer
    try:
        with pool.connection() as conn:
            store.register_sink(conn, sink.name, sink.kind)
        runner = SinkRunner(sink, pool, make_settings(dsn, "relay-p"))
        runner.desired = set(ALL_BUCKETS)
        runner.observer = observer
        run_until(runner, lambda: undelivered(dsn, "orders_seen") == 0 and not parked_ids(dsn, "orders_seen"))
    finally:
        sink.close()
    assert fetch_all(dsn, "SELECT id FROM orders_seen") == [(ids[0],)]
    assert ids[1] in dead_letters(dsn, "orders_seen")

    finished = exporter.get_finished_spans()
    handled = {s.attributes["messaging.message.id"]: s for s in finished  # type: ignore[index]
               if s.name.startswith("handle ")}
    ok, poison = handled[str(ids[0])], handled[str(ids[1])]
    assert ok.name == "handle OrderPlaced"
    assert poison.name == "handle Poison"
    for span in (ok, poison):
        assert linked_to(span, producer), "linked to the span that published the event"
        assert span.context.trace_id != producer.trace_id, "not parented by it: the relay's own trace"
        assert span.attributes is not None
        assert span.attributes["messaging.consumer.group.name"] == "orders_seen"
        assert span.attributes["messaging.destination.name"] == "orders"
    assert ok.status.status_code == StatusCode.UNSET
    assert poison.status.status_code == StatusCode.ERROR
    assert any(e.name == "exception" for e in poison.events)

    # Each handler span is a child of its batch's span, which links to the producer and ends with
    # the outcome.
    batches = {s.context.span_id: s for s in finished if s.name == "process orders_seen"}
    for span in (ok, poison):
        assert span.parent is not None and span.parent.span_id in batches
    outcome = batches[poison.parent.span_id]  # type: ignore[union-attr]
    assert outcome.kind == SpanKind.CONSUMER
    assert linked_to(outcome, producer)
    assert outcome.attributes is not None and outcome.attributes["outbox_relay.dead_lettered"] == 1
    assert outcome.status.status_code == StatusCode.ERROR
    assert [e.name for e in outcome.events] == ["event dead-lettered"]
