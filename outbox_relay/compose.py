"""The composition root: builds the sinks a relay's settings ask for, and the relay around them.

The only module that knows every kind of sink. The engine (worker.py, relay.py) takes sinks and
imports neither Kafka nor projections, and ``import outbox_relay`` (what a producer needs) loads
neither. Dependencies run one way: compose -> sinks (kafka_sink, projections) -> engine.
"""

from __future__ import annotations

from .housekeeping import application_name
from .kafka_sink import KafkaSink
from .settings import RelaySettings
from .sink import Sink
from .worker import Worker


def default_sinks(settings: RelaySettings) -> list[Sink]:
    """The Kafka sink (unless ``kafka`` is off) and each ``projection`` named in the settings."""
    s = settings
    sinks: list[Sink] = []
    if s.kafka:
        sinks.append(KafkaSink(s.kafka_sink, s.kafka_producer_config(), s.default_topic, s.source,
                               stall_seconds=s.kafka_stall_seconds))
    if s.projection:
        from projections.declare import load_registry
        from projections.sink import ProjectionSink

        assert s.projections is not None  # settings validation
        registry = load_registry(s.projections)
        dsn = s.dsn.get_secret_value()
        sinks.extend(ProjectionSink(registry.get(name), dsn, lease_seconds=s.lease_seconds,
                                    application_name=application_name(s.worker_id))
                     for name in s.projection)
    return sinks


def build_worker(settings: RelaySettings) -> Worker:
    """A relay process's worker with the sinks its settings name, and its metrics server when
    ``metrics_port`` is set: what ``outbox-relay run`` runs."""
    if settings.metrics_port is None:
        return Worker(settings, default_sinks(settings))
    from prometheus_client import CollectorRegistry

    from .metrics import MetricsServer, PrometheusObserver

    registry = CollectorRegistry()
    observer = PrometheusObserver(registry)
    sinks = default_sinks(settings)
    observer.sinks(s.name for s in sinks)
    for sink in sinks:
        if isinstance(sink, KafkaSink):
            sink.observer = observer
    worker = Worker(settings, sinks, observer)
    worker.services.append(MetricsServer(worker, registry, settings.metrics_host, settings.metrics_port,
                                         settings.metrics_refresh_seconds))
    return worker
