"""Every error the package raises on purpose derives from OutboxError."""

from __future__ import annotations

import uuid
from collections.abc import Sequence

MAX_ERROR_CHARS = 2000  # what a parked event or dead letter keeps of an error message


def counted(n: int, noun: str) -> str:
    """``1 attempt``, ``2 attempts``: a count as an error or log message says it."""
    return f"{n} {noun}" if n == 1 else f"{n} {noun}s"


class OutboxError(Exception):
    """Base class of outbox-relay errors."""


class InvalidEvent(OutboxError, ValueError):
    """An event was refused before anything was written; the message names the field."""


class IdempotencyConflict(InvalidEvent):
    """An idempotency key already stands for another event (other type, key or payload) in its topic.

    A retry must publish the same event again; a new event needs a new key. Nothing of the call was
    written, except where the message says otherwise (a concurrent transaction took the key while
    a batch was being written: the transaction was then aborted and must be rolled back).
    """

    def __init__(self, idempotency_key: str, topic: str | None, detail: str) -> None:
        self.idempotency_key = idempotency_key
        self.topic = topic
        scope = f"topic {topic!r}" if topic is not None else "events without a topic"
        super().__init__(f"idempotency key {idempotency_key!r} of {scope} {detail}")


class NoTransaction(OutboxError, RuntimeError):
    """``publish`` was given a connection in autocommit mode outside a transaction: the event would
    commit on its own, whatever happens to the business change. Nothing was written."""


class ConfigurationError(OutboxError, ValueError):
    """A setting, sink name or projection reference is not usable."""


class WorkerIdInUse(ConfigurationError):
    """Another relay process is registered under this worker id and its heartbeat is fresh."""

    def __init__(self, worker: str, host: str | None, pid: int | None, seen_seconds_ago: float,
                 seconds_left: float) -> None:
        self.worker, self.host, self.pid = worker, host, pid
        self.seen_seconds_ago, self.seconds_left = seen_seconds_ago, seconds_left
        super().__init__(
            f"worker id {worker!r} is in use by another relay (host {host or 'unknown'}, pid {pid or 'unknown'}, "
            f"heard from {seen_seconds_ago:.1f}s ago): give each relay its own --worker-id (OUTBOX_WORKER_ID). "
            f"If that relay is gone, its registration lapses within {max(seconds_left, 0.0):.0f}s (its "
            "--worker-ttl-seconds): start this one again after that")


class SchemaError(OutboxError):
    """The database schema is missing or newer than this version understands."""


class LeaseLost(OutboxError):
    """This worker no longer holds the bucket; its work there was discarded (fencing)."""


class SinkDropped(ConfigurationError):
    """The sink was dropped (``outbox-relay sinks drop``) or never existed; a relay will not recreate it."""


class CheckpointFailed(OutboxError):
    """The relay's own bookkeeping statement failed (a database or privilege problem, not an event's)."""


class SinkStuck(OutboxError):
    """A sink's work did not return and can not be abandoned safely (its checkpoint hung, or too many
    handlers that never returned are parked on abandoned threads): the relay stops by itself (exit 4)
    and its buckets move; what it had in flight is redelivered from the last checkpoint."""


class NonRetriableDelivery(OutboxError):
    """A sink says this event can never be delivered (e.g. too large): dead-letter at once."""


class OpenTransaction(OutboxError, RuntimeError):
    """``wait_for`` was called on a connection inside a transaction (commit first)."""


class UnknownEvent(OutboxError, LookupError):
    """No stored event has this id: never committed (rolled back, or not yet), or removed by retention."""

    def __init__(self, event_ids: Sequence[uuid.UUID]) -> None:
        self.event_ids = tuple(event_ids)
        more = f" (and {len(self.event_ids) - 1} more)" if len(self.event_ids) > 1 else ""
        super().__init__(f"no stored event with id {self.event_ids[0]}{more}: its transaction did not commit "
                         "(rolled back, or still open), or retention already removed it")


class EventDeadLettered(OutboxError):
    """An awaited event is in the sink's dead letters: it will not be applied unless retried by hand."""

    def __init__(self, sink: str, event_id: uuid.UUID, last_error: str, attempts: int) -> None:
        self.sink = sink
        self.event_id = event_id
        self.last_error = last_error
        self.attempts = attempts
        super().__init__(f"event {event_id} was dead-lettered by sink {sink!r} after {counted(attempts, 'attempt')}: "
                         f"{last_error}")


class WaitTimeout(OutboxError, TimeoutError):
    """The awaited events were not all applied in time; ``pending`` were not attempted yet, ``retrying`` failed
    at least once (or wait behind a failed event of their key) and are parked for another attempt, ``paused``
    belong to a key an operator paused for the sink (``outbox-relay keys pause``): held until it is resumed."""

    def __init__(self, sink: str, timeout: float, pending: Sequence[uuid.UUID], retrying: Sequence[uuid.UUID],
                 last_error: str | None, hints: Sequence[str] = (), *, paused: Sequence[uuid.UUID] = ()) -> None:
        self.sink = sink
        self.timeout = timeout
        self.pending = tuple(pending)
        self.retrying = tuple(retrying)
        self.paused = tuple(paused)
        self.last_error = last_error
        message = (f"sink {sink!r} did not apply {len(self.pending) + len(self.retrying) + len(self.paused)} "
                   f"event(s) within {timeout:g}s: {len(self.pending)} pending, {len(self.retrying)} retrying")
        if self.paused:
            message += f", {len(self.paused)} paused"
        if last_error is not None:
            message += f" (last error: {last_error})"
        for hint in hints:
            message += f"; {hint}"
        # One argument: OSError (TimeoutError's base) reads two as (errno, strerror).
        super().__init__(message)

