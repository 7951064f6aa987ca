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
sink, not of its events: the topic is *held* (``topics.py``), its events wait, no attempt counted.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from confluent_kafka import KafkaError, KafkaException, Producer

from ...dsn import redact_kafka_config
from ...errors import ConfigurationError
from ...observer import NULL_OBSERVER, Observer
from ...store import EventFilter, StoredEvent
from ..engine import PARTIAL_CHECKPOINT_SECONDS, Aborted, Commit, EarlyCheckpoints, Failure, KeyHold, Outcomes
from .broker_errors import TOPIC_CONDITIONS, describe, failure_of
from .config import PRODUCER_DEFAULTS, check_config
from .debezium import DebeziumFormat
from .flight import Batch, Flight, Session
from .message import Message, MessageHeaders
from .topics import TopicCondition, TopicHolds

log = logging.getLogger("outbox_relay.kafka")
# librdkafka's own lines (a broker that refuses connections, TLS and SASL errors, its debug contexts
# when the `debug` option is set) through the relay's logging, so that --log-json and redaction cover
# them; librdkafka's levels map to Python's (its errors are ERROR). confluent-kafka hands them over in
# poll(), on the sink's thread.
LIBRDKAFKA_LOG = logging.getLogger("outbox_relay.librdkafka")
# A batch that waits this long for its acknowledgements says so (and again after as long each time), so
# that no wait for the broker is silent (issue 25: a drain stalled 5.5 s with nothing logged).
ACK_WAIT_WARN_SECONDS = 5.0
DEFAULT_STALL_SECONDS = 60.0
POLL_SECONDS = 0.05
FIRST_RECREATE_DELAY = 1.0  # spacing of replacements in a row (doubling up to the stall time)
SLOW_DESTROY_SECONDS = 5.0  # a replaced producer that takes longer to shut down is logged
# Replaced producers whose destruction has not finished (``_retire``), across sinks.
_retiring = 0
_retiring_lock = threading.Lock()


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




