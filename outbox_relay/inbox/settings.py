"""The inbox consumer's settings in one model; every field is also read from ``OUTBOX_INBOX_<FIELD>``, and
the ones the relay has too (the database, the Kafka brokers and options) from the relay's variable as well
(``OUTBOX_DSN``, ...: the inbox's own wins)."""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

from pydantic import AliasChoices, Field, ValidationError, field_validator, model_validator
from pydantic_settings import NoDecode, SettingsConfigDict

from ..dsn import remember_kafka_secrets
from ..errors import ConfigurationError
from ..settings import env_var as relay_env_var
from ..settings_base import (
    KAFKA_OPTIONS_HELP,
    MODULE_SPEC,
    TOPIC_NAME,
    AttemptSettings,
    BackoffBase,
    BackoffMax,
    BatchSize,
    Dsn,
    HandlerTimeout,
    KafkaOptions,
    LeaseSeconds,
    MaxAttempts,
    default_worker_id,
)

ENV_PREFIX = "OUTBOX_INBOX_"
CONSUMER_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.:-]{0,199}\Z")  # the members table's CHECK
# Settings the relay has too, by the relay's name: also read from its variable, after the inbox's own.
SHARED = {"dsn": "dsn", "bootstrap_servers": "kafka_bootstrap_servers", "kafka_config": "kafka_config"}


def env_vars(name: str) -> list[str]:
    """The environment variables a setting is read from, the first one set winning."""
    own = f"{ENV_PREFIX}{name.upper()}"
    return [own, relay_env_var(SHARED[name])] if name in SHARED else [own]


def env_var(name: str) -> str:
    """The variables of a setting as ``--help`` and errors name them."""
    return " or ".join(env_vars(name))


def _shared(name: str) -> AliasChoices:
    return AliasChoices(*env_vars(name))


