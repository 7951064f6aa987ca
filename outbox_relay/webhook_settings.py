"""The webhook sink's settings (outbox_relay.webhook): :class:`WebhookFields`, which ``RelaySettings``
extends (``outbox-relay run --webhook-url ...``), and :class:`WebhookSettings`, the same alone
(``--sink outbox_relay.webhook:from_env``). Every field is read from ``OUTBOX_WEBHOOK_<FIELD>``."""

from __future__ import annotations

from pathlib import Path

from pydantic import Field, SecretStr, field_validator, model_validator
from pydantic_settings import SettingsConfigDict

from .errors import ConfigurationError
from .settings_base import ENVIRONMENT_ONLY, SINK_NAME, TOPIC_NAME, NameList, SettingsBase


class WebhookFields(SettingsBase):
    """The webhook sink's settings, on when ``webhook_url`` is set."""

    source: str = Field(
        default="outbox-relay", min_length=1, max_length=1000,
                        description="CloudEvents ce_source header value")
    webhook_url: str | None = Field(
        default=None, min_length=1, max_length=4096,
        description="POST every event to this http(s) URL, signed (turns the webhook sink on; see docs/webhooks.md)")
    webhook_sink: str = Field(
        default="webhook", min_length=1, max_length=63,
                              description="sink name of the webhook delivery (its own cursors)")
    webhook_secret: SecretStr | None = Field(
        default=None, json_schema_extra=ENVIRONMENT_ONLY,
        description="the webhook signing secret, whsec_<base64> (environment only, or --webhook-secret-file; "
                          "never logged)")
    webhook_secret_file: Path | None = Field(
        default=None, description="read the webhook signing secret (whsec_<base64>) from this file")
    webhook_connect_timeout_seconds: float = Field(
        default=5.0, ge=0.01, le=600,
        description="webhook: seconds to connect (TCP and TLS) before the receiver counts as down")
    webhook_timeout_seconds: float = Field(
        default=30.0, ge=0.01, le=3600,
        description="webhook: seconds to wait for the whole response (status, headers, body) before the attempt is "
                    "retried")
    webhook_concurrency: int = Field(
        default=4, ge=1, le=256, description="webhook: keys delivered at once (each key stays in order)")
    webhook_topics: NameList = Field(
        default_factory=list, description="webhook: only events of these topics (comma-separated; none: all)")
    webhook_ca_file: Path | None = Field(
        default=None,
        description="webhook: trust the receiver's certificate from this CA file (PEM) instead of the system's")
    webhook_client_cert: Path | None = Field(
        default=None, description="webhook: client certificate (PEM) for mutual TLS")
    webhook_client_key: Path | None = Field(
        default=None,
        description="webhook: the client certificate's private key (PEM), if not in the certificate file")
    webhook_tls_verify: bool = Field(
        default=True, description="webhook: verify the receiver's TLS certificate (turn off only for tests)")

    @field_validator("webhook_url")
    @classmethod
    def _url(cls, value: str | None) -> str | None:
        if value is not None:
            from .sinks.webhook import check_url  # the sink's own check (it imports this module)

            try:
                check_url(value)
            except ConfigurationError as exc:
                raise ValueError(str(exc)) from None
        return value

    @field_validator("webhook_secret")
    @classmethod
    def _secret(cls, value: SecretStr | None) -> SecretStr | None:
        if value is not None:
            from .sinks.webhook import WebhookSecret

            try:
                WebhookSecret(value.get_secret_value())  # remembers it for redaction first
            except ConfigurationError as exc:
                raise ValueError(str(exc)) from None
        return value

    @field_validator("webhook_topics")
    @classmethod
    def _topics(cls, value: list[str]) -> list[str]:
        for topic in value:
            if not TOPIC_NAME.match(topic):
                raise ValueError(f"{topic[:64]!r} is not a topic name (1-249 characters of A-Z a-z 0-9 . _ -)")
        return value

    @model_validator(mode="after")
    def _webhook(self) -> WebhookFields:
        if not SINK_NAME.match(self.webhook_sink):
            raise ValueError("webhook_sink: a sink name is 1-63 characters of a-z 0-9 _ . : - and starts with a "
                             "letter or digit")
        if self.webhook_url is None:
            return self
        if self.webhook_secret is not None and self.webhook_secret_file is not None:
            raise ValueError("give the webhook secret once: --webhook-secret-file or OUTBOX_WEBHOOK_SECRET, not both")
        if self.webhook_secret is None and self.webhook_secret_file is None:
            raise ValueError("the webhook sink needs a signing secret: pass --webhook-secret-file PATH or set "
                             "OUTBOX_WEBHOOK_SECRET (whsec_<base64>; make one with `python -m outbox_relay.webhook "
                             "secret`)")
        if self.webhook_secret_file is not None:
            from .sinks.webhook import WebhookSecret

            try:
                WebhookSecret.from_file(self.webhook_secret_file)  # at start-up, and remembered for redaction
            except ConfigurationError as exc:
                raise ValueError(str(exc)) from None
        https = self.webhook_url.strip().lower().startswith("https:")
        tls = self.webhook_ca_file or self.webhook_client_cert or self.webhook_client_key or not self.webhook_tls_verify
        if not https and tls:
            raise ValueError("webhook TLS settings (CA file, client certificate, verify off) need an https:// URL")
        if self.webhook_client_key is not None and self.webhook_client_cert is None:
            raise ValueError("--webhook-client-key needs --webhook-client-cert")
        return self


class WebhookSettings(WebhookFields):
    """The webhook sink's settings alone, from ``OUTBOX_WEBHOOK_*`` (and ``OUTBOX_SOURCE``)."""

    model_config = SettingsConfigDict(extra="ignore")
