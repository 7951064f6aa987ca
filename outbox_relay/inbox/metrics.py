"""The inbox consumer's Prometheus metrics (``outbox-relay inbox run --metrics-port PORT``), served with
``/healthz`` and ``/readyz`` by the relay's endpoint server (``outbox_relay.metrics.EndpointServer``).

Counters are the consumer's own totals (``InboxConsumer.stats``) and gauges its partitions' state, both
read at scrape time from plain attributes: a scrape never calls the Kafka client or a database. The
handler duration is a histogram observed around each handler call. docs/observability.md lists them.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from ..errors import ConfigurationError
from ..metrics import LATENCY_BUCKETS, EndpointServer
from .store import Handler

if TYPE_CHECKING:
    import psycopg

    from .consumer import InboxConsumer
    from .message import InboxMessage

PREFIX = "outbox_inbox"

# (Stats field, metric name without _total, help)
COUNTERS = (
    ("applied", "applied", "Messages whose handler ran and committed"),
    ("duplicates", "duplicates", "Messages skipped: their ce_id was applied before (a redelivery)"),
    ("dead", "dead_lettered", "Messages moved to the inbox's dead letters after their last attempt"),
    ("retries", "retries", "Failed attempts that wait for a retry"),
    ("lapses", "partitions_lapsed", "Partitions claimed from a process that stopped without releasing them "
                                    "(killed, crashed, cut off): their next message is applied alone, recorded"),
    ("log_resets", "log_resets", "Partitions read again from the start: the broker lost the log"),
    ("gaps", "offset_gaps", "Jumps in a partition's offsets (compaction, transaction markers, a skipped batch)"),
)


class InboxCollector(Collector):
    """The consumer's counters and per-partition gauges, read when scraped."""

    def __init__(self, consumer: InboxConsumer) -> None:
        self.consumer = consumer

    def collect(self) -> Iterable[CounterMetricFamily | GaugeMetricFamily]:
        c = self.consumer
        name = c.settings.consumer
        for field, metric, doc in COUNTERS:
            yield _counter(f"{PREFIX}_{metric}", doc, name, getattr(c.stats, field))
        held = GaugeMetricFamily(f"{PREFIX}_partitions_held", "Partitions this process holds the lease of",
                                 labels=["consumer"])
        share = GaugeMetricFamily(f"{PREFIX}_partitions_share", "Partitions this process should hold (an even "
                                  "share among the live processes)", labels=["consumer"])
        partitions = list(c.partitions.values())  # one C call: safe while the consumer's thread changes it
        held.add_metric([name], len(partitions))
        share.add_metric([name], c.share)
        yield held
        yield share
        labels = ["consumer", "topic", "partition"]
        position = GaugeMetricFamily(f"{PREFIX}_position", "Next offset to apply (committed with the last "
                                     "message applied)", labels=labels)
        lag = GaugeMetricFamily(f"{PREFIX}_lag_messages", "Messages on the partition after its position: the "
                                "high watermark from the last fetch, or the last offset fetched when that is "
                                "larger (a broker that reports a wrong end offset)", labels=labels)
        attempts = GaugeMetricFamily(f"{PREFIX}_head_attempts", "Failed attempts of the message the partition "
                                     "waits on (0: none waiting)", labels=labels)
        for p in partitions:
            key = [name, p.topic, str(p.partition)]
            if p.next_offset is not None:
                position.add_metric(key, p.next_offset)
            end = max(p.high_watermark, p.fetched_end)
            if end >= 0:
                lag.add_metric(key, max(0, end - (p.next_offset or 0)))
            waiting = p.held
            attempts.add_metric(key, p.attempts if waiting is not None and waiting.id == p.attempt_id else 0)
        yield position
        yield lag
        yield attempts
        yield _gauge(f"{PREFIX}_ready", "1 while /readyz answers 200", name, 0.0 if c.readiness() else 1.0)


def _counter(metric: str, doc: str, consumer: str, value: float) -> CounterMetricFamily:
    family = CounterMetricFamily(metric, doc, labels=["consumer"])
    family.add_metric([consumer], value)
    return family


def _gauge(metric: str, doc: str, consumer: str, value: float) -> GaugeMetricFamily:
    family = GaugeMetricFamily(metric, doc, labels=["consumer"])
    family.add_metric([consumer], value)
    return family


def timed(handler: Handler, registry: CollectorRegistry, consumer: str) -> Handler:
    """``handler``, observed in ``outbox_inbox_handler_duration_seconds`` (failures and all)."""
    histogram = Histogram(f"{PREFIX}_handler_duration_seconds", "How long a handler call took, raised or not",
                          ["consumer", "topic"], buckets=LATENCY_BUCKETS, registry=registry)

    def observed(message: InboxMessage, conn: psycopg.Connection[Any]) -> object:
        start = time.perf_counter()
        try:
            return handler(message, conn)
        finally:
            histogram.labels(consumer, message.topic).observe(time.perf_counter() - start)

    return observed


def serve(consumer: InboxConsumer, registry: CollectorRegistry, host: str, port: int) -> EndpointServer:
    """The consumer's endpoint server (not started); ConfigurationError if it can not listen there."""
    registry.register(InboxCollector(consumer))
    try:
        return EndpointServer(consumer, registry, host, port)
    except OSError as exc:
        raise ConfigurationError(f"cannot serve metrics on {host}:{port} (--metrics-port, --metrics-host): "
                                 f"{exc.strerror or exc}") from None
