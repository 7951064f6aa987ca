"""Tracing without servers: the trace context publish records, span links and their bound, handler
spans (sync and async), observers combined, and ``--tracing`` wiring."""

from __future__ import annotations

import asyncio
import json
import logging
import socket
import subprocess
import sys
import threading
import uuid
from collections.abc import Iterator, Sequence
from datetime import UTC, datetime
from typing import Any

import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode

from outbox_relay.compose import build_worker
from outbox_relay.errors import InvalidEvent
from outbox_relay.event import Event
from outbox_relay.observer import NULL_OBSERVER, Delivery, Observer, Observers
from outbox_relay.publish import Outbox
from outbox_relay.settings import RelaySettings
from outbox_relay.store import Checkpoint, StoredEvent
from outbox_relay.tracing import MAX_LINKS, TracingObserver, relay_observer, with_trace
from projections.event import FenceToken, ProjectionEvent


@pytest.fixture
def exporter() -> Iterator[InMemorySpanExporter]:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    exporter.provider = provider  # type: ignore[attr-defined]
    try:
        yield exporter
    finally:
        provider.shutdown()


def provider_of(exporter: InMemorySpanExporter) -> TracerProvider:
    return exporter.provider  # type: ignore[attr-defined,no-any-return]


def traceparent(trace_id: int, span_id: int, flags: int = 1) -> str:
    return f"00-{trace_id:032x}-{span_id:016x}-{flags:02x}"


def stored(n: int, headers: dict[str, str] | None = None, topic: str | None = "orders") -> StoredEvent:
    return StoredEvent(bucket=n % 7, xid=1000, seq=n, id=uuid.uuid4(), key=f"k{n}", topic=topic, type="T",
                       payload_text="{}", headers_text=json.dumps(headers or {}), time=datetime.now(UTC))


class FakeSink:
    def __init__(self, kind: str = "kafka", name: str = "kafka", default_topic: str | None = None) -> None:
        self.kind = kind
        self.name = name
        self.default_topic = default_topic
        self.event_filter = None


# -- publish --------------------------------------------------------------------------------------


