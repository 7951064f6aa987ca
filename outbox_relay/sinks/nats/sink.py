"""The NATS JetStream sink: one JetStream publish per event, delivered when the stream acknowledged it.

``deliver`` is a coroutine: the relay's adapter runs every lane's calls on one event loop per sink, so one
client connection serves them all, with ``concurrency`` keys in flight at once. Per key the adapter calls
one event at a time, and the sink returns only after the PubAck: a key's events are stored in publish order.

Outcomes:

- a PubAck (``duplicate`` too: the stream already holds this ``Nats-Msg-Id``): delivered;
- a fault of the event, never retried (dead-lettered with the reason): no topic, a subject too long, a
  header NATS can not carry, a message over the server's ``max_payload`` (checked before sending: the server
  would close the connection) or the stream's ``max_msg_size`` (JetStream error 10054);
- a condition of the sink, its events wait and no attempt counts (``SinkUnavailable``): no server, the
  credentials refused, the client reconnecting, no stream for the subject (no responders), the stream full
  (``discard: new``), another stream than ``stream``, JetStream unavailable (503), or no PubAck within
  ``ack_timeout_seconds`` (the server did not answer; a permission denied to publish looks like this, and
  the reason then quotes the server's error);
- any other JetStream error: ``Retry`` with it (counts an attempt).
"""

from __future__ import annotations

import logging
from collections.abc import Collection
from pathlib import Path
from typing import TYPE_CHECKING

from ...dsn import describe_error
from ...errors import ConfigurationError
from ..user import MAX_CONCURRENCY, Delivered, GiveUp, Retry, SinkEvent, SinkUnavailable
from .acks import JetStreamError, NoStream
from .connection import Connection, ConnectOptions, check_url, client_library, read_secret
from .message import Messages
from .subjects import check_prefix, check_topic

if TYPE_CHECKING:
    from ...nats_settings import NatsFields

log = logging.getLogger("outbox_relay.nats")

# JetStream error codes (nats-server errors.json) that the sink tells apart.
MESSAGE_TOO_LARGE = 10054  # JSStreamMessageExceedsMaximumErr: the stream's max_msg_size
STREAM_MISMATCH = 10060  # JSStreamNotMatchErr: Nats-Expected-Stream is another stream
STORE_FULL = frozenset({10077, 10047, 10023})  # maximum messages/bytes exceeded, insufficient resources
UNAVAILABLE_SECONDS = 2.0  # a condition's wait when the server named none


