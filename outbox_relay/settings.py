"""All relay settings in one model. Every field is also read from ``OUTBOX_<FIELD>``."""

from __future__ import annotations

import os
import socket
from typing import Annotated, Any

from pydantic import Field, SecretStr, field_validator, model_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

from .errors import ConfigurationError

ENV_PREFIX = "OUTBOX_"


def default_worker_id() -> str:
    return f"{socket.gethostname()}-{os.getpid()}"


class RelaySettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix=ENV_PREFIX, extra="forbid", validate_default=True)

    dsn: SecretStr = Field(SecretStr("postgresql:///postgres"), description="PostgreSQL connection string")
    worker_id: str = Field(default_factory=default_worker_id, description="unique per process (default host-pid)")

    # sinks
    kafka: bool = Field(True, description="deliver to Kafka")
    kafka_sink: str = Field("kafka", description="sink name of the Kafka delivery (its own cursors)")
    kafka_bootstrap_servers: str = Field("127.0.0.1:9092", description="Kafka bootstrap servers")
    kafka_config: dict[str, str] = Field(
        default_factory=dict,
        description="extra librdkafka settings as JSON, e.g. security.protocol, sasl.*, ssl.* (passed through)",
    )
    kafka_stall_seconds: float = Field(
        60.0, gt=0,
        description="recreate the Kafka producer after this long without a delivery report while messages are in "
                    "flight (e.g. a broker that forgot the producer id); unacknowledged messages are sent again",
    )
    default_topic: str | None = Field(None, description="topic for events published without one")
    projections: str | None = Field(
        None, description="module (or module:attribute) that declares the projections, e.g. myapp.read_models")
    projection: Annotated[list[str], NoDecode] = Field(
        default_factory=list, description="run this projection (repeatable; in the environment: comma-separated)")
    source: str = Field("outbox-relay", description="CloudEvents ce_source header value")

    # batching and leases
    batch_size: int = Field(1000, ge=1, le=100_000, description="events read per fetch")
    lease_seconds: float = Field(30.0, gt=0, description="bucket lease; renewed every third of it")
    heartbeat_seconds: float = Field(2.0, gt=0, description="registry heartbeat and ring refresh interval")
    worker_ttl_seconds: float = Field(10.0, gt=0, description="a worker silent this long leaves the ring")
    poll_seconds: float = Field(1.0, gt=0, description="idle poll interval (LISTEN/NOTIFY wakes sooner)")
    listen: bool = Field(True, description="use LISTEN/NOTIFY to wake idle workers")
    housekeeping_seconds: float = Field(5.0, gt=0, description="housekeeping interval (one worker at a time)")
    vnodes: int = Field(64, ge=1, le=1024, description="virtual nodes per worker on the hash ring")

    # failures
    max_attempts: int = Field(10, ge=1, description="attempts before an event is dead-lettered")
    backoff_base_seconds: float = Field(1.0, gt=0, description="first retry delay")
    backoff_max_seconds: float = Field(600.0, gt=0, description="retry delay cap")
    max_lapses: int = Field(
        3, ge=1, description="leases lost with work pending before a bucket is delivered one event at a time")
    drain_seconds: float = Field(30.0, gt=0, description="SIGTERM: time to finish in-flight work before releasing")

    # history
    retention_seconds: float = Field(7 * 86400.0, ge=0, description="keep delivered events this long")
    retention_batch: int = Field(
        2_000, ge=1, description="events deleted per retention transaction (several per housekeeping pass)")

    @field_validator("projection", mode="before")
    @classmethod
    def _projection_names(cls, value: Any) -> Any:
        if isinstance(value, str):
            return [name.strip() for name in value.split(",") if name.strip()]
        return value

    @field_validator("worker_id")
    @classmethod
    def _worker_id(cls, value: str) -> str:
        if not value or len(value) > 200:
            raise ValueError("worker_id must be 1-200 characters")
        return value

    @model_validator(mode="after")
    def _consistent(self) -> RelaySettings:
        if self.heartbeat_seconds * 2 > self.worker_ttl_seconds:
            raise ValueError("worker_ttl_seconds must be at least twice heartbeat_seconds")
        if self.projection and not self.projections:
            raise ValueError("--projection needs --projections (the module that declares them)")
        if len(set(self.projection)) != len(self.projection):
            raise ValueError(f"a projection is named twice: {self.projection}")
        return self

    @property
    def sinks(self) -> list[str]:
        return ([self.kafka_sink] if self.kafka else []) + list(self.projection)

    def kafka_producer_config(self) -> dict[str, Any]:
        return {"bootstrap.servers": self.kafka_bootstrap_servers, **self.kafka_config}


def load_settings(**overrides: Any) -> RelaySettings:
    try:
        return RelaySettings(**{k: v for k, v in overrides.items() if v is not None})
    except ValueError as exc:
        raise ConfigurationError(str(exc)) from None
