"""The Redis Streams sink's settings (outbox_relay.sinks.redis): :class:`RedisFields`, which ``RelaySettings``
extends (``outbox-relay run --redis-url ...``). Every field is read from ``OUTBOX_REDIS_<FIELD>``."""

from __future__ import annotations

from pathlib import Path

from pydantic import Field, SecretStr, field_validator, model_validator

from .errors import ConfigurationError
from .settings_base import SINK_NAME, TOPIC_NAME, NameList, SettingsBase

MAX_ENTRY_BYTES = 512 * 1024 * 1024  # Redis's largest proto-max-bulk-len default



class RedisFields(SettingsBase):
    """The Redis Streams sink's settings, on when ``redis_url`` is set."""

    redis_url: SecretStr | None = Field(
        default=None, min_length=1, max_length=4096,
        description="XADD every event to Redis Streams at this redis:// or rediss:// (TLS) URL, "
                    "redis://[user:password@]host:port/db (turns the Redis sink on; the password is never logged; "
                    "see docs/redis.md)")
    redis_sink: str = Field(
        default="redis", min_length=1, max_length=63, description="sink name of the Redis delivery (its own cursors)")
    redis_stream_prefix: str = Field(
        default="", max_length=200,
        description="Redis: an event goes to the stream named this prefix + its topic (or --default-topic)")
    redis_maxlen: int | None = Field(
        default=None, ge=1, le=10**15,
        description="Redis: trim each stream to about this many entries (XADD MAXLEN ~); trimming drops entries "
                    "whether consumers read them or not; none: no trimming")
    redis_concurrency: int = Field(
        default=4, ge=1, le=256, description="Redis: keys delivered at once (each key stays in order)")
    redis_topics: NameList = Field(
        default_factory=list, description="Redis: only events of these topics (comma-separated; none: all)")
    redis_password_file: Path | None = Field(
        default=None, description="Redis: read the password from this file (instead of the URL's)")
    redis_timeout_seconds: float = Field(
        default=5.0, ge=0.01, le=3600,
        description="Redis: seconds to connect, and to wait for an XADD's reply, before the server counts as down")
    redis_max_entry_bytes: int = Field(
        default=MAX_ENTRY_BYTES, ge=1, le=MAX_ENTRY_BYTES,
        description="Redis: an event whose entry is larger is dead-lettered at once (set it to the server's "
                    "proto-max-bulk-len)")
    redis_ca_file: Path | None = Field(
        default=None, description="Redis: trust the server's certificate from this CA file (PEM), rediss:// only")
    redis_client_cert: Path | None = Field(
        default=None, description="Redis: client certificate (PEM) for mutual TLS")
    redis_client_key: Path | None = Field(
        default=None, description="Redis: the client certificate's private key (PEM), if not in the certificate file")
    redis_tls_verify: bool = Field(
        default=True, description="Redis: verify the server's TLS certificate (turn off only for tests)")

    @field_validator("redis_url")
    @classmethod
    def _redis_url(cls, value: SecretStr | None) -> SecretStr | None:
        if value is not None:
            from .sinks.redis.connection import check_url  # no redis-py needed

            try:
                check_url(value.get_secret_value())  # remembers its password for redaction first
            except ConfigurationError as exc:
                raise ValueError(str(exc)) from None
        return value

    @field_validator("redis_topics")
    @classmethod
    def _redis_topics(cls, value: list[str]) -> list[str]:
        for topic in value:
            if not TOPIC_NAME.match(topic):
                raise ValueError(f"{topic[:64]!r} is not a topic name (1-249 characters of A-Z a-z 0-9 . _ -)")
        return value

    @field_validator("redis_stream_prefix")
    @classmethod
    def _redis_prefix(cls, value: str) -> str:
        from .sinks.redis.message import PREFIX

        if not PREFIX.match(value):
            raise ValueError("a stream prefix is printable ASCII with no spaces (e.g. outbox:)")
        return value

    @model_validator(mode="after")
    def _redis(self) -> RedisFields:
        if not SINK_NAME.match(self.redis_sink):
            raise ValueError("redis_sink: a sink name is 1-63 characters of a-z 0-9 _ . : - and starts with a "
                             "letter or digit")
        if self.redis_url is None:
            return self
        from .sinks.redis.connection import check_url, read_password

        target = check_url(self.redis_url.get_secret_value())
        if target.password is not None and self.redis_password_file is not None:
            raise ValueError("give the Redis password once: in the URL or --redis-password-file, not both")
        if self.redis_password_file is not None:
            try:
                read_password(self.redis_password_file)  # at start-up, and remembered for redaction
            except ConfigurationError as exc:
                raise ValueError(str(exc)) from None
        tls = self.redis_ca_file or self.redis_client_cert or self.redis_client_key or not self.redis_tls_verify
        if not target.tls and tls:
            raise ValueError("Redis TLS settings (CA file, client certificate, verify off) need a rediss:// URL")
        if self.redis_client_key is not None and self.redis_client_cert is None:
            raise ValueError("--redis-client-key needs --redis-client-cert")
        return self
