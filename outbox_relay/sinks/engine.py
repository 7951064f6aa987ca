"""What a sink is: something that takes an ordered batch and says, per event, how it went."""

from __future__ import annotations

import inspect
import logging
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import psycopg

from ..dsn import describe_error
from ..store import Checkpoint, Conn, EventFilter, StoredEvent

log = logging.getLogger("outbox_relay.sink")

AsyncConn = psycopg.AsyncConnection[Any]
IDLE_CALL_SECONDS = 1.0  # how often a waiting runner calls its sink's ``idle()``
# While a batch takes longer than this (a slow or absent broker, slow calls of a user's sink), what is
# delivered of it is checkpointed every this often (``Commit.partial``), so that a relay that dies or
# loses its buckets meanwhile hands over only the rest to be sent again. A quicker batch costs nothing.
PARTIAL_CHECKPOINT_SECONDS = 1.0


@dataclass(frozen=True)
class Failure:
    error: str
    retriable: bool = True
    # Set when the sink, not the event, is at fault (a Kafka topic that does not exist yet, an ACL
    # that denies it): the event waits this many seconds, parked like a retry but counting no
    # attempt, so a condition that lasts never dead-letters good events.
    hold_seconds: float | None = None
    # A retry that must wait at least this long (a user sink's ``Retry(after_seconds=...)``, e.g. an
    # HTTP Retry-After): the park lasts the longer of this and the relay's backoff.
    retry_after: float | None = None


# Per event id: None = delivered, Failure = failed; an id that is absent was not attempted.
Outcomes = dict[uuid.UUID, Failure | None]


class Keyed(Protocol):
    """What the per-key rule reads of an event: its partition key."""

    @property
    def key(self) -> str: ...


class KeyHold:
    """The per-key rule of a batch, the same for every sink and for the checkpoint that follows
    (relay.classify): once an event of a key has failed and will be retried, the key's later events
    are not attempted, or they could land before it. A failure that is never retried (dead letter)
    lets the key move on."""

    def __init__(self) -> None:
        self._held: set[str] = set()

    def allows(self, e: Keyed) -> bool:
        return e.key not in self._held

    def hold(self, key: str) -> None:
        self._held.add(key)

    def record(self, e: Keyed, outcome: Failure | None) -> None:
        if outcome is not None and outcome.retriable:
            self._held.add(e.key)


class Commit(Protocol):
    """How a sink hands a batch's outcomes back: writes the batch's checkpoint and returns the buckets
    whose fence held. A sink calls exactly one of ``__call__``, ``in_async`` and ``later``, once, and
    ``partial`` any number of times before it.

    A sink with its own transaction (a projection) passes it, so that its writes and the
    checkpoint commit together; if a bucket's fence did not hold, ``LeaseLost`` is raised
    inside that transaction so that it rolls back. Others pass None: they have delivered already, so
    the fence is checked now and the cursor row may be written later (``cursor_flush_seconds``).
    A commit that can do no more than that (a replay's, a test's) is a ``CommitAtEnd``.
    """

    def __call__(self, outcomes: Outcomes, tx: Conn | None) -> set[int]:
        """Checkpoint the batch, in the sink's transaction ``tx`` or (None) on its own."""
        ...

    async def in_async(self, outcomes: Outcomes, tx: AsyncConn) -> set[int]:
        """``__call__`` in a sink's async transaction."""
        ...

    def partial(self, outcomes: Outcomes) -> set[int]:
        """Checkpoint what of a long batch is settled while the rest is in flight (a sink without a
        transaction of its own, every ``PARTIAL_CHECKPOINT_SECONDS``): the delivered run of each bucket's
        events from its start. Returns the buckets written; none if this commit writes nothing early."""
        ...

    def later(self, outcomes: Outcomes) -> set[int]:
        """``self(outcomes, None)`` for a sink that acts on nothing the answer says (the Kafka sink): the
        fence check may then ride on the runner's next read. Returns the buckets the batch was read under
        (which of them held is known only after that read)."""
        ...


class CommitAtEnd:
    """A ``Commit`` that writes only a batch's final checkpoint, on no transaction of a sink's own:
    ``partial`` writes nothing, ``later`` is ``self(outcomes, None)``. Subclasses define ``__call__``;
    ``CommitAtEnd.of`` makes one of a function."""

    def __call__(self, outcomes: Outcomes, tx: Conn | None) -> set[int]:
        raise NotImplementedError

    async def in_async(self, outcomes: Outcomes, tx: AsyncConn) -> set[int]:
        raise NotImplementedError(f"{type(self).__name__} takes no transaction of a sink's own")

    def partial(self, outcomes: Outcomes) -> set[int]:
        return set()

    def later(self, outcomes: Outcomes) -> set[int]:
        return self(outcomes, None)

    @staticmethod
    def of(write: Callable[[Outcomes, Conn | None], set[int]]) -> CommitAtEnd:
        return _CommitFunction(write)


