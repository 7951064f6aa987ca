"""Who reads a sink back, by its registered kind: Kafka here, a broker sink by its own
``outbox_relay.sinks.<kind>.readback`` module (loaded when asked for), a projection not at all."""

from __future__ import annotations

import importlib
import uuid
from collections.abc import Sequence
from typing import Any

from ..errors import ConfigurationError
from ..settings import RelaySettings
from .check import Received

BROKER_KINDS = ("rabbitmq", "nats", "redis", "sqs")
KINDS = ("kafka", "projection", *BROKER_KINDS)

# What verify can check of each kind (the report's first line).
CHECKS = {
    "kafka": "read back from the sink's topics from their first offset (event id: the ce_id header, or id in "
             "--kafka-format debezium): loss, order, phantoms, duplicates",
    "projection": "a projection records what it applied as its checkpoint, committed with the handlers' writes "
                  "(G7): no record per event is kept, so loss, order and phantoms can not be read back; checked: "
                  "every stored event of its topics is behind its checkpoint, retrying, or dead-lettered",
}
BROKER_CHECKS = "read back from the broker by outbox_relay.sinks.{kind}.readback: loss, order, phantoms, duplicates"


def describe(kind: str) -> str:
    return CHECKS.get(kind, BROKER_CHECKS.format(kind=kind))


def check_kind(kind: str, sink: str) -> None:
    """Refuse a sink verify can not read back (a user's own sink, a webhook): what reached it is the user's."""
    if kind not in KINDS:
        raise ConfigurationError(f"sink {sink!r} is of kind {kind!r}: verify reads back sinks of kind "
                                 f"{', '.join(KINDS)} (what reached any other sink is outside outbox-relay's reach)")


def read_back(kind: str, settings: RelaySettings, topics: Sequence[str], timeout_seconds: float
              ) -> list[Received] | None:
    """What reached the sink, in each destination's order; None for a projection (nothing to read back)."""
    if kind == "projection":
        return None
    if kind == "kafka":
        from .kafka_reader import read_topics

        config = settings.kafka_producer_config()
        debezium = settings.kafka_format == "debezium"
        return read_topics(config, [kafka_topic(settings, t) for t in topics], debezium=debezium,
                           timeout_seconds=timeout_seconds)
    reader = _broker_reader(kind)
    found: list[tuple[uuid.UUID, str, str]] = reader(settings, topics=list(topics), timeout_seconds=timeout_seconds)
    return [Received(event_id, key, destination) for event_id, key, destination in found]


def kafka_topic(settings: RelaySettings, topic: str) -> str:
    """The Kafka topic the events of ``topic`` go to (``--kafka-format debezium`` routes them)."""
    if settings.kafka_format == "debezium" and settings.kafka_debezium_route_by == "topic":
        from ..settings import ROUTED_BY_VALUE

        return settings.kafka_debezium_topic.replace(ROUTED_BY_VALUE, topic)
    return topic


def _broker_reader(kind: str) -> Any:
    module = f"outbox_relay.sinks.{kind}.readback"
    try:
        loaded = importlib.import_module(module)
    except ModuleNotFoundError as exc:
        if exc.name is not None and (module == exc.name or module.startswith(exc.name + ".")):
            raise ConfigurationError(f"verify can not read back a {kind} sink: this version of outbox-relay has no "
                                     f"reader for it ({module})") from None
        raise ConfigurationError(f"verify can not read back a {kind} sink: {exc.name} is not installed (pip install "
                                 f"'outbox-relay[{kind}]')") from None
    reader = getattr(loaded, "read_back", None)
    if not callable(reader):
        raise ConfigurationError(f"{module} has no read_back function")
    return reader
