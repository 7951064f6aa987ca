"""The RabbitMQ sink: one persistent, mandatory message per event, delivered once the broker confirms it.

Each delivering thread (the adapter's lanes: ``concurrency`` of them) keeps its own connection and channel
in publisher-confirm mode; pika is not thread-safe. ``deliver`` publishes with ``mandatory`` and waits for
the broker's answer, so "delivered" means the broker acknowledged the message: routed to at least one
queue and, for durable queues, written to disk (RabbitMQ confirms a persistent message once every queue
it was routed to has it). Ordering per key, concurrency across keys, retries, dead letters and fencing
are the relay's (the sink contract's adapter); this module only speaks AMQP.

What is whose fault:

- a condition of the sink (``SinkUnavailable``: the events wait, no attempt counted, nothing
  dead-lettered): the broker unreachable or gone mid-publish, credentials or vhost refused, a write
  permission denied (403), an exchange that does not exist (404), a message returned unroutable (no queue
  bound for its key), a nack (a queue at its ``x-max-length`` with ``reject-publish``), a declare that does
  not match the exchange there (406);
- a fault of the event (``GiveUp``, dead-lettered with the reason): no exchange for it, a partition key or
  header name longer than AMQP allows, a message over ``max_message_bytes`` or refused by the broker for
  its size.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Collection
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ...errors import ConfigurationError
from ..user import MAX_CONCURRENCY, Delivered, GiveUp, SinkEvent, SinkUnavailable
from .connection import Broker, Tls, check_name, client, describe, read_password
from .message import message_of

if TYPE_CHECKING:
    from ...rabbitmq_settings import RabbitMQFields

log = logging.getLogger("outbox_relay.rabbitmq")

DEFAULT_MAX_MESSAGE_BYTES = 128 * 1024 * 1024  # RabbitMQ's default max_message_size
EXCHANGE_TYPES = frozenset({"direct", "topic", "fanout", "headers", "x-consistent-hash"})


@dataclass(eq=False)
class Link:
    """One thread's connection and confirm-mode channel. ``lock`` is held by the thread publishing on it, and by
    ``idle()`` (another thread) while it services the connection's heartbeats: never both at once."""

    connection: Any
    channel: Any = None
    declared: set[str] = field(default_factory=set)  # exchanges this connection declared
    used: bool = False  # a publish went through on it (so a failure may be a connection closed while idle)
    lock: threading.Lock = field(default_factory=threading.Lock)


