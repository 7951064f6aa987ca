"""The inbox's membership: this process's heartbeat, the leases of its partitions (renewed every round,
claimed up to an even share of the live members, released beyond it), and what /healthz and /readyz
say about them. It owns the autocommit control connection; the consumer's thread calls it."""

from __future__ import annotations

import logging
import math
import time
from typing import Any

import psycopg

from ..crashloop import FIRST_PROBE
from ..dsn import redact
from ..renewal import renew_interval
from ..sqlfiles import query
from .incarnation import Run
from .partitions import Partition, PartitionBook, Stats
from .schema import check_inbox_schema, connect
from .settings import InboxSettings
from .upkeep import try_connect

log = logging.getLogger("outbox_relay.inbox")


class Membership:
    def __init__(self, settings: InboxSettings, book: PartitionBook, stats: Stats) -> None:
        self.settings = settings
        self.book = book
        self.stats = stats
        self.control: psycopg.Connection[Any] | None = None  # leases, heartbeats (autocommit)
        self.this_run = Run(settings.consumer, settings.member_id, settings.lease_seconds)  # its leases are its own
        self.known: dict[str, int] = {}  # topic -> partition count, from the broker's metadata
        # For /healthz, /readyz and the gauges (read by the metrics server's threads): written by this thread.
        self.share = 0  # partitions this process should hold, from the last membership round
        self.ok_at: float | None = None  # monotonic time of the last membership round that went through
        self.broker_answered = False  # the last metadata request got an answer

    @property
    def dsn(self) -> str:
        return self.settings.dsn.get_secret_value()

    @property
    def renew_seconds(self) -> float:
        """Between rounds: the relay's cadence for its buckets' leases (outbox_relay.renewal)."""
        return renew_interval(self.settings.lease_seconds)

    def connect(self) -> None:
        self.control = connect(self.dsn, autocommit=True)
        check_inbox_schema(self.control)

    def leave(self) -> None:
        """Give the leases up now (another process takes the partitions at once) and disconnect."""
        if self.control is not None and not self.control.closed:
            try:
                self.control.execute(query("inbox", "leave"), self.this_run.params())
            except psycopg.Error as exc:
                log.warning("could not release the leases (they lapse after %gs): %s", self.settings.lease_seconds,
                            redact(str(exc)))
            self.control.close()

    def round(self) -> None:
        """Heartbeat, renew the held leases (dropping the lost ones), then an even share: release or claim."""
        assert self.control is not None and self.book.kafka is not None
        s = self.settings
        partitions = self.book.partitions
        try:
            self.this_run.joined(self.control.execute(query("inbox", "join"), self.this_run.params()).fetchone())
            self.discover()
            topics = list(self.settings.topics)
            held = {(r[0], r[1]): r[2] for r in self.control.execute(query("inbox", "renew"), {
                **self.this_run.params(), "topics": topics, "lease": s.lease_seconds})}
            for key, p in list(partitions.items()):
                if held.get(key) != p.fence:
                    log.warning("lost the lease of %s/%d: another process applies it now", *key)
                    self.book.drop(p)
            row = self.control.execute(query("inbox", "live_members"),
                                       {"consumer": s.consumer, "ttl": s.lease_seconds}).fetchone()
            live = max(1, int(row[0]) if row else 1)
            total = sum(self.known.values())
            share = self.share = math.ceil(total / live) if total else 0
            for p in sorted(partitions.values(), key=lambda p: p.tp)[share:]:
                self.release(p)
            if len(partitions) < share:
                claimed = self.control.execute(query("inbox", "claim"), {
                    **self.this_run.params(), "topics": topics, "lease": s.lease_seconds,
                    "limit": share - len(partitions)}).fetchall()
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
            self.ok_at = time.monotonic()
        except psycopg.OperationalError as exc:
            # Leases run out meanwhile; the next round renews or finds them lost. Reconnect then.
            log.warning("inbox membership: database unavailable: %s", redact(str(exc)))
            if self.control.closed or self.control.broken:
                self.control = try_connect(self.dsn, autocommit=True) or self.control

    def discover(self) -> None:
        """Partitions of the topics, from the broker; a broker that does not answer keeps the last ones."""
        assert self.control is not None and self.book.kafka is not None
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
            self.known[topic] = len(md.partitions)
            for partition in md.partitions:
                topics.append(topic)
                partitions.append(partition)
        self.broker_answered = answered
        if topics:
            self.control.execute(query("inbox", "add_partitions"),
                                 {"consumer": self.settings.consumer, "topics": topics, "partitions": partitions})

    def release(self, p: Partition) -> None:
        assert self.control is not None
        self.book.drop(p)
        self.control.execute(query("inbox", "release"), {"consumer": self.settings.consumer, "topic": p.topic,
                                                         "partition": p.partition, "member": self.settings.member_id,
                                                         "fence": p.fence})
        log.info("released %s/%d (more than this process's share)", p.topic, p.partition)

    def health(self) -> list[str]:
        """Why this process is not alive and in touch with its database; empty when it is. A loop held up
        by a handler for longer than its time limit, or a database unreachable for as long, fails it."""
        if self.ok_at is None:
            return ["not registered yet (waiting for the database and the broker)"]
        silent = time.monotonic() - self.ok_at
        if silent > self.settings.lease_seconds + self.settings.handler_timeout_seconds:
            return [f"no heartbeat reached the database for {silent:.0f}s"]
        return []

    def readiness(self, closing: bool) -> list[str]:
        """Why this process is not doing its share; empty when its heartbeat renews its leases in time, the
        brokers answer, and it is not ``closing``."""
        problems = self.health()
        if closing:
            problems.append("stopping")
        if self.ok_at is not None:
            silent = time.monotonic() - self.ok_at
            if silent > self.settings.lease_seconds and not problems:
                problems.append(f"its leases were not renewed for {silent:.0f}s (--lease-seconds "
                                f"{self.settings.lease_seconds:g})")
        if not self.broker_answered:
            problems.append("the brokers did not answer the last metadata request")
        return problems
