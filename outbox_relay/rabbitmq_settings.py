"""The RabbitMQ sink's settings (outbox_relay.sinks.rabbitmq): :class:`RabbitMQFields`, which ``RelaySettings``
extends (``outbox-relay run --rabbitmq-url ...``), and :class:`RabbitMQSettings`, the same alone
(``--sink outbox_relay.sinks.rabbitmq:from_env``). Every field is read from ``OUTBOX_RABBITMQ_<FIELD>``."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field, SecretStr, field_validator, model_validator
from pydantic_settings import SettingsConfigDict

from .broker_settings import SinkOptions, as_value_error, checked, remembered
from .settings_base import ENVIRONMENT_ONLY, TOPIC_NAME, NameList, SettingsBase

ExchangeType = Literal["direct", "topic", "fanout", "headers", "x-consistent-hash"]
RABBITMQ = SinkOptions("rabbitmq", "RabbitMQ", label="rabbitmq", peer="broker")


class RabbitMQFields(SettingsBase):
    """The RabbitMQ sink's settings, on when ``rabbitmq_url`` is set."""

    rabbitmq_url: str | None = RABBITMQ.url(
        "publish every event to this broker, amqp[s]://user@host:port/vhost (turns the RabbitMQ sink on; "
        "a password in it is masked in logs, better --rabbitmq-password-file; see docs/rabbitmq.md)")
    rabbitmq_sink: str = RABBITMQ.sink()
    rabbitmq_password: SecretStr | None = Field(
        default=None, json_schema_extra=ENVIRONMENT_ONLY,
        description="the RabbitMQ password, instead of the URL's (environment only, or --rabbitmq-password-file; "
                    "never logged)")
    rabbitmq_password_file: Path | None = Field(
        default=None, description="read the RabbitMQ password from this file (one trailing newline dropped)")
    rabbitmq_concurrency: int = RABBITMQ.concurrency(4, "published", ", one connection each")
    rabbitmq_topics: NameList = RABBITMQ.topics()
    rabbitmq_default_exchange: str | None = Field(
        default=None, min_length=1, max_length=249,
        description="rabbitmq: exchange of the events published without a topic (an event's topic is its exchange)")
    rabbitmq_declare_exchange: ExchangeType | None = Field(
        default=None,
        description="rabbitmq: declare each exchange (durable) of this type if it is missing; none: declare nothing "
                    "(a missing exchange holds its events until it exists)")
    rabbitmq_queues: NameList = Field(
        default_factory=list,
        description="rabbitmq: queues bound to the sink's exchanges, which `outbox-relay verify` reads back (their "
                    "messages are read and requeued; comma-separated)")
    rabbitmq_max_message_bytes: int = Field(
        default=128 * 1024 * 1024, ge=1, le=512 * 1024 * 1024,
        description="rabbitmq: dead-letter a message larger than this without sending it (the broker's "
                    "max_message_size)")
    rabbitmq_heartbeat_seconds: int = Field(
        default=15, ge=0, le=600,
        description="rabbitmq: AMQP heartbeat (a broker silent about twice this long counts as lost; 0: off)")
    rabbitmq_connect_timeout_seconds: float = RABBITMQ.connect_timeout()
    rabbitmq_blocked_timeout_seconds: float = Field(
        default=60.0, ge=1, le=3600,
        description="rabbitmq: drop a connection the broker blocked this long (a memory or disk alarm); its events "
                    "wait")
    rabbitmq_unavailable_seconds: float = RABBITMQ.unavailable(
        "wait this long before trying again after the broker was unreachable, returned a message unroutable or "
        "refused it (nack); the events wait meanwhile")
    rabbitmq_ca_file: Path | None = RABBITMQ.ca_file(", amqps:// only")
    rabbitmq_client_cert: Path | None = RABBITMQ.client_cert(" (EXTERNAL auth if no password)")
    rabbitmq_client_key: Path | None = RABBITMQ.client_key()
    rabbitmq_tls_verify: bool = RABBITMQ.tls_verify()

    @field_validator("rabbitmq_url")
    @classmethod
    def _rabbitmq_url(cls, value: str | None) -> str | None:
        from .sinks.rabbitmq.connection import check_url  # the sink's own check (no client library needed)

        return checked(check_url, value)  # check_url remembers its password for redaction first

    @field_validator("rabbitmq_password")
    @classmethod
    def _rabbitmq_password(cls, value: SecretStr | None) -> SecretStr | None:
        return remembered(value)

    @field_validator("rabbitmq_topics", "rabbitmq_queues")
    @classmethod
    def _rabbitmq_names(cls, value: list[str]) -> list[str]:
        from .sinks.rabbitmq.connection import check_name

        for name in value:
            with as_value_error():
                check_name(name, "name")
        return value

    @field_validator("rabbitmq_default_exchange")
    @classmethod
    def _rabbitmq_exchange(cls, value: str | None) -> str | None:
        if value is not None and not TOPIC_NAME.match(value):
            raise ValueError(f"{value[:64]!r} is not an exchange name the sink publishes to (1-249 characters of "
                             "A-Z a-z 0-9 . _ -, as topics)")
        return value

    @model_validator(mode="after")
    def _rabbitmq(self) -> RabbitMQFields:
        RABBITMQ.check_sink_name(self)
        RABBITMQ.check_once(self, "password")
        if self.rabbitmq_url is None:
            return self
        if self.rabbitmq_password_file is not None:
            from .sinks.rabbitmq.connection import read_password

            with as_value_error():
                read_password(self.rabbitmq_password_file)  # at start-up, and remembered for redaction
        RABBITMQ.check_tls(self, self.rabbitmq_url.strip().lower().startswith("amqps:"), "an amqps:// URL")
        return self


class RabbitMQSettings(RabbitMQFields):
    """The RabbitMQ sink's settings alone, from ``OUTBOX_RABBITMQ_*`` (and ``OUTBOX_SOURCE``)."""

    model_config = SettingsConfigDict(extra="ignore")

    source: str = Field(default="outbox-relay", min_length=1, max_length=1000,
                        description="CloudEvents source attribute")
