"""The partitions this process holds, as the Kafka client sees them: which are assigned from which offset,
which are held for a retry, and the log check (a broker that lost its log numbers a topic's messages from
0 again, so a stored position can point past its end: each claimed partition is read from its last
applied offset, and that message must be the one applied). Only the consumer's thread touches it."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from datetime import UTC, datetime

from confluent_kafka import OFFSET_BEGINNING, OFFSET_END, Consumer, KafkaError, Message, TopicPartition

from ..crashloop import HEALTHY
from .message import InboxMessage
from .settings import InboxSettings

log = logging.getLogger("outbox_relay.inbox")


@dataclass
class Partition:
    """A partition this process holds the lease of."""

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
    # after each one that commits (outbox_relay.crashloop); 1: alone and recorded; HEALTHY: batch_size.
    ramp: int = HEALTHY
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


class PartitionBook:
    """The held partitions and the Kafka client's assignment of them."""

    def __init__(self, settings: InboxSettings, stats: Stats) -> None:
        self.settings = settings
        self.stats = stats
        self.partitions: dict[tuple[str, int], Partition] = {}
        self.kafka: Consumer | None = None  # set by the consumer's start()
        # Partitions reassigned while a fetched batch is handled: the rest of the batch's messages of
        # them are from before (the client drops what it holds itself, not what it already returned).
        self.reassigned: set[tuple[str, int]] = set()

    def take(self, p: Partition) -> None:
        self.partitions[p.tp] = p
        if p.next_offset is not None and p.next_offset > 0 and p.last_message_id is not None:
            p.verify_until = time.monotonic() + self.settings.verify_seconds
            self.assign(p, p.next_offset - 1)
        elif p.next_offset is not None:
            self.assign(p, p.next_offset)
        else:
            self.assign(p, OFFSET_BEGINNING if self.settings.start == "earliest" else OFFSET_END)
        log.info("leased %s/%d (fence %d) from offset %s", p.topic, p.partition, p.fence, p.next_offset)

    def assign(self, p: Partition, offset: int) -> None:
        assert self.kafka is not None
        self.reassigned.add(p.tp)
        self.kafka.incremental_assign([TopicPartition(p.topic, p.partition, offset)])

    def unassign(self, p: Partition) -> None:
        assert self.kafka is not None
        try:
            self.kafka.incremental_unassign([TopicPartition(p.topic, p.partition)])
        except Exception as exc:  # KafkaException: not assigned (held for a retry)
            log.debug("unassign %s/%d: %s", p.topic, p.partition, exc)

    def drop(self, p: Partition) -> None:
        if p.held is None:
            self.unassign(p)
        del self.partitions[p.tp]

    def hold(self, p: Partition, message: InboxMessage, delay: float) -> None:
        """Hold ``p`` at ``message`` (unassigned meanwhile) until ``delay`` seconds from now."""
        if p.held is None:
            self.unassign(p)
        p.held = message
        p.retry_at = time.monotonic() + delay

    def watermarks(self) -> None:
        """The high watermark each held partition's last fetch returned (librdkafka's cache: no request;
        the end offsets a broker lists can be wrong, Tansu's among them, its fetch answers are not)."""
        assert self.kafka is not None
        for p in list(self.partitions.values()):
            try:
                _, high = self.kafka.get_watermark_offsets(TopicPartition(p.topic, p.partition), cached=True)
            except Exception as exc:  # KafkaException: not assigned (held for a retry)
                log.debug("watermarks of %s/%d: %s", p.topic, p.partition, exc)
                continue
            if high is not None and high >= 0:
                p.high_watermark = high

    # -- the log check (a broker that lost its log) -----------------------------------------

    def verify_all(self, why: str) -> None:
        log.warning("%s: checking that the broker still has what was applied", why)
        for p in self.partitions.values():
            if p.held is None and p.next_offset and p.last_message_id is not None:
                self.unassign(p)
                p.verify_until = time.monotonic() + self.settings.verify_seconds
                self.assign(p, p.next_offset - 1)

    def check_verifications(self) -> None:
        now = time.monotonic()
        late = [p for p in self.partitions.values() if p.verify_until is not None and now >= p.verify_until]
        if not late:
            return
        assert self.kafka is not None
        try:
            self.kafka.list_topics(late[0].topic, timeout=2.0)
        except Exception:  # the broker does not answer: silence says nothing about its log yet
            for p in late:
                p.verify_until = now + self.settings.verify_seconds
            return
        for p in late:
            self.read_from_start(p, f"its last applied message (offset {(p.next_offset or 1) - 1}) was not fetched "
                                    f"within {self.settings.verify_seconds:g}s")

    def read_from_start(self, p: Partition, why: str) -> None:
        log.warning("%s/%d: %s: the broker lost its log; reading it from the start (messages applied before are "
                    "skipped by their ce_id)", p.topic, p.partition, why)
        self.stats.log_resets += 1
        p.verify_until = None
        self.unassign(p)
        self.assign(p, OFFSET_BEGINNING)

    def accept(self, m: Message) -> InboxMessage | None:
        """The message to apply, or None: an error, a partition no longer ours or held, or the log check."""
        err = m.error()
        if err is not None:
            if err.code() != KafkaError._PARTITION_EOF:
                log.info("kafka: %s/%s: %s", m.topic(), m.partition(), err.str())
            return None
        topic, partition = m.topic(), m.partition()
        assert topic is not None and partition is not None
        p = self.partitions.get((topic, partition))
        if p is None or p.held is not None or p.tp in self.reassigned:
            return None  # fetched before the partition was released or held; it is read again from its position
        message = kafka_message(m)
        p.fetched_end = message.offset + 1
        if p.verify_until is not None:
            expected = (p.next_offset or 1) - 1
            p.verify_until = None
            if message.offset == expected and message.id == p.last_message_id:
                return None  # the log still holds what was applied: go on after it
            if message.offset == expected:
                self.read_from_start(p, f"offset {expected} holds another message than the one applied")
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


def kafka_message(m: Message) -> InboxMessage:
    """The InboxMessage of a message the Kafka client returned."""
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
