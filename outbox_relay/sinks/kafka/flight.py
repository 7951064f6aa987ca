"""What one producer instance was told: its session (the error callback's reports) and its flights (the
messages handed to it and what their delivery reports said), shared by a batch's flights (``Batch``)."""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from typing import Any

from confluent_kafka import KafkaError

from ..engine import Failure, Outcomes
from .broker_errors import SESSION_ERRORS, TOPIC_CONDITIONS, describe, failure_of


class Session:
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
        self.client_error = describe(err)
        if err.fatal():
            self.fatal = self.client_error
        elif err.code() == KafkaError._ALL_BROKERS_DOWN and self.may_hold_id:
            self.brokers_lost = True

    def acknowledged(self) -> None:
        self.may_hold_id = True


class Flight:
    """The messages handed to one producer instance, and what their delivery reports said.

    Only the thread in ``deliver`` touches it: librdkafka runs delivery callbacks inside
    ``poll()`` on the calling thread.
    """

    def __init__(self, outcomes: Outcomes, session: Session, batch: Batch | None = None) -> None:
        self.outcomes = outcomes  # the batch's, shared by every flight of the batch
        self.session = session
        self.batch = batch if batch is not None else Batch()  # the batch's too
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
                    self.session_error = self.session_error or describe(err)  # sent again by the next producer
                elif err.code() in TOPIC_CONDITIONS:
                    self.outcomes[event_id] = self.batch.topic_failed(msg.topic(), event_id, err)
                else:
                    self.outcomes[event_id] = failure_of(err)
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


class Batch:
    """Topic conditions one batch met, shared by its flights: events whose topic turned out not
    writable (their outcomes are set once the batch is done) and topics something was acknowledged on."""

    def __init__(self) -> None:
        self.held: dict[uuid.UUID, str] = {}  # event id -> its topic
        self.errors: dict[str, str] = {}  # topic -> the broker's or the client's answer
        self.acknowledged: set[str] = set()

    def topic_failed(self, topic: str, event_id: uuid.UUID, err: KafkaError) -> Failure:
        self.held[event_id] = topic
        self.errors.setdefault(topic, describe(err))
        return Failure(f"kafka: topic {topic}: {describe(err)}", hold_seconds=0.0)  # replaced by ``TopicHolds.settle``