class _CommitFunction(CommitAtEnd):
    def __init__(self, write: Callable[[Outcomes, Conn | None], set[int]]) -> None:
        self.write = write

    def __call__(self, outcomes: Outcomes, tx: Conn | None) -> set[int]:
        return self.write(outcomes, tx)


class EarlyCheckpoints:
    """The early checkpoints of one long batch (``Commit.partial``): due every ``seconds``, each of what is
    settled by then if more is than at the last one. One that fails (the database may be away) ends them
    for the batch: they only save redelivery, the batch's own checkpoint at its end decides."""

    def __init__(self, sink: str, partial: Callable[[Outcomes], set[int]] | None, seconds: float) -> None:
        self.sink = sink  # for the log line
        self.partial = partial  # None: this commit writes nothing early
        self.seconds = seconds
        self.next_at = time.monotonic() + seconds
        self.written = 0  # how many outcomes the last early checkpoint held

    def due(self) -> bool:
        return self.partial is not None and time.monotonic() >= self.next_at

    def write(self, settled: Outcomes) -> None:
        """Checkpoint ``settled`` (the caller's copy; the batch goes on meanwhile) if it holds more than the last."""
        self.next_at = time.monotonic() + self.seconds
        if self.partial is None or len(settled) <= self.written:
            return
        self.written = len(settled)
        try:
            self.partial(settled)
        except Exception as exc:
            log.warning("sink %s: could not checkpoint the settled part of a batch in flight (%s); it is checkpointed "
                        "with the rest", self.sink, describe_error(exc))
            self.partial = None


class Aborted(Exception):
    """Hard stop while a batch was in flight: nothing is checkpointed, the next owner redelivers."""


class Sink(Protocol):
    """A destination the relay delivers to.

    Optional hook: ``idle() -> None``. A sink that has it is called on its runner's thread (the one
    that calls ``deliver``) whenever the runner waits with nothing to do, at once and then every
    ``IDLE_CALL_SECONDS`` until it is woken (``wait_idle``): for work a client library does only when
    called, such as the Kafka sink serving librdkafka's log lines and error callbacks. It must not
    block; what it raises is logged.
    """

    name: str
    kind: str
    # The events it wants (a projection's types and topics); None: all. The others are skipped
    # by the read query and never handed to ``deliver``.
    event_filter: EventFilter | None

    def deliver(self, events: Sequence[StoredEvent], fences: dict[int, int], commit: Commit,
                abort: threading.Event) -> set[int]:
        """Deliver ``events`` (in position order per bucket), then call ``commit`` exactly once.

        Returns what ``commit`` returned. Raises Aborted if ``abort`` was set mid-batch.
        """
        ...

    def close(self) -> None: ...


def is_engine_sink(sink: object) -> bool:
    """Whether ``sink`` keeps the engine's protocol (``deliver(events, fences, commit, abort)`` and an
    ``event_filter``) rather than a user's ``EventSink`` (``deliver(event)``)."""
    deliver = getattr(sink, "deliver", None)
    return (callable(deliver) and len(inspect.signature(deliver).parameters) == 4
            and hasattr(sink, "event_filter"))


def wait_idle(sink: Sink, wake: threading.Event, seconds: float) -> bool:
    """Wait for ``wake`` at most ``seconds``, calling the sink's ``idle()`` (if it has one) at once and
    then every ``IDLE_CALL_SECONDS``. True if woken."""
    idle: Callable[[], None] | None = getattr(sink, "idle", None)
    if idle is None:
        return wake.wait(seconds)
    deadline = time.monotonic() + seconds
    while True:
        try:
            idle()
        except Exception as exc:  # the runner's loop goes on: one failure never kills the worker
            log.warning("sink %s: idle call failed: %s", sink.name, describe_error(exc))
        left = deadline - time.monotonic()
        if left <= 0:
            return False
        if wake.wait(min(left, IDLE_CALL_SECONDS)):
            return True


__all__ = ["Aborted", "AsyncConn", "Checkpoint", "Commit", "CommitAtEnd", "Failure", "KeyHold", "Outcomes", "Sink",
           "wait_idle"]
