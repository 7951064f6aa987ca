"""The Redis Streams sink's settings (outbox_relay.sinks.redis): :class:`RedisFields`, which ``RelaySettings``
extends (``outbox-relay run --redis-url ...``). Every field is read from ``OUTBOX_REDIS_<FIELD>``."""

from __future__ import annotations

from pathlib import Path

from pydantic import Field, SecretStr, field_validator, model_validator

from .broker_settings import SinkOptions, as_value_error, check_topics, checked
from .settings_base import NameList, SettingsBase

MAX_ENTRY_BYTES = 512 * 1024 * 1024  # Redis's largest proto-max-bulk-len default
REDIS = SinkOptions("redis", "Redis", label="Redis", peer="server")


class RedisFields(SettingsBase):
    """The Redis Streams sink's settings, on when ``redis_url`` is set."""

    redis_url: SecretStr | None = REDIS.url(
        "XADD every event to Redis Streams at this redis:// or rediss:// (TLS) URL, "
        "redis://[user:password@]host:port/db (turns the Redis sink on; the password is never logged; "
        "see docs/redis.md)")
    redis_sink: str = REDIS.sink()
    redis_stream_prefix: str = Field(
        default="", max_length=200,
        description="Redis: an event goes to the stream named this prefix + its topic (or --default-topic)")
    redis_maxlen: int | None = Field(
        default=None, ge=1, le=10**15,
        description="Redis: trim each stream to about this many entries (XADD MAXLEN ~); trimming drops entries "
                    "whether consumers read them or not; none: no trimming")
    redis_concurrency: int = REDIS.concurrency(64, note=" (their events sent in one pipeline)")
    redis_topics: NameList = REDIS.topics()
    redis_password_file: Path | None = Field(
        default=None, description="Redis: read the password from this file (instead of the URL's)")
    redis_timeout_seconds: float = Field(
        default=5.0, ge=0.01, le=3600,
        description="Redis: seconds to connect, and to wait for an XADD's reply, before the server counts as down")
    redis_max_entry_bytes: int = Field(
        default=MAX_ENTRY_BYTES, ge=1, le=MAX_ENTRY_BYTES,
        description="Redis: an event whose entry is larger is dead-lettered at once (set it to the server's "
                    "proto-max-bulk-len)")
    redis_ca_file: Path | None = REDIS.ca_file(", rediss:// only")
    redis_client_cert: Path | None = REDIS.client_cert()
    redis_client_key: Path | None = REDIS.client_key()
    redis_tls_verify: bool = REDIS.tls_verify()

    @field_validator("redis_url")
    @classmethod
    def _redis_url(cls, value: SecretStr | None) -> SecretStr | None:
        from .sinks.redis.connection import check_url  # no redis-py needed

        # check_url remembers its password for redaction first
        return checked(lambda url: check_url(url.get_secret_value()), value)

    @field_validator("redis_topics")
    @classmethod
    def _redis_topics(cls, value: list[str]) -> list[str]:
        return check_topics(value)

    @field_validator("redis_stream_prefix")
    @classmethod
    def _redis_prefix(cls, value: str) -> str:
        from .sinks.redis.message import PREFIX

        if not PREFIX.match(value):
            raise ValueError("a stream prefix is printable ASCII with no spaces (e.g. outbox:)")
        return value

    @model_validator(mode="after")
    def _redis(self) -> RedisFields:
        REDIS.check_sink_name(self)
        if self.redis_url is None:
            return self
        from .sinks.redis.connection import check_url, read_password

        target = check_url(self.redis_url.get_secret_value())
        if target.password is not None and self.redis_password_file is not None:
            raise ValueError("give the Redis password once: in the URL or --redis-password-file, not both")
        if self.redis_password_file is not None:
            with as_value_error():
                read_password(self.redis_password_file)  # at start-up, and remembered for redaction
        REDIS.check_tls(self, target.tls, "a rediss:// URL")
        return self
