"""Kafka delivery with confluent-kafka: idempotent producer, acks=all, many messages in flight.

An event counts as delivered only once its delivery report arrived without error and with the
offset the broker stored it at. Message key = partition key, so Kafka keeps per-key order within a
partition; the idempotent producer keeps it across its own retries. ``message.timeout.ms=0`` (no
timeout): while the broker is down the batch waits (leases keep being renewed) instead of burning
retry attempts, so a user-set message timeout is refused (``check_config``).

A producer is only as good as the broker's memory of it, though. A broker that lost its state (a
restart with in-memory storage, a cluster rebuilt from scratch, producer state expired) answers the
producer's retries with UNKNOWN_PRODUCER_ID, which librdkafka retries forever without a word; worse,
it hands out producer ids again from the start, so a producer that survived the restart can share
its id with a new producer of another relay. The survivor's batches are then answered
DUPLICATE_SEQUENCE_NUMBER, which librdkafka reports as delivered although nothing was stored (the
report carries no offset for the batch's first message, and made-up ones for the rest). Hence:

- a report without a real offset does not count, nor does any later report of that partition from
  the same producer (the rest of such a batch), and the producer is replaced;
- a producer that lost every broker connection after it had been connected is replaced before it
  sends anything more (its id may be forgotten or handed out again by the broker it meets next);
- a producer that raised a fatal error, or got no delivery report for ``stall_seconds`` with
  messages in flight, is replaced too.

A replacement sends the batch's unacknowledged messages again, in their original order (duplicates
are possible, reordering is not; see ``_resend``), and counts no attempt.

A topic that does not exist (with auto-creation off) or that an ACL denies is a condition of the
sink, not of its events (``TOPIC_CONDITIONS``): the topic is *held* (``TopicCondition``). Its events
fail with ``Failure.hold_seconds`` (parked, no attempt counted, nothing dead-lettered) without being
produced, ``problem()`` names it, and its metadata is asked for again after a backoff; once the broker
answers for it, its events go out again. Events of other topics are not held back.
"""

from __future__ import annotations

import contextlib
import json
import logging
import threading
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from confluent_kafka import KafkaError, KafkaException, Producer

from ...backoff import Backoff
from ...dsn import describe_error, redact_kafka_config
from ...errors import ConfigurationError
from ...observer import NULL_OBSERVER, Observer
from ...store import EventFilter, StoredEvent
from ..engine import PARTIAL_CHECKPOINT_SECONDS, Aborted, Commit, Failure, KeyHold, Outcomes

log = logging.getLogger("outbox_relay.kafka")
# librdkafka's own lines (a broker that refuses connections, TLS and SASL errors, its debug contexts
# when the `debug` option is set) through the relay's logging, so that --log-json and redaction cover
# them; librdkafka's levels map to Python's (its errors are ERROR). confluent-kafka hands them over in
# poll(), on the sink's thread.
LIBRDKAFKA_LOG = logging.getLogger("outbox_relay.librdkafka")
# A batch that waits this long for its acknowledgements says so (and again after as long each time), so
# that no wait for the broker is silent (issue 25: a drain stalled 5.5 s with nothing logged).
ACK_WAIT_WARN_SECONDS = 5.0

PRODUCER_DEFAULTS: dict[str, Any] = {
    "enable.idempotence": True,
    "acks": "all",
    # No linger: the relay produces a whole batch, then waits for its acknowledgements, so messages
    # queue behind the first request anyway. Measured on the bench machine (1 relay, ~400 ev/s): 2 ms of
    # linger made a cycle 9.3 ms instead of 4.8 ms (produce -> acks 4.0 vs 1.2 ms), and drain rates were
    # the same within noise (bench/run.py --quick --cases drain, with --kafka-option linger.ms=0).
    "linger.ms": 0,
    "message.timeout.ms": 0,
    "partitioner": "murmur2_random",  # same partition for a key as the Java client
    "compression.type": "none",
    "queue.buffering.max.messages": 200_000,
}

# Header names the relay sets on every message, compared lower-case, plus every name starting with
# RESERVED_PREFIX (outbox_fence, outbox_replay, ...). An event's own header of such a name would reach
# consumers next to the relay's value; migration 0005's trigger (outbox.check_event_v1) refuses them
# at insert, and the sink drops them from older rows.
RESERVED_HEADERS = frozenset({
    "ce_specversion", "ce_id", "ce_source", "ce_type", "ce_time", "ce_sequence", "ce_partitionkey", "content-type",
})
RESERVED_PREFIX = "outbox_"

