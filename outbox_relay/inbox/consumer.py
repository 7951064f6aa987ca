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
transactions), upkeep.py (dead letters to retry, retention), and this loop with the membership rounds.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from typing import TYPE_CHECKING, Any

import psycopg
from confluent_kafka import Consumer, KafkaError

from ..backoff import Backoff
from ..crashloop import FIRST_PROBE, HEALTHY, next_probe_size
from ..dsn import redact
from ..errors import LeaseLost, counted
from ..sqlfiles import query
from .incarnation import Run
from .message import InboxMessage
from .partitions import Partition, PartitionBook, Stats
from .schema import check_inbox_schema, connect
from .settings import InboxSettings
from .store import (
    CRASH_ERROR,
    Handler,
    HandlerTimeout,
    InboxStuck,
    Lease,
    TimeLimit,
    apply_batch,
    dead_letter,
    record_attempt,
    record_failure,
)
from .upkeep import housekeeping, retry_dead_letters, try_connect, usable

if TYPE_CHECKING:
    from prometheus_client import CollectorRegistry

    from ..metrics import EndpointServer

log = logging.getLogger("outbox_relay.inbox")

DEAD_LETTER_CHECK_SECONDS = 1.0  # how often a consumer looks for dead letters an operator asked to retry
WATERMARK_SECONDS = 1.0  # with metrics on: how often the partitions' high watermarks are read (no request)
DATABASE_BACKOFF = Backoff(0.5, 10.0)  # a database that is down: the message waits, no attempt counted


