"""What every settings model of the package shares: the checks of values both the relay and the inbox read
(the database, Kafka options, names), the formatting of defaults and bounds for ``--help`` and the docs,
and :class:`AttemptSettings`, the one declaration of how work is leased, retried and time-limited that
``RelaySettings`` and ``InboxSettings`` extend (each sets its own defaults).

Every number has finite bounds: an infinite or huge interval overflows ``threading.Event.wait`` and kills
the thread that waits on it, and a zero one spins.
"""

from __future__ import annotations

import os
import re
import socket
from pathlib import Path
from typing import Annotated, Any

from annotated_types import Ge, Gt, Le, MaxLen, MinLen
from pydantic import AfterValidator, BeforeValidator, Field, SecretStr, model_validator
from pydantic.fields import FieldInfo
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

from .dsn import check_dsn, remember_dsn

ENV_PREFIX = "OUTBOX_"

# outbox.sinks.name's CHECK constraint.
SINK_NAME = re.compile(r"^[a-z0-9][a-z0-9_.:-]{0,62}\Z")
SINK_NAME_RULE = "a sink name is 1-63 characters of a-z 0-9 _ . : - and starts with a letter or digit"
# Kafka's rule for topic names (also checked by the events table's trigger).
TOPIC_NAME = re.compile(r"^[A-Za-z0-9._-]{1,249}\Z")
# module or module:attribute
MODULE_SPEC = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*(:[A-Za-z_][A-Za-z0-9_]*)?\Z")

DAY = 86400.0

NO_DSN = (f"no database given: pass --dsn or set {ENV_PREFIX}DSN to a PostgreSQL connection string "
          "(e.g. postgresql://user@host:5432/dbname)")
KAFKA_OPTIONS_HELP = ("a value @PATH is read from that file (secrets stay out of `ps`), @@ stands for a literal @")


def default_worker_id() -> str:
    return f"{socket.gethostname()}-{os.getpid()}"


def _dsn_value(value: SecretStr) -> SecretStr:
    dsn = value.get_secret_value()
    if not dsn.strip():  # libpq reads "" as every default: the silent guess a required DSN prevents
        raise ValueError(NO_DSN)
    remember_dsn(dsn)  # before anything can fail and print it
    check_dsn(dsn)
    return value


def option_value(key: str, value: str) -> str:
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


def _kafka_values(value: dict[str, str]) -> dict[str, str]:
    return {k: option_value(k, v) for k, v in value.items()}


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
        config[key.strip()] = option_value(key.strip(), value.strip())
    return config


Dsn = Annotated[SecretStr, AfterValidator(_dsn_value)]
KafkaOptions = Annotated[dict[str, str], AfterValidator(_kafka_values)]

# -- how work is leased, retried and time-limited: one declaration (bounds and meaning) per setting; a
# model that extends AttemptSettings with other defaults gives them as `name: Type = default`.

MaxAttempts = Annotated[int, Field(ge=1, le=1000, description="attempts before an event is dead-lettered")]
BackoffBase = Annotated[float, Field(ge=0.001, le=DAY, description="first retry delay (doubling, with jitter)")]
BackoffMax = Annotated[float, Field(ge=0.001, le=DAY, description="retry delay cap")]
BatchSize = Annotated[int, Field(
    ge=1, le=100_000,
    description="events read per fetch (the inbox: consecutive messages of a partition applied in one transaction, "
                "each in a savepoint of its own)")]
LeaseSeconds = Annotated[float, Field(
    ge=0.1, le=3600,
    description="a bucket's (an inbox partition's) lease, renewed every third of it; a crashed process's work moves "
                "after this")]
HandlerTimeout = Annotated[float, Field(
    ge=0.1, le=DAY,
    description="a handler (a projection's, a user sink's deliver, the inbox's) that has not returned after this "
                "long is abandoned (its transaction ended) and charged to its event as a failed attempt; in the relay, "
                "a sink that has not checked its stop flag for this long counts as stuck: it gives its buckets up and "
                "/readyz says so")]


def split_names(value: Any) -> Any:
    """A comma-separated value (an option, an ``OUTBOX_*`` variable) as its names; a list as it is."""
    return [name.strip() for name in value.split(",") if name.strip()] if isinstance(value, str) else value


# A list of names given comma-separated (the environment's form) or as a list (from code).
NameList = Annotated[list[str], NoDecode, BeforeValidator(split_names)]


# The json_schema_extra of a secret with no command-line option (a command line shows in `ps`): it is read
# from the environment, or from the file its ``*_file`` setting names.
ENVIRONMENT_ONLY: dict[str, Any] = {"environment_only": True}


def environment_only(field: FieldInfo) -> bool:
    extra = field.json_schema_extra
    return isinstance(extra, dict) and extra.get("environment_only") is True


class SettingsBase(BaseSettings):
    """The model configuration every settings model has: no infinite or NaN number, defaults checked too."""

    model_config = SettingsConfigDict(env_prefix=ENV_PREFIX, validate_default=True, allow_inf_nan=False)


class AttemptSettings(SettingsBase):
    """Leases, batches, attempts, backoff and the handler time limit, with the relay's defaults."""

    batch_size: BatchSize = 1000
    lease_seconds: LeaseSeconds = 30.0
    max_attempts: MaxAttempts = 10
    backoff_base_seconds: BackoffBase = 1.0
    backoff_max_seconds: BackoffMax = 600.0
    handler_timeout_seconds: HandlerTimeout = 30.0

    @model_validator(mode="after")
    def _backoff(self) -> AttemptSettings:
        if self.backoff_base_seconds > self.backoff_max_seconds:
            raise ValueError("backoff_base_seconds must not exceed backoff_max_seconds")
        return self


def number(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else f"{value:g}"


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
        return number(value)
    return str(value)


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
    return f"{number(float(low or 0))}-{number(float(high))}"