# Errors no retry can fix: dead-letter at once with the reason. TOPIC_EXCEPTION is a topic name the
# broker refuses outright, which no operator action on the cluster changes.
NON_RETRIABLE = {
    KafkaError.MSG_SIZE_TOO_LARGE,
    KafkaError.INVALID_MSG,
    KafkaError.INVALID_RECORD,
    KafkaError.RECORD_LIST_TOO_LARGE,
    KafkaError.TOPIC_EXCEPTION,
    KafkaError._INVALID_ARG,
}

# Errors that say the topic can not be written by this producer now, whichever event it is: it does
# not exist (yet: auto-creation is off and it is created late) or an ACL denies it. An operator fixes
# them on the cluster; the events wait meanwhile (held), no attempt counted.
TOPIC_CONDITIONS = {
    KafkaError.UNKNOWN_TOPIC_OR_PART,
    KafkaError._UNKNOWN_TOPIC,
    KafkaError.TOPIC_AUTHORIZATION_FAILED,
}
HOLD_BACKOFF = Backoff(1.0, 30.0)  # between checks of a held topic (by how many checks failed)
METADATA_TIMEOUT_SECONDS = 5.0  # a topic's metadata request; no answer: produce and let the batch wait

# Errors of the producer's idempotence session, not of the message: the broker forgot or
# refused the producer id or its sequence, or librdkafka purged the message because the
# instance turned fatal. A new producer fixes them, so they are not a delivery attempt.
SESSION_ERRORS = {
    KafkaError.UNKNOWN_PRODUCER_ID,
    KafkaError.OUT_OF_ORDER_SEQUENCE_NUMBER,
    KafkaError.DUPLICATE_SEQUENCE_NUMBER,
    KafkaError.INVALID_PRODUCER_EPOCH,
    KafkaError.INVALID_PRODUCER_ID_MAPPING,
    KafkaError.PRODUCER_FENCED,
    KafkaError._FATAL,
    KafkaError._GAPLESS_GUARANTEE,
    KafkaError._PURGE_QUEUE,
    KafkaError._PURGE_INFLIGHT,
}

DEFAULT_STALL_SECONDS = 60.0
POLL_SECONDS = 0.05
FIRST_RECREATE_DELAY = 1.0  # spacing of replacements in a row (doubling up to the stall time)
SLOW_DESTROY_SECONDS = 5.0  # a replaced producer that takes longer to shut down is logged
# Replaced producers whose destruction has not finished (``_retire``), across sinks.
_retiring = 0
_retiring_lock = threading.Lock()


def _describe(err: KafkaError) -> str:
    return f"{err.name()}: {err.str()}"


def _failure(err: KafkaError) -> Failure:
    return Failure(f"kafka: {_describe(err)}", retriable=err.code() not in NON_RETRIABLE)


def _retire(retired: list[Producer], sink: str) -> None:
    """Destroy the producer in ``retired`` (its only reference) on a daemon thread.

    Dropping a producer's last reference runs ``rd_kafka_destroy``, which joins librdkafka's threads
    and can take long: after a broker restart under CPU load the sink's thread sat in it for over 30 s
    (``rd_kafka_destroy_app`` -> ``thrd_join``), checked no stop flag meanwhile, so its runner counted
    as stuck and gave its buckets up. The old producer was purged: nothing of it is waited for.
    """

    global _retiring

    def destroy() -> None:
        global _retiring
        started = time.monotonic()
        retired.clear()  # the last reference: rd_kafka_destroy runs here, without the GIL
        took = time.monotonic() - started
        with _retiring_lock:
            _retiring -= 1
        if took >= SLOW_DESTROY_SECONDS:
            log.info("kafka sink %s: a replaced producer took %.1fs to shut down", sink, took)

    with _retiring_lock:
        before = _retiring
        _retiring += 1
    if before:  # one that never finishes keeps its threads and sockets: say so
        log.warning("kafka sink %s: %d replaced producers are still shutting down", sink, before)
    threading.Thread(target=destroy, name=f"kafka-retire-{sink}", daemon=True).start()


@dataclass
class TopicCondition:
    """Why a topic's events are held: the broker's answer, since when, how many checks found it."""

    error: str
    since: float  # monotonic time it was first seen
    checks: int = 1  # answers that found the topic not writable (its backoff grows with them)
    retry_at: float = 0.0  # monotonic time of the next check

    def failure(self, topic: str, now: float) -> Failure:
        return Failure(f"kafka: topic {topic}: {self.error} (a condition of the sink: the event waits, no attempt "
                       "counted)", hold_seconds=max(0.0, self.retry_at - now))


