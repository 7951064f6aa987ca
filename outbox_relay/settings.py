"""All relay settings in one model. Every field is also read from ``OUTBOX_<FIELD>``.

Every number has finite bounds (``bounds`` names them for ``--help`` and the docs): an infinite
or huge interval overflows ``threading.Event.wait`` and kills the thread that waits on it, and a
zero one spins. Errors name the option and its environment variable, never the value given (it
may be a secret).
"""

from __future__ import annotations

import os
import re
import socket
from pathlib import Path
from typing import Annotated, Any

from annotated_types import Ge, Gt, Le, MaxLen, MinLen
from pydantic import (
    AfterValidator,
    BeforeValidator,
    Field,
    SecretStr,
    ValidationError,
    field_validator,
    model_validator,
)
from pydantic.fields import FieldInfo
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

from .dsn import check_dsn, remember_dsn, remember_kafka_secrets
from .errors import ConfigurationError

ENV_PREFIX = "OUTBOX_"

# outbox.sinks.name's CHECK constraint.
SINK_NAME = re.compile(r"^[a-z0-9][a-z0-9_.:-]{0,62}\Z")
# Kafka's rule for topic names (also checked by the events table's trigger).
TOPIC_NAME = re.compile(r"^[A-Za-z0-9._-]{1,249}\Z")
# module or module:attribute
MODULE_SPEC = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*(:[A-Za-z_][A-Za-z0-9_]*)?\Z")

DAY = 86400.0


def default_worker_id() -> str:
    return f"{socket.gethostname()}-{os.getpid()}"


# -- what the inbox's settings (outbox_relay.inbox.settings) share with the relay's: the same checks, and
# the same variables for the same things (the OUTBOX_DSN and OUTBOX_KAFKA_BOOTSTRAP_SERVERS that
# `outbox-relay dev` prints serve both).


def _dsn_value(value: SecretStr) -> SecretStr:
    dsn = value.get_secret_value()
    if not dsn.strip():  # libpq reads "" as every default: the silent guess a required DSN prevents
        raise ValueError(NO_DSN)
    remember_dsn(dsn)  # before anything can fail and print it
    check_dsn(dsn)
    return value


def _kafka_values(value: dict[str, str]) -> dict[str, str]:
    return {k: _option_value(k, v) for k, v in value.items()}


Dsn = Annotated[SecretStr, AfterValidator(_dsn_value)]
KafkaOptions = Annotated[dict[str, str], AfterValidator(_kafka_values)]
KAFKA_OPTIONS_HELP = ("a value @PATH is read from that file (secrets stay out of `ps`), @@ stands for a literal @")


# -- the webhook sink's settings (outbox_relay.webhook): shared by RelaySettings (``outbox-relay run
# --webhook-url ...``) and WebhookSettings (``--sink outbox_relay.webhook:from_env``).


def _webhook_url(value: str | None) -> str | None:
    if value is not None:
        from .sinks.webhook import check_url

        try:
            check_url(value)
        except ConfigurationError as exc:
            raise ValueError(str(exc)) from None
    return value


def _webhook_secret(value: SecretStr | None) -> SecretStr | None:
    if value is not None:
        from .sinks.webhook import WebhookSecret

        try:
            WebhookSecret(value.get_secret_value())  # remembers it for redaction first
        except ConfigurationError as exc:
            raise ValueError(str(exc)) from None
    return value


def _names(value: Any) -> Any:
    return [name.strip() for name in value.split(",") if name.strip()] if isinstance(value, str) else value


def _topics(value: list[str]) -> list[str]:
    for topic in value:
        if not TOPIC_NAME.match(topic):
            raise ValueError(f"{topic[:64]!r} is not a topic name (1-249 characters of A-Z a-z 0-9 . _ -)")
    return value


WebhookUrl = Annotated[str | None, Field(
    min_length=1, max_length=4096,
    description="POST every event to this http(s) URL, signed (turns the webhook sink on; see docs/webhooks.md)"),
    AfterValidator(_webhook_url)]
