"""What the broker sinks' settings (webhook, NATS, Redis, RabbitMQ, SQS) share: the fields each declares alike
(its URL, sink name, topics, concurrency, timeouts, TLS files), made by one :class:`SinkOptions` per sink, and
the checks of them.

Each ``*Fields`` class still declares its fields itself, with a factory's ``Field`` as the value, so every
option keeps its name, its ``OUTBOX_*`` variable, default, help and place in ``run --help``. The fields of a
broker ``kind`` are named ``<kind>_<field>`` (``rabbitmq_ca_file``): the checks read them by those names.
Validators stay in the classes, under names of their own: pydantic keys them by name, so one declared here
and inherited by two sinks would be replaced by the other in ``RelaySettings`` (tests/unit/test_settings.py).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, TypeVar

from pydantic import Field, SecretStr

from .dsn import remember_secret
from .errors import ConfigurationError
from .settings_base import ENV_PREFIX, SINK_NAME, SINK_NAME_RULE, TOPIC_NAME

T = TypeVar("T")


@contextmanager
def as_value_error() -> Iterator[None]:
    """A sink's ConfigurationError raised inside, as the ValueError pydantic reports (naming the field)."""
    try:
        yield
    except ConfigurationError as exc:
        raise ValueError(str(exc)) from None


def checked(check: Callable[[T], object], value: T | None) -> T | None:
    """``value`` once ``check`` (a sink's own check, e.g. of a URL) accepted it; None as it is."""
    if value is not None:
        with as_value_error():
            check(value)
    return value


def remembered(value: SecretStr | None) -> SecretStr | None:
    """A secret setting, remembered for redaction (never logged, never in an error)."""
    if value is not None:
        remember_secret(value.get_secret_value())
    return value


def check_topic(topic: str) -> None:
    if not TOPIC_NAME.match(topic):
        raise ValueError(f"{topic[:64]!r} is not a topic name (1-249 characters of A-Z a-z 0-9 . _ -)")


def check_topics(value: list[str]) -> list[str]:
    for topic in value:
        check_topic(topic)
    return value


@dataclass(frozen=True)
class SinkOptions:
    """How one broker sink's settings name it: ``kind`` prefixes its fields and is its default sink name,
    ``title`` names it in sentences, ``label`` prefixes its help texts, ``peer`` is what it talks to."""

    kind: str  # rabbitmq
    title: str  # RabbitMQ
    label: str  # rabbitmq
    peer: str  # broker

    # -- fields

    def url(self, description: str, max_length: int = 4096) -> Any:
        """The sink's address: set, it turns the sink on."""
        return Field(default=None, min_length=1, max_length=max_length, description=description)

    def sink(self) -> Any:
        return Field(default=self.kind, min_length=1, max_length=63,
                     description=f"sink name of the {self.title} delivery (its own cursors)")

    def topics(self) -> Any:
        return Field(default_factory=list,
                     description=f"{self.label}: only events of these topics (comma-separated; none: all)")

    def concurrency(self, default: int, verb: str = "delivered", note: str = "") -> Any:
        return Field(default=default, ge=1, le=256,
                     description=f"{self.label}: keys {verb} at once{note} (each key stays in order)")

    def connect_timeout(self, note: str = "") -> Any:
        return Field(default=5.0, ge=0.01, le=600,
                     description=f"{self.label}: seconds to connect{note} before the {self.peer} counts as down")

    def unavailable(self, description: str) -> Any:
        """The wait after the broker was unreachable or refused, before the next try (no attempt counted)."""
        return Field(default=5.0, ge=0.01, le=3600, description=f"{self.label}: {description}")

    def ca_file(self, note: str = "") -> Any:
        return Field(default=None,
                     description=f"{self.label}: trust the {self.peer}'s certificate from this CA file (PEM){note}")

    def client_cert(self, note: str = "") -> Any:
        return Field(default=None, description=f"{self.label}: client certificate (PEM) for mutual TLS{note}")

    def client_key(self) -> Any:
        return Field(default=None, description=f"{self.label}: the client certificate's private key (PEM), if not "
                                               "in the certificate file")

    def tls_verify(self) -> Any:
        return Field(default=True,
                     description=f"{self.label}: verify the {self.peer}'s TLS certificate (turn off only for tests)")

    # -- checks (of a model's fields, after each field's own)

    def check_sink_name(self, settings: Any) -> None:
        if not SINK_NAME.match(getattr(settings, f"{self.kind}_sink")):
            raise ValueError(f"{self.kind}_sink: {SINK_NAME_RULE}")

    def check_once(self, settings: Any, secret: str) -> None:
        """A secret given in the environment and in a file: which one is meant is a guess."""
        if getattr(settings, f"{self.kind}_{secret}") is not None and \
                getattr(settings, f"{self.kind}_{secret}_file") is not None:
            raise ValueError(f"give the {self.title} {secret} once: --{self.kind}-{secret}-file or "
                             f"{ENV_PREFIX}{self.kind.upper()}_{secret.upper()}, not both")

    def check_tls(self, settings: Any, secure: bool, url: str) -> None:
        """TLS settings only with a TLS URL (``secure``), described as ``url``; a client key only with its
        certificate."""
        tls = (getattr(settings, f"{self.kind}_ca_file") or getattr(settings, f"{self.kind}_client_cert")
               or getattr(settings, f"{self.kind}_client_key") or not getattr(settings, f"{self.kind}_tls_verify"))
        if tls and not secure:
            raise ValueError(f"{self.title} TLS settings (CA file, client certificate, verify off) need {url}")
        self.check_client_key(settings)

    def check_client_key(self, settings: Any) -> None:
        if getattr(settings, f"{self.kind}_client_key") is not None and \
                getattr(settings, f"{self.kind}_client_cert") is None:
            raise ValueError(f"--{self.kind}-client-key needs --{self.kind}-client-cert")
