"""The inbox consumer: Kafka partitions leased through PostgreSQL, each message applied exactly once.

Why ``assign()`` with positions and leases in PostgreSQL, not a consumer group: the position must
commit in the handler's transaction anyway (a group's committed offsets would be a second,
non-transactional copy), the relays already coordinate through PostgreSQL the same way (leases with
fences, heartbeats, an even share per live process), and a group join costs a rebalance round
(about 20 s on Tansu) at every start, crash and deploy. A partition is applied by the process that
holds its lease; an apply locks the partition's row and checks the lease's fence, so a process that
lost its lease writes nothing.

Order: one thread applies the messages of all leased partitions, each partition in offset order. A
message whose handler fails holds its partition only (the partition is unassigned from the Kafka
client meanwhile; others go on) and is retried with backoff; after ``max_attempts`` it goes to the
inbox's dead letters and the partition moves on: a poison message never blocks a partition for
longer than its attempts' backoff.

Crash loops: a handler that kills the process (out of memory, a crash in native code, os._exit, a
watchdog's SIGKILL) reports no failure. A partition claimed from a holder that did not release its
lease (``lapsed``) is therefore applied carefully: its next message alone, with the attempt recorded in
``positions`` (committed) before it is made, then batches of 2, 4, ... up to ``batch_size``; a retry of
a failed message is made alone and recorded the same way. A process that dies during a recorded
attempt has spent one of the message's ``max_attempts``; the holder after the last one dead-letters it
without calling the handler. Healthy batches write nothing extra.

A broker that lost its log (memory storage, a rebuilt cluster) numbers a topic's messages from 0
again: each claimed partition is *verified* (outbox_relay.inbox.partitions), and again after the client
lost every broker. The parts: PartitionBook (the held partitions and the Kafka assignment), store.py (the
transactions), applier.py (attempts, holds, dead letters), membership.py (heartbeat, leases, the
share), upkeep.py (dead letters to retry, retention), and this loop that runs them.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import TYPE_CHECKING, Any

import psycopg
from confluent_kafka import Consumer, KafkaError

from ..backoff import Backoff
from .applier import DATABASE_BACKOFF, Applier
from .incarnation import Run
from .membership import Membership
from .message import InboxMessage
from .partitions import PartitionBook, Stats
from .schema import connect
from .settings import InboxSettings
from .store import Handler, InboxStuck
from .upkeep import housekeeping

if TYPE_CHECKING:
    from prometheus_client import CollectorRegistry

    from ..metrics import EndpointServer

log = logging.getLogger("outbox_relay.inbox")

DEAD_LETTER_CHECK_SECONDS = 1.0  # how often a consumer looks for dead letters an operator asked to retry
WATERMARK_SECONDS = 1.0  # with metrics on: how often the partitions' high watermarks are read (no request)


class InboxConsumer:
    """``start()``, then ``run_once()`` in a loop (``run(stop)`` does both), then ``close()``."""

    def __init__(self, settings: InboxSettings, handler: Handler, *, backoff: Backoff | None = None) -> None:
        self.settings = settings
        self.handler = handler
        self.backoff = backoff or Backoff(settings.backoff_base_seconds, settings.backoff_max_seconds)
        self.stats = Stats()
        self.book = PartitionBook(settings, self.stats)
        self.partitions = self.book.partitions  # the same dict (the metrics' gauges read it)
        self.membership = Membership(settings, self.book, self.stats)
        self._next_membership = 0.0
        self._next_dead_letters = 0.0
        self._next_housekeeping = 0.0
        self._next_watermarks = 0.0
        self._brokers_lost = False  # set by the client's error callback, on this thread (inside poll)
        self._closing = False
        self._registry: CollectorRegistry | None = None
        self._endpoints: EndpointServer | None = None
        if settings.metrics_port is not None:
            from prometheus_client import CollectorRegistry

            from .metrics import timed

            self._registry = CollectorRegistry()
            self.handler = timed(handler, self._registry, settings.consumer)
        self.applier = Applier(settings, self.handler, self.backoff, self.book, self.stats)
        self.limit = self.applier.limit

    @property
    def dsn(self) -> str:
        return self.settings.dsn.get_secret_value()

    @property
    def share(self) -> int:
        """Partitions this process should hold, from the last membership round (for the gauges)."""
        return self.membership.share

    @property
    def this_run(self) -> Run:
        return self.membership.this_run

    @property
    def _control(self) -> psycopg.Connection[Any] | None:
        return self.membership.control

    @property
    def _db(self) -> psycopg.Connection[Any] | None:
        return self.applier.db

    # -- lifecycle --------------------------------------------------------------------------

    def start(self) -> None:
        self.membership.connect()
        self.applier.db = connect(self.dsn)
        self.book.kafka = Consumer({**self.settings.consumer_config(), "error_cb": self._on_error,
                                    "logger": logging.getLogger("outbox_relay.librdkafka")})
        if self._registry is not None and self.settings.metrics_port is not None:
            from .metrics import serve

            self._endpoints = serve(self, self._registry, self.settings.metrics_host, self.settings.metrics_port)
            self._endpoints.start()
        log.info("inbox consumer %s (member %s) consuming %s", self.settings.consumer, self.settings.member_id,
                 ", ".join(self.settings.topics))

    def run(self, stop: threading.Event) -> None:
        try:
            self.start()
            while not stop.is_set():
                try:
                    self.run_once()
                except InboxStuck:
                    raise
                except Exception:  # one failure never ends the consumer: log it and go on
                    log.exception("inbox consumer: unexpected error; going on in 1s")
                    stop.wait(1.0)
        finally:
            self.close()

    def close(self) -> None:
        """Give the leases up now (another process takes the partitions at once) and disconnect."""
        self._closing = True
        self.membership.leave()
        if self._db is not None:
            self._db.close()
        if self.book.kafka is not None:
            self.book.kafka.close()
            self.book.kafka = None
        self.limit.close()
        self.partitions.clear()
        if self._endpoints is not None:
            self._endpoints.close()
            self._endpoints = None

    @property
    def metrics_port(self) -> int | None:
        """The port /metrics, /healthz and /readyz are served on (None: off or not started)."""
        return self._endpoints.port if self._endpoints is not None else None

    def health(self) -> list[str]:
        """Why this process is not alive and in touch with its database; empty when it is."""
        return self.membership.health()

    def readiness(self) -> list[str]:
        """Why this process is not doing its share; empty when it does."""
        return self.membership.readiness(self._closing)

    def _on_error(self, err: KafkaError) -> None:
        if err.code() == KafkaError._ALL_BROKERS_DOWN:
            self._brokers_lost = True
        log.log(logging.ERROR if err.fatal() else logging.INFO, "kafka: %s", err.str())

    # -- the loop ---------------------------------------------------------------------------

    def run_once(self) -> int:
        """One round: membership when due, due retries, one poll of messages; returns messages handled."""
        now = time.monotonic()
        if now >= self._next_membership:
            self.membership.round()
            self._next_membership = now + self.membership.renew_seconds
        handled = self.applier.retry_held()
        if now >= self._next_dead_letters:
            handled += self.applier.retry_dead_letters()
            self._next_dead_letters = now + DEAD_LETTER_CHECK_SECONDS
        if now >= self._next_housekeeping:
            self.housekeeping()
            self._next_housekeeping = now + self.settings.housekeeping_seconds
        self.book.check_verifications()
        if self._endpoints is not None and now >= self._next_watermarks:
            self.book.watermarks()
            self._next_watermarks = now + WATERMARK_SECONDS
        assert self.book.kafka is not None
        if not any(p.held is None for p in self.partitions.values()):
            time.sleep(self.settings.poll_seconds)
            return handled
        self.book.reassigned.clear()
        groups: dict[tuple[str, int], list[InboxMessage]] = {}
        for m in self.book.kafka.consume(num_messages=500, timeout=self.settings.poll_seconds):
            message = self.book.accept(m)
            if message is not None:
                groups.setdefault((message.topic, message.partition), []).append(message)
        for key, messages in groups.items():
            i = 0
            while i < len(messages):
                p = self.partitions.get(key)
                if p is None or p.held is not None or key in self.book.reassigned:
                    break  # the rest is read again from the partition's position
                n, handled_now = self.applier.apply_next(p, messages[i:])
                handled += handled_now
                i += n
        self.book.reassigned.clear()
        if self._brokers_lost:
            self._brokers_lost = False
            self.book.verify_all("the client lost every broker")
        return handled

    def housekeeping(self) -> int:
        """Delete dedupe records past retention (outbox_relay.inbox.upkeep); returns how many."""
        assert self._control is not None
        return housekeeping(self._control, self.settings)


__all__ = ["DATABASE_BACKOFF", "DEAD_LETTER_CHECK_SECONDS", "WATERMARK_SECONDS", "InboxConsumer", "Stats"]
