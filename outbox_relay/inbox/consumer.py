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
again, so a stored position can point past its end, where nothing ever arrives. Each claimed
partition is therefore *verified*: it is read from the last applied offset, and that message must be
the one applied (``last_message_id``); if another message is there, or nothing arrives for
``verify_seconds`` while the broker answers, the partition is read from the start and the dedupe
records skip what was applied. The same check runs again after the client lost every broker.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from contextlib import suppress
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

import psycopg
from confluent_kafka import OFFSET_BEGINNING, OFFSET_END, Consumer, KafkaError, Message, TopicPartition

from ..backoff import Backoff
from ..dsn import redact
from ..errors import LeaseLost, counted
from ..sqlfiles import query
from .incarnation import Run
from .message import InboxMessage
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
    retry_one_dead_letter,
)

if TYPE_CHECKING:
    from prometheus_client import CollectorRegistry

    from ..metrics import EndpointServer

log = logging.getLogger("outbox_relay.inbox")

DEAD_LETTER_CHECK_SECONDS = 1.0  # how often a consumer looks for dead letters an operator asked to retry
WATERMARK_SECONDS = 1.0  # with metrics on: how often the partitions' high watermarks are read (no request)
DATABASE_BACKOFF = Backoff(0.5, 10.0)  # a database that is down: the message waits, no attempt counted
MAX_RETENTION_BATCHES = 100  # per housekeeping pass; the next pass goes on


@dataclass
class _Partition:
    """A partition this process holds the lease of. Only the consumer's thread touches it."""

    topic: str
    partition: int
    fence: int
    next_offset: int | None
    last_message_id: str | None
    verify_until: float | None = None  # while the log is checked at next_offset - 1 (monotonic deadline)
    held: InboxMessage | None = None  # a message waiting for its next attempt (partition unassigned meanwhile)
    retry_at: float = 0.0
    # Attempts made of the head message ``attempt_id`` that did not succeed (a recorded one counts while it
    # runs), and its last error; loaded from ``positions`` at the claim, written before an attempt alone.
    attempt_id: str | None = None
    attempts: int = 0
    last_error: str = ""
    # After a lapse (the holder before stopped without releasing): the size of the next batch, doubling
    # after each one that commits; 1: alone and recorded. None: batch_size.
    ramp: int | None = None
    # For the lag gauge: the high watermark of the last fetch (librdkafka's cache; -1: none yet) and the
    # offset after the last message fetched (-1: none).
    high_watermark: int = -1
    fetched_end: int = -1

    @property
    def tp(self) -> tuple[str, int]:
        return self.topic, self.partition


@dataclass
class Stats:
    applied: int = 0
    duplicates: int = 0
    dead: int = 0
    retries: int = 0  # failed attempts that will be retried
    log_resets: int = 0  # partitions read again from the start (the broker lost the log)
    gaps: int = 0  # offsets a partition skipped
    lapses: int = 0  # partitions claimed from a holder that stopped without releasing them (crashed, killed)


