"""What the relay engine reports as it works: batches, leases, failed cycles, housekeeping passes.

The engine calls an ``Observer``; it never imports a metrics or tracing library. The default does
nothing. ``metrics.PrometheusObserver`` turns the calls into Prometheus metrics (``outbox-relay run
--metrics-port``), ``tracing.TracingObserver`` into OpenTelemetry spans (``--tracing``); ``Observers``
hands every call to several. Calls come from several threads (a runner per sink, membership,
housekeeping), so an implementation must be thread-safe and each call cheap. The engine calls its
observer through ``guarded``: a hook that raises is logged (once a minute per hook) and the work goes on.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any, TypeVar

if TYPE_CHECKING:
    from .sinks.engine import Sink
    from .store import Checkpoint, StoredEvent

HandlerT = TypeVar("HandlerT", bound=Callable[..., Any])

log = logging.getLogger("outbox_relay.observer")

# A hook that keeps raising is logged once per this many seconds (tests shrink it).
FAILURE_LOG_SECONDS = 60.0


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
    """Several observers as one (metrics and tracing), called in the order given, each ``guarded``: one
    that raises keeps none of the others from its call."""

    def __init__(self, *observers: Observer) -> None:
        self.observers = tuple(guarded(o) for o in observers)

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


class Guarded(Observer):
    """``observer`` with every hook guarded: one that raises is logged, with its traceback, at most once per
    FAILURE_LOG_SECONDS per hook (with how often it raised since), and the engine goes on. Unguarded, the
    exception failed the runner's cycle after its checkpoint had landed, and the cycle's backoff slowed
    every batch. ``Observer.delivering`` scopes see the batch's exception as before and can not swallow it;
    a ``handler`` wrapper is the handler's own code once made (what it raises is the handler's)."""

    def __init__(self, observer: Observer) -> None:
        self.observer = observer
        self._lock = threading.Lock()
        self._failures: dict[str, tuple[float, int]] = {}  # hook -> (when last logged, raised since then)

    def __repr__(self) -> str:
        return f"Guarded({self.observer!r})"

    def _failed(self, hook: str) -> None:
        """Called in the ``except`` block of a hook that raised."""
        now = time.monotonic()
        with self._lock:
            logged, since = self._failures.get(hook, (-FAILURE_LOG_SECONDS, 0))
            if now - logged < FAILURE_LOG_SECONDS:
                self._failures[hook] = (logged, since + 1)
                return
            self._failures[hook] = (now, 0)
        log.error("observer %s: %s raised (%d more times since it was last logged); the relay goes on and "
                  "logs this at most once every %gs", type(self.observer).__name__, hook, since,
                  FAILURE_LOG_SECONDS, exc_info=True)

    def batch(self, sink: str, *, size: int, delivered: int, retried: int, dead: int,
              latencies: Sequence[float]) -> None:
        try:
            self.observer.batch(sink, size=size, delivered=delivered, retried=retried, dead=dead, latencies=latencies)
        except Exception:
            self._failed("batch")

    def ages(self, sink: str, seconds: Sequence[float]) -> None:
        try:
            self.observer.ages(sink, seconds)
        except Exception:
            self._failed("ages")

    def checkpointed(self, sink: str, *, delivered: Sequence[uuid.UUID], dead: Sequence[uuid.UUID]) -> None:
        try:
            self.observer.checkpointed(sink, delivered=delivered, dead=dead)
        except Exception:
            self._failed("checkpointed")

    def acknowledged(self, sink: str, event_ids: Sequence[uuid.UUID]) -> None:
        try:
            self.observer.acknowledged(sink, event_ids)
        except Exception:
            self._failed("acknowledged")

    def held(self, sink: str, events: int) -> None:
        try:
            self.observer.held(sink, events)
        except Exception:
            self._failed("held")

    def leases(self, sink: str, *, acquired: int = 0, lost: int = 0, released: int = 0) -> None:
        try:
            self.observer.leases(sink, acquired=acquired, lost=lost, released=released)
        except Exception:
            self._failed("leases")

    def cycle_failed(self, sink: str, error: str) -> None:
        try:
            self.observer.cycle_failed(sink, error)
        except Exception:
            self._failed("cycle_failed")

    def producer_recreated(self, sink: str, reason: str) -> None:
        try:
            self.observer.producer_recreated(sink, reason)
        except Exception:
            self._failed("producer_recreated")

    def housekeeping(self, *, seconds: float, dead_workers: int, expired_leases: int, deleted_events: int) -> None:
        try:
            self.observer.housekeeping(seconds=seconds, dead_workers=dead_workers, expired_leases=expired_leases,
                                       deleted_events=deleted_events)
        except Exception:
            self._failed("housekeeping")

    @contextlib.contextmanager
    def delivering(self, sink: Sink, events: Sequence[StoredEvent]) -> Iterator[Delivery]:
        try:
            scope = self.observer.delivering(sink, events)
            delivery = scope.__enter__()
        except Exception:
            self._failed("delivering")
            yield NULL_DELIVERY
            return
        try:
            yield _GuardedDelivery(delivery, self)
        except BaseException as exc:
            try:
                scope.__exit__(type(exc), exc, exc.__traceback__)  # told; what it returns can not swallow it
            except BaseException as raised:
                if raised is not exc:
                    if not isinstance(raised, Exception):
                        raise
                    self._failed("delivering")
            raise
        try:
            scope.__exit__(None, None, None)
        except Exception:
            self._failed("delivering")

    def handler(self, sink: str, handler: HandlerT) -> HandlerT:
        try:
            return self.observer.handler(sink, handler)
        except Exception:
            self._failed("handler")
            return handler


class _GuardedDelivery(Delivery):
    def __init__(self, delivery: Delivery, guard: Guarded) -> None:
        self.delivery = delivery
        self.guard = guard

    def landed(self, checkpoint: Checkpoint | None, buckets: set[int]) -> None:
        try:
            self.delivery.landed(checkpoint, buckets)
        except Exception:
            self.guard._failed("delivering.landed")


def guarded(observer: Observer) -> Observer:
    """``observer`` as the engine calls it (``Guarded``). As it is: the no-op base, one already guarded,
    and ``Observers`` (which guards each of its own)."""
    if type(observer) in (Observer, Observers) or isinstance(observer, Guarded):
        return observer
    return Guarded(observer)
