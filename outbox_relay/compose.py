"""The composition root: builds the sinks a relay's settings ask for, and the relay around them.

The only module that knows every kind of sink. The engine (worker.py, relay.py) takes sinks and
imports neither Kafka nor projections, and ``import outbox_relay`` (what a producer needs) loads
neither. Dependencies run one way: compose -> sinks (sinks/kafka, sinks/webhook, sinks/sqs, projections) -> engine.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Sequence
from types import ModuleType
from typing import Any

from .dsn import describe_error
from .errors import ConfigurationError
from .housekeeping import application_name
from .loader import import_module
from .observer import NULL_OBSERVER, Observer, Observers, guarded
from .settings import RelaySettings
from .sinks import EventSink, check_sink
from .sinks.adapter import EventSinkAdapter
from .sinks.engine import Sink, is_engine_sink
from .sinks.kafka import DebeziumFormat, KafkaSink
from .worker import Worker


def default_sinks(settings: RelaySettings, observer: Observer = NULL_OBSERVER,
                  extra: Sequence[object] = ()) -> list[Sink]:
    """The Kafka sink (unless ``kafka`` is off), each ``projection`` and each user ``sink`` named in the
    settings, then ``extra`` (sink objects), reporting to ``observer`` (producer replacements; handler
    calls, for tracing). ConfigurationError if two have one name."""
    s = settings
    sinks: list[Sink] = []
    if s.kafka:
        kafka = KafkaSink(s.kafka_sink, s.kafka_producer_config(), s.default_topic, s.source,
                          stall_seconds=s.kafka_stall_seconds, debezium=debezium_format(s))
        kafka.observer = observer
        sinks.append(kafka)
    if s.projection:
        from projections.declare import load_registry
        from projections.sink import BATCHED_READ_SIZE, ProjectionSink

        assert s.projections is not None  # settings validation
        registry = load_registry(s.projections)
        dsn = s.dsn.get_secret_value()
        chosen = "batch_size" in s.model_fields_set  # --batch-size given: every sink reads that many
        for name in s.projection:
            p = registry.get(name)
            sink = ProjectionSink(p, dsn, lease_seconds=s.lease_seconds,
                                  application_name=application_name(s.worker_id),
                                  handler_timeout_seconds=s.handler_timeout_seconds,
                                  batch_size=BATCHED_READ_SIZE if p.batch and not chosen else None)
            sink.observer = observer
            sinks.append(sink)
    def adapted(sink: Any, where: str) -> EventSinkAdapter:
        adapter = EventSinkAdapter(sink, handler_timeout_seconds=s.handler_timeout_seconds, where=where)
        adapter.observer = observer
        return adapter

    for spec in s.sink:
        sinks.append(adapted(load_sink(spec), f"--sink {spec}"))
    # The product's sinks on the user contract, each turned on by its URL and built by its package (imported
    # only then: each needs its broker's client).
    brokers: list[tuple[object, str, Callable[[ModuleType], Any]]] = [
        (s.webhook_url, "webhook", lambda m: m.from_settings(s)),
        (s.nats_url, "nats", lambda m: m.from_settings(s, s.source, s.default_topic)),
        (s.redis_url, "redis", lambda m: m.from_settings(s, source=s.source, default_topic=s.default_topic)),
        (s.rabbitmq_url, "rabbitmq", lambda m: m.from_settings(s, s.source)),
        (s.sqs_url, "sqs", lambda m: m.from_settings(s, source=s.source, default_topic=s.default_topic)),
    ]
    for url, kind, build in brokers:
        if url:
            sinks.append(adapted(build(importlib.import_module(f"{__package__}.sinks.{kind}")), f"--{kind}-url"))
    for given in extra:
        sinks.append(as_engine_sink(given, s.handler_timeout_seconds, observer))
    names = [made.name for made in sinks]
    twice = sorted({name for name in names if names.count(name) > 1})
    if twice:
        for made in sinks:
            made.close()
        raise ConfigurationError(f"two sinks of this relay have the name {', '.join(map(repr, twice))} (each sink "
                                 "has its own name: its cursors, dead letters and metrics); sinks: "
                                 + ", ".join(f"{made.name} ({made.kind})" for made in sinks))
    return sinks


def debezium_format(settings: RelaySettings) -> DebeziumFormat | None:
    """The Debezium message format when --kafka-format debezium asks for it (None: CloudEvents)."""
    if settings.kafka_format != "debezium":
        return None
    return DebeziumFormat(settings.kafka_debezium_topic, settings.kafka_debezium_route_by)


def as_engine_sink(sink: object, handler_timeout_seconds: float, observer: Observer = NULL_OBSERVER) -> Sink:
    """``sink`` as the engine runs it: an ``EventSink`` in its adapter; an engine ``Sink`` (a
    ``deliver(events, fences, commit, abort)``, e.g. ``RecordingSink``) as it is."""
    if is_engine_sink(sink):
        return sink  # type: ignore[return-value]  # the engine's own protocol
    adapter = EventSinkAdapter(check_sink(sink), handler_timeout_seconds=handler_timeout_seconds)
    adapter.observer = observer
    return adapter


def load_sink(spec: str) -> EventSink:
    """The sink ``MODULE:ATTR`` names: the attribute itself, or what calling it (no arguments) returns.
    ConfigurationError says which part is wrong: the module, the attribute, the object."""
    module_name, _, attr = spec.partition(":")
    if not attr:
        raise ConfigurationError(f"--sink {spec}: expected MODULE:ATTR (e.g. myapp.sinks:audit)")
    module = import_module(module_name, f"--sink {spec}")
    try:
        found: Any = getattr(module, attr)
    except AttributeError:
        raise ConfigurationError(f"--sink {spec}: module {module_name!r} has no attribute {attr!r}") from None
    # A class is a zero-argument callable too (the docs' sinks are classes with class attributes).
    if isinstance(found, type) or (not hasattr(found, "deliver") and callable(found)):
        try:
            found = found()
        except SystemExit as exc:
            raise ConfigurationError(f"--sink {spec}: calling {attr}() to make the sink failed: it called "
                                     f"sys.exit({exc.code!r})") from None
        except Exception as exc:
            raise ConfigurationError(f"--sink {spec}: calling {attr}() to make the sink failed: "
                                     f"{describe_error(exc)}") from None
    return check_sink(found, f"--sink {spec}")


def build_worker(settings: RelaySettings, sinks: Sequence[object] = (), observer: Observer | None = None) -> Worker:
    """A relay process's worker with the sinks its settings name (and ``sinks``, EventSinks or engine
    sinks, after them), its metrics server when ``metrics_port`` is set and its spans when ``tracing``
    is on, reporting to ``observer`` too: what ``outbox-relay run`` runs, and ``Relay`` embeds."""
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
    activity = None
    if settings.activity_log_seconds:
        from .activity import ActivityLog

        activity = ActivityLog(settings.activity_log_seconds)
        observers.append(activity)
    if observer is not None:
        observers.append(observer)
    observer = observers[0] if len(observers) == 1 else Observers(*observers) if observers else NULL_OBSERVER
    made = default_sinks(settings, guarded(observer), sinks)  # a hook that raises is logged, not the sink's failure
    worker = Worker(settings, made, observer)
    if activity is not None:
        worker.services.append(activity)
    if metrics is not None and settings.metrics_port is not None:
        from .metrics import MetricsServer

        prometheus.sinks(s.name for s in made)  # every sink's series exist from the first scrape
        worker.services.append(MetricsServer(worker, metrics, settings.metrics_host, settings.metrics_port,
                                             settings.metrics_refresh_seconds))
    return worker
