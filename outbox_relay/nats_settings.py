"""The NATS JetStream sink's settings (outbox_relay.sinks.nats): :class:`NatsFields`, which ``RelaySettings``
extends (``outbox-relay run --nats-url ...``), and :class:`NatsSettings`, the same alone
(``--sink outbox_relay.sinks.nats:from_env``). Every field is read from ``OUTBOX_NATS_<FIELD>``."""

from __future__ import annotations

from pathlib import Path

from pydantic import Field, SecretStr, field_validator, model_validator
from pydantic_settings import SettingsConfigDict

from .broker_settings import SinkOptions, as_value_error, check_topic, checked, remembered
from .settings_base import ENVIRONMENT_ONLY, NameList, SettingsBase

NATS = SinkOptions("nats", "NATS", label="nats", peer="server")


class NatsFields(SettingsBase):
    """The NATS sink's settings, on when ``nats_url`` is set."""

    nats_url: str | None = NATS.url(
        "publish every event to JetStream on these servers, nats://host:4222 or tls://host:4222 "
        "(comma-separated; turns the NATS sink on; a password in it is masked in logs, better "
        "--nats-password-file; see docs/nats.md)")
    nats_sink: str = NATS.sink()
    nats_subject_prefix: str = Field(
        default="outbox", min_length=1, max_length=255,
        description="nats: an event goes to subject PREFIX.TOPIC.KEY (the key escaped into one token); a stream "
                    "must take PREFIX.>")
    nats_stream: str | None = Field(
        default=None, min_length=1, max_length=255,
        description="nats: the stream the messages must land in (Nats-Expected-Stream; another one holds the events); "
                    "none: whichever stream takes the subject")
    nats_concurrency: int = NATS.concurrency(16, "published")
    nats_topics: NameList = NATS.topics()
    nats_ack_timeout_seconds: float = Field(
        default=5.0, ge=0.01, le=3600,
        description="nats: seconds to wait for the stream's PubAck; none in time: the server counts as unavailable "
                    "(the event waits, no attempt counted)")
    nats_connect_timeout_seconds: float = NATS.connect_timeout()
    nats_user: str | None = Field(default=None, min_length=1, max_length=1000, description="nats: user name")
    nats_password: SecretStr | None = Field(
        default=None, json_schema_extra=ENVIRONMENT_ONLY,
        description="nats: the user's password (environment only, or --nats-password-file; never logged)")
    nats_password_file: Path | None = Field(
        default=None, description="nats: read the password from this file (one trailing newline dropped)")
    nats_token: SecretStr | None = Field(
        default=None, json_schema_extra=ENVIRONMENT_ONLY,
        description="nats: an authentication token (environment only, or --nats-token-file; never logged)")
    nats_token_file: Path | None = Field(default=None, description="nats: read the token from this file")
    nats_creds_file: Path | None = Field(
        default=None, description="nats: a .creds file (user JWT and nkey seed, decentralized auth)")
    nats_nkey_seed_file: Path | None = Field(default=None, description="nats: a file holding an nkey seed")
    nats_ca_file: Path | None = NATS.ca_file(" instead of the system's")
    nats_client_cert: Path | None = NATS.client_cert()
    nats_client_key: Path | None = NATS.client_key()
    nats_tls_verify: bool = NATS.tls_verify()

    @field_validator("nats_url")
    @classmethod
    def _nats_url(cls, value: str | None) -> str | None:
        from .sinks.nats.connection import check_url  # the sink's own check (no client library needed)

        return checked(check_url, value)  # check_url remembers its password or token for redaction first

    @field_validator("nats_password", "nats_token")
    @classmethod
    def _nats_secret(cls, value: SecretStr | None) -> SecretStr | None:
        return remembered(value)

    @field_validator("nats_subject_prefix")
    @classmethod
    def _nats_prefix(cls, value: str) -> str:
        from .sinks.nats.subjects import check_prefix

        with as_value_error():
            value = check_prefix(value)
        return value

    @field_validator("nats_topics")
    @classmethod
    def _nats_topics(cls, value: list[str]) -> list[str]:
        from .sinks.nats.subjects import topic_problem

        for topic in value:
            check_topic(topic)
            if problem := topic_problem(topic):
                raise ValueError(problem)
        return value

    @model_validator(mode="after")
    def _nats(self) -> NatsFields:
        NATS.check_sink_name(self)
        NATS.check_once(self, "password")
        NATS.check_once(self, "token")
        if self.nats_url is None:
            return self
        from .sinks.nats.connection import read_secret

        for name in ("password", "token"):
            path = getattr(self, f"nats_{name}_file")
            if path is not None:
                with as_value_error():
                    read_secret(path, name)  # at start-up, and remembered for redaction
        if (self.nats_password is not None or self.nats_password_file is not None) and self.nats_user is None:
            raise ValueError("a NATS password needs --nats-user")
        NATS.check_client_key(self)
        return self


class NatsSettings(NatsFields):
    """The NATS sink's settings alone, from ``OUTBOX_NATS_*`` (and ``OUTBOX_SOURCE``, ``OUTBOX_DEFAULT_TOPIC``)."""

    model_config = SettingsConfigDict(extra="ignore")

    source: str = Field(default="outbox-relay", min_length=1, max_length=1000,
                        description="CloudEvents source attribute")
    default_topic: str | None = Field(default=None, description="topic for events published without one")


__all__ = ["NatsFields", "NatsSettings"]
