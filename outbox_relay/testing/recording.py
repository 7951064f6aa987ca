"""``RecordingSink``: a sink a real relay delivers to in a test, recording each event."""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from outbox_relay.sinks.engine import Commit, Failure, KeyHold, Outcomes
from outbox_relay.store import EventFilter, StoredEvent

from .published import SHOWN, PublishedEvent
from .published_event import published_event

# -- a sink for whole-relay tests ------------------------------------------------------------------


@dataclass(frozen=True)
class Delivery:
    """One attempt a ``RecordingSink`` saw: the event, its attempt number (1 on first delivery, counted
    by the relay across retries) and the error it was failed with (None: delivered)."""

    event: PublishedEvent
    attempt: int
    error: str | None


FailWith = Callable[[PublishedEvent, int], "str | Failure | None"]


class RecordingSink:
    """A sink that records what a real relay delivers to it, for tests of a whole relay without Kafka::

        sink = RecordingSink("kafka")
        worker = Worker(RelaySettings(dsn=test_dsn, kafka=False, worker_id="t"), sinks=[sink])
        worker.start()
        ...publish and commit...
        sink.wait_for(3)                         # three events delivered (AssertionError after the timeout)
        assert [e.type for e in sink.delivered(key="order:7")] == ["OrderPlaced", "OrderPaid", "OrderShipped"]
        worker.drain(); worker.wait()

    It follows the relay's rules like a real sink: it gets each bucket's events in order, and after a
    failure it leaves the rest of that key's batch alone (the relay parks them behind it). ``fail(event,
    attempt)`` makes an attempt fail: return an error text (retried with backoff, dead-lettered after
    ``--max-attempts``), a ``Failure(error, retriable=False)`` (dead-lettered at once) or None.

    ``delivered()`` lists each delivered event once, in the order of its first delivery (a relay
    redelivers a batch whose checkpoint did not land: at-least-once); ``deliveries`` every attempt.
    Thread-safe: the relay calls ``deliver`` on its runner thread.

    To record more (per-batch timing, fences, a gate that holds a batch in flight), subclass it and
    override the hooks ``deliver`` calls on the runner thread: ``begin(events, fences, abort)``
    before the batch, ``attempt(e, fence) -> Failure | None`` per event it attempts (the default asks
    ``fail``), ``end(events, landed)`` after the checkpoint.
    """

    event_filter: EventFilter | None = None  # every event, like the Kafka sink

    def __init__(self, name: str = "kafka", *, fail: FailWith | None = None, kind: str = "kafka") -> None:
        if kind not in ("kafka", "projection"):
            raise ValueError(f"kind must be 'kafka' or 'projection' (how the sink is registered), not {kind!r}")
        self.name, self.kind, self.fail = name, kind, fail
        self._deliveries: list[Delivery] = []
        self._lock = threading.Condition()

    def deliver(self, events: Sequence[StoredEvent], fences: dict[int, int], commit: Commit,
                abort: threading.Event) -> set[int]:
        self.begin(events, fences, abort)
        outcomes: Outcomes = {}
        hold = KeyHold()
        attempts: list[Delivery] = []
        for e in events:
            if not hold.allows(e):
                continue
            outcome = self.attempt(e, fences[e.bucket])
            outcomes[e.id] = outcome
            attempts.append(Delivery(published_event(e, None, None), e.attempts + 1,
                                     outcome.error if outcome else None))
            hold.record(e, outcome)
        landed = commit(outcomes, None)
        with self._lock:
            # Only what landed counts: a batch whose checkpoint was fenced out is delivered again.
            self._deliveries.extend(d for d in attempts if d.event.id in {e.id for e in events if e.bucket in landed})
            self._lock.notify_all()
        self.end(events, landed)
        return landed

    def begin(self, events: Sequence[StoredEvent], fences: dict[int, int], abort: threading.Event) -> None:
        """Hook: a batch is about to be delivered (may raise ``Aborted`` when ``abort`` is set)."""

    def attempt(self, e: StoredEvent, fence: int) -> Failure | None:
        """Hook: deliver ``e`` (its bucket's fence is ``fence``); its outcome. The default asks ``fail``."""
        result = self.fail(published_event(e, None, None), e.attempts + 1) if self.fail is not None else None
        if result is None or isinstance(result, Failure):
            return result
        return Failure(str(result))

    def end(self, events: Sequence[StoredEvent], landed: set[int]) -> None:
        """Hook: the batch's checkpoint was written; ``landed`` are the buckets whose fence held."""

    def close(self) -> None:
        pass

    @property
    def deliveries(self) -> list[Delivery]:
        """Every attempt of a batch that landed, failed ones included, in order."""
        with self._lock:
            return list(self._deliveries)

    def delivered(self, *, key: str | None = None) -> list[PublishedEvent]:
        """Each delivered event once (of ``key``, if given), in the order of its first delivery."""
        seen: set[uuid.UUID] = set()
        out = []
        for d in self.deliveries:
            if d.error is None and d.event.id not in seen and (key is None or d.event.key == key):
                seen.add(d.event.id)
                out.append(d.event)
        return out

    def wait_for(self, count: int, timeout: float = 10.0) -> list[PublishedEvent]:
        """Block until ``count`` distinct events were delivered; returns them. AssertionError (what was
        delivered, and what failed) after ``timeout`` seconds."""
        deadline = time.monotonic() + timeout
        with self._lock:
            while len(self.delivered()) < count:
                left = deadline - time.monotonic()
                if left <= 0:
                    failed = [f"{d.event.type} {d.event.key!r} attempt {d.attempt}: {d.error}"
                              for d in self._deliveries if d.error is not None]
                    raise AssertionError(f"{len(self.delivered())} of {count} events delivered within {timeout:g}s"
                                         + (f"; failed attempts: {failed[:SHOWN]}" if failed else ""))
                self._lock.wait(left)
        return self.delivered()