def sequence(xid: int, seq: int) -> str:
    """CloudEvents ``sequence``: the event's position, sortable as a string.

    Not a per-key counter: a key's events are delivered in the order their transactions became
    visible, which can put a larger position first (README, "The order one key gets").
    """
    return f"{xid:020d}-{seq:020d}"


def is_reserved_header(name: str) -> bool:
    """A header name only the relay sets (as the trigger of migration 0005 compares: lower-case)."""
    lowered = name.lower()
    return lowered in RESERVED_HEADERS or lowered.startswith(RESERVED_PREFIX)


def check_config(config: Mapping[str, Any]) -> None:
    """Refuse librdkafka settings that would break what the sink promises (ConfigurationError).

    - ``message.timeout.ms`` / ``delivery.timeout.ms`` other than 0: a message that times out
      during a broker outage would come back as a failure and burn one of the event's attempts
      per outage (and dead-letter it after ``--max-attempts`` outages), and a timeout is no
      substitute for stall detection either: a wedged producer is replaced after
      ``--kafka-stall-seconds``, its messages sent again without counting an attempt.
    - ``acks=0``: the broker acknowledges nothing, so no delivery report carries an offset and
      no event could ever count as delivered.
    - ``enable.idempotence`` other than true: without the idempotent producer, a request that
      librdkafka retries can land after a later request to the same partition (several are in
      flight), so a key's messages arrive reordered; replacing a producer and re-sending its
      unacknowledged messages in order (``_resend``) relies on it too.
    """
    for name in ("message.timeout.ms", "delivery.timeout.ms"):
        if name in config and str(config[name]).strip() != "0":
            raise ConfigurationError(
                f"Kafka option {name}={config[name]} is not supported: the relay waits for the broker without a "
                "message timeout, so that an outage costs no delivery attempts; a producer that stops getting "
                "delivery reports is replaced after --kafka-stall-seconds instead (leave the option out)")
    for name in ("acks", "request.required.acks"):
        if name in config and str(config[name]).strip() == "0":
            raise ConfigurationError(
                f"Kafka option {name}=0 is not supported: an event counts as delivered only once the broker "
                "acknowledged it with an offset, which acks=0 never does (leave the option out: acks=all)")
    value = config.get("enable.idempotence", True)
    if str(value).strip().lower() not in ("true", "1", "t"):  # what librdkafka reads as true
        raise ConfigurationError(
            f"Kafka option enable.idempotence={value} is not supported: without the idempotent producer a "
            "request librdkafka retries can land after a later one to the same partition, so a key's messages "
            "would arrive out of order (leave the option out: enable.idempotence=true)")


def _json_type(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int | float):
        return "number"
    if isinstance(value, str):
        return "string"
    return "array" if isinstance(value, list) else "object"


@dataclass(frozen=True)
class _Message:
    event: StoredEvent
    topic: str
    headers: list[tuple[str, str | bytes | None]]


class _Session:
    """What one producer instance's callbacks said. The producer's error callback holds this, not
    the producer, so that a replaced producer is destroyed at once, not by the garbage collector.

    Only the thread in ``KafkaSink.deliver`` touches it: librdkafka runs callbacks inside
    ``poll()`` on the calling thread.
    """

    def __init__(self, may_hold_id: bool = True) -> None:
        self.fatal: str | None = None  # the producer raised a fatal error: it must be replaced
        self.client_error = "none"  # the last error_cb report, for the stall warning
        self.brokers_lost = False  # every broker connection was lost while it may have held a producer id
        # Whether the producer may hold a producer id that a broker could forget. A replacement is
        # made while the brokers may still be unreachable, and a producer that never connected
        # reports "all brokers down" on its failed attempts (more than once: it re-bootstraps), which
        # says nothing about forgotten state; so it counts from its first acknowledgement on. The
        # first producer of a sink is assumed connected (it may sit idle, holding an id, for long).
        self.may_hold_id = may_hold_id

    def on_error(self, err: KafkaError) -> None:
        # Mostly informational (broker down, reconnects); librdkafka recovers by itself from
        # everything but a fatal error. confluent-kafka raises fatal errors from poll() rather
        # than passing them here (see KafkaSink._poll), but a client version that passes them is covered.
        self.client_error = _describe(err)
        if err.fatal():
            self.fatal = self.client_error
        elif err.code() == KafkaError._ALL_BROKERS_DOWN and self.may_hold_id:
            self.brokers_lost = True

    def acknowledged(self) -> None:
        self.may_hold_id = True