class NatsSink:
    """Publishes each event to JetStream (an ``EventSink``, outbox_relay.sinks)."""

    kind = "nats"

    def __init__(self, url: str, *, name: str = "nats", source: str = "outbox-relay",
                 subject_prefix: str = "outbox", default_topic: str | None = None, stream: str | None = None,
                 concurrency: int = 16, topics: Collection[str] | None = None, types: Collection[str] | None = None,
                 ack_timeout_seconds: float = 5.0, connect_timeout_seconds: float = 5.0,
                 user: str | None = None, password: str | None = None, token: str | None = None,
                 creds_file: str | None = None, nkey_seed_file: str | None = None, ca_file: str | None = None,
                 client_cert: str | None = None, client_key: str | None = None, tls_verify: bool = True,
                 unavailable_seconds: float = UNAVAILABLE_SECONDS) -> None:
        self.name = name
        self.source = source
        self.prefix = check_prefix(subject_prefix)
        if default_topic is not None:
            check_topic(default_topic)
        self.default_topic = default_topic
        self.stream = stream
        if not 1 <= concurrency <= MAX_CONCURRENCY:
            raise ConfigurationError(f"nats concurrency must be 1-{MAX_CONCURRENCY} (keys published at once)")
        self.concurrency = concurrency
        self.topics = frozenset(check_topic(t) for t in topics) if topics is not None else None
        self.types = frozenset(types) if types is not None else None
        if not 0 < ack_timeout_seconds <= 3600 or not 0 < connect_timeout_seconds <= 600:
            raise ConfigurationError("nats timeouts must be more than 0 (ack at most 3600 s, connect at most 600 s)")
        self.ack_timeout_seconds = ack_timeout_seconds
        self.unavailable_seconds = unavailable_seconds
        options = ConnectOptions(check_url(url), user=user, password=password, token=token,
                                 creds_file=Path(creds_file) if creds_file else None,
                                 nkey_seed_file=Path(nkey_seed_file) if nkey_seed_file else None,
                                 ca_file=Path(ca_file) if ca_file else None,
                                 client_cert=Path(client_cert) if client_cert else None,
                                 client_key=Path(client_key) if client_key else None, tls_verify=tls_verify,
                                 connect_timeout_seconds=connect_timeout_seconds)
        options.tls()  # unusable TLS files: a configuration error now, not at the first event
        if not tls_verify:
            log.warning("nats sink %s: TLS certificate verification is OFF", name)
        self.connection = Connection(options, name)
        self.messages = Messages(sink=name, prefix=self.prefix, default_topic=default_topic, source=source,
                                 stream=stream)
        self.endpoint = self.connection.endpoint
        self._client = client_library()
        errors = self._client.errors
        # What the client's publish raises when the connection is down (TimeoutError: no PubAck in time).
        self._down = (errors.ConnectionClosedError, errors.ConnectionReconnectingError, errors.OutboundBufferLimitError,
                      errors.StaleConnectionError, errors.NoServersError, errors.ConnectionDrainingError,
                      ConnectionError)

    def __repr__(self) -> str:
        return f"NatsSink(name={self.name!r}, endpoint={self.endpoint!r}, prefix={self.prefix!r})"

    async def deliver(self, event: SinkEvent) -> Delivered | Retry | GiveUp:
        made = self.messages.build(event)
        if isinstance(made, GiveUp):
            return made
        acks = await self.connection.acks()
        limit = self.connection.max_payload()
        if made.size > limit:
            return GiveUp(f"the message is {made.size} bytes (headers and payload), over the server's max_payload "
                          f"of {limit}")
        try:
            error = await acks.publish(made.subject, made.payload, made.headers, self.ack_timeout_seconds)
        except NoStream:
            raise SinkUnavailable(f"{self._where(made.subject)}: no stream takes this subject (no responders; add a "
                                  f"stream whose subjects cover {self.prefix}.>)", self.unavailable_seconds) from None
        except self._client.errors.MaxPayloadError:
            return GiveUp(f"{self._where(made.subject)}: the payload is over the server's max_payload of {limit} "
                          "bytes")
        except (TimeoutError, self._client.errors.TimeoutError):
            said = self.connection.last_error
            raise SinkUnavailable(f"{self._where(made.subject)}: no PubAck within {self.ack_timeout_seconds:g}s (the "
                                  f"server did not answer{f'; it last said: {said}' if said else ''})",
                                  self.unavailable_seconds) from None
        except self._down as exc:
            raise SinkUnavailable(f"{self._where(made.subject)}: the connection is down: {describe_error(exc)}",
                                  self.unavailable_seconds) from None
        if error is not None:
            return self._api_error(self._where(made.subject), error)
        return Delivered()

    def _where(self, subject: str) -> str:
        return f"nats {self.endpoint}: subject {subject[:200]}"

    def _api_error(self, where: str, error: JetStreamError) -> Retry | GiveUp:
        code, err_code = error.code, error.err_code
        what = f"{where}: JetStream error {code}/{err_code}: {error.description}"
        if err_code == MESSAGE_TOO_LARGE:
            return GiveUp(what)
        if err_code == STREAM_MISMATCH:
            raise SinkUnavailable(f"{what} (the subject belongs to another stream than {self.stream!r})", 30.0)
        if err_code in STORE_FULL or code == 503:
            raise SinkUnavailable(f"{what} (a condition of the stream: its events wait)", self.unavailable_seconds)
        return Retry(what)

    def close(self) -> None:
        self.connection.close()


# -- configuration --------------------------------------------------------------------------------


def from_settings(settings: NatsFields, source: str = "outbox-relay", default_topic: str | None = None) -> NatsSink:
    """The NATS sink that ``settings`` (``nats_*``) describe, with the relay's CloudEvents ``source`` and
    ``--default-topic``; ConfigurationError without a URL."""
    s = settings
    if not s.nats_url:
        raise ConfigurationError("no NATS URL: pass --nats-url or set OUTBOX_NATS_URL")
    password = (read_secret(s.nats_password_file, "password") if s.nats_password_file is not None
                else s.nats_password.get_secret_value() if s.nats_password is not None else None)
    token = (read_secret(s.nats_token_file, "token") if s.nats_token_file is not None
             else s.nats_token.get_secret_value() if s.nats_token is not None else None)
    return NatsSink(s.nats_url, name=s.nats_sink, source=source, subject_prefix=s.nats_subject_prefix,
                    default_topic=default_topic, stream=s.nats_stream,
                    concurrency=s.nats_concurrency, topics=s.nats_topics or None,
                    ack_timeout_seconds=s.nats_ack_timeout_seconds,
                    connect_timeout_seconds=s.nats_connect_timeout_seconds, user=s.nats_user, password=password,
                    token=token, creds_file=_path(s.nats_creds_file), nkey_seed_file=_path(s.nats_nkey_seed_file),
                    ca_file=_path(s.nats_ca_file), client_cert=_path(s.nats_client_cert),
                    client_key=_path(s.nats_client_key), tls_verify=s.nats_tls_verify)


def _path(value: object) -> str | None:
    return None if value is None else str(value)


def from_env() -> NatsSink:
    """The NATS sink the ``OUTBOX_NATS_*`` variables describe: ``--sink outbox_relay.sinks.nats:from_env``."""
    from pydantic import ValidationError

    from ...nats_settings import NatsSettings
    from ...settings import describe_validation_error

    try:
        settings = NatsSettings()
    except ValidationError as exc:
        raise ConfigurationError(f"invalid NATS settings: {describe_validation_error(exc)}") from None
    return from_settings(settings, settings.source, settings.default_topic)


__all__ = ["NatsSink", "from_env", "from_settings"]
