"""OpenTelemetry tracing (the ``otel`` extra: ``pip install 'outbox-relay[otel]'``).

- Producers: ``publish`` records the W3C trace context of the caller's current span
  (``traceparent``, ``tracestate``) in the event's headers, unless the caller set either. The Kafka
  sink sends an event's headers with its message, so a consumer continues the producer's trace.
  OpenTelemetry is only looked at once the application has imported it (before that no span can be
  current), so ``import outbox_relay`` does not load it and a producer without it pays a dict lookup.
- Relays (``outbox-relay run --tracing``): ``TracingObserver`` makes a span per batch a sink
  delivers (Kafka: ``send <topic>``, kind PRODUCER; a projection: ``process <sink>``, kind CONSUMER),
  linked to the producers' spans of its events (the first ``MAX_LINKS`` distinct ones) and ended with
  the outcome; and a span per projection handler call (``handle <event type>``), a child of its
  batch's span, linked to the producer's span of its event. Attributes follow OpenTelemetry's
  messaging conventions where they fit (``messaging.*``), the rest are ``outbox_relay.*``.
- Spans go to the process's global tracer provider, which OpenTelemetry's own environment-based
  setup configures (``opentelemetry-instrument`` and the OTEL_* variables). Nothing here chooses an
  exporter.

Why links rather than parents: a batch carries the events of many traces, so its span can only link
to them (the messaging conventions' batch rule). A handler call has one event, but it runs later,
possibly much later (retries after backoff, a dead letter retried next week, a rebuild replaying a
year of history), inside its batch's transaction: parented on the producer it would keep adding spans
to traces long finished. So it is a child of its batch's span (the work it commits with) and links to
the producer; trace viewers follow links both ways.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import logging
import re
import sys
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any, cast

from .dsn import redact
from .errors import ConfigurationError
from .observer import NULL_DELIVERY, Delivery, HandlerT, Observer

if TYPE_CHECKING:
    from opentelemetry.trace import Link, Span, TracerProvider

    from .sinks.engine import Sink
    from .store import Checkpoint, StoredEvent

log = logging.getLogger("outbox_relay.tracing")

TRACE_HEADERS = frozenset({"traceparent", "tracestate"})
# Links per batch span: enough to find the producers of a batch's events, bounded so that a batch
# of thousands of traced events stays a small span (the SDK's own default limit is 128).
MAX_LINKS = 32
# Span events per batch span naming failed events (the counts are attributes).
MAX_FAILURE_EVENTS = 10
# messaging.system of projection spans: the queue is the outbox itself.
SYSTEM = "outbox_relay"
# A traceparent in an event's headers as PostgreSQL prints jsonb (a key after "{" or ", "): an escaped
# quote inside another header's value can not produce this.
_TRACEPARENT = re.compile(r'(?:^\{|, )"traceparent": "([^"\\]*)"')


def trace_headers() -> dict[str, str]:
    """The W3C trace context of the current span (``traceparent``, and ``tracestate`` if it has one);
    empty without one. Loads nothing unless the application already imported OpenTelemetry."""
    if "opentelemetry.trace" not in sys.modules:
        return {}
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    carrier: dict[str, str] = {}
    TraceContextTextMapPropagator().inject(carrier)  # nothing when no valid span is current
    return carrier


def with_trace(headers: Any) -> Any:
    """``headers`` with the current trace context added, unless they name ``traceparent`` or
    ``tracestate`` already (in any case: the caller's own wins). Anything that is not a mapping is
    returned as it is, for validation to name the problem."""
    context = trace_headers()
    if not context:
        return headers
    if headers is None:
        return context
    if not isinstance(headers, Mapping) or any(isinstance(n, str) and n.lower() in TRACE_HEADERS for n in headers):
        return headers
    return {**headers, **context}


def relay_observer() -> TracingObserver:
    """The observer of ``outbox-relay run --tracing``: ConfigurationError without OpenTelemetry, a
    warning when nothing set up a tracer provider (the spans would go nowhere)."""
    try:
        from opentelemetry import trace
    except ImportError:
        raise ConfigurationError("--tracing (OUTBOX_TRACING) needs OpenTelemetry: pip install "
                                 "'outbox-relay[otel]'") from None
    if isinstance(trace.get_tracer_provider(), trace.ProxyTracerProvider):
        log.warning("tracing is on but no OpenTelemetry tracer provider is set up in this process, so the spans go "
                    "nowhere: run the relay under `opentelemetry-instrument` (packages opentelemetry-distro and an "
                    "exporter, e.g. opentelemetry-exporter-otlp), which sets the SDK up from the OTEL_* variables")
    return TracingObserver()


class TracingObserver(Observer):
    """Spans for batches and projection handler calls (see the module's notes). Thread-safe: it
    keeps no state of its own between calls."""

    def __init__(self, tracer_provider: TracerProvider | None = None) -> None:
        from opentelemetry import trace
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        from . import __version__

        self._trace = trace
        self._tracer = trace.get_tracer("outbox_relay", __version__, tracer_provider)
        self._propagator = TraceContextTextMapPropagator()

    # -- links to the producers --------------------------------------------------------------

    def _producer(self, headers: Any) -> Link | None:
        """A link to the span that published an event with these headers, if they carry one."""
        if not isinstance(headers, Mapping) or not isinstance(headers.get("traceparent"), str):
            return None
        span = self._trace.get_current_span(self._propagator.extract(headers)).get_span_context()
        return self._trace.Link(span) if span.is_valid else None

    def _links(self, events: Sequence[StoredEvent]) -> tuple[list[Link], int]:
        """Links to the producers of ``events`` (distinct, at most MAX_LINKS), and how many more
        distinct ones there were. The stored headers are searched, not parsed: a batch of a thousand
        traced events costs a regular expression per event and MAX_LINKS parsed contexts."""
        seen: set[str] = set()
        links: list[Link] = []
        for e in events:
            found = _TRACEPARENT.search(e.headers_text) if "traceparent" in e.headers_text else None
            if found is None or found[1] in seen:
                continue
            seen.add(found[1])
            if len(links) < MAX_LINKS:
                link = self._producer({"traceparent": found[1]})
                if link is not None:
                    links.append(link)
        return links, max(0, len(seen) - MAX_LINKS)

    # -- batches ------------------------------------------------------------------------------

    @contextlib.contextmanager
    def delivering(self, sink: Sink, events: Sequence[StoredEvent]) -> Iterator[Delivery]:
        if not events:  # only events queued behind parked keys: nothing is delivered
            yield NULL_DELIVERY
            return
        from opentelemetry.trace import SpanKind

        kafka = sink.kind == "kafka"
        topics = sorted(_topics(sink, events))
        operation = "send" if kafka else "process"
        links, more = self._links(events)
        attributes: dict[str, Any] = {
            "messaging.system": "kafka" if kafka else SYSTEM,
            "messaging.operation.type": operation,
            "messaging.operation.name": operation,
            "messaging.batch.message_count": len(events),
            "outbox_relay.sink": sink.name,
            "outbox_relay.sink.kind": sink.kind,
            "outbox_relay.buckets": len({e.bucket for e in events}),
            "outbox_relay.topics": topics,
        }
        if len(topics) == 1:
            attributes["messaging.destination.name"] = topics[0]
        if not kafka:
            attributes["messaging.consumer.group.name"] = sink.name
        if more:
            attributes["outbox_relay.trace_links_omitted"] = more
        name = (f"send {topics[0]}" if len(topics) == 1 else "send") if kafka else f"process {sink.name}"
        with self._tracer.start_as_current_span(name, kind=SpanKind.PRODUCER if kafka else SpanKind.CONSUMER,
                                                links=links, attributes=attributes) as span:
            yield _SpanDelivery(span)

    def producer_recreated(self, sink: str, reason: str) -> None:
        # Called inside a Kafka batch (its span is current) or before one.
        self._trace.get_current_span().add_event("producer recreated", {"outbox_relay.reason": redact(reason)})

    # -- projection handlers ------------------------------------------------------------------

    def handler(self, sink: str, handler: HandlerT) -> HandlerT:
        from opentelemetry.trace import SpanKind

        tracer = self._tracer

        def span(event: Any) -> contextlib.AbstractContextManager[Span]:
            if isinstance(event, list):  # a batched handler's call: one span, linked to each producer
                links = [link for e in event if (link := self._producer(e.headers))]
                return tracer.start_as_current_span(
                    "handle batch", kind=SpanKind.INTERNAL, links=links or None,
                    attributes={"messaging.system": SYSTEM, "messaging.operation.type": "process",
                                "messaging.consumer.group.name": sink, "messaging.batch.message_count": len(event),
                                "outbox_relay.sink": sink})
            link = self._producer(event.headers)
            attributes: dict[str, Any] = {
                "messaging.system": SYSTEM,
                "messaging.operation.type": "process",
                "messaging.consumer.group.name": sink,
                "messaging.message.id": str(event.id),
                "cloudevents.event_type": event.type,
                "outbox_relay.sink": sink,
                "outbox_relay.attempt": event.attempt,
                "outbox_relay.replay": getattr(event, "replay", False),
            }
            if event.topic:
                attributes["messaging.destination.name"] = event.topic
            # An exception is recorded and sets the status to error; it still reaches the sink.
            return tracer.start_as_current_span(f"handle {event.type}", kind=SpanKind.INTERNAL,
                                                links=[link] if link else None, attributes=attributes)

        # Two three-line drivers over ``span`` (the shared part): an async handler must be awaited
        # inside its span, so it needs a wrapper of its own.
        if inspect.iscoroutinefunction(handler):
            @functools.wraps(handler)
            async def traced_async(event: Any, tx: Any) -> Any:
                with span(event):
                    return await handler(event, tx)

            return cast(HandlerT, traced_async)

        @functools.wraps(handler)
        def traced(event: Any, tx: Any) -> Any:
            with span(event):
                return handler(event, tx)

        return cast(HandlerT, traced)


class _SpanDelivery(Delivery):
    def __init__(self, span: Span) -> None:
        self.span = span

    def landed(self, checkpoint: Checkpoint | None, buckets: set[int]) -> None:
        if checkpoint is None:
            return
        from opentelemetry.trace import Status, StatusCode

        span = self.span
        delivered = sum(1 for e in checkpoint.delivered if e.bucket in buckets)
        retried = [(e, error) for e, _, _, error in checkpoint.park if error is not None and e.bucket in buckets]
        dead = [(e, error) for e, _, error in checkpoint.dead if e.bucket in buckets]
        lost = len(set(checkpoint.fences) - buckets)
        span.set_attributes({"outbox_relay.delivered": delivered, "outbox_relay.retried": len(retried),
                             "outbox_relay.dead_lettered": len(dead), "outbox_relay.buckets_lost": lost})
        failures: Iterable[tuple[str, StoredEvent, str]] = [
            *(("event dead-lettered", e, error) for e, error in dead),
            *(("event failed", e, error) for e, error in retried)]
        for what, e, error in list(failures)[:MAX_FAILURE_EVENTS]:
            span.add_event(what, {"messaging.message.id": str(e.id), "outbox_relay.error": redact(error)})
        problems = []
        if retried or dead:
            problems.append(f"{len(retried) + len(dead)} events failed ({len(dead)} dead-lettered)")
        if lost:
            problems.append(f"fenced out of {lost} buckets: their outcomes were discarded, the new owner redelivers")
        if problems:
            span.set_status(Status(StatusCode.ERROR, "; ".join(problems)))


def _topics(sink: Sink, events: Sequence[StoredEvent]) -> set[str]:
    """The topics a batch goes to: for a Kafka sink as it resolves them (its topic override, the
    event's, its default), else the events' own."""
    override = getattr(sink, "topic", None)
    if override:
        return {override}
    default = getattr(sink, "default_topic", None)
    return {t for t in (e.topic or default for e in events) if t}