class _Flight:
    """The messages handed to one producer instance, and what their delivery reports said.

    Only the thread in ``deliver`` touches it: librdkafka runs delivery callbacks inside
    ``poll()`` on the calling thread.
    """

    def __init__(self, outcomes: Outcomes, session: _Session, batch: _Batch | None = None) -> None:
        self.outcomes = outcomes  # the batch's, shared by every flight of the batch
        self.session = session
        self.batch = batch if batch is not None else _Batch()  # the batch's too
        self.pending = 0
        self.last_report = time.monotonic()
        self.session_error: str | None = None
        self.live = True  # False once its producer was given up: late reports are ignored
        # Partitions where a report came without an offset: that report and every later one of the
        # partition (the rest of the batch, with offsets librdkafka made up) do not count.
        self.doubtful: set[tuple[str, int]] = set()
        self.acked: list[uuid.UUID] = []  # acknowledged since the observer last heard (Observer.acknowledged)

    def report(self, event_id: uuid.UUID) -> Callable[[KafkaError | None, Any], None]:
        def on_delivery(err: KafkaError | None, msg: Any) -> None:
            if not self.live:
                return
            self.pending -= 1
            self.last_report = time.monotonic()
            if err is not None:
                if err.code() in SESSION_ERRORS or err.fatal():
                    self.session_error = self.session_error or _describe(err)  # sent again by the next producer
                elif err.code() in TOPIC_CONDITIONS:
                    self.outcomes[event_id] = self.batch.topic_failed(msg.topic(), event_id, err)
                else:
                    self.outcomes[event_id] = _failure(err)
                return
            partition = (msg.topic(), msg.partition())
            offset = msg.offset()
            if partition in self.doubtful or offset is None or offset < 0:
                # librdkafka's report of a DUPLICATE_SEQUENCE_NUMBER answer: maybe stored earlier
                # (a retry), maybe never (another producer holds this one's id). Not acknowledged.
                self.doubtful.add(partition)
                self.session_error = self.session_error or (
                    f"the broker acknowledged messages of {partition[0]} [{partition[1]}] without an offset "
                    "(DUPLICATE_SEQUENCE_NUMBER: it may have handed this producer's id to another producer "
                    "after losing its state)")
                return
            self.outcomes[event_id] = None
            self.acked.append(event_id)
            self.batch.acknowledged.add(partition[0])
            self.session.acknowledged()
        return on_delivery


class _Batch:
    """Topic conditions one batch met, shared by its flights: events whose topic turned out not
    writable (their outcomes are set once the batch is done) and topics something was acknowledged on."""

    def __init__(self) -> None:
        self.held: dict[uuid.UUID, str] = {}  # event id -> its topic
        self.errors: dict[str, str] = {}  # topic -> the broker's or the client's answer
        self.acknowledged: set[str] = set()

    def topic_failed(self, topic: str, event_id: uuid.UUID, err: KafkaError) -> Failure:
        self.held[event_id] = topic
        self.errors.setdefault(topic, _describe(err))
        return Failure(f"kafka: topic {topic}: {_describe(err)}", hold_seconds=0.0)  # replaced by ``_settle``


