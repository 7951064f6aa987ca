"""The composition root: builds the sinks a relay's settings ask for, and the relay around them.

The only module that knows every kind of sink. The engine (worker.py, relay.py) takes sinks and
imports neither Kafka nor projections, and ``import outbox_relay`` (what a producer needs) loads
neither. Dependencies run one way: compose -> sinks (kafka_sink, projections) -> engine.
"""

from __future__ import annotations

from .housekeeping import application_name
from .kafka_sink import KafkaSink
from .observer import NULL_OBSERVER, Observer, Observers
from .settings import RelaySettings
from .sink import Sink
from .worker import Worker


def default_sinks(settings: RelaySettings, observer: Observer = NULL_OBSERVER) -> list[Sink]:
    """The Kafka sink (unless ``kafka`` is off) and each ``projection`` named in the settings, reporting
    to ``observer`` (producer replacements; a projection's handler calls, for tracing)."""
    s = settings
    sinks: list[Sink] = []
    if s.kafka:
        kafka = KafkaSink(s.kafka_sink, s.kafka_producer_config(), s.default_topic, s.source,
                          stall_seconds=s.kafka_stall_seconds)
        kafka.observer = observer
        sinks.append(kafka)
    if s.projection:
        from projections.declare import load_registry
        from projections.sink import ProjectionSink

        assert s.projections is not None  # settings validation
        registry = load_registry(s.projections)
        dsn = s.dsn.get_secret_value()
        for name in s.projection:
            sink = ProjectionSink(registry.get(name), dsn, lease_seconds=s.lease_seconds,
                                  application_name=application_name(s.worker_id),
                                  handler_timeout_seconds=s.handler_timeout_seconds)
            sink.observer = observer
            sinks.append(sink)
    return sinks


def build_worker(settings: RelaySettings) -> Worker:
    """A relay process's worker with the sinks its settings name, its metrics server when
    ``metrics_port`` is set and its spans when ``tracing`` is on: what ``outbox-relay run`` runs."""
    observers: list[Observer] = []
    metrics = None
    if settings.metrics_port is not None:
        from prometheus_client import CollectorRegistry

        from .metrics import PrometheusObserver

        metrics = CollectorRegistry()
        prometheus = PrometheusObserver(metrics)
        observers.append(prometheus)
    if settings.tracing:
        from .tracing import relay_observer

        observers.append(relay_observer())
    observer = observers[0] if len(observers) == 1 else Observers(*observers) if observers else NULL_OBSERVER
    sinks = default_sinks(settings, observer)
    worker = Worker(settings, sinks, observer)
    if metrics is not None and settings.metrics_port is not None:
        from .metrics import MetricsServer

        prometheus.sinks(s.name for s in sinks)  # every sink's series exist from the first scrape
        worker.services.append(MetricsServer(worker, metrics, settings.metrics_host, settings.metrics_port,
                                             settings.metrics_refresh_seconds))
    return worker
