"""The broker a RabbitMQ sink talks to: its URL's checks, credentials and TLS, and one AMQP connection.

pika is imported here and only when a connection is made, so ``import outbox_relay`` (and the settings'
checks) never need it. Nothing that leaves this module shows a password: the URL's is remembered for
``redact`` when the URL is checked, and ``endpoint`` (what reasons and logs name) has no user info.
"""

from __future__ import annotations

import logging
import re
import ssl
import urllib.parse
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

from ...dsn import redact, remember_secret
from ...errors import ConfigurationError
from ..credentials import read_secret_file, remember_url_secret
from ..user import SinkUnavailable

log = logging.getLogger("outbox_relay.rabbitmq")

# AMQP 0-9-1's exchange and queue names: a short string of letters, digits, - _ . : (RabbitMQ takes more,
# but a name outside this set is a typo more often than a plan).
AMQP_NAME = re.compile(r"^[A-Za-z0-9._:-]{1,255}\Z")
EXTRA = "the rabbitmq sink needs `pip install outbox-relay[rabbitmq]` (the pika client)"
REFUSED_SECONDS = 30.0  # the wait after the broker refused our credentials or vhost: an operator must act


def client() -> ModuleType:
    """The pika module, or ConfigurationError saying which extra brings it."""
    try:
        import pika
    except ImportError:
        raise ConfigurationError(EXTRA) from None
    quiet = logging.getLogger("pika")
    if quiet.level == logging.NOTSET:
        # pika logs each connection's steps at INFO and each failure it raises at ERROR with a traceback, on every
        # attempt while a broker is away; the sink reports those failures itself (the reason its events wait).
        # Configure the "pika" logger to see its lines.
        quiet.setLevel(logging.CRITICAL)
    module: ModuleType = pika
    return module


def check_name(name: str, what: str) -> str:
    if not AMQP_NAME.match(name):
        raise ConfigurationError(f"{what} {name[:64]!r} is not an AMQP name (1-255 characters of A-Z a-z 0-9 . _ : -)")
    return name


def check_url(url: str) -> urllib.parse.SplitResult:
    """The parts of an ``amqp://`` or ``amqps://`` URL, or ConfigurationError naming what is wrong (never the
    password, which is remembered for redaction before anything else)."""
    try:
        parts = urllib.parse.urlsplit(url.strip())
        password = parts.password
        port = parts.port
    except ValueError as exc:  # a port that is not a number, a bracket left open
        raise ConfigurationError(f"the RabbitMQ URL can not be parsed ({redact(str(exc))})") from None
    remember_url_secret(password)
    if parts.scheme not in ("amqp", "amqps"):
        raise ConfigurationError("the RabbitMQ URL must start with amqp:// or amqps:// (e.g. "
                                 "amqp://user@rabbitmq.internal:5672/vhost)")
    if not parts.hostname:
        raise ConfigurationError("the RabbitMQ URL has no host (e.g. amqp://user@rabbitmq.internal:5672/vhost)")
    if port == 0:
        raise ConfigurationError("the RabbitMQ URL's port must be 1-65535")
    if parts.query or parts.fragment:
        raise ConfigurationError("the RabbitMQ URL takes no ?query or #fragment: give heartbeat, TLS and timeouts as "
                                 "--rabbitmq-* options")
    if "/" in parts.path[1:]:
        raise ConfigurationError("the RabbitMQ URL's path is the vhost: percent-encode a / in it (%2F)")
    return parts


def read_password(path: Path) -> str:
    """The password in ``path`` (one trailing newline dropped), remembered for redaction."""
    return read_secret_file(path, "the RabbitMQ password file")


@dataclass(frozen=True)
class Tls:
    """TLS towards the broker (amqps:// only)."""

    ca_file: Path | None = None
    client_cert: Path | None = None
    client_key: Path | None = None
    verify: bool = True

    def context(self) -> ssl.SSLContext:
        try:
            context = ssl.create_default_context(cafile=str(self.ca_file) if self.ca_file else None)
            if not self.verify:
                context.check_hostname = False
                context.verify_mode = ssl.CERT_NONE
            if self.client_cert is not None:
                context.load_cert_chain(str(self.client_cert), str(self.client_key) if self.client_key else None)
        except (OSError, ssl.SSLError) as exc:
            raise ConfigurationError(f"rabbitmq TLS: {getattr(exc, 'strerror', None) or exc}") from None
        return context