WebhookSink = Annotated[str, Field(
    min_length=1, max_length=63, description="sink name of the webhook delivery (its own cursors)")]
WebhookSecretText = Annotated[SecretStr | None, Field(
    description="the webhook signing secret, whsec_<base64> (environment only, or --webhook-secret-file; never "
                "logged)"),
    AfterValidator(_webhook_secret)]
WebhookSecretFile = Annotated[Path | None, Field(
    description="read the webhook signing secret (whsec_<base64>) from this file")]
WebhookConnectTimeout = Annotated[float, Field(
    ge=0.01, le=600, description="webhook: seconds to connect (TCP and TLS) before the receiver counts as down")]
WebhookTimeout = Annotated[float, Field(
    ge=0.01, le=3600, description="webhook: seconds to wait for the whole response (status, headers, body) "
                                  "before the attempt is retried")]
WebhookConcurrency = Annotated[int, Field(
    ge=1, le=256, description="webhook: keys delivered at once (each key stays in order)")]
WebhookTopics = Annotated[list[str], NoDecode, Field(
    description="webhook: only events of these topics (comma-separated; none: all)"),
    BeforeValidator(_names), AfterValidator(_topics)]
WebhookCaFile = Annotated[Path | None, Field(
    description="webhook: trust the receiver's certificate from this CA file (PEM) instead of the system's")]
WebhookClientCert = Annotated[Path | None, Field(description="webhook: client certificate (PEM) for mutual TLS")]
WebhookClientKey = Annotated[Path | None, Field(
    description="webhook: the client certificate's private key (PEM), if not in the certificate file")]
WebhookTlsVerify = Annotated[bool, Field(
    description="webhook: verify the receiver's TLS certificate (turn off only for tests)")]


def _check_webhook(s: RelaySettings | WebhookSettings) -> None:
    if not SINK_NAME.match(s.webhook_sink):
        raise ValueError("webhook_sink: a sink name is 1-63 characters of a-z 0-9 _ . : - and starts with a letter "
                         "or digit")
    if s.webhook_url is None:
        return
    if s.webhook_secret is not None and s.webhook_secret_file is not None:
        raise ValueError("give the webhook secret once: --webhook-secret-file or OUTBOX_WEBHOOK_SECRET, not both")
    if s.webhook_secret is None and s.webhook_secret_file is None:
        raise ValueError("the webhook sink needs a signing secret: pass --webhook-secret-file PATH or set "
                         "OUTBOX_WEBHOOK_SECRET (whsec_<base64>; make one with `python -m outbox_relay.webhook "
                         "secret`)")
    if s.webhook_secret_file is not None:
        from .sinks.webhook import WebhookSecret

        try:
            WebhookSecret.from_file(s.webhook_secret_file)  # at start-up, and remembered for redaction
        except ConfigurationError as exc:
            raise ValueError(str(exc)) from None
    https = s.webhook_url.strip().lower().startswith("https:")
    if not https and (s.webhook_ca_file or s.webhook_client_cert or s.webhook_client_key or not s.webhook_tls_verify):
        raise ValueError("webhook TLS settings (CA file, client certificate, verify off) need an https:// URL")
    if s.webhook_client_key is not None and s.webhook_client_cert is None:
        raise ValueError("--webhook-client-key needs --webhook-client-cert")


class WebhookSettings(BaseSettings):
    """The webhook sink's settings alone, from ``OUTBOX_WEBHOOK_*`` (and ``OUTBOX_SOURCE``)."""

    model_config = SettingsConfigDict(env_prefix=ENV_PREFIX, extra="ignore", validate_default=True,
                                      allow_inf_nan=False)

    source: str = Field(default="outbox-relay", min_length=1, max_length=1000,
                        description="CloudEvents ce-source value")
    webhook_url: WebhookUrl = None
    webhook_sink: WebhookSink = "webhook"
    webhook_secret: WebhookSecretText = None
    webhook_secret_file: WebhookSecretFile = None
    webhook_connect_timeout_seconds: WebhookConnectTimeout = 5.0
    webhook_timeout_seconds: WebhookTimeout = 30.0
    webhook_concurrency: WebhookConcurrency = 4
    webhook_topics: WebhookTopics = Field(default_factory=list)
    webhook_ca_file: WebhookCaFile = None
    webhook_client_cert: WebhookClientCert = None
    webhook_client_key: WebhookClientKey = None
    webhook_tls_verify: WebhookTlsVerify = True

    @model_validator(mode="after")
    def _consistent(self) -> WebhookSettings:
        _check_webhook(self)
        return self


class RelaySettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix=ENV_PREFIX, extra="forbid", validate_default=True,
                                      allow_inf_nan=False)

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
    source: str = Field("outbox-relay", min_length=1, max_length=1000, description="CloudEvents ce_source header value")

    # the webhook sink (outbox_relay.webhook), on when webhook_url is set
    webhook_url: WebhookUrl = None
    webhook_sink: WebhookSink = "webhook"
    webhook_secret: WebhookSecretText = None
    webhook_secret_file: WebhookSecretFile = None
    webhook_connect_timeout_seconds: WebhookConnectTimeout = 5.0
    webhook_timeout_seconds: WebhookTimeout = 30.0
    webhook_concurrency: WebhookConcurrency = 4
    webhook_topics: WebhookTopics = Field(default_factory=list)
    webhook_ca_file: WebhookCaFile = None
    webhook_client_cert: WebhookClientCert = None
    webhook_client_key: WebhookClientKey = None
    webhook_tls_verify: WebhookTlsVerify = True

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

    # batching and leases
    batch_size: int = Field(1000, ge=1, le=100_000, description="events read per fetch")
    lease_seconds: float = Field(30.0, ge=0.1, le=3600, description="bucket lease; renewed every third of it")
    cursor_flush_seconds: float = Field(
        5.0, ge=0, le=600,
        description="while a long transaction holds vacuum back, a sink without a transaction of its own (Kafka) "
                    "writes a bucket's cursor at most this often (every batch still checks its fence, and a released "
                    "bucket's cursor is written at once): fewer dead row versions in outbox.cursors, at the cost of "
                    "up to this much more redelivery after a crash; otherwise every batch writes it; 0: every batch "
                    "writes it always (projections always do)")
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

    # failures
    max_attempts: int = Field(10, ge=1, le=1000, description="attempts before an event is dead-lettered")
    backoff_base_seconds: float = Field(1.0, ge=0.001, le=DAY, description="first retry delay")
    backoff_max_seconds: float = Field(600.0, ge=0.001, le=DAY, description="retry delay cap")
    max_lapses: int = Field(
        3, ge=1, le=1000,
        description="leases lost with work pending before a bucket is delivered one event at a time")
    drain_seconds: float = Field(
        30.0, ge=0.1, le=3600,
        description="SIGTERM: time to finish in-flight work and release; then a hard stop, and the process "
                    "exits at most HARD_STOP_SECONDS (5) later even if a sink is blocked (exit 5)")
    handler_timeout_seconds: float = Field(
        30.0, ge=0.1, le=3600,
        description="a projection handler (or a user sink's deliver) that has not returned after this long is "
                    "abandoned (its transaction ended) and charged to its event as a failed attempt; a sink that has "
                    "not checked its stop flag for this long counts as stuck: it gives its buckets up and /readyz "
                    "says so")

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
            raise ValueError("a sink name is 1-63 characters of a-z 0-9 _ . : - and starts with a letter or digit")
        return value

    @field_validator("default_topic")
    @classmethod
    def _topic(cls, value: str | None) -> str | None:
        if value is not None and (not TOPIC_NAME.match(value) or value in (".", "..")):
            raise ValueError('a Kafka topic name is 1-249 characters of A-Z a-z 0-9 . _ - and not "." or ".."')
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
        if self.backoff_base_seconds > self.backoff_max_seconds:
            raise ValueError("backoff_base_seconds must not exceed backoff_max_seconds")
        if self.projection and not self.projections:
            raise ValueError("--projection needs --projections (the module that declares them)")
        if len(set(self.projection)) != len(self.projection):
            raise ValueError(f"a projection is named twice: {self.projection}")
        _check_webhook(self)
        return self

    @property
    def sinks(self) -> list[str]:
        return (([self.kafka_sink] if self.kafka else []) + list(self.projection)
                + ([self.webhook_sink] if self.webhook_url else []))

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


