"""The Redis Streams sink: ``XADD`` each event to the stream of its topic, pipelined.

Delivered means the server's reply to the event's ``XADD`` (the new entry's id): the entry is in the
stream, as durable as the server's persistence makes it (``appendonly yes`` with ``appendfsync always``: on
disk before the reply; see docs/redis.md). The relay's adapter calls ``deliver_many`` with the next event of
each of up to ``concurrency`` keys (sinks/waves.py), and they go out in one pipeline, one round trip, each
``XADD`` answered on its own; a key's next event goes only once the previous one was acknowledged, so a
key's events reach their stream (one per topic) in publish order. Redelivery may repeat an entry, so
consumers dedupe by its ``id`` field. Order per key, retries, dead letters and fencing are the relay's; this
module only speaks Redis.

Outcomes, per event: the reply is ``Delivered``; a connection error, a timeout (for the whole pipeline:
which of its entries landed is not known, and they are sent again) and a server that can not take writes
now (auth refused, ACL, OOM, read-only replica, loading, a key of another type) are ``SinkUnavailable`` (no
attempt counted, never a dead letter); an event that can not be an entry (no topic, too large) is a
``GiveUp``; any other error of the server is a ``Retry`` with its message.
"""

from __future__ import annotations

import logging
from collections.abc import Collection, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ...errors import ConfigurationError
from ..user import MAX_CONCURRENCY, Delivered, GiveUp, Retry, SinkEvent, SinkUnavailable
from .connection import check_url, condition, connect, read_password, redis_module
from .message import DEFAULT_MAX_ENTRY_BYTES, PREFIX, entry, stream_of

if TYPE_CHECKING:
    from ...redis_settings import RedisFields

log = logging.getLogger("outbox_relay.redis")

UNAVAILABLE_SECONDS = 2.0  # the wait after a failure of the server or the connection


