"""The runner: one sink's loop in its own thread, composed of the parts that own its state.

Arrows run one way: this module builds and calls the parts; ``delivery`` and ``prober`` hand batches
to ``batch``, which writes through ``checkpoints``, which keeps the ``cursors`` book and tells
``leases`` what was lost; ``keeper`` (leases taken and handed back) uses the writer to flush first.
Nothing below this module knows the runner.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from psycopg_pool import ConnectionPool

from ..backoff import Backoff
from ..dsn import describe_error
from ..errors import OutboxError, SinkDropped, SinkStuck
from ..observer import Observer
from ..settings import RelaySettings
from ..sinks.engine import Aborted, Sink, wait_idle
from ..store import Conn
from .batch import Batches
from .checkpoints import CheckpointWriter
from .cursors import AHEAD_FLUSH_UNFILTERED_SECONDS, CursorBook
from .delivery import Delivery
from .gate import DeliveryGate, Pulse
from .health import Progress
from .hints import Hints
from .hooks import Hooks
from .keeper import LeaseKeeper
from .leases import Leases, Losses
from .parked import ParkSchedule
from .prober import CrashLoopProber
from .ramp import Ramp
from .reads import ReadPlan
from .tally import Tally

log = logging.getLogger("outbox_relay.relay")  # every part of the runner logs as the relay

# Between failed cycles of one runner: short, because what fails a whole cycle is mostly a lost
# connection (a failover, a terminated backend), which a prompt retry on a new one fixes; an event
# that fails a batch is found by the probe, not by waiting. Capped at seconds: a runner whose cycles
# keep failing for ``handler_timeout_seconds`` counts as stuck and gives its buckets up instead.
CYCLE_BACKOFF = Backoff(0.1, 2.0)


class SinkRunner:
    """Runs one sink in its own thread. ``desired`` is set by the membership thread."""

    def __init__(self, sink: Sink, pool: ConnectionPool[Conn], settings: RelaySettings,
                 backoff: Backoff | None = None, gate: DeliveryGate | None = None) -> None:
        self.sink = sink
        self.pool = pool
        self.settings = settings
        self.worker = worker = settings.worker_id
        self.wake = threading.Event()  # set by the listener, assignment changes and stop requests
        self.backoff = backoff = backoff or Backoff(settings.backoff_base_seconds, settings.backoff_max_seconds)
        self.leases = Leases()
        self.hints = Hints()  # buckets notifications said were written (the worker's listener adds)
        self.desired: set[int] | None = None  # None until the first assignment is known
        self.draining = threading.Event()  # stop claiming, finish the batch, release, exit
        self.abort = Pulse()  # hard stop: drop the batch in flight; each check of it is a sign of life
        self.fatal: OutboxError | None = None  # why the runner stopped by itself (the worker stops too)
        self.park_changed = threading.Event()  # set by the listener (PARKED_NOTICE), cleared by the runner
        self.hooks = hooks = Hooks(settings)
        self.progress = Progress(self.abort, hooks, settings.handler_timeout_seconds)
        # The parts, each owning its state (runner thread only unless it says otherwise). None holds the runner
        # (the writer gets its stop flags, not a method of it): a dropped runner is freed at once, not by a
        # later garbage collection that would also close what its sink left open in some other test's time.
        # Events per read: the sink's own if it has one (a batched projection's, projections/sink.py), else
        # --batch-size.
        self.reads = ReadPlan(getattr(sink, "batch_size", None) or settings.batch_size)
        ahead_every = (AHEAD_FLUSH_UNFILTERED_SECONDS if sink.event_filter is None
                       else max(1.0, 5 * settings.heartbeat_seconds))
        self.book = CursorBook(settings.cursor_flush_seconds, ahead_every, time.monotonic())
        self.ramp = Ramp()
        self.park = ParkSchedule()
        losses = Losses(sink.name, worker, pool, self.leases, hooks)
        self.losses = losses
        self.writer = CheckpointWriter(sink.name, worker, pool, settings, book=self.book, leases=self.leases,
                                       losses=losses, tally=Tally(sink.name, settings.max_attempts, hooks),
                                       park=self.park, hooks=hooks, abort=self.abort, draining=self.draining)
        self.batches = batches = Batches(sink, gate or DeliveryGate(), self.abort, hooks, writer=self.writer,
                                         book=self.book, ramp=self.ramp, max_attempts=settings.max_attempts,
                                         backoff=backoff)
        self.keeper = LeaseKeeper(sink.name, worker, pool, settings, leases=self.leases, losses=losses,
                                  writer=self.writer, book=self.book, ramp=self.ramp, hints=self.hints,
                                  park=self.park, progress=self.progress, hooks=hooks, draining=self.draining)
        self.delivery = Delivery(sink, worker, pool, book=self.book, reads=self.reads, writer=self.writer,
                                 batches=batches, losses=losses, hints=self.hints, park=self.park, hooks=hooks)
        self.prober = CrashLoopProber(sink, worker, pool, settings, ramp=self.ramp, book=self.book, reads=self.reads,
                                      writer=self.writer, batches=batches, losses=losses, backoff=backoff)

    # -- what the worker sets --------------------------------------------------------------

    @property
    def gate(self) -> DeliveryGate:
        """Admission to delivery, shared by every runner of the process (``Batches`` holds it)."""
        return self.batches.gate

    @gate.setter
    def gate(self, value: DeliveryGate) -> None:
        self.batches.gate = value

    @property
    def listening(self) -> Callable[[], bool]:
        """Whether notifications reach the runner (set by the worker)."""
        return self.hooks.listening

    @listening.setter
    def listening(self, value: Callable[[], bool]) -> None:
        self.hooks.listening = value

    @property
    def reachable_since(self) -> Callable[[], float | None]:
        """Since when the worker's heartbeats have been reaching the database without a failure."""
        return self.hooks.reachable_since

    @reachable_since.setter
    def reachable_since(self, value: Callable[[], float | None]) -> None:
        self.hooks.reachable_since = value

    @property
    def defer_writes(self) -> Callable[[], bool]:
        """Whether a deferrable cursor write may wait now (``CursorBook.deferrable``)."""
        return self.hooks.defer_writes

    @defer_writes.setter
    def defer_writes(self, value: Callable[[], bool]) -> None:
        self.hooks.defer_writes = value

    @property
    def observer(self) -> Observer:
        return self.hooks.observer

    @observer.setter
    def observer(self, value: Observer) -> None:
        self.hooks.observer = value

    # -- loop ------------------------------------------------------------------------------

    def run(self) -> None:
        failures = 0
        progress = self.progress
        while not self._stopping():
            # Cleared before reading, so that a notification arriving during the cycle is not lost.
            self.wake.clear()
            progress.idle = False
            try:
                n = self.run_once()
                failures = 0
                progress.cycle_ok()
            except Aborted:
                break
            except (SinkDropped, SinkStuck) as exc:
                self.fatal = exc
                log.error("sink %s: %s; this relay stops", self.sink.name, exc)
                break
            except Exception as exc:  # one failure never kills the worker
                failures += 1
                progress.cycle_failed()
                delay = CYCLE_BACKOFF.delay(failures)
                self.observer.cycle_failed(self.sink.name, describe_error(exc))
                log.warning("sink %s: cycle failed (%s); retrying in %.1fs", self.sink.name, describe_error(exc),
                            delay)
                self._pause(delay)
                continue
            except BaseException as exc:  # SystemExit & co. from code no sink rule caught: see _escaped
                self._escaped(exc)
                break
            if n == 0:
                jitter = 0.8 + 0.4 * (time.monotonic() % 1)
                until_owed = self.writer.until_flush(time.monotonic())
                progress.idle = True
                try:
                    wait_idle(self.sink, self.wake, min(self.hooks.idle_poll() * jitter, self.park.until() + 0.001,
                                                        max(0.0, until_owed) + 0.001))
                except BaseException as exc:
                    self._escaped(exc)
                    break
        progress.idle = True
        self.release_all()

    def _escaped(self, exc: BaseException) -> None:
        """A BaseException reached the runner's loop: its thread would end quietly while the relay
        heartbeats and keeps its buckets, so nothing of the sink is delivered and nothing says so. The
        relay stops instead (exit 4), releasing the leases; the next owner goes on from the checkpoint."""
        self.fatal = SinkStuck(f"sink {self.sink.name}: the runner thread got {describe_error(exc)}; this relay "
                               "stops so that a fresh process takes over")
        log.error("%s", self.fatal)

    def stuck(self) -> str | None:
        """Why this runner counts as stuck (membership thread, health checks); None while it makes
        progress or waits for work."""
        return self.progress.stuck()

    def _stopping(self) -> bool:
        return self.draining.is_set() or self.abort.is_set()

    def _pause(self, seconds: float) -> None:
        """Sleep after a failed cycle. Unlike the idle wait, wake-ups do not end it (a stream of
        notifications would turn a failing cycle into a hot loop); draining or a hard stop do."""
        deadline = time.monotonic() + seconds
        while not self._stopping() and (left := deadline - time.monotonic()) > 0:
            self.abort.wait(min(left, 0.1))

    def run_once(self) -> int:
        """One cycle: rebalance leases, probe suspects, retry due parked keys, deliver new events.

        Returns the number of events handled."""
        self.losses.explain()  # before rebalance: taking a bucket up again clears why it was re-fenced
        self.rebalance()
        held = self.leases.snapshot()
        self.book.forget(held)
        if not held:
            return 0
        if self.park_changed.is_set():
            self.park_changed.clear()
            self.park.now()
        handled = 0
        normal = held
        suspects = self.ramp.suspects & held.keys()  # usually none: no look at every held bucket
        if suspects:
            normal = {b: f for b, f in held.items() if b not in suspects}
            for b, fence in held.items():
                if b in suspects:
                    handled += self.prober.probe(b, fence, len(held))
        if normal:
            if self.park.due():
                handled += self.delivery.retry_parked(normal)
                normal = self.leases.still_held(normal)  # a loss it found is told once, not again by the read
            if normal:
                handled += self.delivery.deliver_new(normal)
        self.writer.flush_due(held, busy=bool(handled))
        return handled

    # -- leases ----------------------------------------------------------------------------

    def rebalance(self) -> None:
        self.keeper.rebalance(self.desired)

    def renew(self) -> None:
        """Called by the membership thread: extend every lease, forget the lost ones; a stuck runner's are
        released instead (``LeaseKeeper.renew``)."""
        self.keeper.renew()

    def release_all(self) -> None:
        """Hand every bucket back, its cursors written first (the end of ``run``; tests and benches call it
        for a graceful stop)."""
        self.keeper.release_all()