class RabbitMQSink:
    """Publishes each event to the exchange named by its topic, routing key = partition key. An ``EventSink``."""

    kind = "rabbitmq"

    def __init__(self, url: str, *, name: str = "rabbitmq", password: str | None = None,
                 source: str = "outbox-relay", concurrency: int = 4,
                 topics: Collection[str] | None = None, types: Collection[str] | None = None,
                 default_exchange: str | None = None, declare_exchange: str | None = None,
                 max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES, heartbeat_seconds: int = 15,
                 connect_timeout_seconds: float = 5.0, blocked_timeout_seconds: float = 60.0,
                 tls: Tls | None = None, unavailable_seconds: float = 5.0) -> None:
        # At start-up, not at the first event: a missing extra is a ConfigurationError, never a retry.
        self._pika = client()
        self.name = name
        self.source = source
        if not 1 <= concurrency <= MAX_CONCURRENCY:
            raise ConfigurationError(f"rabbitmq concurrency must be 1-{MAX_CONCURRENCY} (keys published at once)")
        self.concurrency = concurrency
        self.topics = frozenset(topics) if topics is not None else None
        self.types = frozenset(types) if types is not None else None
        self.default_exchange = check_name(default_exchange, "default exchange") if default_exchange else None
        if declare_exchange is not None and declare_exchange not in EXCHANGE_TYPES:
            raise ConfigurationError(f"rabbitmq: can not declare exchanges of type {declare_exchange!r} (one of "
                                     f"{', '.join(sorted(EXCHANGE_TYPES))})")
        self.declare_exchange = declare_exchange
        if max_message_bytes < 1:
            raise ConfigurationError("rabbitmq max_message_bytes must be at least 1")
        self.max_message_bytes = max_message_bytes
        if not 0 <= heartbeat_seconds <= 600 or not 0 < connect_timeout_seconds <= 600:
            raise ConfigurationError("rabbitmq: heartbeat 0-600 s, connect timeout more than 0 and at most 600 s")
        if not 0 <= unavailable_seconds <= 3600:
            raise ConfigurationError("rabbitmq unavailable_seconds must be 0-3600")
        self.broker = Broker(url, password=password, tls=tls, heartbeat_seconds=heartbeat_seconds,
                             connect_timeout_seconds=connect_timeout_seconds,
                             blocked_timeout_seconds=blocked_timeout_seconds, unavailable_seconds=unavailable_seconds,
                             client_name=f"outbox-relay {name}")
        self.endpoint = self.broker.endpoint
        if tls is not None and not tls.verify:
            log.warning("rabbitmq sink %s: TLS certificate verification is OFF for %s", name, self.endpoint)
        self._local = threading.local()
        self._lock = threading.Lock()
        self._links: set[Link] = set()  # every thread's link, for idle() and close()

    def __repr__(self) -> str:
        return f"RabbitMQSink(name={self.name!r}, endpoint={self.endpoint!r})"

    # -- the contract

    def deliver(self, event: SinkEvent) -> Delivered | GiveUp:
        message = message_of(event, sink=self.name, source=self.source, default_exchange=self.default_exchange,
                             max_bytes=self.max_message_bytes)
        if isinstance(message, GiveUp):
            return message
        errors = self._pika.exceptions
        properties = message.properties(str(event.id), self._pika)
        for fresh in (False, True):
            link = self._link(fresh)
            reused = link.used
            with link.lock:
                try:
                    channel = self._channel(link, message.exchange)
                    channel.basic_publish(message.exchange, message.routing_key, message.body, properties,
                                          mandatory=True)
                except errors.UnroutableError:
                    raise SinkUnavailable(
                        f"{self.endpoint}: exchange {message.exchange!r} routed the message (routing key "
                        f"{message.routing_key[:100]!r}) to no queue: bind a queue for it (the event waits)",
                        self.broker.unavailable_seconds) from None
                except errors.NackError:
                    raise SinkUnavailable(
                        f"{self.endpoint}: the broker refused the message on exchange {message.exchange!r} (nack: "
                        "a queue at its max length with x-overflow=reject-publish, or an internal error; the "
                        "event waits)", self.broker.unavailable_seconds) from None
                except errors.ChannelClosedByBroker as exc:
                    link.channel = None
                    link.declared.clear()
                    why = refusal(int(exc.reply_code), str(exc.reply_text), message.exchange)
                    if isinstance(why, GiveUp):
                        return GiveUp(f"{self.endpoint}: {why.reason}")
                    raise SinkUnavailable(f"{self.endpoint}: {why}; its events wait",
                                          self.broker.unavailable_seconds) from None
                except (errors.AMQPError, OSError, AssertionError) as exc:
                    # AssertionError: pika's own checks on a connection it found dead midway.
                    self._drop(link)
                    if reused and not fresh:
                        # A connection the broker closed while it was idle: that publish never reached it.
                        # Once more on a new one (consumers dedupe by message_id if it did).
                        continue
                    raise SinkUnavailable(f"{self.endpoint}: connection lost while publishing: {describe(exc)}",
                                          self.broker.unavailable_seconds) from None
                except BaseException:
                    self._drop(link)  # a publish cut short leaves the channel's confirm count unknown
                    raise
                link.used = True
                return Delivered()
        raise AssertionError("unreachable")  # the loop returns or raises

    def idle(self) -> None:
        """Between batches (the runner's thread): let each idle connection send and read heartbeats, so the
        broker keeps it; a lane busy on its link (a call past the time limit) is left alone."""
        with self._lock:
            links = list(self._links)
        for link in links:
            if not link.lock.acquire(blocking=False):
                continue
            try:
                link.connection.process_data_events(0)
            except Exception as exc:  # closed while idle: the next publish on that lane opens a new one
                log.debug("rabbitmq sink %s: an idle connection was lost: %s", self.name, describe(exc))
                self._forget(link)
            finally:
                link.lock.release()

    def close(self) -> None:
        with self._lock:
            links, self._links = self._links, set()
        for link in links:
            _close(link)

    # -- AMQP

    def _link(self, fresh: bool) -> Link:
        link: Link | None = getattr(self._local, "link", None)
        if link is not None and not fresh and link.connection.is_open:
            return link
        if link is not None:
            self._drop(link)
        link = Link(self.broker.connect())  # SinkUnavailable if it can not
        self._local.link = link
        with self._lock:
            self._links.add(link)
        return link

    def _channel(self, link: Link, exchange: str) -> Any:
        if link.channel is None or not link.channel.is_open:
            channel = link.connection.channel()
            channel.confirm_delivery()
            link.channel = channel
        if self.declare_exchange is not None and exchange not in link.declared:
            link.channel.exchange_declare(exchange, self.declare_exchange, durable=True)
            link.declared.add(exchange)
        return link.channel

    def _forget(self, link: Link) -> None:
        with self._lock:
            self._links.discard(link)

    def _drop(self, link: Link) -> None:
        self._forget(link)
        if getattr(self._local, "link", None) is link:
            self._local.link = None
        _close(link)


