"""All relay settings in one model. Every field is also read from ``OUTBOX_<FIELD>``.

Every number has finite bounds (``bounds`` names them for ``--help`` and the docs). Errors name the option
and its environment variable, never the value given (it may be a secret). What the relay's settings share
with the inbox's and the webhook's is declared once, in outbox_relay.settings_base and
outbox_relay.webhook_settings.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import Field, ValidationError, field_validator, model_validator
from pydantic.fields import FieldInfo
from pydantic_settings import NoDecode, SettingsConfigDict

from .dsn import remember_kafka_secrets
from .errors import ConfigurationError
from .nats_settings import NatsFields
from .rabbitmq_settings import RabbitMQFields
from .redis_settings import RedisFields
from .settings_base import (
    DAY,
    ENV_PREFIX,
    KAFKA_OPTIONS_HELP,
    MODULE_SPEC,
    NO_DSN,
    SINK_NAME,
    SINK_NAME_RULE,
    TOPIC_NAME,
    AttemptSettings,
    Dsn,
    KafkaOptions,
    bounds,
    default_text,
    default_worker_id,
    environment_only,
    read_kafka_config_file,
)
from .sqs_settings import SqsFields
from .webhook_settings import WebhookFields, WebhookSettings

# Debezium's placeholder in route.topic.replacement (sinks/kafka/debezium.py; not imported: it loads confluent-kafka).
ROUTED_BY_VALUE = "${routedByValue}"



class RelaySettings(AttemptSettings, WebhookFields, NatsFields, RedisFields, RabbitMQFields, SqsFields):
    """The relay's settings: its own below; leases, attempts and the handler time limit (AttemptSettings) and
    the sinks' (WebhookFields, NatsFields, RedisFields, RabbitMQFields, SqsFields) inherited."""

    model_config = SettingsConfigDict(extra="forbid")

    # Required: a default database is a silent guess (it once put the schema into `postgres`).
    dsn: Dsn = Field(description="PostgreSQL connection string")
    worker_id: str = Field(default_factory=default_worker_id, min_length=1, max_length=200,
                           description="unique per process")

    # sinks
    kafka: bool = Field(True, description="deliver to Kafka")
    kafka_sink: str = Field("kafka", min_length=1, max_length=63,
                            description="sink name of the Kafka delivery (its own cursors)")
    # No default: a relay guessing a broker takes its buckets and can not deliver them.
    kafka_bootstrap_servers: str | None = Field(
        None, min_length=1, max_length=4096,
        description="Kafka bootstrap servers, e.g. 127.0.0.1:9092 (required while Kafka is on)")
    kafka_config: KafkaOptions = Field(
        default_factory=dict,
        description="extra librdkafka settings, e.g. security.protocol, sasl.*, ssl.* (passed through); "
                    + KAFKA_OPTIONS_HELP,
    )
    kafka_config_file: Path | None = Field(
        None, description="librdkafka settings from a file of KEY=VALUE lines (# comments); --kafka-option and "
                          "OUTBOX_KAFKA_CONFIG win for their keys")
    kafka_stall_seconds: float = Field(
        60.0, ge=0.1, le=DAY,
        description="recreate the Kafka producer after this long without a delivery report while messages are in "
                    "flight (e.g. a broker that forgot the producer id); unacknowledged messages are sent again",
    )
    kafka_format: Literal["cloudevents", "debezium"] = Field(
        "cloudevents",
        description="the Kafka messages' shape: cloudevents (the payload as value, ce_* headers) or debezium (as "
                    "Debezium's outbox event router emits them: key and value as JSON strings, header id; "
                    "docs/debezium-cutover.md)")
    kafka_debezium_topic: str = Field(
        "outbox.event." + ROUTED_BY_VALUE, min_length=1, max_length=249,
        description="--kafka-format debezium: each message's topic, ${routedByValue} replaced by the routed value "
                    "(Debezium's route.topic.replacement)")
    kafka_debezium_route_by: Literal["topic", "type"] = Field(
        "topic", description="--kafka-format debezium: what ${routedByValue} is, the event's topic (its aggregate "
                             "type; --default-topic for events without one) or its type (Debezium's route.by.field)")
    default_topic: str | None = Field(None, description="topic for events published without one")
    projections: str | None = Field(
        None, max_length=500,
        description="module (or module:attribute) that declares the projections, e.g. myapp.read_models")
    projection: Annotated[list[str], NoDecode] = Field(
        default_factory=list, description="run this projection (repeatable; in the environment: comma-separated)")
    sink: Annotated[list[str], NoDecode] = Field(
        default_factory=list,
        description="run your own sink, MODULE:ATTR: an EventSink (outbox_relay.sinks) or a zero-argument callable "
                    "returning one (repeatable; in the environment: separated by commas or spaces)")
    # observability
    metrics_port: int | None = Field(
        None, ge=1, le=65535,
        description="serve /metrics (Prometheus), /healthz and /readyz on this port (off when unset)")
    metrics_host: str = Field("0.0.0.0", min_length=1, description="address the metrics port listens on")
    metrics_refresh_seconds: float = Field(
        15.0, ge=1, le=3600, description="how often the outbox-wide gauges (backlog, lagging keys) are read")
    activity_log_seconds: float = Field(
        60.0, ge=0, le=86400, description="log one INFO line this often with what each sink delivered, retried and "
                                          "dead-lettered (an idle interval logs nothing); 0: off")
    tracing: bool = Field(
        False, description="OpenTelemetry spans per batch and per projection handler call, to the tracer provider "
                           "the OTEL_* variables set up (run under opentelemetry-instrument; needs the otel extra)")

    # batching and leases (batch_size, lease_seconds: AttemptSettings)
    cursor_flush_seconds: float = Field(
        5.0, ge=0, le=600,
        description="a sink without a transaction of its own (Kafka) writes a bucket's cursor at most this often "
                    "while a long transaction holds vacuum back, else all its cursors once a second (fences are "
                    "checked every batch): fewer dead rows and statements, more redelivery after a crash; 0: "
                    "every batch")
    heartbeat_seconds: float = Field(2.0, ge=0.01, le=600,
                                     description="registry heartbeat interval; each heartbeat also reads the stored "
                                                 "assignment (and stores a new one when members changed)")
    worker_ttl_seconds: float = Field(
        10.0, ge=0.02, le=3600,
        description="a worker silent this long is no longer a live member (its buckets are reassigned) and "
                    "housekeeping frees its leases")
    poll_seconds: float = Field(
        1.0, ge=0.01, le=3600, description="idle poll interval while the LISTEN connection is down")
    listen_poll_seconds: float = Field(
        10.0, ge=0.01, le=3600,
        description="idle poll interval while LISTEN is connected (notifications wake a relay at once; "
                    "polling is the safety net)")
    listen: bool = Field(True, description="use LISTEN/NOTIFY to wake idle workers")
    # Whole milliseconds: the watch sleeps with pg_sleep, which rounds a shorter or fractional sleep up.
    watch_interval_ms: int = Field(
        1, ge=1, le=1000,
        description="how often the one relay that watches for commits looks for new ones (whole milliseconds; "
                    "it then wakes the owners of the buckets written)")
    watch_max_interval_ms: int = Field(
        8, ge=1, le=1000,
        description="the longest interval of those looks: each second without a commit doubles it up to this "
                    "(an idle server is not woken every millisecond); the first commit brings back "
                    "--watch-interval-ms (a value below that is read as it)")
    housekeeping_seconds: float = Field(5.0, ge=0.01, le=3600,
                                        description="housekeeping interval (one pass per interval across all relays)")

    # failures (max_attempts, backoff_*, handler_timeout_seconds: AttemptSettings)
    max_lapses: int = Field(
        3, ge=1, le=1000,
        description="leases lost with work pending before a bucket is delivered one event at a time")
    drain_seconds: float = Field(
        30.0, ge=0.1, le=3600,
        description="SIGTERM: time to finish in-flight work and release; then a hard stop, and the process "
                    "exits at most HARD_STOP_SECONDS (5) later even if a sink is blocked (exit 5)")

    # history
    retention_seconds: float = Field(7 * DAY, ge=0, le=3650 * DAY, description="keep delivered events this long")
    retention_batch: int = Field(
        2_000, ge=1, le=1_000_000,
        description="unused since schema version 14 (retention drops whole partitions); accepted so that "
                    "existing configurations still start")
    partition_seconds: float = Field(
        DAY, ge=1, le=366 * DAY,
        description="about how much time one history partition of outbox.events covers (sized from the "
                    "transaction rate; retention drops whole partitions, so this is its granularity)")

    @field_validator("kafka_sink")
    @classmethod
    def _kafka_sink(cls, value: str) -> str:
        if not SINK_NAME.match(value):
            raise ValueError(SINK_NAME_RULE)
        return value

    @field_validator("default_topic")
    @classmethod
    def _topic(cls, value: str | None) -> str | None:
        if value is not None and (not TOPIC_NAME.match(value) or value in (".", "..")):
            raise ValueError('a Kafka topic name is 1-249 characters of A-Z a-z 0-9 . _ - and not "." or ".."')
        return value

    @field_validator("kafka_debezium_topic")
    @classmethod
    def _debezium_topic(cls, value: str) -> str:
        made = value.replace(ROUTED_BY_VALUE, "x")
        if not TOPIC_NAME.match(made) or made in (".", ".."):
            raise ValueError(f"expected a Kafka topic name in which {ROUTED_BY_VALUE} stands for the routed value "
                             "(A-Z a-z 0-9 . _ -)")
        return value

    @field_validator("projections")
    @classmethod
    def _module(cls, value: str | None) -> str | None:
        if value is not None and not MODULE_SPEC.match(value):
            raise ValueError("expected a module path (a.b.c) or module:attribute")
        return value

    @field_validator("projection", mode="before")
    @classmethod
    def _projection_names(cls, value: Any) -> Any:
        if isinstance(value, str):
            return [name.strip() for name in value.split(",") if name.strip()]
        return value

    @field_validator("projection")
    @classmethod
    def _projection_sinks(cls, value: list[str]) -> list[str]:
        for name in value:
            if not SINK_NAME.match(name):
                raise ValueError(f"{name[:64]!r} is not a projection name (a-z 0-9 _, starting with a letter)")
        return value

    @field_validator("sink", mode="before")
    @classmethod
    def _sink_specs(cls, value: Any) -> Any:
        if isinstance(value, str):
            value = [value]
        if isinstance(value, list | tuple):
            return [spec for item in value for spec in re.split(r"[\s,]+", str(item)) if spec]
        return value

    @field_validator("sink")
    @classmethod
    def _sink_spec(cls, value: list[str]) -> list[str]:
        for spec in value:
            if not MODULE_SPEC.match(spec) or ":" not in spec:
                raise ValueError(f"{spec[:100]!r} is not MODULE:ATTR (e.g. myapp.sinks:audit)")
        if len(set(value)) != len(value):
            raise ValueError(f"a sink is named twice: {value}")
        return value

    @model_validator(mode="after")
    def _consistent(self) -> RelaySettings:
        if self.kafka_config_file is not None:
            self.kafka_config = {**read_kafka_config_file(self.kafka_config_file), **self.kafka_config}
        remember_kafka_secrets(self.kafka_config)
        if self.heartbeat_seconds * 2 > self.worker_ttl_seconds:
            raise ValueError("worker_ttl_seconds must be at least twice heartbeat_seconds")
        if self.projection and not self.projections:
            raise ValueError("--projection needs --projections (the module that declares them)")
        if len(set(self.projection)) != len(self.projection):
            raise ValueError(f"a projection is named twice: {self.projection}")
        return self

    @property
    def sinks(self) -> list[str]:
        brokers = [(self.webhook_url, self.webhook_sink), (self.nats_url, self.nats_sink),
                   (self.redis_url, self.redis_sink), (self.rabbitmq_url, self.rabbitmq_sink),
                   (self.sqs_url, self.sqs_sink)]
        return (([self.kafka_sink] if self.kafka else []) + list(self.projection)
                + [name for url, name in brokers if url])

    def require_kafka(self) -> str:
        """The bootstrap servers, or ConfigurationError saying how to give them."""
        if not self.kafka_bootstrap_servers:
            raise ConfigurationError(
                f"Kafka is on but no bootstrap servers are given: pass {flag('kafka_bootstrap_servers')} "
                f"HOST:PORT[,HOST:PORT...] or set {env_var('kafka_bootstrap_servers')} (or --no-kafka for a "
                "relay of projections only)")
        return self.kafka_bootstrap_servers

    def kafka_producer_config(self) -> dict[str, Any]:
        return {"bootstrap.servers": self.require_kafka(), **self.kafka_config}