class InboxConsumer:
    """``start()``, then ``run_once()`` in a loop (``run(stop)`` does both), then ``close()``."""

    def __init__(self, settings: InboxSettings, handler: Handler, *, backoff: Backoff | None = None) -> None:
        self.settings = settings
        self.handler = handler
        self.backoff = backoff or Backoff(settings.backoff_base_seconds, settings.backoff_max_seconds)
        self.limit = TimeLimit(settings.handler_timeout_seconds)
        self.stats = Stats()
        self.book = PartitionBook(settings, self.stats)
        self.partitions = self.book.partitions  # the same dict (the metrics' gauges read it)
        self._known: dict[str, int] = {}  # topic -> partition count, from the broker's metadata
        self._db: psycopg.Connection[Any] | None = None  # applies (transactions); the consumer's thread only
        self._control: psycopg.Connection[Any] | None = None  # leases, heartbeats (autocommit)
        self._next_membership = 0.0
        self._next_dead_letters = 0.0
        self._next_housekeeping = 0.0
        self._next_watermarks = 0.0
        self._db_failures = 0
        self._brokers_lost = False  # set by the client's error callback, on this thread (inside poll)
        self.this_run = Run(settings.consumer, settings.member_id, settings.lease_seconds)  # its leases are its own
        # For /healthz, /readyz and the gauges (read by the metrics server's threads): written by this thread.
        self.share = 0  # partitions this process should hold, from the last membership round
        self._membership_ok_at: float | None = None  # monotonic time of the last membership round that went through
        self._broker_answered = False  # the last metadata request got an answer
        self._closing = False
        self._registry: CollectorRegistry | None = None
        self._endpoints: EndpointServer | None = None
        if settings.metrics_port is not None:
            from prometheus_client import CollectorRegistry

            from .metrics import timed

            self._registry = CollectorRegistry()
            self.handler = timed(handler, self._registry, settings.consumer)

    @property
    def dsn(self) -> str:
        return self.settings.dsn.get_secret_value()

    def _lease(self, p: Partition) -> Lease:
        return Lease(self.settings.consumer, self.settings.member_id, p.fence)

    # -- lifecycle --------------------------------------------------------------------------

    def start(self) -> None:
        self._control = connect(self.dsn, autocommit=True)
        check_inbox_schema(self._control)
        self._db = connect(self.dsn)
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
        if self._control is not None and not self._control.closed:
            try:
                self._control.execute(query("inbox", "leave"), self.this_run.params())
            except psycopg.Error as exc:
                log.warning("could not release the leases (they lapse after %gs): %s", self.settings.lease_seconds,
                            redact(str(exc)))
            self._control.close()
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
        """Why this process is not alive and in touch with its database; empty when it is. A loop held up
        by a handler for longer than its time limit, or a database unreachable for as long, fails it."""
        if self._membership_ok_at is None:
            return ["not registered yet (waiting for the database and the broker)"]
        silent = time.monotonic() - self._membership_ok_at
        if silent > self.settings.lease_seconds + self.settings.handler_timeout_seconds:
            return [f"no heartbeat reached the database for {silent:.0f}s"]
        return []

    def readiness(self) -> list[str]:
        """Why this process is not doing its share; empty when its heartbeat renews its leases in time, the
        brokers answer, and it is not stopping."""
        problems = self.health()
        if self._closing:
            problems.append("stopping")
        if self._membership_ok_at is not None:
            silent = time.monotonic() - self._membership_ok_at
            if silent > self.settings.lease_seconds and not problems:
                problems.append(f"its leases were not renewed for {silent:.0f}s (--lease-seconds "
                                f"{self.settings.lease_seconds:g})")
        if not self._broker_answered:
            problems.append("the brokers did not answer the last metadata request")
        return problems

    def _on_error(self, err: KafkaError) -> None:
        if err.code() == KafkaError._ALL_BROKERS_DOWN:
            self._brokers_lost = True
        log.log(logging.ERROR if err.fatal() else logging.INFO, "kafka: %s", err.str())

    # -- the loop ---------------------------------------------------------------------------

    def run_once(self) -> int:
        """One round: membership when due, due retries, one poll of messages; returns messages handled."""
        now = time.monotonic()
        if now >= self._next_membership:
            self._membership()
            self._next_membership = now + self.settings.lease_seconds / 3
        handled = self._retry_held()
        if now >= self._next_dead_letters:
            handled += self._retry_dead_letters()
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
                n, handled_now = self._apply_next(p, messages[i:])
                handled += handled_now
                i += n
        self.book.reassigned.clear()
        if self._brokers_lost:
            self._brokers_lost = False
            self.book.verify_all("the client lost every broker")
        return handled

    # -- membership: heartbeat, leases, an even share -------------------------------------

    def _membership(self) -> None:
        assert self._control is not None and self.book.kafka is not None
        s = self.settings
        try:
            self.this_run.joined(self._control.execute(query("inbox", "join"), self.this_run.params()).fetchone())
            self._discover()
            topics = list(self.settings.topics)
            held = {(r[0], r[1]): r[2] for r in self._control.execute(query("inbox", "renew"), {
                **self.this_run.params(), "topics": topics, "lease": s.lease_seconds})}
            for key, p in list(self.partitions.items()):
                if held.get(key) != p.fence:
                    log.warning("lost the lease of %s/%d: another process applies it now", *key)
                    self.book.drop(p)
            row = self._control.execute(query("inbox", "live_members"),
                                        {"consumer": s.consumer, "ttl": s.lease_seconds}).fetchone()
            live = max(1, int(row[0]) if row else 1)
            total = sum(self._known.values())
            share = self.share = math.ceil(total / live) if total else 0
            for p in sorted(self.partitions.values(), key=lambda p: p.tp)[share:]:
                self._release(p)
            if len(self.partitions) < share:
                claimed = self._control.execute(query("inbox", "claim"), {
                    **self.this_run.params(), "topics": topics, "lease": s.lease_seconds,
                    "limit": share - len(self.partitions)}).fetchall()
                for topic, partition, fence, next_offset, last_id, lapsed, attempt_id, attempts, error in claimed:
                    p = Partition(topic, partition, fence, next_offset, last_id, attempt_id=attempt_id,
                                   attempts=attempts, last_error=error or "")
                    if lapsed:
                        # Its holder may have died of the next message: that one goes alone, recorded.
                        p.ramp = FIRST_PROBE
                        self.stats.lapses += 1
                        log.warning("%s/%d was claimed from a process that stopped without releasing it: its next "
                                    "message is applied alone, its attempt recorded first (a crash counts)",
                                    topic, partition)
                    self.book.take(p)
            self._membership_ok_at = time.monotonic()
        except psycopg.OperationalError as exc:
            # Leases run out meanwhile; the next round renews or finds them lost. Reconnect then.
            log.warning("inbox membership: database unavailable: %s", redact(str(exc)))
            if self._control.closed or self._control.broken:
                self._control = try_connect(self.dsn, autocommit=True) or self._control

    def _discover(self) -> None:
        """Partitions of the topics, from the broker; a broker that does not answer keeps the last ones."""
        assert self._control is not None and self.book.kafka is not None
        topics: list[str] = []
        partitions: list[int] = []
        answered = False
        for topic in self.settings.topics:
            try:
                md = self.book.kafka.list_topics(topic, timeout=2.0).topics.get(topic)
            except Exception as exc:  # KafkaException: broker unreachable
                log.debug("metadata of %s: %s", topic, exc)
                continue
            answered = True
            if md is None or md.error is not None or not md.partitions:
                continue
            self._known[topic] = len(md.partitions)
            for partition in md.partitions:
                topics.append(topic)
                partitions.append(partition)
        self._broker_answered = answered
        if topics:
            self._control.execute(query("inbox", "add_partitions"),
                                  {"consumer": self.settings.consumer, "topics": topics, "partitions": partitions})

    def _release(self, p: Partition) -> None:
        assert self._control is not None
        self.book.drop(p)
        self._control.execute(query("inbox", "release"), {"consumer": self.settings.consumer, "topic": p.topic,
                                                          "partition": p.partition, "member": self.settings.member_id,
                                                          "fence": p.fence})
        log.info("released %s/%d (more than this process's share)", p.topic, p.partition)

    # -- messages ---------------------------------------------------------------------------

    def _apply_next(self, p: Partition, messages: list[InboxMessage]) -> tuple[int, int]:
        """Apply the next batch of ``messages`` (consecutive, of ``p``): (how many the batch took, how many
        were applied or skipped). A batch that does not pass all it took holds, drops or re-reads ``p``."""
        first = messages[0]
        problem = first.id_problem
        if problem is not None:
            p.attempt_id, p.attempts = first.id, 0
            self._give_up(p, first, f"not applied: {problem}")
            return 1, 0
        if first.id == p.attempt_id or p.ramp == FIRST_PROBE:
            return 1, self._apply_alone(p, first)
        size = self.settings.batch_size if p.ramp == HEALTHY else min(p.ramp, self.settings.batch_size)
        batch = messages[:size]
        # A message whose id can not be stored ends the batch: its turn comes next, alone (above).
        unusable = next((i for i, m in enumerate(batch) if m.id_problem is not None), len(batch))
        batch = batch[:unusable]
        return len(batch), self._apply(p, batch)

    def _apply_alone(self, p: Partition, message: InboxMessage) -> int:
        """An attempt that may end the process (a retry, or the first message after a lapse): recorded,
        committed, before it is made; past ``max_attempts`` the message is dead-lettered uncalled."""
        if not self._connected(p, message):
            return 0
        assert self._db is not None
        made = p.attempts if p.attempt_id == message.id else 0
        if made >= self.settings.max_attempts:
            p.attempt_id, p.attempts = message.id, made
            self._give_up(p, message, p.last_error or CRASH_ERROR)
            return 0
        try:
            record_attempt(self._db, self._lease(p), message, made + 1)
        except LeaseLost as exc:
            log.warning("%s", exc)
            self.book.drop(p)
            return 0
        except psycopg.Error as exc:
            log.warning("database: %s: %s", type(exc).__name__, redact(str(exc)))
            self._hold_for_database(p, message)
            return 0
        p.attempt_id, p.attempts, p.last_error = message.id, made + 1, CRASH_ERROR
        return self._apply(p, [message], recorded=True)

    def _connected(self, p: Partition, message: InboxMessage) -> bool:
        assert self._db is not None
        db = usable(self._db, self.dsn)
        if db is None:
            self._hold_for_database(p, message)
            return False
        self._db = db
        return True

    def _apply(self, p: Partition, messages: list[InboxMessage], recorded: bool = False) -> int:
        """Apply consecutive messages of ``p`` in one transaction; returns how many were applied or skipped.
        ``recorded``: the one message's attempt is already counted (``_apply_alone``)."""
        if not self._connected(p, messages[0]):
            if recorded:
                p.attempts -= 1  # not the message's doing; the next record writes the count again
            return 0
        assert self._db is not None
        try:
            batch = apply_batch(self._db, self._lease(p), messages, self.handler, self.limit)
        except LeaseLost as exc:
            log.warning("%s", exc)
            self.book.drop(p)
            return 0
        except InboxStuck:
            raise
        except Exception as exc:
            # Nothing of the batch committed. A handler past its time limit: the messages before it
            # again, then its own failure; a database that went away: the first message waits.
            index = getattr(exc, "inbox_index", 0)
            if isinstance(exc, HandlerTimeout):
                done = self._apply(p, messages[:index]) if index else 0
                if p.tp in self.partitions and (p.held is None or p.held is messages[index]):
                    self._failed(p, messages[index], f"{type(exc).__name__}: {exc}", recorded)
                return done
            # The inbox's own statements failed (the database went away, a lock or statement timeout):
            # not the message's fault, so no attempt is counted; the first message waits.
            log.warning("database: %s: %s", type(exc).__name__, redact(str(exc)))
            if recorded:
                p.attempts -= 1
            self._hold_for_database(p, messages[0])
            return 0
        self._db_failures = 0
        done = len(batch.outcomes)
        if done:
            last = messages[done - 1]
            p.next_offset, p.last_message_id = last.offset + 1, last.id
            applied = batch.outcomes.count("applied")
            self.stats.applied += applied
            self.stats.duplicates += done - applied
            if p.attempt_id is not None and messages[0].id == p.attempt_id:
                p.attempt_id, p.attempts, p.last_error = None, 0, ""  # ``advance`` cleared the record too
            if p.held is not None:  # a retry that succeeded: read on after it
                p.held = None
                self.book.assign(p, last.offset + 1)
        if batch.failure is not None:
            error = batch.failure
            self._failed(p, messages[done], f"{type(error).__name__}: {error}", recorded)
        elif p.ramp != HEALTHY:
            p.ramp = next_probe_size(p.ramp, self.settings.batch_size)
        return done

    def _hold_for_database(self, p: Partition, message: InboxMessage) -> None:
        self._db_failures += 1
        self.book.hold(p, message, DATABASE_BACKOFF.delay(self._db_failures))

    def _failed(self, p: Partition, message: InboxMessage, error: str, recorded: bool = False) -> None:
        if p.attempt_id != message.id:
            p.attempt_id, p.attempts = message.id, 0
        if not recorded:
            p.attempts += 1
        elif self._db is not None and not self._db.closed and not self._db.broken:
            # The record says "the process stopped" until now: keep the real error for a later holder.
            try:
                record_failure(self._db, self._lease(p), message, error)
            except psycopg.Error as exc:
                log.debug("could not record the error of %s/%d@%d: %s", message.topic, message.partition,
                          message.offset, redact(str(exc)))
        p.last_error = error
        if p.attempts < self.settings.max_attempts:
            self.stats.retries += 1
            delay = self.backoff.delay(p.attempts)
            log.warning("handler failed on %s/%d@%d (id %s), attempt %d of %d, retry in %.1fs: %s", message.topic,
                        message.partition, message.offset, message.id, p.attempts, self.settings.max_attempts, delay,
                        error)
            self.book.hold(p, message, delay)
            return
        self._give_up(p, message, error)

    def _give_up(self, p: Partition, message: InboxMessage, error: str) -> None:
        """Dead-letter the head message after its last attempt, and read the partition on after it."""
        assert self._db is not None
        self._db = usable(self._db, self.dsn) or self._db
        try:
            dead_letter(self._db, self._lease(p), message, p.attempts, error)
        except LeaseLost as exc:
            log.warning("%s", exc)
            self.book.drop(p)
            return
        except psycopg.OperationalError as exc:
            log.warning("database unavailable: %s", redact(str(exc)))
            self._hold_for_database(p, message)  # its next turn finds the attempts spent: dead-letters it
            return
        log.error("%s/%d@%d (id %s): %s failed: moved to the inbox's dead letters: %s", message.topic,
                  message.partition, message.offset, message.id, counted(p.attempts, "attempt"), error)
        self.stats.dead += 1
        if p.held is None:
            self.book.unassign(p)
        p.held, p.attempt_id, p.attempts, p.last_error = None, None, 0, ""
        p.next_offset, p.last_message_id = message.offset + 1, message.id
        # Messages after it may have been fetched with it and not applied: read on from right after it.
        self.book.assign(p, message.offset + 1)

    def _retry_held(self) -> int:
        now = time.monotonic()
        handled = 0
        for p in list(self.partitions.values()):
            if p.held is not None and now >= p.retry_at and p.tp in self.partitions:
                handled += self._apply_next(p, [p.held])[1]
        return handled

    def _retry_dead_letters(self) -> int:
        assert self._db is not None
        done, self._db = retry_dead_letters(self._db, self.dsn, self.settings, self.handler, self.limit)
        return done

    def housekeeping(self) -> int:
        """Delete dedupe records past retention (outbox_relay.inbox.upkeep); returns how many."""
        assert self._control is not None
        return housekeeping(self._control, self.settings)