def refusal(code: int, text: str, exchange: str) -> GiveUp | str:
    """Why the broker closed the channel over a message: GiveUp if for the message's size (the event's fault),
    else the reason the sink is held."""
    if code == 406 and "max size" in text:
        return GiveUp(f"the broker refused the message for its size: {text}")
    if code == 404:
        return f"exchange {exchange!r} does not exist (declare it, or pass --rabbitmq-declare-exchange TYPE)"
    if code == 403:
        return f"the user may not write to exchange {exchange!r} ({text})"
    if code == 406:
        return f"exchange {exchange!r} is not what --rabbitmq-declare-exchange asks for ({text})"
    return f"the broker closed the channel: {code} {text}"


def _close(link: Link) -> None:
    try:
        if link.connection.is_open:
            link.connection.close()
    except Exception as exc:  # already gone: nothing to release
        log.debug("rabbitmq: closing a connection failed: %s", describe(exc))


# -- configuration --------------------------------------------------------------------------------


def from_settings(settings: RabbitMQFields, source: str | None = None) -> RabbitMQSink:
    """The RabbitMQ sink that ``settings`` (``rabbitmq_*``) describe; ConfigurationError without a URL."""
    s = settings
    if not s.rabbitmq_url:
        raise ConfigurationError("no RabbitMQ URL: pass --rabbitmq-url or set OUTBOX_RABBITMQ_URL")
    password = (read_password(s.rabbitmq_password_file) if s.rabbitmq_password_file is not None
                else s.rabbitmq_password.get_secret_value() if s.rabbitmq_password is not None else None)
    tls = None
    if s.rabbitmq_ca_file or s.rabbitmq_client_cert or s.rabbitmq_client_key or not s.rabbitmq_tls_verify:
        tls = Tls(s.rabbitmq_ca_file, s.rabbitmq_client_cert, s.rabbitmq_client_key, s.rabbitmq_tls_verify)
    return RabbitMQSink(
        s.rabbitmq_url, name=s.rabbitmq_sink, password=password,
        source=source or str(getattr(s, "source", "outbox-relay")), concurrency=s.rabbitmq_concurrency,
        topics=s.rabbitmq_topics or None, default_exchange=s.rabbitmq_default_exchange,
        declare_exchange=s.rabbitmq_declare_exchange, max_message_bytes=s.rabbitmq_max_message_bytes,
        heartbeat_seconds=s.rabbitmq_heartbeat_seconds, connect_timeout_seconds=s.rabbitmq_connect_timeout_seconds,
        blocked_timeout_seconds=s.rabbitmq_blocked_timeout_seconds, tls=tls,
        unavailable_seconds=s.rabbitmq_unavailable_seconds)


def from_env() -> RabbitMQSink:
    """The sink the ``OUTBOX_RABBITMQ_*`` variables describe: ``--sink outbox_relay.sinks.rabbitmq:from_env``."""
    from pydantic import ValidationError

    from ...rabbitmq_settings import RabbitMQSettings
    from ...settings import describe_validation_error

    try:
        settings = RabbitMQSettings()
    except ValidationError as exc:
        raise ConfigurationError(f"invalid RabbitMQ settings: {describe_validation_error(exc)}") from None
    return from_settings(settings, settings.source)


__all__ = ["RabbitMQSink", "from_env", "from_settings", "refusal"]