def flag(name: str) -> str:
    """The command-line option of a setting."""
    return {"kafka_config": "--kafka-option"}.get(name, "--" + name.replace("_", "-"))


def env_var(name: str) -> str:
    return f"{ENV_PREFIX}{name.upper()}"


def describe_validation_error(exc: ValidationError) -> str:
    """Each problem with the option and variable it came from; never the value given."""
    problems = []
    for error in exc.errors(include_input=False, include_url=False):
        message = str(error["msg"]).removeprefix("Value error, ")
        loc = [str(part) for part in error["loc"]]
        if not loc:
            problems.append(message)
        elif loc == ["dsn"] and error["type"] == "missing":
            problems.append(NO_DSN)
        elif loc[0] == "kafka_config" and len(loc) > 1:
            problems.append(f"Kafka option {loc[1]} ({flag(loc[0])}, {env_var(loc[0])}): {message}")
        else:
            name = loc[0]
            where = f" ({flag(name)}, {env_var(name)})" if name in RelaySettings.model_fields else ""
            if name in RelaySettings.model_fields and environment_only(RelaySettings.model_fields[name]):
                where = f" ({env_var(name)})"
            problems.append(f"{name}{where}: {message}")
    return "; ".join(problems)


def listed_fields() -> dict[str, FieldInfo]:
    """``RelaySettings``' fields in the order ``run --help`` and docs/configuration.md list them: the relay's
    own as declared, each base's group after the option it belongs with (pydantic puts base fields first)."""
    fields = RelaySettings.model_fields
    sink_fields = (WebhookFields, NatsFields, RedisFields, RabbitMQFields, SqsFields)
    groups = {"sink": {name: f for cls in sink_fields for name, f in cls.model_fields.items()},
              "housekeeping_seconds": AttemptSettings.model_fields}
    inherited = {name for group in groups.values() for name in group}
    listed: dict[str, FieldInfo] = {}
    for name, field in fields.items():
        if name in inherited:
            continue
        listed[name] = field
        for base_name in groups.get(name, ()):
            listed[base_name] = fields[base_name]
    return listed


def load_settings(**overrides: Any) -> RelaySettings:
    try:
        return RelaySettings(**{k: v for k, v in overrides.items() if v is not None})
    except ValidationError as exc:
        raise ConfigurationError(f"invalid settings: {describe_validation_error(exc)}") from None
    except ValueError as exc:  # pydantic-settings: a variable it could not decode (it names the field only)
        raise ConfigurationError(str(exc)) from None


__all__ = ["DAY", "ENV_PREFIX", "KAFKA_OPTIONS_HELP", "MODULE_SPEC", "NO_DSN", "SINK_NAME", "TOPIC_NAME", "Dsn",
           "KafkaOptions", "RelaySettings", "WebhookSettings", "bounds", "default_text", "default_worker_id",
           "describe_validation_error", "env_var", "flag", "listed_fields", "load_settings", "read_kafka_config_file"]