class KafkaSink:
    kind = "kafka"
    event_filter: EventFilter | None = None  # every event goes to Kafka

    def __init__(self, name: str, config: dict[str, Any], default_topic: str | None, source: str,
                 stall_seconds: float = DEFAULT_STALL_SECONDS, *, topic: str | None = None,
                 extra_headers: Sequence[tuple[str, bytes]] = ()) -> None:
        check_config(config)
        self.name = name
        self.default_topic = default_topic
        self.topic = topic  # every message to this topic (a replay into another topic)
        self.extra_headers = list(extra_headers)
        self.source = source.encode()
        self.stall_seconds = stall_seconds
        self._config = {**PRODUCER_DEFAULTS, **config}
        log.info("kafka producer config %s", redact_kafka_config({k: str(v) for k, v in self._config.items()}))
        # Owned by the thread that calls deliver() (callbacks run inside its poll() calls).
        self._recreate_delay = FIRST_RECREATE_DELAY
        self._recreate_after = 0.0  # monotonic time before which the producer is not replaced again
        self._session = _Session()
        self.hold_backoff = HOLD_BACKOFF
        self.partial_seconds = PARTIAL_CHECKPOINT_SECONDS
        self.ack_warn_seconds = ACK_WAIT_WARN_SECONDS
        # Held topics: written by the thread that calls deliver(), read by problem() and the metrics on
        # others (replaced under the lock, never changed in place).
        self._conditions: dict[str, TopicCondition] = {}
        self._conditions_lock = threading.Lock()
        self._writable: set[str] = set()  # topics the broker answered for (deliver()'s thread only)
        # After a lookup got no answer (brokers away): no lookups before this monotonic time, so that an
        # outage does not cost every batch a metadata timeout per topic (deliver()'s thread only).
        self._lookups_after = 0.0
        self.observer: Observer = NULL_OBSERVER  # set by the composition root
        try:
            self._producer = self._new_producer(self._session)
        except KafkaException as exc:  # an unknown option, a value it does not take, a contradiction
            err: KafkaError = exc.args[0]
            raise ConfigurationError(f"Kafka options refused by librdkafka: {err.str()}") from None

    def _new_producer(self, session: _Session) -> Producer:
        return Producer({**self._config, "error_cb": session.on_error, "logger": LIBRDKAFKA_LOG})

    def problem(self, timeout: float = 2.0) -> str | None:
        """Why the sink can not deliver now (for /readyz), or None: its brokers answer a metadata request.
        Safe from another thread (librdkafka is thread-safe)."""
        if self._session.fatal is not None:
            return f"the Kafka producer failed: {self._session.fatal}"
        try:
            self._producer.list_topics(timeout=timeout)
        except KafkaException as exc:
            err: KafkaError = exc.args[0]
            return f"the Kafka brokers do not answer: {_describe(err)}"
        now = time.monotonic()
        held = [f"topic {topic}: {c.error} for {now - c.since:.0f}s (its events wait)"
                for topic, c in sorted(self.conditions().items())]
        return "; ".join(held) or None

    def conditions(self) -> dict[str, TopicCondition]:
        """The held topics and why (a copy; safe from any thread)."""
        with self._conditions_lock:
            return dict(self._conditions)

    def idle(self) -> None:
        """While the runner waits with nothing to deliver (``sink.wait_idle``, on the thread that calls
        ``deliver``): serve what librdkafka queued meanwhile, its log lines (logger
        outbox_relay.librdkafka) and error callbacks, which confluent-kafka hands over only inside
        ``poll()``. Without it an idle relay's broker problems would show only with its next batch."""
        try:
            self._producer.poll(0)
        except KafkaException as exc:
            err: KafkaError = exc.args[0]
            if not err.fatal():
                raise
            self._session.fatal = _describe(err)  # the producer is replaced before the next batch

    def close(self) -> None:
        with contextlib.suppress(KafkaException):  # a fatal producer raises from flush()
            self._producer.purge()
            self._producer.flush(0)

    def deliver(self, events: Sequence[StoredEvent], fences: dict[int, int], commit: Commit,
                abort: threading.Event) -> set[int]:
        outcomes: Outcomes = {}
        messages: list[_Message] = []
        for e in events:
            topic = self.topic or e.topic or self.default_topic
            if topic is None:
                outcomes[e.id] = Failure("event has no topic and the relay has no --default-topic", retriable=False)
                continue
            headers = self._headers(e, fences[e.bucket])
            if isinstance(headers, Failure):
                outcomes[e.id] = headers
                continue
            messages.append(_Message(e, topic, headers))
        if messages:
            self._check_producer(abort)
            messages = self._hold_back(messages, outcomes)
        batch = _Batch()
        # The runner's commit checkpoints the acknowledged part of a long batch early; another may write nothing.
        partial: Callable[[Outcomes], set[int]] | None = commit.partial
        todo = messages
        while todo:
            flight = _Flight(outcomes, self._session, batch)
            # A key whose event failed in this batch is parked at that event: what follows it waits.
            hold = KeyHold()
            for m in messages:
                hold.record(m.event, outcomes.get(m.event.id))
            self._produce(todo, hold, flight, abort)
            # Wait for every delivery report. With no message timeout this waits out a broker
            # outage; the membership thread keeps renewing our leases meanwhile.
            reason = self._wait(flight, abort, partial)
            if reason is None:
                self._recreate_delay = FIRST_RECREATE_DELAY
                break
            todo = self._resend(messages, flight, reason)
        self._settle(batch, outcomes)
        # Delivered: nothing here acts on whether the fence held, so the runner's commit may check it with
        # its next read rather than a statement of its own (``later``; another commit writes at once).
        return commit.later(outcomes)

    # -- topic conditions --------------------------------------------------------------------

    def _hold_back(self, messages: list[_Message], outcomes: Outcomes) -> list[_Message]:
        """The messages to produce: those of held topics fail at once (held), without a word to the broker
        until their next check is due. A topic not seen before is looked up first, so that a missing one
        does not hold the whole batch for librdkafka's ``topic.metadata.propagation.max.ms``."""
        now = time.monotonic()
        held: dict[str, TopicCondition] = {}
        for topic in dict.fromkeys(m.topic for m in messages):
            condition = self._conditions.get(topic)
            if condition is not None and now < condition.retry_at:
                held[topic] = condition
            elif topic not in self._writable:
                error = self._topic_error(topic)
                if error is not None:
                    held[topic] = self._hold(topic, error)
                elif condition is None:
                    self._writable.add(topic)
                # else a held topic the broker now answers for: its messages go out, and the first
                # acknowledgement ends the hold (_settle); an ACL may still deny writes.
        if not held:
            return messages
        now = time.monotonic()
        failures = {topic: c.failure(topic, now) for topic, c in held.items()}
        for m in messages:
            if m.topic in failures:
                outcomes[m.event.id] = failures[m.topic]
        return [m for m in messages if m.topic not in failures]

    def _topic_error(self, topic: str) -> str | None:
        """The broker's answer for ``topic`` if it says the topic can not be written (missing, denied)."""
        if time.monotonic() < self._lookups_after:
            return None
        try:
            metadata = self._producer.list_topics(topic, timeout=METADATA_TIMEOUT_SECONDS)
        except KafkaException:
            # No answer: produce, and the batch waits for the broker as in any outage.
            self._lookups_after = time.monotonic() + self.hold_backoff.cap
            return None
        found = metadata.topics.get(topic)
        err: KafkaError | None = None if found is None else found.error
        if err is not None and err.code() in TOPIC_CONDITIONS:
            return _describe(err)
        return None

    def _hold(self, topic: str, error: str) -> TopicCondition:
        """Record that ``topic`` is not writable (again); one warning per check."""
        now = time.monotonic()
        old = self._conditions.get(topic)
        checks = 1 if old is None else old.checks + 1
        condition = TopicCondition(error, now if old is None else old.since, checks,
                                   now + self.hold_backoff.delay(checks))
        with self._conditions_lock:
            self._conditions = {**self._conditions, topic: condition}
        self._writable.discard(topic)
        log.warning("kafka sink %s: topic %s: %s; its events wait (no attempt counted, nothing dead-lettered)%s, "
                    "next check in %.1fs", self.name, topic, error,
                    "" if old is None else f" for {now - condition.since:.0f}s", condition.retry_at - now)
        return condition

    def _settle(self, batch: _Batch, outcomes: Outcomes) -> None:
        """After a batch: hold the topics it found not writable, end the holds of those it got acks from."""
        resumed = [t for t in batch.acknowledged if t in self._conditions and t not in batch.errors]
        for topic in resumed:
            condition = self._conditions[topic]
            with self._conditions_lock:
                self._conditions = {t: c for t, c in self._conditions.items() if t != topic}
            log.info("kafka sink %s: topic %s is writable again after %.0fs; delivery resumes", self.name, topic,
                     time.monotonic() - condition.since)
        self._writable.update(batch.acknowledged - batch.errors.keys())
        if not batch.errors:
            return
        now = time.monotonic()
        failures = {topic: self._hold(topic, error).failure(topic, now) for topic, error in batch.errors.items()}
        for event_id, topic in batch.held.items():
            outcomes[event_id] = failures[topic]

    def _headers(self, e: StoredEvent, fence: int) -> list[tuple[str, str | bytes | None]] | Failure:
        """The message's headers, or why the event's own headers can not be sent (non-retriable:
        the row never changes). Never raises: one bad event must not fail the batch."""
        headers: list[tuple[str, str | bytes | None]] = [
            ("ce_specversion", b"1.0"),
            ("ce_id", e.id_text or str(e.id)),
            ("ce_source", self.source),
            ("ce_type", e.type),
            ("ce_time", e.time_text or e.time.isoformat()),
            ("ce_sequence", e.sequence_text or sequence(e.xid, e.seq)),
            ("ce_partitionkey", e.key),
            ("content-type", b"application/json"),
            ("outbox_fence", str(fence)),
        ]
        if e.headers_text != "{}":
            own = self._own_headers(e)
            if isinstance(own, Failure):
                return own
            headers.extend(own)
        headers.extend(self.extra_headers)
        return headers

    def _own_headers(self, e: StoredEvent) -> list[tuple[str, bytes]] | Failure:
        # Rows written before migration 0005's trigger (or past it, by a superuser) may hold
        # anything the jsonb column takes.
        try:
            value = json.loads(e.headers_text)
        except ValueError as exc:
            return Failure(f"the event's headers are not JSON: {exc}", retriable=False)
        if not isinstance(value, dict):
            return Failure(f"the event's headers must be a JSON object of strings, not a JSON {_json_type(value)}",
                           retriable=False)
        own: list[tuple[str, bytes]] = []
        for name, header in value.items():
            if not isinstance(header, str):
                return Failure(f"the event's header {name!r} is a JSON {_json_type(header)}, not a string "
                               "(headers must be a JSON object of strings)", retriable=False)
            if is_reserved_header(name):
                # The relay's own value is the one consumers rely on; the event goes out without this one.
                log.warning("kafka sink %s: event %s has a header %r, a name reserved for the relay; sending the "
                            "event without it", self.name, e.id, name)
                continue
            try:
                own.append((name, header.encode()))
            except UnicodeError as exc:
                return Failure(f"the event's header {name!r} can not be encoded as UTF-8: {exc}", retriable=False)
        return own

    def _produce(self, todo: list[_Message], hold: KeyHold, flight: _Flight, abort: threading.Event) -> None:
        """Hand ``todo`` to the producer in order, except keys ``hold`` holds (it grows with failures);
        stops early if the producer is wedged."""
        outcomes = flight.outcomes
        for m in todo:
            if not hold.allows(m.event):
                continue
            while True:
                try:
                    self._producer.produce(m.topic, m.event.payload_text.encode(), m.event.key.encode(),
                                           headers=m.headers, on_delivery=flight.report(m.event.id))
                    flight.pending += 1
                    break
                except BufferError:  # local queue full: let reports drain
                    self._poll(abort)
                    if self._wedged(flight) is not None:
                        return
                except KafkaException as exc:
                    err: KafkaError = exc.args[0]
                    if err.code() == KafkaError._FATAL or err.fatal():
                        self._session.fatal = self._session.fatal or _describe(err)
                        return
                    if err.code() in TOPIC_CONDITIONS:  # the client already knows the topic is not there
                        failure = outcomes[m.event.id] = flight.batch.topic_failed(m.topic, m.event.id, err)
                    else:
                        failure = outcomes[m.event.id] = _failure(err)
                    hold.record(m.event, failure)
                    break
                except (TypeError, ValueError) as exc:  # the client refused the message's shape
                    outcomes[m.event.id] = Failure(f"kafka: the message can not be produced: {exc}", retriable=False)
                    break

    def _check_producer(self, abort: threading.Event) -> None:
        """Before a batch: serve callbacks the producer queued since the last one, and replace a
        producer that lost every broker or turned fatal meanwhile, while nothing is in flight."""
        self._poll(abort, 0)
        if self._session.fatal is not None:
            self._replace(f"fatal producer error: {self._session.fatal}")
        elif self._session.brokers_lost:
            self._replace(f"every broker connection was lost ({self._session.client_error}); the broker may have "
                          "forgotten this producer or handed its id to another")

    def _wait(self, flight: _Flight, abort: threading.Event,
              partial: Callable[[Outcomes], set[int]] | None = None) -> str | None:
        """Poll until every report of ``flight`` arrived, checkpointing what is acknowledged every
        ``partial_seconds`` meanwhile (with ``partial``). Returns why the producer has to be replaced
        instead, if it has to."""
        started = time.monotonic()
        next_partial = started + self.partial_seconds
        next_warn = started + self.ack_warn_seconds
        reported = len(flight.outcomes)
        while True:
            self._tell_acknowledged(flight)  # what the last poll served (or _produce's, on a full queue)
            reason = self._wedged(flight)
            if reason is None and flight.pending == 0:
                if next_warn > started + self.ack_warn_seconds:
                    log.info("kafka sink %s: the batch was acknowledged after %.1fs", self.name,
                             time.monotonic() - started)
                return None
            if time.monotonic() >= next_warn:
                next_warn = time.monotonic() + self.ack_warn_seconds
                log.warning("kafka sink %s: %d messages have waited %.0fs for the broker's acknowledgement "
                            "(last client error: %s)", self.name, flight.pending, time.monotonic() - started,
                            self._session.client_error)
            if reason is not None and time.monotonic() >= self._recreate_after:
                return reason
            if partial is not None and time.monotonic() >= next_partial:
                next_partial = time.monotonic() + self.partial_seconds
                if len(flight.outcomes) > reported:
                    reported = len(flight.outcomes)
                    if not self._checkpoint_acknowledged(partial, flight.outcomes):
                        partial = None  # the database is away: not again in this batch
            self._poll(abort)

    def _tell_acknowledged(self, flight: _Flight) -> None:
        if flight.acked:
            self.observer.acknowledged(self.name, flight.acked)
            flight.acked = []

    def _checkpoint_acknowledged(self, partial: Callable[[Outcomes], set[int]], outcomes: Outcomes) -> bool:
        try:
            partial(dict(outcomes))
        except Exception as exc:  # the database may be away: the batch's own checkpoint comes at its end
            log.warning("kafka sink %s: could not checkpoint the acknowledged part of a batch in flight (%s); "
                        "it is checkpointed with the rest", self.name, describe_error(exc))
            return False
        return True

    def _wedged(self, flight: _Flight) -> str | None:
        session = self._session
        if session.fatal is not None:
            return f"fatal producer error: {session.fatal}"
        if flight.session_error is not None:
            return f"delivery failed with a producer error: {flight.session_error}"
        if session.brokers_lost and flight.pending:
            return (f"every broker connection was lost with {flight.pending} messages in flight "
                    f"({session.client_error}); the broker may come back without this producer's state")
        if flight.pending and time.monotonic() - flight.last_report >= self.stall_seconds:
            return (f"no delivery report for {self.stall_seconds:g}s with {flight.pending} messages in flight "
                    f"(last client error: {session.client_error})")
        return None

    def _poll(self, abort: threading.Event, timeout: float = POLL_SECONDS) -> None:
        if abort.is_set():
            # Drop what is still queued so that nothing of ours lands after the next
            # owner has started (it redelivers from the same cursor).
            with contextlib.suppress(KafkaException):
                self._producer.purge()
            raise Aborted()
        try:
            self._producer.poll(timeout)
        except KafkaException as exc:
            # confluent-kafka raises a fatal error (the idempotent producer can not keep its
            # guarantees, e.g. UNKNOWN_PRODUCER_ID with requests in flight) from poll().
            err: KafkaError = exc.args[0]
            if not err.fatal():
                raise
            self._session.fatal = _describe(err)
            abort.wait(timeout)

    def _replace(self, reason: str) -> None:
        """A new producer instance; the old one is purged and destroyed without waiting for it."""
        with contextlib.suppress(KafkaException):
            self._producer.purge()
        log.warning("kafka sink %s: %s; recreating the producer", self.name, reason)
        self.observer.producer_recreated(self.name, reason)
        self._session = _Session(may_hold_id=False)  # it may start while the brokers are still away
        self._swap_producer()

    def _swap_producer(self) -> None:
        """Put a new producer in place and destroy the old one on a thread of its own (``_retire``)."""
        retired = [self._producer]
        self._producer = self._new_producer(self._session)
        _retire(retired, self.name)

    def _resend(self, messages: list[_Message], flight: _Flight, reason: str) -> list[_Message]:
        """Replace the producer; returns the messages to send again, in their original order.

        Why per-key order survives (a key maps to one partition): per partition the idempotent
        producer writes, acknowledges and fails messages in produce order, so the acknowledged
        ones are a prefix of what was produced there and the rest a suffix, which is sent again
        in order. (A report without an offset ends the prefix of its partition: the reports after
        it in that flight are not counted either.) The old producer may still have written part of
        that suffix unacknowledged: a run in order from the suffix's start, possibly landing after
        the new producer's first writes. Two in-order runs from the same start, however
        interleaved, keep every message's first occurrence in order, so the de-duplicated sequence
        per key is the published one.
        """
        with contextlib.suppress(KafkaException):
            self._producer.purge()  # queued and in flight: their reports say _PURGE_*, i.e. not acknowledged
            self._producer.poll(0)  # acks that made it before the purge still count
        flight.live = False
        self._tell_acknowledged(flight)
        todo = [m for m in messages if m.event.id not in flight.outcomes]
        log.warning("kafka sink %s: %s; recreating the producer and producing %d unacknowledged messages again",
                    self.name, reason, len(todo))
        self.observer.producer_recreated(self.name, reason)
        self._session = _Session(may_hold_id=False)  # it may start while the brokers are still away
        self._swap_producer()
        self._recreate_after = time.monotonic() + self._recreate_delay
        self._recreate_delay = min(self._recreate_delay * 2, self.stall_seconds)
        return todo
