"""What the relay engine reports as it works: batches, leases, failed cycles, housekeeping passes.

The engine calls an ``Observer``; it never imports a metrics or tracing library. The default does
nothing. ``metrics.PrometheusObserver`` turns the calls into Prometheus metrics (``outbox-relay run
--metrics-port``), ``tracing.TracingObserver`` into OpenTelemetry spans (``--tracing``); ``Observers``
hands every call to several. Calls come from several threads (a runner per sink, membership,
housekeeping), so an implementation must be thread-safe; each call is cheap and never raises into the
engine.
"""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any, TypeVar

if TYPE_CHECKING:
    from .sink import Sink
    from .store import Checkpoint, StoredEvent

HandlerT = TypeVar("HandlerT", bound=Callable[..., Any])


class Delivery:
    """What became of one batch, told to the scope ``Observer.delivering`` opened for it."""

    def landed(self, checkpoint: Checkpoint | None, buckets: set[int]) -> None:
        """The sink returned: ``checkpoint`` is what its commit wrote (None: it wrote none), ``buckets``
        the buckets whose fence held (the others' outcomes were discarded). A Kafka batch whose fence check
        rides on the runner's next read (``Commit.later``) names the buckets it was read under: if that
        read finds one lost, ``Observer.leases(lost=...)`` says so and ``checkpointed`` leaves it out."""


NULL_DELIVERY = Delivery()
# Reusable and thread-safe: nullcontext keeps no state between uses.
_NO_SCOPE = contextlib.nullcontext(NULL_DELIVERY)


class Observer:
    """No-op base: override what you need."""

    def batch(self, sink: str, *, size: int, delivered: int, retried: int, dead: int,
              latencies: Sequence[float]) -> None:
        """A batch's checkpoint landed: ``size`` events handled, of which ``delivered`` were delivered
        (``latencies``: seconds from when each became visible to the relay to the checkpoint; at most
        from the last read that could not see it, at most from its storing),
        ``retried`` failed and wait for a retry, ``dead`` were dead-lettered."""

    def ages(self, sink: str, seconds: Sequence[float]) -> None:
        """A checkpoint landed for delivered events stored ``seconds`` ago each (from their transaction's
        start, by the database's clock); ``batch`` has the relay's own latency."""

    def checkpointed(self, sink: str, *, delivered: Sequence[uuid.UUID], dead: Sequence[uuid.UUID]) -> None:
        """A batch's checkpoint committed, fenced: ``delivered`` are done for ``sink`` (no relay delivers them
        again, short of a replay), ``dead`` went to its dead letters. The hook for "this batch is safe",
        e.g. to acknowledge upstream or to wake a waiter. Called on the sink's runner thread right after
        the commit (a Kafka batch's: after the runner's next read, which checks its fence): keep it short
        (hand work to a queue of your own)."""

    def acknowledged(self, sink: str, event_ids: Sequence[uuid.UUID]) -> None:
        """The broker acknowledged these events of a Kafka sink's batch (the delivery reports one ``poll``
        served), before the batch's checkpoint: a crash before it sends them again. Called on the sink's
        runner thread while it waits for the rest of the batch: keep it short."""

    def held(self, sink: str, events: int) -> None:
        """A checkpoint parked ``events`` events that wait for a condition of the sink (a Kafka topic that
        does not exist yet or that an ACL denies), counting no attempt."""

    def leases(self, sink: str, *, acquired: int = 0, lost: int = 0, released: int = 0) -> None:
        """Buckets this relay leased, lost (fenced out: another relay took them over) or handed back."""

    def cycle_failed(self, sink: str, error: str) -> None:
        """A runner's cycle failed as a whole (it backs off and tries again)."""

    def producer_recreated(self, sink: str, reason: str) -> None:
        """A Kafka sink replaced its producer (broker amnesia, a fatal error, a stall)."""

    def housekeeping(self, *, seconds: float, dead_workers: int, expired_leases: int, deleted_events: int) -> None:
        """This relay ran a housekeeping pass."""

    def delivering(self, sink: Sink, events: Sequence[StoredEvent]) -> AbstractContextManager[Delivery]:
        """The scope of one batch's ``sink.deliver(events, ...)``: entered and left on the runner's thread
        (so what it makes current, a span, is current inside the sink), told the outcome through the
        ``Delivery`` it yields, and left with the exception if the batch raised one."""
        return _NO_SCOPE

    def handler(self, sink: str, handler: HandlerT) -> HandlerT:
        """A projection's handler as its sink calls it for one batch (a wrapper, e.g. a span per call).
        The default is the handler itself: an unobserved projection pays nothing per event."""
        return handler


NULL_OBSERVER = Observer()


class Observers(Observer):
    """Several observers as one (metrics and tracing), called in the order given."""

    def __init__(self, *observers: Observer) -> None:
        self.observers = observers

    def batch(self, sink: str, *, size: int, delivered: int, retried: int, dead: int,
              latencies: Sequence[float]) -> None:
        for o in self.observers:
            o.batch(sink, size=size, delivered=delivered, retried=retried, dead=dead, latencies=latencies)

    def ages(self, sink: str, seconds: Sequence[float]) -> None:
        for o in self.observers:
            o.ages(sink, seconds)

    def checkpointed(self, sink: str, *, delivered: Sequence[uuid.UUID], dead: Sequence[uuid.UUID]) -> None:
        for o in self.observers:
            o.checkpointed(sink, delivered=delivered, dead=dead)

    def acknowledged(self, sink: str, event_ids: Sequence[uuid.UUID]) -> None:
        for o in self.observers:
            o.acknowledged(sink, event_ids)

    def held(self, sink: str, events: int) -> None:
        for o in self.observers:
            o.held(sink, events)

    def leases(self, sink: str, *, acquired: int = 0, lost: int = 0, released: int = 0) -> None:
        for o in self.observers:
            o.leases(sink, acquired=acquired, lost=lost, released=released)

    def cycle_failed(self, sink: str, error: str) -> None:
        for o in self.observers:
            o.cycle_failed(sink, error)

    def producer_recreated(self, sink: str, reason: str) -> None:
        for o in self.observers:
            o.producer_recreated(sink, reason)

    def housekeeping(self, *, seconds: float, dead_workers: int, expired_leases: int, deleted_events: int) -> None:
        for o in self.observers:
            o.housekeeping(seconds=seconds, dead_workers=dead_workers, expired_leases=expired_leases,
                           deleted_events=deleted_events)

    @contextlib.contextmanager
    def delivering(self, sink: Sink, events: Sequence[StoredEvent]) -> Iterator[Delivery]:
        with contextlib.ExitStack() as scopes:
            yield _Deliveries([scopes.enter_context(o.delivering(sink, events)) for o in self.observers])

    def handler(self, sink: str, handler: HandlerT) -> HandlerT:
        for o in self.observers:
            handler = o.handler(sink, handler)
        return handler


class _Deliveries(Delivery):
    def __init__(self, deliveries: list[Delivery]) -> None:
        self.deliveries = deliveries

    def landed(self, checkpoint: Checkpoint | None, buckets: set[int]) -> None:
        for d in self.deliveries:
            d.landed(checkpoint, buckets)