class InboxConsumer:
    """``start()``, then ``run_once()`` in a loop (``run(stop)`` does both), then ``close()``."""

    def __init__(self, settings: InboxSettings, handler: Handler, *, backoff: Backoff | None = None) -> None:
        self.settings = settings
        self.handler = handler
        self.backoff = backoff or Backoff(settings.backoff_base_seconds, settings.backoff_max_seconds)
        self.limit = TimeLimit(settings.handler_timeout_seconds)
        self.stats = Stats()
        self.partitions: dict[tuple[str, int], _Partition] = {}
        self._known: dict[str, int] = {}  # topic -> partition count, from the broker's metadata
        self._db: psycopg.Connection[Any] | None = None  # applies (transactions); the consumer's thread only
        self._control: psycopg.Connection[Any] | None = None  # leases, heartbeats (autocommit)
        self._kafka: Consumer | None = None
        self._next_membership = 0.0
        self._next_dead_letters = 0.0
        self._next_housekeeping = 0.0
        self._next_watermarks = 0.0
        self._db_failures = 0
        self._db_retry_at = 0.0
        self._brokers_lost = False  # set by the client's error callback, on this thread (inside poll)
        # Partitions reassigned while a fetched batch is handled: the rest of the batch's messages of
        # them are from before (the client drops what it holds itself, not what it already returned).
        self._reassigned: set[tuple[str, int]] = set()
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

    def _lease(self, p: _Partition) -> Lease:
        return Lease(self.settings.consumer, self.settings.member_id, p.fence)

    # -- lifecycle --------------------------------------------------------------------------

    def start(self) -> None:
        self._control = connect(self.dsn, autocommit=True)
        check_inbox_schema(self._control)
        self._db = connect(self.dsn)
        self._kafka = Consumer({**self.settings.consumer_config(), "error_cb": self._on_error,
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
        if self._kafka is not None:
            self._kafka.close()
            self._kafka = None
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
        self._check_verifications()
        if self._endpoints is not None and now >= self._next_watermarks:
            self._watermarks()
            self._next_watermarks = now + WATERMARK_SECONDS
        assert self._kafka is not None
        if not any(p.held is None for p in self.partitions.values()):
            time.sleep(self.settings.poll_seconds)
            return handled
        self._reassigned.clear()
        groups: dict[tuple[str, int], list[InboxMessage]] = {}
        for m in self._kafka.consume(num_messages=500, timeout=self.settings.poll_seconds):
            message = self._accept(m)
            if message is not None:
                groups.setdefault((message.topic, message.partition), []).append(message)
        for key, messages in groups.items():
            i = 0
            while i < len(messages):
                p = self.partitions.get(key)
                if p is None or p.held is not None or key in self._reassigned:
                    break  # the rest is read again from the partition's position
                n, handled_now = self._apply_next(p, messages[i:])
                handled += handled_now
                i += n
        self._reassigned.clear()
        if self._brokers_lost:
            self._brokers_lost = False
            self._verify_all("the client lost every broker")
        return handled

    # -- membership: heartbeat, leases, an even share -------------------------------------

    def _membership(self) -> None:
        assert self._control is not None and self._kafka is not None
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
                    self._drop(p)
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
                    p = _Partition(topic, partition, fence, next_offset, last_id, attempt_id=attempt_id,
                                   attempts=attempts, last_error=error or "")
                    if lapsed:
                        # Its holder may have died of the next message: that one goes alone, recorded.
                        p.ramp = 1
                        self.stats.lapses += 1
                        log.warning("%s/%d was claimed from a process that stopped without releasing it: its next "
                                    "message is applied alone, its attempt recorded first (a crash counts)",
                                    topic, partition)
                    self._take(p)
            self._membership_ok_at = time.monotonic()
        except psycopg.OperationalError as exc:
            # Leases run out meanwhile; the next round renews or finds them lost. Reconnect then.
            log.warning("inbox membership: database unavailable: %s", redact(str(exc)))
            if self._control.closed or self._control.broken:
                self._control = _try_connect(self.dsn, autocommit=True) or self._control

    def _watermarks(self) -> None:
        """The high watermark each held partition's last fetch returned (librdkafka's cache: no request;
        the end offsets a broker lists can be wrong, Tansu's among them, its fetch answers are not)."""
        assert self._kafka is not None
        for p in list(self.partitions.values()):
            try:
                _, high = self._kafka.get_watermark_offsets(TopicPartition(p.topic, p.partition), cached=True)
            except Exception as exc:  # KafkaException: not assigned (held for a retry)
                log.debug("watermarks of %s/%d: %s", p.topic, p.partition, exc)
                continue
            if high is not None and high >= 0:
                p.high_watermark = high

    def _discover(self) -> None:
        """Partitions of the topics, from the broker; a broker that does not answer keeps the last ones."""
        assert self._control is not None and self._kafka is not None
        topics: list[str] = []
        partitions: list[int] = []
        answered = False
        for topic in self.settings.topics:
            try:
                md = self._kafka.list_topics(topic, timeout=2.0).topics.get(topic)
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

    def _take(self, p: _Partition) -> None:
        self.partitions[p.tp] = p
        if p.next_offset is not None and p.next_offset > 0 and p.last_message_id is not None:
            p.verify_until = time.monotonic() + self.settings.verify_seconds
            self._assign(p, p.next_offset - 1)
        elif p.next_offset is not None:
            self._assign(p, p.next_offset)
        else:
            self._assign(p, OFFSET_BEGINNING if self.settings.start == "earliest" else OFFSET_END)
        log.info("leased %s/%d (fence %d) from offset %s", p.topic, p.partition, p.fence, p.next_offset)

    def _assign(self, p: _Partition, offset: int) -> None:
        assert self._kafka is not None
        self._reassigned.add(p.tp)
        self._kafka.incremental_assign([TopicPartition(p.topic, p.partition, offset)])

    def _unassign(self, p: _Partition) -> None:
        assert self._kafka is not None
        try:
            self._kafka.incremental_unassign([TopicPartition(p.topic, p.partition)])
        except Exception as exc:  # KafkaException: not assigned (held for a retry)
            log.debug("unassign %s/%d: %s", p.topic, p.partition, exc)

    def _drop(self, p: _Partition) -> None:
        if p.held is None:
            self._unassign(p)
        del self.partitions[p.tp]

    def _release(self, p: _Partition) -> None:
        assert self._control is not None
        self._drop(p)
        self._control.execute(query("inbox", "release"), {"consumer": self.settings.consumer, "topic": p.topic,
                                                          "partition": p.partition, "member": self.settings.member_id,
                                                          "fence": p.fence})
        log.info("released %s/%d (more than this process's share)", p.topic, p.partition)

    # -- the log check (a broker that lost its log) -----------------------------------------

    def _verify_all(self, why: str) -> None:
        log.warning("%s: checking that the broker still has what was applied", why)
        for p in self.partitions.values():
            if p.held is None and p.next_offset and p.last_message_id is not None:
                self._unassign(p)
                p.verify_until = time.monotonic() + self.settings.verify_seconds
                self._assign(p, p.next_offset - 1)

    def _check_verifications(self) -> None:
        now = time.monotonic()
        late = [p for p in self.partitions.values() if p.verify_until is not None and now >= p.verify_until]
        if not late:
            return
        assert self._kafka is not None
        try:
            self._kafka.list_topics(late[0].topic, timeout=2.0)
        except Exception:  # the broker does not answer: silence says nothing about its log yet
            for p in late:
                p.verify_until = now + self.settings.verify_seconds
            return
        for p in late:
            self._read_from_start(p, f"its last applied message (offset {(p.next_offset or 1) - 1}) was not fetched "
                                     f"within {self.settings.verify_seconds:g}s")

    def _read_from_start(self, p: _Partition, why: str) -> None:
        log.warning("%s/%d: %s: the broker lost its log; reading it from the start (messages applied before are "
                    "skipped by their ce_id)", p.topic, p.partition, why)
        self.stats.log_resets += 1
        p.verify_until = None
        self._unassign(p)
        self._assign(p, OFFSET_BEGINNING)

    # -- messages ---------------------------------------------------------------------------

    def _accept(self, m: Message) -> InboxMessage | None:
        """The message to apply, or None: an error, a partition no longer ours or held, or the log check."""
        err = m.error()
        if err is not None:
            if err.code() != KafkaError._PARTITION_EOF:
                log.info("kafka: %s/%s: %s", m.topic(), m.partition(), err.str())
            return None
        topic, partition = m.topic(), m.partition()
        assert topic is not None and partition is not None
        p = self.partitions.get((topic, partition))
        if p is None or p.held is not None or p.tp in self._reassigned:
            return None  # fetched before the partition was released or held; it is read again from its position
        message = _message(m)
        p.fetched_end = message.offset + 1
        if p.verify_until is not None:
            expected = (p.next_offset or 1) - 1
            p.verify_until = None
            if message.offset == expected and message.id == p.last_message_id:
                return None  # the log still holds what was applied: go on after it
            if message.offset == expected:
                self._read_from_start(p, f"offset {expected} holds another message than the one applied")
                return None
            if message.offset < expected:
                log.warning("%s/%d: the log ends before offset %d: the broker lost it; its messages from offset %d on "
                            "are applied unless their ce_id was", topic, partition, expected, message.offset)
                self.stats.log_resets += 1
        elif p.next_offset is not None and message.offset > p.next_offset:
            # Normal under compaction and transaction markers; otherwise a broker that skipped a batch
            # (Tansu can, while several producers write a partition): worth a line in the log.
            self.stats.gaps += 1
            log.info("%s/%d: offsets %d-%d were not delivered (compacted, transaction markers, or skipped by the "
                     "broker)", topic, partition, p.next_offset, message.offset - 1)
        return message

    def _apply_next(self, p: _Partition, messages: list[InboxMessage]) -> tuple[int, int]:
        """Apply the next batch of ``messages`` (consecutive, of ``p``): (how many the batch took, how many
        were applied or skipped). A batch that does not pass all it took holds, drops or re-reads ``p``."""
        first = messages[0]
        problem = first.id_problem
        if problem is not None:
            p.attempt_id, p.attempts = first.id, 0
            self._give_up(p, first, f"not applied: {problem}")
            return 1, 0
        if first.id == p.attempt_id or p.ramp == 1:
            return 1, self._apply_alone(p, first)
        size = self.settings.batch_size if p.ramp is None else min(p.ramp, self.settings.batch_size)
        batch = messages[:size]
        # A message whose id can not be stored ends the batch: its turn comes next, alone (above).
        unusable = next((i for i, m in enumerate(batch) if m.id_problem is not None), len(batch))
        batch = batch[:unusable]
        return len(batch), self._apply(p, batch)

    def _apply_alone(self, p: _Partition, message: InboxMessage) -> int:
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
            self._drop(p)
            return 0
        except psycopg.Error as exc:
            log.warning("database: %s: %s", type(exc).__name__, redact(str(exc)))
            self._hold_for_database(p, message)
            return 0
        p.attempt_id, p.attempts, p.last_error = message.id, made + 1, CRASH_ERROR
        return self._apply(p, [message], recorded=True)

    def _connected(self, p: _Partition, message: InboxMessage) -> bool:
        assert self._db is not None
        if self._db.closed or self._db.broken:
            reconnected = _try_connect(self.dsn)
            if reconnected is None:
                self._hold_for_database(p, message)
                return False
            self._db = reconnected
        return True

    def _apply(self, p: _Partition, messages: list[InboxMessage], recorded: bool = False) -> int:
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
            self._drop(p)
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
                self._assign(p, last.offset + 1)
        if batch.failure is not None:
            error = batch.failure
            self._failed(p, messages[done], f"{type(error).__name__}: {error}", recorded)
        elif p.ramp is not None:
            p.ramp = None if p.ramp * 2 > self.settings.batch_size else p.ramp * 2
        return done

    def _hold(self, p: _Partition, message: InboxMessage, delay: float) -> None:
        if p.held is None:
            self._unassign(p)
        p.held = message
        p.retry_at = time.monotonic() + delay

    def _hold_for_database(self, p: _Partition, message: InboxMessage) -> None:
        self._db_failures += 1
        self._hold(p, message, DATABASE_BACKOFF.delay(self._db_failures))

    def _failed(self, p: _Partition, message: InboxMessage, error: str, recorded: bool = False) -> None:
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
            self._hold(p, message, delay)
            return
        self._give_up(p, message, error)

    def _give_up(self, p: _Partition, message: InboxMessage, error: str) -> None:
        """Dead-letter the head message after its last attempt, and read the partition on after it."""
        assert self._db is not None
        if self._db.closed or self._db.broken:
            self._db = _try_connect(self.dsn) or self._db
        try:
            dead_letter(self._db, self._lease(p), message, p.attempts, error)
        except LeaseLost as exc:
            log.warning("%s", exc)
            self._drop(p)
            return
        except psycopg.OperationalError as exc:
            log.warning("database unavailable: %s", redact(str(exc)))
            self._hold_for_database(p, message)  # its next turn finds the attempts spent: dead-letters it
            return
        log.error("%s/%d@%d (id %s): %s failed: moved to the inbox's dead letters: %s", message.topic,
                  message.partition, message.offset, message.id, counted(p.attempts, "attempt"), error)
        self.stats.dead += 1
        if p.held is None:
            self._unassign(p)
        p.held, p.attempt_id, p.attempts, p.last_error = None, None, 0, ""
        p.next_offset, p.last_message_id = message.offset + 1, message.id
        # Messages after it may have been fetched with it and not applied: read on from right after it.
        self._assign(p, message.offset + 1)

    def _retry_held(self) -> int:
        now = time.monotonic()
        handled = 0
        for p in list(self.partitions.values()):
            if p.held is not None and now >= p.retry_at and p.tp in self.partitions:
                handled += self._apply_next(p, [p.held])[1]
        return handled

    def _retry_dead_letters(self) -> int:
        assert self._db is not None
        if self._db.closed or self._db.broken:
            reconnected = _try_connect(self.dsn)
            if reconnected is None:
                return 0
            self._db = reconnected
        done = 0
        try:
            for _ in range(100):
                result = retry_one_dead_letter(self._db, self.settings.consumer, self.handler, self.limit)
                if result is None:
                    break
                ident, outcome = result
                if outcome in ("applied", "duplicate", "gone"):
                    log.info("dead letter %d retried: %s", ident, outcome)
                    done += 1
                else:
                    log.warning("dead letter %d failed again: %s", ident, outcome)
        except InboxStuck:
            raise
        except HandlerTimeout as exc:
            timed_out = getattr(exc, "dead_letter_id", None)
            log.warning("dead letter %s failed again: %s", timed_out, exc)
            self._db = _try_connect(self.dsn) or self._db
            if timed_out is not None and not self._db.closed:
                with suppress(psycopg.Error), self._db.transaction():
                    self._db.execute(query("inbox", "retry_failed"),
                                     {"id": timed_out, "error": f"HandlerTimeout: {exc}"})
        except psycopg.OperationalError as exc:
            log.warning("retrying dead letters: %s", redact(str(exc)))
        return done

    # -- housekeeping -----------------------------------------------------------------------

    def housekeeping(self) -> int:
        """Delete dedupe records past retention, a bounded batch per transaction; returns how many."""
        assert self._control is not None
        s = self.settings
        deleted = 0
        try:
            self._control.execute(query("inbox", "delete_stale_members"),
                                  {"consumer": s.consumer, "ttl": s.lease_seconds})
            for _ in range(MAX_RETENTION_BATCHES):
                n = self._control.execute(query("inbox", "delete_old_messages"), {
                    "consumer": s.consumer, "retention": s.retention_seconds, "batch": s.retention_batch}).rowcount
                deleted += n
                if n < s.retention_batch:
                    break
        except psycopg.Error as exc:
            log.warning("inbox housekeeping: %s", redact(str(exc)))
        if deleted:
            log.info("retention: deleted %d dedupe records older than %gs", deleted, s.retention_seconds)
        return deleted


def _message(m: Message) -> InboxMessage:
    kind, ms = m.timestamp()
    stamp = datetime.fromtimestamp(ms / 1000, UTC) if kind != 0 and ms is not None and ms >= 0 else None
    topic, partition, offset = m.topic(), m.partition(), m.offset()
    assert topic is not None and partition is not None and offset is not None
    key, value = m.key(), m.value()
    found = m.headers() or []
    raw = list(found.items()) if isinstance(found, dict) else list(found)
    return InboxMessage(topic=topic, partition=partition, offset=offset,
                        key=key.encode() if isinstance(key, str) else key,
                        value=value.encode() if isinstance(value, str) else value,
                        headers=tuple((str(k), v.encode() if isinstance(v, str) else v)
                                      for k, v in raw),
                        timestamp=stamp)


def _try_connect(dsn: str, **kwargs: Any) -> psycopg.Connection[Any] | None:
    try:
        return psycopg.connect(dsn, connect_timeout=5, **kwargs)
    except psycopg.OperationalError as exc:
        log.warning("database unavailable: %s", redact(str(exc)))
        return None