def _option_value(key: str, value: str) -> str:
    """A Kafka option's value: ``@PATH`` is the content of that file (one trailing newline dropped)."""
    if value.startswith("@@"):
        return value[1:]
    if not value.startswith("@"):
        return value
    path = Path(value[1:])
    try:
        text = path.read_text()
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"cannot read the value of Kafka option {key} from {str(path)!r}: "
                         f"{getattr(exc, 'strerror', None) or type(exc).__name__}") from None
    return text[:-2] if text.endswith("\r\n") else text.removesuffix("\n")


def read_kafka_config_file(path: Path) -> dict[str, str]:
    """librdkafka settings from ``KEY=VALUE`` lines (blank lines and ``#`` comments skipped)."""
    try:
        text = path.read_text()
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"cannot read the Kafka config file {str(path)!r}: "
                         f"{getattr(exc, 'strerror', None) or type(exc).__name__}") from None
    config: dict[str, str] = {}
    for number, line in enumerate(text.splitlines(), 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        key, sep, value = line.partition("=")
        if not sep or not key.strip():
            # The line is not quoted: it may be a secret with a missing key.
            raise ValueError(f"{str(path)!r} line {number} is not KEY=VALUE")
        config[key.strip()] = _option_value(key.strip(), value.strip())
    return config


NO_DSN = (f"no database given: pass --dsn or set {ENV_PREFIX}DSN to a PostgreSQL connection string "
          "(e.g. postgresql://user@host:5432/dbname)")


def default_text(name: str, field: FieldInfo) -> str:
    """A setting's default as ``--help`` shows it: ``1000``, ``on``, ``host-pid``, ``required``, ``none``."""
    if field.is_required():
        return "required"
    if field.default_factory is not None:
        if name == "worker_id":
            return "host-pid"
        value: Any = field.default_factory()  # type: ignore[call-arg]
        return "none" if not value else str(value)
    value = field.default
    if value is None:
        return "none"
    if isinstance(value, bool):
        return "on" if value else "off"
    if isinstance(value, float):
        return _number(value)
    return str(value)


def flag(name: str) -> str:
    """The command-line option of a setting."""
    return {"kafka_config": "--kafka-option"}.get(name, "--" + name.replace("_", "-"))


def env_var(name: str) -> str:
    return f"{ENV_PREFIX}{name.upper()}"


def _number(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else f"{value:g}"


def bounds(field: FieldInfo) -> str | None:
    """A setting's allowed range or length, e.g. ``0.01-3600`` or ``1-200 characters``; None if unbounded."""
    low: Any = None
    high: Any = None
    chars = False
    for m in field.metadata:
        if isinstance(m, Ge | Gt):
            low = m.ge if isinstance(m, Ge) else m.gt
        elif isinstance(m, Le):
            high = m.le
        elif isinstance(m, MinLen | MaxLen):
            chars = True
            if isinstance(m, MinLen):
                low = m.min_length
            else:
                high = m.max_length
    if high is None:
        return None
    if chars:
        return f"{low}-{high} characters" if low else f"at most {high} characters"
    return f"{_number(float(low or 0))}-{_number(float(high))}"


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
            if name == "webhook_secret":  # no command-line option (a command line shows in `ps`)
                where = f" ({env_var(name)})"
            problems.append(f"{name}{where}: {message}")
    return "; ".join(problems)


def load_settings(**overrides: Any) -> RelaySettings:
    try:
        return RelaySettings(**{k: v for k, v in overrides.items() if v is not None})
    except ValidationError as exc:
        raise ConfigurationError(f"invalid settings: {describe_validation_error(exc)}") from None
    except ValueError as exc:  # pydantic-settings: a variable it could not decode (it names the field only)
        raise ConfigurationError(str(exc)) from None