class KafkaSink:
    kind = "kafka"
    event_filter: EventFilter | None = None  # every event goes to Kafka

    def __init__(self, name: str, config: dict[str, Any], default_topic: str | None, source: str,
                 stall_seconds: float = DEFAULT_STALL_SECONDS, *, topic: str | None = None,
                 extra_headers: Sequence[tuple[str, bytes]] = (), debezium: DebeziumFormat | None = None) -> None:
        check_config(config)
        self.name = name
        self.default_topic = default_topic
        self.topic = topic  # every message to this topic (a replay into another topic)
        self.headers = MessageHeaders(name, source.encode(), extra_headers)
        self.debezium = debezium  # None: CloudEvents headers, the payload as the value (message.py)
        self.stall_seconds = stall_seconds
        self._config = {**PRODUCER_DEFAULTS, **config}
        log.info("kafka producer config %s", redact_kafka_config({k: str(v) for k, v in self._config.items()}))
        # Owned by the thread that calls deliver() (callbacks run inside its poll() calls).
        self._recreate_delay = FIRST_RECREATE_DELAY
        self._recreate_after = 0.0  # monotonic time before which the producer is not replaced again
        self._session = Session()
        self.partial_seconds = PARTIAL_CHECKPOINT_SECONDS
        self.ack_warn_seconds = ACK_WAIT_WARN_SECONDS
        self.holds = TopicHolds(name)  # held topics: what the broker said can not be written now
        self.observer: Observer = NULL_OBSERVER  # set by the composition root
        try:
            self._producer = self._new_producer(self._session)
        except KafkaException as exc:  # an unknown option, a value it does not take, a contradiction
            err: KafkaError = exc.args[0]
            raise ConfigurationError(f"Kafka options refused by librdkafka: {err.str()}") from None

    def _new_producer(self, session: Session) -> Producer:
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
            return f"the Kafka brokers do not answer: {describe(err)}"
        now = time.monotonic()
        held = [f"topic {topic}: {c.error} for {now - c.since:.0f}s (its events wait)"
                for topic, c in sorted(self.conditions().items())]
        return "; ".join(held) or None

    def conditions(self) -> dict[str, TopicCondition]:
        """The held topics and why (a copy; safe from any thread)."""
        return self.holds.conditions()

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
            self._session.fatal = describe(err)  # the producer is replaced before the next batch

    def close(self) -> None:
        with contextlib.suppress(KafkaException):  # a fatal producer raises from flush()
            self._producer.purge()
            self._producer.flush(0)

    def deliver(self, events: Sequence[StoredEvent], fences: dict[int, int], commit: Commit,
                abort: threading.Event) -> set[int]:
        outcomes: Outcomes = {}
        messages: list[Message] = []
        for e in events:
            message = self._message(e, fences[e.bucket])
            if isinstance(message, Failure):
                outcomes[e.id] = message
            else:
                messages.append(message)
        if messages:
            self._check_producer(abort)
            messages = self.holds.hold_back(messages, outcomes, self._producer)
        batch = Batch()
        # The runner's commit checkpoints the acknowledged part of a long batch early; another may write nothing.
        partial: Callable[[Outcomes], set[int]] | None = commit.partial
        todo = messages
        while todo:
            flight = Flight(outcomes, self._session, batch)
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
        self.holds.settle(batch, outcomes)
        # Delivered: nothing here acts on whether the fence held, so the runner's commit may check it with
        # its next read rather than a statement of its own (``later``; another commit writes at once).
        return commit.later(outcomes)

    def _message(self, e: StoredEvent, fence: int) -> Message | Failure:
        """The event's message, or why it can not have one (non-retriable: the row never changes)."""
        if self.debezium is not None:
            routed = self.topic or self.debezium.topic(e, self.default_topic)
            if isinstance(routed, Failure):
                return routed
            return Message(e, routed, self.debezium.headers(e), self.debezium.key(e), self.debezium.value(e))
        topic = self.topic or e.topic or self.default_topic
        if topic is None:
            return Failure("event has no topic and the relay has no --default-topic", retriable=False)
        headers = self.headers.of(e, fence)
        if isinstance(headers, Failure):
            return headers
        return Message(e, topic, headers, e.key.encode(), e.payload_text.encode())

    def _produce(self, todo: list[Message], hold: KeyHold, flight: Flight, abort: threading.Event) -> None:
        """Hand ``todo`` to the producer in order, except keys ``hold`` holds (it grows with failures);
        stops early if the producer is wedged."""
        outcomes = flight.outcomes
        for m in todo:
            if not hold.allows(m.event):
                continue
            while True:
                try:
                    self._producer.produce(m.topic, m.value, m.key,
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
                        self._session.fatal = self._session.fatal or describe(err)
                        return
                    if err.code() in TOPIC_CONDITIONS:  # the client already knows the topic is not there
                        failure = outcomes[m.event.id] = flight.batch.topic_failed(m.topic, m.event.id, err)
                    else:
                        failure = outcomes[m.event.id] = failure_of(err)
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

    def _wait(self, flight: Flight, abort: threading.Event,
              partial: Callable[[Outcomes], set[int]] | None = None) -> str | None:
        """Poll until every report of ``flight`` arrived, checkpointing what is acknowledged every
        ``partial_seconds`` meanwhile (with ``partial``). Returns why the producer has to be replaced
        instead, if it has to."""
        started = time.monotonic()
        early = EarlyCheckpoints(self.name, partial, self.partial_seconds)
        next_warn = started + self.ack_warn_seconds
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
            if early.due():
                early.write(dict(flight.outcomes))
            self._poll(abort)

    def _tell_acknowledged(self, flight: Flight) -> None:
        if flight.acked:
            self.observer.acknowledged(self.name, flight.acked)
            flight.acked = []

    def _wedged(self, flight: Flight) -> str | None:
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
            self._session.fatal = describe(err)
            abort.wait(timeout)

    def _replace(self, reason: str) -> None:
        """A new producer instance; the old one is purged and destroyed without waiting for it."""
        with contextlib.suppress(KafkaException):
            self._producer.purge()
        log.warning("kafka sink %s: %s; recreating the producer", self.name, reason)
        self.observer.producer_recreated(self.name, reason)
        self._session = Session(may_hold_id=False)  # it may start while the brokers are still away
        self._swap_producer()

    def _swap_producer(self) -> None:
        """Put a new producer in place and destroy the old one on a thread of its own (``_retire``)."""
        retired = [self._producer]
        self._producer = self._new_producer(self._session)
        _retire(retired, self.name)

    def _resend(self, messages: list[Message], flight: Flight, reason: str) -> list[Message]:
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
        self._session = Session(may_hold_id=False)  # it may start while the brokers are still away
        self._swap_producer()
        self._recreate_after = time.monotonic() + self._recreate_delay
        self._recreate_delay = min(self._recreate_delay * 2, self.stall_seconds)
        return todo