class RedisStreamsSink:
    """``XADD``s each event to ``stream_prefix`` + its topic. An ``EventSink`` (outbox_relay.sinks) with
    ``deliver_many``: ``concurrency`` is how many keys' events one pipeline holds.

    Thread-safe: the client's connection pool gives each calling thread a connection of its own."""

    kind = "redis"

    def __init__(self, url: str, *, name: str = "redis", source: str = "outbox-relay",
                 default_topic: str | None = None, stream_prefix: str = "", maxlen: int | None = None,
                 concurrency: int = 64, topics: Collection[str] | None = None, types: Collection[str] | None = None,
                 password: str | None = None, password_file: Path | None = None, timeout_seconds: float = 5.0,
                 max_entry_bytes: int = DEFAULT_MAX_ENTRY_BYTES, ca_file: Path | None = None,
                 client_cert: Path | None = None, client_key: Path | None = None, verify_tls: bool = True,
                 unavailable_seconds: float | None = None) -> None:
        self.name = name
        self.source = source
        target = check_url(url)
        self.endpoint = target.endpoint  # what logs and reasons show: no credentials
        if not PREFIX.match(stream_prefix):
            raise ConfigurationError("the Redis stream prefix must be at most 200 printable ASCII characters, no "
                                     "spaces")
        self.stream_prefix = stream_prefix
        self.default_topic = default_topic
        if maxlen is not None and maxlen < 1:
            raise ConfigurationError("the Redis stream MAXLEN must be at least 1 (or none: no trimming)")
        self.maxlen = maxlen
        if not 1 <= concurrency <= MAX_CONCURRENCY:
            raise ConfigurationError(f"Redis sink concurrency must be 1-{MAX_CONCURRENCY} (keys delivered at once)")
        self.concurrency = concurrency
        self.topics = frozenset(topics) if topics is not None else None
        self.types = frozenset(types) if types is not None else None
        if not 0 < timeout_seconds <= 3600:
            raise ConfigurationError("the Redis timeout must be more than 0 and at most 3600 seconds")
        if max_entry_bytes < 1:
            raise ConfigurationError("the Redis sink's max entry bytes must be at least 1")
        self.max_entry_bytes = max_entry_bytes
        # The wait after a failure of the server (tests shrink it, or UNAVAILABLE_SECONDS).
        self.unavailable_seconds = UNAVAILABLE_SECONDS if unavailable_seconds is None else unavailable_seconds
        given = [p for p in (target.password, password, password_file) if p is not None]
        if len(given) > 1:
            raise ConfigurationError("give the Redis password once: in the URL, or as a password file, not both")
        if password_file is not None:
            password = read_password(password_file)
        # One pipeline is in flight at a time; room too for calls past the time limit that still hold a
        # connection until their timeout.
        self._client = connect(target, password=password, timeout_seconds=timeout_seconds, max_connections=8,
                               ca_file=ca_file, client_cert=client_cert, client_key=client_key, verify_tls=verify_tls)
        if target.tls and not verify_tls:
            log.warning("redis sink %s: TLS certificate verification is OFF for %s", name, self.endpoint)
        self._errors: Any = redis_module().exceptions

    def __repr__(self) -> str:
        return f"RedisStreamsSink(name={self.name!r}, endpoint={self.endpoint!r})"

    # -- the contract

    def deliver(self, event: SinkEvent) -> Delivered | Retry | GiveUp:
        answer = self.deliver_many([event])[0]
        if isinstance(answer, SinkUnavailable):
            raise answer
        return answer

    def deliver_many(self, events: Sequence[SinkEvent]) -> list[Delivered | Retry | GiveUp | SinkUnavailable]:
        """One pipeline of ``XADD``s for ``events`` (of distinct keys), one round trip: an answer each."""
        answers: list[Delivered | Retry | GiveUp | SinkUnavailable] = []
        sent: list[tuple[int, str]] = []  # (answer's index, stream) of each XADD in the pipeline
        pipe = self._client.pipeline(transaction=False)
        for event in events:
            stream = stream_of(self.stream_prefix, event.topic, self.default_topic)
            fields = stream if isinstance(stream, GiveUp) else entry(event, self.source, self.max_entry_bytes)
            if isinstance(fields, GiveUp):  # no topic, or too large
                answers.append(fields)
                continue
            assert isinstance(stream, str)
            pipe.xadd(stream, fields, maxlen=self.maxlen, approximate=True)  # type: ignore[arg-type]  # bytes keys
            sent.append((len(answers), stream))
            answers.append(Delivered())
        if not sent:
            return answers
        try:
            # Each reply (an entry's id) is the server's acknowledgement of its XADD; an error reply is in its place.
            replies = pipe.execute(raise_on_error=False)
        except self._errors.RedisError as exc:  # the connection, a timeout: none of them is known to have landed
            replies = [exc] * len(sent)
        for (i, stream), reply in zip(sent, replies, strict=True):
            if isinstance(reply, Exception):
                answers[i] = self._failed(stream, reply)
        return answers

    def _failed(self, stream: str, exc: Exception) -> Retry | SinkUnavailable:
        why = condition(exc)
        if why is None:
            return Retry(f"XADD {stream} on {self.endpoint}: {type(exc).__name__}: {exc}")
        return SinkUnavailable(f"XADD {stream} on {self.endpoint}: {why}", self.unavailable_seconds)

    def close(self) -> None:
        self._client.close()
        self._client.connection_pool.disconnect()


# -- configuration --------------------------------------------------------------------------------


def from_settings(settings: RedisFields, *, source: str = "outbox-relay",
                  default_topic: str | None = None) -> RedisStreamsSink:
    """The Redis sink that ``settings`` (``redis_*``) describe; ConfigurationError without a URL."""
    s = settings
    if s.redis_url is None:
        raise ConfigurationError("no Redis URL: pass --redis-url or set OUTBOX_REDIS_URL")
    return RedisStreamsSink(s.redis_url.get_secret_value(), name=s.redis_sink, source=source,
                            default_topic=default_topic, stream_prefix=s.redis_stream_prefix, maxlen=s.redis_maxlen,
                            concurrency=s.redis_concurrency, topics=s.redis_topics or None,
                            password_file=s.redis_password_file, timeout_seconds=s.redis_timeout_seconds,
                            max_entry_bytes=s.redis_max_entry_bytes, ca_file=s.redis_ca_file,
                            client_cert=s.redis_client_cert, client_key=s.redis_client_key,
                            verify_tls=s.redis_tls_verify)


__all__ = ["RedisStreamsSink", "from_settings"]
