"""Topics a Kafka sink holds: a topic that does not exist (with auto-creation off) or that an ACL denies is
a condition of the sink, not of its events. Its events fail with ``Failure.hold_seconds`` (parked, no
attempt counted, nothing dead-lettered) without being produced, ``KafkaSink.problem()`` names it, and
its metadata is asked for again after a backoff; once the broker answers for it, its events go out
again. Events of other topics are not held back."""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass

from confluent_kafka import KafkaError, KafkaException, Producer

from ...backoff import Backoff
from ..engine import Failure, Outcomes
from .broker_errors import TOPIC_CONDITIONS, describe
from .flight import Batch
from .message import Message

log = logging.getLogger("outbox_relay.kafka")

HOLD_BACKOFF = Backoff(1.0, 30.0)  # between checks of a held topic (by how many checks failed)
METADATA_TIMEOUT_SECONDS = 5.0  # a topic's metadata request; no answer: produce and let the batch wait


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



class TopicHolds:
    """The held topics of one sink and the topics the broker answered for.

    Written by the thread that calls the sink's ``deliver``; ``conditions()`` is safe from any thread
    (problem() and the metrics): the dict is replaced under the lock, never changed in place.
    """

    def __init__(self, sink: str) -> None:
        self.sink = sink  # for log lines
        self.backoff = HOLD_BACKOFF  # tests shrink it
        self._conditions: dict[str, TopicCondition] = {}
        self._conditions_lock = threading.Lock()
        self.writable: set[str] = set()  # topics the broker answered for (deliver()'s thread only)
        # After a lookup got no answer (brokers away): no lookups before this monotonic time, so that an
        # outage does not cost every batch a metadata timeout per topic (deliver()'s thread only).
        self._lookups_after = 0.0

    def conditions(self) -> dict[str, TopicCondition]:
        """The held topics and why (a copy; safe from any thread)."""
        with self._conditions_lock:
            return dict(self._conditions)

    def hold_back(self, messages: list[Message], outcomes: Outcomes, producer: Producer) -> list[Message]:
        """The messages to produce: those of held topics fail at once (held), without a word to the broker
        until their next check is due. A topic not seen before is looked up first, so that a missing one
        does not hold the whole batch for librdkafka's ``topic.metadata.propagation.max.ms``."""
        now = time.monotonic()
        held: dict[str, TopicCondition] = {}
        for topic in dict.fromkeys(m.topic for m in messages):
            condition = self._conditions.get(topic)
            if condition is not None and now < condition.retry_at:
                held[topic] = condition
            elif topic not in self.writable:
                error = self._topic_error(topic, producer)
                if error is not None:
                    held[topic] = self.hold(topic, error)
                elif condition is None:
                    self.writable.add(topic)
                # else a held topic the broker now answers for: its messages go out, and the first
                # acknowledgement ends the hold (settle); an ACL may still deny writes.
        if not held:
            return messages
        now = time.monotonic()
        failures = {topic: c.failure(topic, now) for topic, c in held.items()}
        for m in messages:
            if m.topic in failures:
                outcomes[m.event.id] = failures[m.topic]
        return [m for m in messages if m.topic not in failures]

    def _topic_error(self, topic: str, producer: Producer) -> str | None:
        """The broker's answer for ``topic`` if it says the topic can not be written (missing, denied)."""
        if time.monotonic() < self._lookups_after:
            return None
        try:
            metadata = producer.list_topics(topic, timeout=METADATA_TIMEOUT_SECONDS)
        except KafkaException:
            # No answer: produce, and the batch waits for the broker as in any outage.
            self._lookups_after = time.monotonic() + self.backoff.cap
            return None
        found = metadata.topics.get(topic)
        err: KafkaError | None = None if found is None else found.error
        if err is not None and err.code() in TOPIC_CONDITIONS:
            return describe(err)
        return None

    def hold(self, topic: str, error: str) -> TopicCondition:
        """Record that ``topic`` is not writable (again); one warning per check."""
        now = time.monotonic()
        old = self._conditions.get(topic)
        checks = 1 if old is None else old.checks + 1
        condition = TopicCondition(error, now if old is None else old.since, checks,
                                   now + self.backoff.delay(checks))
        with self._conditions_lock:
            self._conditions = {**self._conditions, topic: condition}
        self.writable.discard(topic)
        log.warning("kafka sink %s: topic %s: %s; its events wait (no attempt counted, nothing dead-lettered)%s, "
                    "next check in %.1fs", self.sink, topic, error,
                    "" if old is None else f" for {now - condition.since:.0f}s", condition.retry_at - now)
        return condition

    def settle(self, batch: Batch, outcomes: Outcomes) -> None:
        """After a batch: hold the topics it found not writable, end the holds of those it got acks from."""
        resumed = [t for t in batch.acknowledged if t in self._conditions and t not in batch.errors]
        for topic in resumed:
            condition = self._conditions[topic]
            with self._conditions_lock:
                self._conditions = {t: c for t, c in self._conditions.items() if t != topic}
            log.info("kafka sink %s: topic %s is writable again after %.0fs; delivery resumes", self.sink, topic,
                     time.monotonic() - condition.since)
        self.writable.update(batch.acknowledged - batch.errors.keys())
        if not batch.errors:
            return
        now = time.monotonic()
        failures = {topic: self.hold(topic, error).failure(topic, now) for topic, error in batch.errors.items()}
        for event_id, topic in batch.held.items():
            outcomes[event_id] = failures[topic]