class InboxSettings(AttemptSettings):
    # validate_by_name: InboxSettings(dsn=...) from code and the CLI; the aliases are the variables.
    model_config = SettingsConfigDict(env_prefix=ENV_PREFIX, extra="forbid", validate_by_name=True,
                                      validate_by_alias=True)

    # AttemptSettings with the inbox's defaults (a handler's message is one small transaction)
    max_attempts: MaxAttempts = 5
    backoff_base_seconds: BackoffBase = 0.5
    backoff_max_seconds: BackoffMax = 30.0
    handler_timeout_seconds: HandlerTimeout = 60.0
    batch_size: BatchSize = 100
    lease_seconds: LeaseSeconds = 10.0

    dsn: Dsn = Field(description="PostgreSQL connection string of the consuming service's database",
                     validation_alias=_shared("dsn"))
    bootstrap_servers: str = Field(min_length=1, max_length=4096, validation_alias=_shared("bootstrap_servers"),
                                   description="Kafka bootstrap servers, HOST:PORT[,...]")
    topics: Annotated[list[str], NoDecode] = Field(min_length=1, description="topics to consume (comma-separated)")
    handler: str | None = Field(None, description="the handler, MODULE:ATTR: called as handler(message, connection) "
                                                  "inside the message's transaction")
    consumer: str = Field("inbox", description="the consumer's name: its positions, dedupe records and dead letters "
                                               "(like a consumer group id)")
    member_id: str = Field(default_factory=default_worker_id, min_length=1, max_length=200,
                           description="unique per process")
    kafka_config: KafkaOptions = Field(default_factory=dict, validation_alias=_shared("kafka_config"),
                                       description="extra librdkafka settings (passed through); " + KAFKA_OPTIONS_HELP)
    start: Literal["earliest", "latest"] = Field(
        "earliest", description="where a partition nothing was applied from yet starts")
    verify_seconds: float = Field(
        10.0, gt=0, le=3600,
        description="how long a claimed partition waits for its last applied message to be fetched again before it "
                    "reads its log from the start (the broker lost it: dedupe by ce_id skips what was applied)")
    retention_seconds: float = Field(7 * 86400.0, ge=60, le=3650 * 86400.0,
                                     description="keep dedupe records this long (longer than any redelivery or replay)")
    retention_batch: int = Field(5000, ge=1, le=1_000_000, description="dedupe records deleted per transaction")
    housekeeping_seconds: float = Field(300.0, ge=1, le=86400, description="between retention passes")
    poll_seconds: float = Field(0.1, ge=0.01, le=10, description="longest wait for a message per loop")
    metrics_port: int | None = Field(
        None, ge=1, le=65535,
        description="serve /metrics (Prometheus), /healthz and /readyz on this port (off when unset)")
    metrics_host: str = Field("0.0.0.0", min_length=1, max_length=255,
                              description="address the metrics port listens on")

    @field_validator("topics", mode="before")
    @classmethod
    def _split(cls, value: Any) -> Any:
        if isinstance(value, str):
            return [t.strip() for t in value.split(",") if t.strip()]
        if isinstance(value, list | tuple):
            return [t.strip() for item in value for t in str(item).split(",") if t.strip()]
        return value

    @field_validator("topics")
    @classmethod
    def _topics(cls, value: list[str]) -> list[str]:
        for t in value:
            if not TOPIC_NAME.match(t) or t in (".", ".."):
                raise ValueError(f"{t[:100]!r} is not a Kafka topic name (1-249 characters of A-Z a-z 0-9 . _ -)")
        return list(dict.fromkeys(value))

    @field_validator("handler")
    @classmethod
    def _handler(cls, value: str | None) -> str | None:
        if value is not None and not (MODULE_SPEC.match(value) and ":" in value):
            raise ValueError("expected MODULE:ATTR, e.g. myservice.inbox:apply")
        return value

    @field_validator("consumer")
    @classmethod
    def _consumer(cls, value: str) -> str:
        if not CONSUMER_NAME.match(value):
            raise ValueError("a consumer name is 1-200 characters of A-Z a-z 0-9 _ . : - and starts with a letter "
                             "or digit")
        return value

    @model_validator(mode="after")
    def _consistent(self) -> InboxSettings:
        remember_kafka_secrets(self.kafka_config)
        return self

    def consumer_config(self) -> dict[str, Any]:
        """librdkafka settings: assign() only (no group join; positions live in PostgreSQL)."""
        return {
            "bootstrap.servers": self.bootstrap_servers,
            # Required by the client, never joined: partitions are assigned from PostgreSQL leases.
            "group.id": f"outbox-inbox-{self.consumer}",
            "enable.auto.commit": False,
            "enable.auto.offset.store": False,
            "enable.partition.eof": False,
            # A position past the log's end (a broker that lost its log, on a broker that says so):
            # read from the start; the ce_id records skip what was applied.
            "auto.offset.reset": "earliest",
            **self.kafka_config,
        }


def flag(name: str) -> str:
    """The command-line option of a setting."""
    return {"topics": "--topic", "kafka_config": "--kafka-option"}.get(name, "--" + name.replace("_", "-"))


_ALIASES = {alias: name for name in SHARED for alias in env_vars(name)}  # a missing value's loc is its first


def load_inbox_settings(**values: Any) -> InboxSettings:
    """Settings from keyword arguments (None: not given) and the environment; ConfigurationError names the
    option and its variable, never the value."""
    try:
        return InboxSettings(**{k: v for k, v in values.items() if v is not None})
    except ValidationError as exc:
        problems = []
        for error in exc.errors(include_input=False, include_url=False):
            message = str(error["msg"]).removeprefix("Value error, ")
            loc = [str(p) for p in error["loc"]]
            name = _ALIASES.get(loc[0], loc[0]) if loc else ""
            if name == "dsn" and error["type"] == "missing":
                problems.append(f"no database given: pass --dsn or set {env_var('dsn')}")
            elif name in InboxSettings.model_fields:
                problems.append(f"{name} ({flag(name)}, {env_var(name)}): {message}")
            else:
                problems.append(message)
        raise ConfigurationError(f"invalid inbox settings: {'; '.join(problems)}") from None
    except ValueError as exc:
        raise ConfigurationError(str(exc)) from None