def test_import_and_building_events_load_no_opentelemetry() -> None:
    code = ("import sys, outbox_relay; from outbox_relay import Outbox; "
            "Outbox('t').event(type='T', key='k', payload={}, headers={'a': 'b'}); "
            "print(sorted(m for m in sys.modules if m.startswith('opentelemetry')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_events_built_inside_a_span_carry_its_context(exporter: InMemorySpanExporter) -> None:
    tracer = provider_of(exporter).get_tracer("t")
    outbox = Outbox("orders")
    assert "traceparent" not in outbox.event(type="T", key="k", payload={}).headers
    with tracer.start_as_current_span("request") as span:
        ctx = span.get_span_context()
        expected = traceparent(ctx.trace_id, ctx.span_id, ctx.trace_flags)
        assert outbox.event(type="T", key="k", payload={}).headers == {"traceparent": expected}
        assert outbox.event(type="T", key="k", payload={}, headers={"x": "1"}).headers == {
            "x": "1", "traceparent": expected}
        # The caller's own trace context wins, whatever the case of its name.
        assert outbox.event(type="T", key="k", payload={}, headers={"TraceParent": "mine"}).headers == {
            "TraceParent": "mine"}
        assert outbox.event(type="T", key="k", payload={}, headers={"tracestate": "a=b"}).headers == {
            "tracestate": "a=b"}
        # An Event made by hand gets it when it is published (the batch being prepared).
        made = Event(type="T", key="k", payload={}, topic="orders")
        assert outbox._events([made])[0].headers == {"traceparent": expected}
        # Bad headers still get the clear error.
        with pytest.raises(InvalidEvent, match="headers"):
            outbox.event(type="T", key="k", payload={}, headers={"x": 1})  # type: ignore[dict-item]
        with pytest.raises(InvalidEvent, match="headers"):
            outbox.event(type="T", key="k", payload={}, headers=[("x", "1")])  # type: ignore[arg-type]
    assert with_trace({"a": "b"}) == {"a": "b"}


# -- batch spans ----------------------------------------------------------------------------------


def test_batch_span_links_to_distinct_producers_bounded(exporter: InMemorySpanExporter) -> None:
    observer = TracingObserver(provider_of(exporter))
    events = [stored(i, {"traceparent": traceparent(7, 100 + i)}) for i in range(MAX_LINKS + 5)]
    events += [stored(100, {"traceparent": traceparent(7, 100)}),  # the same producer span again
               stored(101, {"traceparent": "garbage"}), stored(102), stored(103, topic=None)]
    sink = FakeSink(default_topic="fallback")
    with observer.delivering(sink, events) as delivery:  # type: ignore[arg-type]
        cp = Checkpoint(fences={0: 1, 1: 1}, delivered=events[:3])
        delivery.landed(cp, {0, 1})
    (span,) = exporter.get_finished_spans()
    assert span.name == "send"  # two topics: orders and the default one
    assert span.kind == SpanKind.PRODUCER
    assert len(span.links) == MAX_LINKS
    assert span.attributes is not None
    assert span.attributes["outbox_relay.trace_links_omitted"] == 6  # 5 more, and the malformed one
    assert span.attributes["outbox_relay.topics"] == ("fallback", "orders")
    assert span.attributes["messaging.batch.message_count"] == len(events)
    assert span.attributes["outbox_relay.buckets_lost"] == 0
    assert span.status.status_code == StatusCode.UNSET


def test_batch_span_ends_with_failures_lost_buckets_and_exceptions(exporter: InMemorySpanExporter) -> None:
    observer = TracingObserver(provider_of(exporter))
    events = [stored(i) for i in range(3)]
    sink = FakeSink(kind="projection", name="totals")
    cp = Checkpoint(fences={0: 1, 1: 1, 2: 1}, delivered=[events[0]], dead=[(events[1], 1, "bad password=hunter2")],
                    park=[(events[2], 1, 0.1, "try later")])
    with observer.delivering(sink, events) as delivery:  # type: ignore[arg-type]
        delivery.landed(cp, {0, 1})  # bucket 2 fenced out: its failure does not count
    with pytest.raises(RuntimeError), observer.delivering(sink, events):  # type: ignore[arg-type]
        raise RuntimeError("the batch failed as a whole")
    with observer.delivering(sink, []) as delivery:  # type: ignore[arg-type]
        delivery.landed(Checkpoint(fences={}), set())
    first, second = exporter.get_finished_spans()
    assert first.name == "process totals"
    assert first.kind == SpanKind.CONSUMER
    assert first.attributes is not None
    assert (first.attributes["outbox_relay.delivered"], first.attributes["outbox_relay.dead_lettered"],
            first.attributes["outbox_relay.retried"], first.attributes["outbox_relay.buckets_lost"]) == (1, 1, 0, 1)
    assert first.status.status_code == StatusCode.ERROR
    assert "fenced out of 1 buckets" in (first.status.description or "")
    assert [e.name for e in first.events] == ["event dead-lettered"]
    assert second.status.status_code == StatusCode.ERROR
    assert any(e.name == "exception" for e in second.events)


# -- handler spans --------------------------------------------------------------------------------


def projection_event(headers: dict[str, str]) -> ProjectionEvent[Any]:
    return ProjectionEvent(id=uuid.uuid4(), type="OrderPlaced", key="k", topic="orders", payload={},
                           headers=headers, time=datetime.now(UTC), position=(1, 2), token=FenceToken(1, 1, 1, 2),
                           attempt=1, replay=False)


def test_handler_spans_sync_and_async_linked_to_the_producer(exporter: InMemorySpanExporter) -> None:
    observer = TracingObserver(provider_of(exporter))
    seen: list[Any] = []

    def handle(event: Any, tx: Any) -> None:
        seen.append(tx)
        if tx == "fail":
            raise ValueError("no")

    async def ahandle(event: Any, tx: Any) -> None:
        seen.append(tx)

    traced = observer.handler("totals", handle)
    atraced = observer.handler("totals", ahandle)
    event = projection_event({"traceparent": traceparent(9, 99)})
    traced(event, "ok")
    with pytest.raises(ValueError, match="no"):
        traced(event, "fail")
    asyncio.run(atraced(event, "async"))
    assert seen == ["ok", "fail", "async"]
    spans = exporter.get_finished_spans()
    assert [s.name for s in spans] == ["handle OrderPlaced"] * 3
    assert [s.status.status_code for s in spans] == [StatusCode.UNSET, StatusCode.ERROR, StatusCode.UNSET]
    for s in spans:
        assert [(link.context.trace_id, link.context.span_id) for link in s.links] == [(9, 99)]
        assert s.attributes is not None
        assert s.attributes["messaging.message.id"] == str(event.id)
    # Without a producer's context: no link, and a handler left unobserved is the handler itself.
    traced(projection_event({}), "ok")
    assert exporter.get_finished_spans()[-1].links == ()
    assert NULL_OBSERVER.handler("totals", handle) is handle


# -- observers combined ---------------------------------------------------------------------------


class Recorder(Observer):
    def __init__(self) -> None:
        self.calls: list[str] = []

    def batch(self, sink: str, *, size: int, delivered: int, retried: int, dead: int,
              latencies: Sequence[float]) -> None:
        self.calls.append(f"batch {sink} {size}")

    def producer_recreated(self, sink: str, reason: str) -> None:
        self.calls.append(f"recreated {sink}")


def test_observers_hand_every_call_to_each(exporter: InMemorySpanExporter) -> None:
    recorder = Recorder()
    both = Observers(recorder, TracingObserver(provider_of(exporter)))
    both.batch("kafka", size=3, delivered=3, retried=0, dead=0, latencies=[])
    events = [stored(1)]
    with both.delivering(FakeSink(), events) as delivery:  # type: ignore[arg-type]
        both.producer_recreated("kafka", "a stall")
        delivery.landed(Checkpoint(fences={1: 1}, delivered=events), {1})
    assert recorder.calls == ["batch kafka 3", "recreated kafka"]
    (span,) = exporter.get_finished_spans()
    assert span.attributes is not None and span.attributes["outbox_relay.delivered"] == 1
    assert [e.name for e in span.events] == ["producer recreated"]
    handler = both.handler("totals", print)
    assert handler is not print and handler.__wrapped__ is print  # type: ignore[attr-defined]
    assert isinstance(NULL_OBSERVER.delivering(FakeSink(), events).__enter__(), Delivery)  # type: ignore[arg-type]


# -- --tracing ------------------------------------------------------------------------------------


def test_tracing_setting_installs_the_observer(caplog: pytest.LogCaptureFixture) -> None:
    settings = RelaySettings(dsn="postgresql://relay@db.invalid/app", kafka=False, tracing=True, worker_id="w",
                             activity_log_seconds=0)
    with caplog.at_level(logging.WARNING, logger="outbox_relay.tracing"):
        worker = build_worker(settings)
    assert isinstance(worker.observer, TracingObserver)
    assert "no OpenTelemetry tracer provider is set up" in caplog.text  # nothing configured one here
    with socket.socket() as free:
        free.bind(("127.0.0.1", 0))
        port = free.getsockname()[1]
    worker = build_worker(settings.model_copy(update={"metrics_port": port, "metrics_host": "127.0.0.1"}))
    try:
        assert isinstance(worker.observer, Observers)  # metrics and tracing
    finally:
        for service in worker.services:  # never started: close() would wait for its serve_forever
            if hasattr(service, "server"):
                service.server.server_close()
    assert isinstance(build_worker(settings.model_copy(update={"tracing": False})).observer, Observer)
    quiet = settings.model_copy(update={"tracing": False, "activity_log_seconds": 0})
    assert build_worker(quiet).observer is NULL_OBSERVER
    assert isinstance(relay_observer(), TracingObserver)


def test_tracing_without_opentelemetry_is_a_clear_error() -> None:
    code = ("import sys; sys.modules['opentelemetry'] = None\n"
            "from outbox_relay.tracing import relay_observer\n"
            "try:\n    relay_observer()\nexcept Exception as exc:\n    print(type(exc).__name__, exc)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.startswith("ConfigurationError --tracing (OUTBOX_TRACING) needs OpenTelemetry")
    assert "pip install 'outbox-relay[otel]'" in out


def test_a_span_is_current_only_on_its_own_thread(exporter: InMemorySpanExporter) -> None:
    # publish reads the *current* span: another thread's span is not the caller's.
    tracer = provider_of(exporter).get_tracer("t")
    got: list[dict[str, str]] = []
    with tracer.start_as_current_span("request"):
        t = threading.Thread(target=lambda: got.append(Outbox("o").event(type="T", key="k", payload={}).headers))
        t.start()
        t.join()
    assert got == [{}]