class Broker:
    """How to connect to one broker: ``connect()`` opens a pika ``BlockingConnection`` (one per thread: pika is not
    thread-safe), or raises ``SinkUnavailable`` saying why not."""

    def __init__(self, url: str, *, password: str | None = None, tls: Tls | None = None,
                 heartbeat_seconds: int = 15, connect_timeout_seconds: float = 5.0,
                 blocked_timeout_seconds: float = 60.0, unavailable_seconds: float = 5.0,
                 client_name: str = "outbox-relay") -> None:
        parts = check_url(url)
        self.tls = parts.scheme == "amqps"
        if not self.tls and tls is not None:
            raise ConfigurationError("RabbitMQ TLS settings (CA file, client certificate, verify off) need an amqps:// "
                                     "URL")
        self.host = parts.hostname or ""
        self.port = parts.port or (5671 if self.tls else 5672)
        path = parts.path[1:] if parts.path.startswith("/") else parts.path
        self.vhost = urllib.parse.unquote(path) if path else "/"
        self.username = urllib.parse.unquote(parts.username) if parts.username else None
        if password is not None:
            remember_secret(password)
        self._password = password if password is not None else (
            urllib.parse.unquote(parts.password) if parts.password else None)
        host = f"[{self.host}]" if ":" in self.host else self.host
        # What reasons and log lines name: no user info.
        self.endpoint = f"{parts.scheme}://{host}:{self.port}/{urllib.parse.quote(self.vhost, safe='')}"
        self._context = (tls or Tls()).context() if self.tls else None
        self._client_cert = tls is not None and tls.client_cert is not None
        self.heartbeat_seconds = heartbeat_seconds
        self.connect_timeout_seconds = connect_timeout_seconds
        self.blocked_timeout_seconds = blocked_timeout_seconds
        self.unavailable_seconds = unavailable_seconds  # the wait after a failed connect (tests shrink it)
        self.client_name = client_name

    def __repr__(self) -> str:
        return f"Broker({self.endpoint!r})"

    def parameters(self) -> Any:
        pika = client()
        if self._password is None and self._client_cert:
            credentials: Any = pika.credentials.ExternalCredentials()
        else:
            credentials = pika.PlainCredentials(self.username or "guest", self._password or "guest",
                                                erase_on_connect=False)
        ssl_options = pika.SSLOptions(self._context, server_hostname=self.host) if self._context else None
        return pika.ConnectionParameters(
            host=self.host, port=self.port, virtual_host=self.vhost, credentials=credentials,
            ssl_options=ssl_options, heartbeat=self.heartbeat_seconds,
            blocked_connection_timeout=self.blocked_timeout_seconds, socket_timeout=self.connect_timeout_seconds,
            stack_timeout=self.connect_timeout_seconds + 5, connection_attempts=1,
            client_properties={"connection_name": self.client_name})

    def connect(self) -> Any:
        """A new ``pika.BlockingConnection``; SinkUnavailable if the broker can not be reached or refuses us."""
        pika = client()
        exceptions = pika.exceptions
        try:
            return pika.BlockingConnection(self.parameters())
        except (exceptions.ProbableAuthenticationError, exceptions.AuthenticationError) as exc:
            raise SinkUnavailable(f"{self.endpoint}: the broker refuses the credentials of user "
                                  f"{self.username or 'guest'!r} ({describe(exc)})", REFUSED_SECONDS) from None
        except exceptions.ProbableAccessDeniedError as exc:
            raise SinkUnavailable(f"{self.endpoint}: user {self.username or 'guest'!r} may not use vhost "
                                  f"{self.vhost!r} ({describe(exc)})", REFUSED_SECONDS) from None
        except exceptions.ConnectionClosedByBroker as exc:
            raise SinkUnavailable(f"{self.endpoint}: the broker closed the connection at once: {describe(exc)}",
                                  REFUSED_SECONDS if exc.reply_code in (403, 530) else self.unavailable_seconds
                                  ) from None
        except (exceptions.AMQPError, OSError) as exc:
            raise SinkUnavailable(f"{self.endpoint}: can not connect: {describe(exc)}",
                                  self.unavailable_seconds) from None


def describe(exc: BaseException) -> str:
    """A pika error in one line, redacted (pika's own messages repeat its nested errors' reprs)."""
    text = " ".join(str(exc).split()) or type(exc).__name__
    return redact(f"{type(exc).__name__}: {text}")[:500]


__all__ = ["AMQP_NAME", "Broker", "Tls", "check_name", "check_url", "client", "describe", "read_password"]
