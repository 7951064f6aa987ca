"""The webhook sink's settings (outbox_relay.webhook): :class:`WebhookFields`, which ``RelaySettings``
extends (``outbox-relay run --webhook-url ...``), and :class:`WebhookSettings`, the same alone
(``--sink outbox_relay.webhook:from_env``). Every field is read from ``OUTBOX_WEBHOOK_<FIELD>``."""

from __future__ import annotations

from pathlib import Path

from pydantic import Field, SecretStr, field_validator, model_validator
from pydantic_settings import SettingsConfigDict

from .broker_settings import SinkOptions, as_value_error, check_topics, checked
from .settings_base import ENVIRONMENT_ONLY, NameList, SettingsBase

WEBHOOK = SinkOptions("webhook", "webhook", label="webhook", peer="receiver")


class WebhookFields(SettingsBase):
    """The webhook sink's settings, on when ``webhook_url`` is set."""

    source: str = Field(
        default="outbox-relay", min_length=1, max_length=1000,
                        description="CloudEvents ce_source header value")
    webhook_url: str | None = WEBHOOK.url(
        "POST every event to this http(s) URL, signed (turns the webhook sink on; see docs/webhooks.md)")
    webhook_sink: str = WEBHOOK.sink()
    webhook_secret: SecretStr | None = Field(
        default=None, json_schema_extra=ENVIRONMENT_ONLY,
        description="the webhook signing secret, whsec_<base64> (environment only, or --webhook-secret-file; "
                          "never logged)")
    webhook_secret_file: Path | None = Field(
        default=None, description="read the webhook signing secret (whsec_<base64>) from this file")
    webhook_connect_timeout_seconds: float = WEBHOOK.connect_timeout(" (TCP and TLS)")
    webhook_timeout_seconds: float = Field(
        default=30.0, ge=0.01, le=3600,
        description="webhook: seconds to wait for the whole response (status, headers, body) before the attempt is "
                    "retried")
    webhook_concurrency: int = WEBHOOK.concurrency(4)
    webhook_topics: NameList = WEBHOOK.topics()
    webhook_ca_file: Path | None = WEBHOOK.ca_file(" instead of the system's")
    webhook_client_cert: Path | None = WEBHOOK.client_cert()
    webhook_client_key: Path | None = WEBHOOK.client_key()
    webhook_tls_verify: bool = WEBHOOK.tls_verify()

    @field_validator("webhook_url")
    @classmethod
    def _url(cls, value: str | None) -> str | None:
        from .sinks.webhook import check_url  # the sink's own check (it imports this module)

        return checked(check_url, value)

    @field_validator("webhook_secret")
    @classmethod
    def _secret(cls, value: SecretStr | None) -> SecretStr | None:
        from .sinks.webhook import WebhookSecret

        # WebhookSecret remembers it for redaction first
        return checked(lambda secret: WebhookSecret(secret.get_secret_value()), value)

    @field_validator("webhook_topics")
    @classmethod
    def _topics(cls, value: list[str]) -> list[str]:
        return check_topics(value)

    @model_validator(mode="after")
    def _webhook(self) -> WebhookFields:
        WEBHOOK.check_sink_name(self)
        if self.webhook_url is None:
            return self
        WEBHOOK.check_once(self, "secret")
        if self.webhook_secret is None and self.webhook_secret_file is None:
            raise ValueError("the webhook sink needs a signing secret: pass --webhook-secret-file PATH or set "
                             "OUTBOX_WEBHOOK_SECRET (whsec_<base64>; make one with `python -m outbox_relay.webhook "
                             "secret`)")
        if self.webhook_secret_file is not None:
            from .sinks.webhook import WebhookSecret

            with as_value_error():
                WebhookSecret.from_file(self.webhook_secret_file)  # at start-up, and remembered for redaction
        WEBHOOK.check_tls(self, self.webhook_url.strip().lower().startswith("https:"), "an https:// URL")
        return self


class WebhookSettings(WebhookFields):
    """The webhook sink's settings alone, from ``OUTBOX_WEBHOOK_*`` (and ``OUTBOX_SOURCE``)."""

    model_config = SettingsConfigDict(extra="ignore")
