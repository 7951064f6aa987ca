"""One sink's delivery loop: lease buckets, read past their cursors, deliver, checkpoint.

No SQL here (store.py has it). Per key, events go out in position order; a failing head
parks its key (only that key waits), retries with backoff and ends in dead letters after
``max_attempts``. Every checkpoint is fenced: a worker that lost a bucket writes nothing
there.

Crash-loop isolation: an event that kills the process (or stalls it past its lease) never
reports a failure, so it is found another way. A bucket whose lease lapsed ``max_lapses``
times with work pending is a suspect. Its next owner delivers it one event at a time, each
attempt counted in ``outbox.parked`` *before* it is made and made alone in the process (the
``DeliveryGate``), so a crash during it can only be that event's doing and counts as a
failed attempt; past ``max_attempts`` the event is dead-lettered like any other. After
each survived probe the bucket's batch size doubles until it is back to normal.

A batch that fails as a whole with an exception (a sink bug, an event the sink can not even
start on, a handler cut off by a timeout) is treated the same way, without waiting for lapses:
its buckets become suspects at once, the probe finds the event that causes it and records the
exception as that event's error. A failing cycle backs off; notifications do not cut it short.

A runner that makes no progress (its sink has not checked the stop flag for
``handler_timeout_seconds``, or its cycles keep failing for that long) is *stuck*: the membership
thread stops renewing its leases and releases them, its heartbeats leave it out of the sink's live
members (so the assignment moves its buckets to other relays), and /readyz says so. It rejoins by
itself once it makes progress again; the fences keep whatever it still does from landing.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Iterator, Sequence
from datetime import datetime

import psycopg
from psycopg_pool import ConnectionPool, PoolTimeout

from . import store
from .activity import RetryLog
from .backoff import Backoff
from .dsn import describe_error
from .errors import CheckpointFailed, LeaseLost, OutboxError, SinkDropped, SinkStuck, counted
from .observer import NULL_OBSERVER, Observer
from .positions import Cursor, Snapshot
from .settings import RelaySettings
from .sinks.engine import Aborted, AsyncConn, Failure, KeyHold, Outcomes, Sink, wait_idle
from .store import Checkpoint, Conn, StoredEvent

log = logging.getLogger("outbox_relay.relay")

MIN_BUCKET_LIMIT = 8
# Between failed cycles of one runner: short, because what fails a whole cycle is mostly a lost
# connection (a failover, a terminated backend), which a prompt retry on a new one fixes; an event
# that fails a batch is found by the probe, not by waiting. Capped at seconds: a runner whose cycles
# keep failing for ``handler_timeout_seconds`` counts as stuck and gives its buckets up instead.
# Between attempts at a checkpoint whose connection broke (``_checkpoint_alone``).
CHECKPOINT_RETRY = Backoff(0.05, 1.0)
CYCLE_BACKOFF = Backoff(0.1, 2.0)
PARKED_KEYS_PER_PASS = 256
PARKED_PER_KEY = 100
# Steps of one probe that deliver nothing (queueing behind a parked key, dead-lettering an
# exhausted event) before it gives the loop back.
PROBE_QUIET_STEPS = 100
CRASH_ERROR = ("the relay stopped while delivering this event alone (process crash, kill, or stall past the "
               "lease); counted as a failed attempt")
# A timeout that cut a batch short can be an event's doing (a handler slower than the lease).
_EVENT_TIMEOUTS = {"57014", "25P03", "25P04"}  # query_canceled, idle_in_transaction / transaction timeout
# Classes of server errors that say nothing about the events: connection, resources, operator
# intervention (shutdown, terminated backend), system errors.
_INFRASTRUCTURE_CLASSES = {"08", "53", "57", "58"}
# A notification on the events channel that says an operator changed a parked key in a bucket
# (outbox-relay keys retry|skip|resume; sql/queries/admin.sql, notify_parked): "parked:<bucket>".
# Its owner then looks at the park at once instead of at its next retry time.
PARKED_NOTICE = "parked:"
# With nothing parked and notifications arriving, how often a runner looks at the park anyway. What
# parks an event tells the runner (its own checkpoint, a bucket acquired, a blocked read, an operator's
# PARKED_NOTICE); this is the safety net for a park changed by hand without one.
PARK_CHECK_IDLE_SECONDS = 60.0
# How often read cursors that passed only empty deltas are written. A sink that gets every event (Kafka)
# passes no event that way, so a next owner rereads nothing by their lag: once a minute (and on release).
# A sink that filters (a projection) passes events it skips, which retention waits for: every 5 heartbeats.
AHEAD_FLUSH_UNFILTERED_SECONDS = 60.0
# While a runner is busy, deferred cursor writes that are due (``_flush_owed``) wait until the oldest is
# this much overdue (at most ``cursor_flush_seconds``), so that they go out together about once a second
# rather than as a statement in most cycles: a Kafka batch defers its due writes too (``_BatchCommit.later``).
OWED_BUSY_SLACK_SECONDS = 1.0


def points_at_events(exc: BaseException) -> bool:
    """Whether a batch that raised ``exc`` may have failed because of one of its events (so that
    retrying its events one at a time can find the culprit), rather than because the database or the
    relay's own bookkeeping failed."""
    if isinstance(exc, CheckpointFailed | PoolTimeout | LeaseLost | SinkDropped | SinkStuck):
        return False
    if isinstance(exc, psycopg.Error):
        if exc.sqlstate in _EVENT_TIMEOUTS:
            return True
        if isinstance(exc, psycopg.OperationalError | psycopg.InterfaceError):
            return False
        if exc.sqlstate and exc.sqlstate[:2] in _INFRASTRUCTURE_CLASSES:
            return False
    return True


class Leases:
    """The buckets a runner holds, bucket -> fence. The runner acquires and releases; the
    membership thread renews and may drop lost buckets. Guarded by one lock because both
    threads touch it."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._fences: dict[int, int] = {}

    def snapshot(self) -> dict[int, int]:
        with self._lock:
            return dict(self._fences)

    def add(self, fences: dict[int, int]) -> None:
        with self._lock:
            self._fences.update(fences)

    def holds_any(self, buckets: Iterable[int]) -> bool:
        with self._lock:
            return any(b in self._fences for b in buckets)

    def drop(self, buckets: Iterable[int], fences: dict[int, int] | None = None) -> None:
        """Forget buckets (only if still under the given fences, when given)."""
        with self._lock:
            for b in buckets:
                if fences is None or self._fences.get(b) == fences.get(b):
                    self._fences.pop(b, None)


class Hints:
    """Buckets that notifications said were written since the runner last read them: the listener
    thread adds, the runner takes. Until something says otherwise (start, a lost LISTEN connection,
    a payload that names no buckets), every bucket counts as written."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._buckets: set[int] = set()
        self._everything = True

    def add(self, buckets: Iterable[int]) -> None:
        with self._lock:
            self._buckets.update(buckets)

    def everything(self) -> None:
        with self._lock:
            self._everything = True

    def take(self) -> set[int] | None:
        """The hinted buckets, cleared; None: read every bucket."""
        with self._lock:
            if self._everything:
                self._everything = False
                self._buckets.clear()
                return None
            taken, self._buckets = self._buckets, set()
            return taken


class DeliveryGate:
    """Admission to delivery, shared by every runner of a process. Batches share it; an
    isolation probe holds it alone, so that a crash during a probe can only be the probed
    event's doing, whichever sink's runner made it. Waiting probes hold new batches back.

    A holder that has been in for ``stale_seconds`` (a stuck sink) no longer counts: one stuck sink
    must not stop the others. A crash while a stale batch is still in would be charged to the probed
    event, an innocent one's attempt counted at worst."""

    def __init__(self, stale_seconds: float = float("inf")) -> None:
        self._cond = threading.Condition()
        self.stale_seconds = stale_seconds
        self._shared: dict[int, float] = {}  # holder -> when it came in
        self._exclusive: float | None = None  # when the probe came in
        self._waiting = 0
        self._ids = itertools.count()

    def _live(self, since: float | None) -> bool:
        return since is not None and time.monotonic() - since < self.stale_seconds

    @contextlib.contextmanager
    def shared(self, abort: threading.Event) -> Iterator[None]:
        me = next(self._ids)
        with self._cond:
            since = time.monotonic()
            while self._live(self._exclusive) or (self._waiting and time.monotonic() - since < self.stale_seconds):
                self._wait(abort)
            self._shared[me] = time.monotonic()
        try:
            yield
        finally:
            with self._cond:
                del self._shared[me]
                self._cond.notify_all()

    @contextlib.contextmanager
    def exclusive(self, abort: threading.Event) -> Iterator[None]:
        with self._cond:
            self._waiting += 1
            try:
                while self._live(self._exclusive) or any(self._live(t) for t in self._shared.values()):
                    self._wait(abort)
            finally:
                self._waiting -= 1
                self._cond.notify_all()
            self._exclusive = since = time.monotonic()
        try:
            yield
        finally:
            with self._cond:
                if self._exclusive == since:
                    self._exclusive = None
                self._cond.notify_all()

    def _wait(self, abort: threading.Event) -> None:
        if abort.is_set():
            raise Aborted()
        self._cond.wait(0.1)


class Pulse(threading.Event):
    """A runner's hard-stop flag. Sinks check it while they work (``Sink.deliver``), so each check also
    says the runner's thread is alive: ``last`` is when it was last checked."""

    def __init__(self) -> None:
        super().__init__()
        self.last = time.monotonic()

    def is_set(self) -> bool:
        self.last = time.monotonic()
        return super().is_set()


def read_limits(buckets: Iterable[int], saturated: set[int], batch_size: int, rotation: int) -> dict[int, int]:
    """Per-bucket read limits, in an order that rotates with ``rotation`` (the first buckets of a read
    are served first when the batch fills): the batch budget spread over the buckets, at least
    MIN_BUCKET_LIMIT each, and the buckets whose last read was full share it when that is more."""
    order = sorted(buckets)
    if not order:
        return {}
    base = max(MIN_BUCKET_LIMIT, batch_size // len(order))
    busy = saturated.intersection(order)
    hot = max(base, batch_size // max(1, len(busy)))
    start = rotation % len(order)
    return {b: hot if b in busy else base for b in order[start:] + order[:start]}


_UNTRIED = Failure("not attempted")  # classify: an event the sink did not attempt (no outcome)


def classify(events: Sequence[StoredEvent], outcomes: Outcomes, fences: dict[int, int], *,
             max_attempts: int, backoff: Backoff) -> Checkpoint:
    """Turn per-event outcomes into a checkpoint that keeps per-key order.

    Walks each key in position order: delivered events are done; the first failure parks the
    key (or dead-letters the event if it can never succeed or has no attempts left, which
    unblocks the key; a failure the sink holds, ``Failure.hold_seconds``, parks it without
    counting an attempt); everything behind a parked head is parked behind it. Events read from
    the park stay there unless delivered or dead-lettered.
    """
    cp = Checkpoint(fences=fences)
    hold = KeyHold()  # keys whose head is parked in this batch (the sink followed the same rule)
    for e in events:
        outcome = outcomes.get(e.id, _UNTRIED)  # one lookup: a uuid's hash is a Python call
        if e.blocked or not hold.allows(e) or outcome is _UNTRIED:
            hold.hold(e.key)
            if not e.parked:
                cp.park.append((e, e.attempts, 0.0, None))
            continue
        if outcome is None:
            cp.delivered.append(e)
            if e.parked:
                cp.done.append(e)
            continue
        if outcome.hold_seconds is not None:  # the sink's condition, not the event's: no attempt counted
            cp.park.append((e, e.attempts, outcome.hold_seconds, outcome.error))
            hold.hold(e.key)
            continue
        attempts = e.attempts + 1
        if not outcome.retriable or attempts >= max_attempts:
            cp.dead.append((e, attempts, outcome.error))
            if e.parked:
                cp.done.append(e)
        else:
            delay = backoff.delay(attempts)
            if outcome.retry_after is not None:
                delay = max(delay, outcome.retry_after)
            cp.park.append((e, attempts, delay, outcome.error))
            hold.hold(e.key)
    return cp


class SinkRunner:
    """Runs one sink in its own thread. ``desired`` is set by the membership thread."""

    def __init__(self, sink: Sink, pool: ConnectionPool[Conn], settings: RelaySettings,
                 backoff: Backoff | None = None, gate: DeliveryGate | None = None) -> None:
        self.sink = sink
        self.pool = pool
        self.settings = settings
        self.worker = settings.worker_id
        self.wake = threading.Event()  # set by the listener, assignment changes and stop requests
        self.backoff = backoff or Backoff(settings.backoff_base_seconds, settings.backoff_max_seconds)
        self.gate = gate or DeliveryGate()
        self._formatted = sink.kind == "kafka"  # reads carry the Kafka headers' ready-made values
        # Events per read: the sink's own if it has one (a batched projection's, projections/sink.py), else
        # --batch-size.
        self._batch_size: int = getattr(sink, "batch_size", None) or settings.batch_size
        self.leases = Leases()
        self.hints = Hints()  # buckets notifications said were written (the worker's listener adds)
        self.desired: set[int] | None = None  # None until the first assignment is known
        self.draining = threading.Event()  # stop claiming, finish the batch, release, exit
        self.abort = Pulse()  # hard stop: drop the batch in flight; each check of it is a sign of life
        # Written by the runner thread, read by the membership thread and health checks:
        self._idle = True  # waiting for work (or not running): never stuck
        self._failing_since: float | None = None  # monotonic time of the first failed cycle in a row
        self._gave_up = False  # the membership thread released the leases of this stuck runner
        self.fatal: OutboxError | None = None  # why the runner stopped by itself (the worker stops too)
        self.listening: Callable[[], bool] = lambda: False  # whether notifications reach it (set by the worker)
        # Since when the worker's heartbeats have been reaching the database without a failure (set by the worker).
        self.reachable_since: Callable[[], float | None] = time.monotonic
        # Whether a deferrable cursor write may wait now (``_deferrable``): the worker makes it "while a long
        # transaction holds vacuum back" (horizon.py); alone, a runner defers whenever cursor_flush_seconds > 0.
        self.defer_writes: Callable[[], bool] = lambda: True
        self.observer: Observer = NULL_OBSERVER
        self.park_changed = threading.Event()  # set by the listener (PARKED_NOTICE), cleared by the runner
        # Runner thread only:
        self._cursors: dict[int, Cursor] = {}  # held bucket -> its cursor as written in outbox.cursors
        # Held buckets whose read cursor is ahead of the stored one: it passed an empty delta (nothing to
        # deliver there), or a delivered batch whose cursor write was deferred (``_owed``). Written with
        # the next written checkpoint of the bucket, by ``_flush_owed``, or by ``_flush_ahead``.
        self._ahead: dict[int, Cursor] = {}
        self._flushed_at = time.monotonic()
        # Bounded checkpoint writes (``_deferrable``): held bucket -> monotonic time its cursor row was last
        # written (or acquired); held buckets whose ``_ahead`` cursor passed delivered events that are not
        # written yet (``_flush_owed`` writes them once ``cursor_flush_seconds`` passed); held buckets
        # acquired with lapses counted, written at once until a reset lands.
        self._written_at: dict[int, float] = {}
        self._owed: set[int] = set()
        self._owed_oldest: float | None = None  # min of ``_written_at`` over ``_owed``; None: to be computed
        self._lapsed: set[int] = set()
        self._ramp: dict[int, int] = {}  # crash-loop suspects: bucket -> events per probe
        # Crash-loop isolation: buckets this process has held (one it takes in its own worker id without having
        # held it is a restart's: the last process of that id died holding it), and per suspect the deaths
        # counted before its probe, charged to the first event probed alone (``_probe_alone``).
        self._held_ever: set[int] = set()
        self._deaths: dict[int, int] = {}
        self._unexplained: set[int] = set()  # buckets ``_lose`` dropped, logged with why by the next cycle
        self._retry_log = RetryLog(sink.name)  # a WARNING per failed attempt past the first few, rate-limited
        # A delivered Kafka batch's checkpoint whose fence check rides on the next read (``_BatchCommit.later``):
        # settled by ``_deliver_new``'s read of its buckets, or by a statement of its own
        # (``_settle_pending``) before anything else writes their cursors. Its cursors are in ``_ahead``.
        self._pending: Checkpoint | None = None
        # Held bucket -> (fence, reads of it numbered under that fence): see ``_number_read``.
        self._reads: dict[int, tuple[int, int]] = {}
        self._saturated: set[int] = set()
        self._server_started: datetime | None = None  # the server start its read cursors come from
        self._snapshots = _SnapshotTimes()  # when this runner's reads took their snapshots (delivery latency)
        self._full_read_at = 0.0  # monotonic time of the next read of every held bucket (the safety net)
        self._check_parked_at = 0.0
        self._rotation = 0

    # -- loop ------------------------------------------------------------------------------

    def run(self) -> None:
        failures = 0
        while not self._stopping():
            # Cleared before reading, so that a notification arriving during the cycle is not lost.
            self.wake.clear()
            self._idle = False
            try:
                n = self.run_once()
                failures = 0
                self._failing_since = None
            except Aborted:
                break
            except (SinkDropped, SinkStuck) as exc:
                self.fatal = exc
                log.error("sink %s: %s; this relay stops", self.sink.name, exc)
                break
            except Exception as exc:  # one failure never kills the worker
                failures += 1
                if self._failing_since is None:
                    self._failing_since = time.monotonic()
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
                until_retry = max(0.0, self._check_parked_at - time.monotonic())
                self._idle = True
                try:
                    wait_idle(self.sink, self.wake, min(self._idle_poll() * jitter, until_retry + 0.001,
                                                        max(0.0, self._until_owed_flush()) + 0.001))
                except BaseException as exc:
                    self._escaped(exc)
                    break
        self._idle = True
        self._release_all()

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
        limit = self.settings.handler_timeout_seconds
        now = time.monotonic()
        if not self._idle and now - self.abort.last > limit:
            return f"no progress for {now - self.abort.last:.0f}s (its sink has not returned)"
        failing = self._failing_since
        # Only while the database answers the membership thread: in an outage every runner fails, and
        # giving every bucket up would only move them all when it ends.
        reachable = self.reachable_since()
        if failing is not None and reachable is not None and now - max(failing, reachable) > limit:
            return f"every cycle failed for {now - failing:.0f}s"
        return None

    def _idle_poll(self) -> float:
        """How long an idle runner waits for a wake-up before it reads again: long while LISTEN is up
        (notifications wake it; polling is the safety net), short while it is not."""
        return self.settings.listen_poll_seconds if self.listening() else self.settings.poll_seconds

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
        self._explain_lost()  # before rebalance: taking a bucket up again clears why it was re-fenced
        self.rebalance()
        held = self.leases.snapshot()
        self._forget_lost(held)
        if not held:
            return 0
        if self.park_changed.is_set():
            self.park_changed.clear()
            self._check_parked_at = 0.0
        handled = 0
        normal = {}
        for b, fence in held.items():
            if self._ramp.get(b):
                handled += self._probe(b, fence, len(held))
            else:
                normal[b] = fence
        if normal:
            if time.monotonic() >= self._check_parked_at:
                handled += self._retry_parked(normal)
                normal = self._still_held(normal)  # a loss it found is told once, not again by the read
            if normal:
                handled += self._deliver_new(normal)
        if self._ahead and time.monotonic() - self._flushed_at >= self._flush_every():
            self._flush_ahead(held)
        elif self._owed and self._until_owed_flush() <= (-self._owed_slack() if handled else 0.0):
            self._flush_owed(held)
        return handled

    def _forget_lost(self, held: dict[int, int]) -> None:
        for b in set(self._cursors) - held.keys():
            del self._cursors[b]
            self._ahead.pop(b, None)
            self._written_at.pop(b, None)
            self._owed.discard(b)
            self._owed_oldest = None
            self._lapsed.discard(b)
        for b in set(self._reads) - held.keys():
            del self._reads[b]

    def _number_read(self, events: Sequence[StoredEvent], fences: dict[int, int]) -> None:
        """Stamp the events of one read (a page of new events, or a fetch of parked ones) with their
        bucket's next read number under its fence: the ``read`` of their projection fence tokens
        (projections/event.py), numbered from 1 again under each new fence.

        A bucket's batches go out one after another in the order they were read, and one read gives
        each key's events in (xid, seq) order, so (fence, read, xid, seq) grows in delivery order per
        key, also where that is not (xid, seq) order, and for a batch read again after it failed."""
        numbered: dict[int, int] = {}
        for e in events:
            n = numbered.get(e.bucket)
            if n is None:
                fence = fences[e.bucket]
                last_fence, last = self._reads.get(e.bucket, (fence, 0))
                n = numbered[e.bucket] = last + 1 if last_fence == fence else 1
                self._reads[e.bucket] = (fence, n)
            e.read = n

    def _flush_every(self) -> float:
        if self.sink.event_filter is None:
            return AHEAD_FLUSH_UNFILTERED_SECONDS
        return max(1.0, 5 * self.settings.heartbeat_seconds)

    def _read_cursor(self, bucket: int) -> Cursor:
        return self._ahead.get(bucket) or self._cursors[bucket]

    def _flush_ahead(self, held: dict[int, int]) -> None:
        """Write the read cursors that passed empty deltas: for a sink that skips most events (a
        projection), so that retention can delete what it passed; for all, so that a next owner does
        not read those deltas again. Deferred cursor writes (``_owed``) go with them."""
        self._settle_pending()  # its cursors are among them: checked first, so that it lands as a batch
        held = self._still_held(held)
        self._flushed_at = time.monotonic()
        ahead = {b: c for b, c in self._ahead.items() if b in held}
        if ahead:
            self._write(Checkpoint(fences={b: held[b] for b in ahead}, advance=ahead))

    # -- bounded checkpoint writes ------------------------------------------------------------
    #
    # Every write of a cursor row leaves a dead row version, and while a long transaction anywhere on
    # the server holds vacuum back none of them can be removed: a write per bucket per batch piled up
    # tens of thousands in outbox.cursors (issue 16). A sink without a transaction of its own (Kafka)
    # has delivered before its checkpoint, so writing its cursor later only means more redelivery after
    # a crash, never a loss or a reorder: its batches check their fence without writing (a read), and a
    # bucket's cursor is written at most once per ``cursor_flush_seconds`` (and when its lease is handed
    # back). A projection's checkpoint commits with its read-model writes (G7) and is never deferred.

    def _deferrable(self, cp: Checkpoint) -> set[int]:
        """The buckets of a sink-less-transaction batch checkpoint whose cursor write can wait."""
        every = self.settings.cursor_flush_seconds
        if every <= 0 or not cp.moves_only or not self.defer_writes():
            return set()
        now = time.monotonic()
        return {b for b in cp.advance
                # A crash-loop suspect's progress is what its isolation counts on; a lapse count is reset
                # only by a write.
                if not self._ramp.get(b) and not (b in cp.resets and b in self._lapsed)
                and now - self._written_at.get(b, -every) < every}

    def _foldable(self, cp: Checkpoint) -> bool:
        """Whether a delivered batch's checkpoint may wait for the runner's next read (``_BatchCommit.later``):
        it only moves cursors, one per bucket it read past, and each of them may be written later (as in
        ``_deferrable``, except that a write that is due waits for ``_flush_owed`` too)."""
        if (self.settings.cursor_flush_seconds <= 0 or not cp.moves_only or cp.advance.keys() != cp.fences.keys()
                or not self.defer_writes()):
            return False
        return not any(self._ramp.get(b) or (b in cp.resets and b in self._lapsed) for b in cp.fences)

    def _take_pending(self) -> Checkpoint | None:
        """The checkpoint waiting for its fence check, taken, without the buckets this runner no longer holds
        under its fences (lost meanwhile, and told so by whoever dropped them: that batch did not land)."""
        cp, self._pending = self._pending, None
        if cp is None:
            return None
        held = self.leases.snapshot()
        kept = {b: f for b, f in cp.fences.items() if held.get(b) == f}
        if kept != cp.fences:
            cp.fences = kept
            cp.advance = {b: c for b, c in cp.advance.items() if b in kept}
            cp.defer &= kept.keys()
            cp.delivered = [e for e in cp.delivered if e.bucket in kept]
        return cp if kept else None

    def _still_held(self, held: dict[int, int]) -> dict[int, int]:
        """``held`` without what a check since found lost (it is told once, not by every write after it)."""
        now = self.leases.snapshot()
        return {b: f for b, f in held.items() if now.get(b) == f}

    def _settle_pending(self) -> None:
        """Check the waiting checkpoint's fence with a statement of its own (the read-only ``advance``):
        before anything else writes its buckets' cursors, and when the runner lets its buckets go."""
        cp = self._take_pending()
        if cp is not None:
            self._landed(cp, self._checkpoint(cp, None))

    def _until_owed_flush(self) -> float:
        """Seconds until the oldest deferred cursor write is due (inf: none is owed)."""
        if not self._owed:
            return float("inf")
        if not self.defer_writes():  # the hold that deferred them is over: due now
            return float("-inf")
        if self._owed_oldest is None:  # once per write of an owed cursor, not per cycle
            self._owed_oldest = min(self._written_at.get(b, 0.0) for b in self._owed)
        return self._owed_oldest + self.settings.cursor_flush_seconds - time.monotonic()

    def _owed_slack(self) -> float:
        return min(OWED_BUSY_SLACK_SECONDS, self.settings.cursor_flush_seconds)

    def _flush_owed(self, held: dict[int, int]) -> None:
        """Write the deferred cursors that are due (one statement for all of them)."""
        self._settle_pending()
        held = self._still_held(held)
        now = time.monotonic()
        every = self.settings.cursor_flush_seconds if self.defer_writes() else 0.0
        due = {b: self._ahead[b] for b in self._owed
               if b in held and b in self._ahead and now - self._written_at.get(b, 0.0) >= every}
        if due:
            self._write(Checkpoint(fences={b: held[b] for b in due}, advance=due))

    # -- leases ----------------------------------------------------------------------------

    def rebalance(self) -> None:
        desired = self.desired
        if desired is None:
            return
        held = self.leases.snapshot()
        surplus = {b: f for b, f in held.items() if b not in desired}
        if not surplus and (self.draining.is_set() or desired <= held.keys()):
            return  # the usual cycle: nothing to hand over or take
        if surplus:
            self._flush_ahead(surplus)  # after the waiting fence check, if any (``_settle_pending``)
        # One connection at a time per thread (the pool may hold just one): nothing below checks out another.
        with self.pool.connection() as conn:
            if surplus:
                store.announce_buckets(conn, store.release_leases(conn, self.sink.name, self.worker, surplus))
                self.leases.drop(surplus.keys(), surplus)
                self.observer.leases(self.sink.name, released=len(surplus))
                log.info("sink %s: released %d buckets", self.sink.name, len(surplus))
            wanted = desired - held.keys()
            if wanted and not self.draining.is_set():
                acquired = store.acquire_leases(conn, self.sink.name, self.worker, wanted,
                                                self.settings.lease_seconds, restarted=wanted - self._held_ever)
                self._held_ever |= acquired.keys()
                if not acquired and not held:
                    # Nothing to hold and nothing to take: normal while buckets change hands, but also what
                    # a dropped sink looks like (its cursors are gone). Never idle silently on one.
                    store.require_live_sink(self.sink.name, store.sink_state(conn, self.sink.name))
                if acquired:
                    self.hints.add(acquired)  # they may come with a backlog
                    self.observer.leases(self.sink.name, acquired=len(acquired))
                    self.leases.add({b: a.fence for b, a in acquired.items()})
                    self._cursors.update({b: a.cursor for b, a in acquired.items()})
                    at = time.monotonic()  # the acquisition wrote the row
                    for b, a in acquired.items():
                        self._ahead.pop(b, None)
                        self._owed.discard(b)
                        self._owed_oldest = None
                        self._written_at[b] = at
                        if a.lapses:
                            self._lapsed.add(b)
                        else:
                            self._lapsed.discard(b)
                    suspects = sorted(b for b, a in acquired.items() if a.lapses >= self.settings.max_lapses)
                    self._ramp.update({b: 1 if b in suspects else 0 for b in acquired})
                    self._deaths.update({b: a.lapses if b in suspects else 0 for b, a in acquired.items()})
                    self._check_parked_at = 0.0  # new buckets may come with parked keys
                    log.info("sink %s: acquired %d buckets", self.sink.name, len(acquired))
                    if suspects:
                        log.warning("sink %s: buckets %s lapsed %d+ times with work pending (a crash loop?): "
                                    "delivering them one event at a time", self.sink.name, suspects,
                                    self.settings.max_lapses)

    def renew(self) -> None:
        """Called by the membership thread: extend every lease, forget the lost ones. A stuck runner's
        leases are released instead, so that other relays take its buckets now (fences keep what it
        still does from landing)."""
        fences = self.leases.snapshot()
        stuck = self.stuck()
        if stuck is None:
            if self._gave_up:
                self._gave_up = False
                log.warning("sink %s: the runner makes progress again; it takes buckets again", self.sink.name)
        elif not self._gave_up:
            self._gave_up = True
            log.error("sink %s: the runner is stuck (%s); releasing its %d buckets so that other relays take them",
                      self.sink.name, stuck, len(fences))
        if not fences:
            return
        if stuck is not None:
            with self.pool.connection() as conn:
                store.announce_buckets(conn, store.release_leases(conn, self.sink.name, self.worker, fences))
            self.leases.drop(fences.keys(), fences)
            self.observer.leases(self.sink.name, lost=len(fences))
            return
        with self.pool.connection() as conn:
            kept = store.renew_leases(conn, self.sink.name, self.worker, fences, self.settings.lease_seconds)
        lost = set(fences) - kept
        if lost:
            self.observer.leases(self.sink.name, lost=len(lost))
            self._log_lost(lost, "lost the lease on %d buckets (fenced out)")
            self.leases.drop(lost, fences)

    def _release_all(self) -> None:
        fences = self.leases.snapshot()
        if not fences:
            return
        try:
            self._flush_ahead(fences)
            with self.pool.connection() as conn:
                store.announce_buckets(conn, store.release_leases(conn, self.sink.name, self.worker, fences))
            self.observer.leases(self.sink.name, released=len(fences))
            log.info("sink %s: released all %d buckets", self.sink.name, len(fences))
        except Exception as exc:
            log.warning("sink %s: could not release leases (%s); they will expire", self.sink.name, exc)
        self.leases.drop(fences.keys(), fences)

    # -- delivery --------------------------------------------------------------------------

    def _bucket_limit(self, buckets: int) -> int:
        return max(MIN_BUCKET_LIMIT, self._batch_size // max(1, buckets))

    def _limits(self, held: dict[int, int]) -> dict[int, int]:
        if not held:
            return {}
        self._rotation = (self._rotation + 1) % len(held)
        return read_limits(held, self._saturated, self._batch_size, self._rotation)

    def _deliver_new(self, held: dict[int, int]) -> int:
        # The previous batch's fence check, if it waits (``_BatchCommit.later``): this read does it. A read
        # that fails puts it back.
        pending = self._take_pending()
        # Read the buckets notifications named (and those whose last read was full); every held bucket
        # now and then, and always while notifications do not reach this relay. The waiting batch's other
        # buckets are only checked (limit 0: their fence, not their delta).
        hinted = self.hints.take()
        now = time.monotonic()
        checks: set[int] = set()
        if hinted is None or now >= self._full_read_at or not self.listening():
            self._full_read_at = now + self._idle_poll()
        else:
            wanted = {b: f for b, f in held.items() if b in hinted or b in self._saturated}
            if pending is not None:
                checks = {b for b in pending.fences if b in held and b not in wanted}
            if not wanted and not checks:
                self._pending = pending
                return 0
            held = {**wanted, **{b: held[b] for b in checks}}
        try:
            with self.pool.connection() as conn:
                if not self._same_server(conn):
                    pending = None  # its cursors were dropped with the others: its events are read again
                limits = self._limits({b: f for b, f in held.items() if b not in checks})
                reads = {b: (limit, self._read_cursor(b)) for b, limit in limits.items()}
                reads.update((b, (0, self._read_cursor(b))) for b in checks)
                read_at = time.monotonic()
                read = store.fetch_events(conn, self.sink.name, self.worker, reads, self.sink.event_filter,
                                          formatted=self._formatted, fences=held)
        except BaseException:
            if pending is not None and self._pending is None:
                self._pending = pending
            raise
        if pending is not None:  # landed where the read found the fence held, before the read moves cursors
            pending.landed_at = read.checked_at
            self._landed(pending, set(pending.fences) & read.held)
        lost = reads.keys() - read.held
        if lost:  # fenced out (a new owner or fence, or the lease ran out): nothing of them was read
            self._lose(lost, held)
        self._snapshots.taken(read.now, read_at)
        # A delta: not visible in the cursor's snapshot, so committed after it was taken (once per bucket).
        unseen = {b: self._snapshots.at(cursor.seen) for b, (_, cursor) in reads.items()}
        for e in read.events:
            e.unseen_at = unseen[e.bucket]
        by_bucket = read.by_bucket()
        # Read again next cycle, whatever the hints say: buckets whose read was full, and buckets read in
        # pages against an older snapshot (their cursor's target). A commit after that target is not in
        # those pages, and its wake-up may have been used up by one of them.
        self._saturated = {b for b, evs in by_bucket.items() if len(evs) >= reads[b][0]} | {
            b for b, (_, cursor) in reads.items() if cursor.target is not None and b in read.held}
        for b, (limit, cursor) in reads.items():
            # An empty delta (or only events the sink does not want): move on. Not a bucket only checked.
            if b not in by_bucket and b in read.held and limit:
                moved = cursor.after_read(read.now, None, full=False)
                if moved != cursor:
                    self._ahead[b] = moved
        if not read.events:
            return 0
        advance = {b: reads[b][1].after_read(read.now, evs[-1].position, full=len(evs) >= reads[b][0])
                   for b, evs in by_bucket.items()}
        if any(e.blocked for e in read.events):
            self._check_parked_at = 0.0
        fences = {b: held[b] for b in advance}
        self._number_read(read.events, fences)
        self._run_batch(read.events, fences, advance, resets=set(fences))
        return len(read.events)

    def _retry_parked(self, held: dict[int, int]) -> int:
        with self.pool.connection() as conn:
            events = store.fetch_parked(conn, self.sink.name, list(held), PARKED_KEYS_PER_PASS, PARKED_PER_KEY,
                                        worker=self.worker, fences=held)
            if not events:
                # Nothing due: look again when the next retry is (the idle wait ends then too).
                due_in = store.next_parked_retry(conn, self.sink.name, list(held))
                if due_in is None:  # nothing parked: whatever parks an event says so (PARK_CHECK_IDLE_SECONDS)
                    due_in = PARK_CHECK_IDLE_SECONDS if self.listening() else self._idle_poll()
                self._check_parked_at = time.monotonic() + max(0.0, due_in)
                return 0
        fences = {e.bucket: held[e.bucket] for e in events}
        self._number_read(events, fences)
        self._run_batch(events, fences, {}, resets=set(fences))
        return len(events)

    def _run_batch(self, events: Sequence[StoredEvent], fences: dict[int, int],
                   advance: dict[int, Cursor], resets: set[int], alone: bool = False) -> set[int]:
        """Deliver a batch (``alone``: nothing else in flight in this process) and checkpoint it.

        Returns the buckets whose checkpoint landed."""
        commit = _BatchCommit(self, events, fences, advance, resets)
        to_send = [e for e in events if not e.blocked]
        try:
            with (self.gate.exclusive if alone else self.gate.shared)(self.abort), \
                    self.observer.delivering(self.sink, to_send) as observed:  # tracing hook: a span per batch
                ok = self.sink.deliver(to_send, fences, commit, self.abort)
                observed.landed(commit.checkpoint, ok)
        except LeaseLost:
            return set()  # the sink's transaction rolled back: nothing of this batch landed
        except Exception as exc:
            if not alone and points_at_events(exc):
                # Nothing says which event it was: deliver these buckets one event at a time, each
                # attempt counted first, so that the next failure is charged to its event.
                self._ramp.update({b: 1 for b in fences})
                log.warning("sink %s: a batch failed as a whole (%s); delivering buckets %s one event at a time "
                            "to find the event that causes it", self.sink.name, describe_error(exc), sorted(fences))
            raise
        if commit.checkpoint is not None and not commit.waits:  # a waiting one lands with the next read
            self._landed(commit.checkpoint, ok)
        return ok

    # -- crash-loop isolation --------------------------------------------------------------

    def _probe(self, bucket: int, fence: int, held: int) -> int:
        size = self._ramp[bucket]
        if size == 1:
            return self._probe_alone(bucket, fence)
        cursor = self._read_cursor(bucket)
        with self.pool.connection() as conn:
            parked = store.fetch_parked(conn, self.sink.name, [bucket], size, 1, worker=self.worker,
                                        fences={bucket: fence})
            read = store.fetch_events(conn, self.sink.name, self.worker, {bucket: (size, cursor)},
                                      self.sink.event_filter, formatted=self._formatted, fences={bucket: fence})
        if bucket not in read.held:  # fenced out (the parked read above returned nothing of it then)
            self._lose({bucket}, {bucket: fence})
            return 0
        new = read.events
        if not parked and not new:
            return self._probe_idle(bucket, fence, cursor.after_read(read.now, None, full=False))
        advance = {bucket: cursor.after_read(read.now, new[-1].position, full=len(new) >= size)} if new else {}
        self._number_read(parked, {bucket: fence})  # delivered first: the earlier read
        self._number_read(new, {bucket: fence})
        healthy = size * 2 > self._bucket_limit(held)
        ok = self._run_batch([*parked, *new], {bucket: fence}, advance, resets={bucket} if healthy else set())
        if bucket in ok:
            self._ramp[bucket] = 0 if healthy else size * 2
            if healthy:
                self._deaths.pop(bucket, None)
                log.info("sink %s: bucket %d is healthy again", self.sink.name, bucket)
        return len(parked) + len(new)

    def _probe_alone(self, bucket: int, fence: int) -> int:
        """Deliver the bucket's next event alone, its attempt counted first."""
        fences = {bucket: fence}
        for _ in range(PROBE_QUIET_STEPS):
            cursor = self._read_cursor(bucket)
            with self.pool.connection() as conn:
                events = store.fetch_parked(conn, self.sink.name, [bucket], 1, 1, worker=self.worker, fences=fences)
                read = None if events else store.fetch_events(
                    conn, self.sink.name, self.worker, {bucket: (1, cursor)}, self.sink.event_filter,
                    formatted=self._formatted, fences=fences)
            if read is not None:
                events = read.events
                if not events:
                    return self._probe_idle(bucket, fence, cursor.after_read(read.now, None, full=False))
            self._number_read(events, fences)
            e = events[0]
            advance = {} if read is None else {bucket: cursor.after_read(read.now, e.position, full=True)}
            cp = Checkpoint(fences=fences, advance=advance)
            if e.blocked:  # its key waits for a parked head: queue behind it, deliver nothing
                cp.park.append((e, e.attempts, 0.0, None))
                if not self._write(cp):
                    return 0
                continue
            if e.attempts >= self.settings.max_attempts:  # crashed the relay on every attempt
                cp.dead.append((e, e.attempts, e.last_error or CRASH_ERROR))
                cp.done.append(e)
                if not self._write(cp):
                    return 0
                continue
            attempts = e.attempts + 1
            # The deaths that made the bucket a suspect happened with this event in the batch: charged to it from
            # the first, so --max-attempts N costs about N deaths, not max_lapses + N. An event charged a crash
            # already carries its deaths; an innocent one's charge is replaced by its own outcome's count
            # (``_run_batch`` parks it with ``e.attempts + 1``), so only a death keeps it.
            deaths = self._deaths.get(bucket, 0) if e.last_error != CRASH_ERROR else 0
            cp.park.append((e, attempts + deaths, self.backoff.delay(attempts), CRASH_ERROR))
            if not self._write(cp):
                return 0
            e.parked = True  # it is now; ``attempts`` stays the count before this attempt
            try:
                landed = self._run_batch([e], fences, {}, resets=set(), alone=True)
            except Exception as exc:
                if not points_at_events(exc):
                    raise
                # The attempt was counted before it was made; record why it failed.
                error = describe_error(exc)
                log.warning("sink %s: event %s (key %r) failed alone, attempt %d: %s", self.sink.name, e.id, e.key,
                            attempts, error)
                self._write(Checkpoint(fences=fences, park=[(e, attempts, self.backoff.delay(attempts), error)]))
                return 1
            if bucket in landed:
                self._ramp[bucket] = 2
            return 1
        return 0

    def _probe_idle(self, bucket: int, fence: int, caught_up: Cursor) -> int:
        """Nothing due in a suspect bucket: once nothing is parked there either, it is healthy.
        ``caught_up``: its cursor past the empty delta just read."""
        advance = {bucket: caught_up}
        with self.pool.connection() as conn:
            waiting = store.has_parked(conn, self.sink.name, bucket)
        if waiting:  # a parked retry is still to come
            self._write(Checkpoint(fences={bucket: fence}, advance=advance))
            return 0
        ok = self._write(Checkpoint(fences={bucket: fence}, advance=advance, resets={bucket}))
        if bucket in ok:
            self._ramp[bucket] = 0
            self._deaths.pop(bucket, None)
        return 0

    def _write(self, cp: Checkpoint) -> set[int]:
        """A checkpoint of the runner's own (isolation steps, cursors flushed), outside any sink transaction."""
        ok = self._checkpoint(cp, None)
        self._landed(cp, ok)
        return ok

    def _checkpoint(self, cp: Checkpoint, tx: Conn | None) -> set[int]:
        """Write ``cp`` in the sink's transaction ``tx``, or on its own; returns the buckets whose fence held."""
        cp.lease_seconds = self.settings.lease_seconds
        if isinstance(tx, psycopg.Connection):
            self._require_same_server(tx)
        try:
            ok = (store.checkpoint(tx, self.sink.name, self.worker, cp) if tx is not None
                  else self._checkpoint_alone(cp))
        except psycopg.Error as exc:
            raise CheckpointFailed(f"sink {self.sink.name}: checkpoint failed: {describe_error(exc)}") from exc
        return self._fenced(cp, ok, in_tx=tx is not None)

    def _checkpoint_alone(self, cp: Checkpoint) -> set[int]:
        """Write ``cp`` on a pooled connection. One that only moves cursors sets them to absolute positions,
        so writing it twice is harmless: if the connection breaks (a failover, a terminated backend), it is
        written again on a new one, for as long as the lease may hold, rather than given up, which would
        have the whole batch, already delivered, sent again."""
        attempt = 0
        deadline = time.monotonic() + self.settings.lease_seconds
        while True:
            try:
                with self.pool.connection() as conn:
                    self._require_same_server(conn)
                    return store.checkpoint(conn, self.sink.name, self.worker, cp)
            except psycopg.OperationalError as exc:
                attempt += 1
                delay = CHECKPOINT_RETRY.delay(attempt)
                if not cp.moves_only or self._stopping() or time.monotonic() + delay >= deadline:
                    raise
                log.info("sink %s: checkpoint failed (%s); writing it again in %.2fs", self.sink.name,
                         describe_error(exc), delay)
                self.abort.wait(delay)

    def _same_server(self, conn: Conn) -> bool:
        """Whether ``conn``'s server is the one the read cursors were read from. After a crash restart
        PostgreSQL hands out again the transaction ids whose WAL had not reached disk, so a snapshot
        taken before it can count a new transaction as seen and its events would be skipped. Cursors as
        written are safe (their write committed after their snapshot was taken, so recovery resumes
        past its xmax); the ones held only in memory (``_ahead``, deferred writes) are dropped here, and
        their buckets are read again from the written ones (duplicates, never a gap)."""
        return self._same_start(store.server_started(conn))

    def _same_start(self, started: datetime) -> bool:
        """``_same_server`` for a server start time already read."""
        if started == self._server_started:
            return True
        known, self._server_started = self._server_started, started
        if known is None:
            return True
        if self._ahead:
            log.warning("sink %s: the database server restarted; %d buckets are read again from their stored "
                        "cursors", self.sink.name, len(self._ahead))
        self._ahead.clear()
        self._owed.clear()
        self._owed_oldest = None
        self._pending = None  # its cursors were among them: not landed, its events are read again
        return False

    def _require_same_server(self, conn: Conn) -> None:
        """A checkpoint's cursors come from reads before it: refused if the server restarted since."""
        self._require_same_start(store.server_started(conn))

    def _require_same_start(self, started: datetime) -> None:
        if not self._same_start(started):
            raise CheckpointFailed(f"sink {self.sink.name}: the database server restarted since this batch was "
                                   "read; it is read again from the stored cursors")

    def _fenced(self, cp: Checkpoint, ok: set[int], in_tx: bool) -> set[int]:
        lost = set(cp.fences) - ok
        if lost:
            self._lose(lost, cp.fences)
            if in_tx:
                raise LeaseLost(f"sink {self.sink.name}: lost buckets {sorted(lost)}")
        return ok

    def _lose(self, lost: set[int], fences: dict[int, int]) -> None:
        self.observer.leases(self.sink.name, lost=len(lost))
        self._unexplained |= lost  # logged by the next cycle, before it takes any of them up again
        self.leases.drop(lost, fences)

    def _explain_lost(self) -> None:
        lost, self._unexplained = self._unexplained, set()
        if lost:
            self._log_lost(lost, "fenced out of %d buckets; their batch is discarded and will be redelivered by "
                                 "the new owner")

    def _log_lost(self, lost: set[int], takeover: str) -> None:
        """Say why buckets were lost: an operator's re-fence (the lease stays here, ``fenced_by`` names the
        action) at INFO, a takeover or a lease that ran out as the WARNING ``takeover`` (a %d for the count)."""
        try:
            with self.pool.connection() as conn:
                why = store.why_fenced(conn, self.sink.name, self.worker, lost)
        except (psycopg.Error, PoolTimeout) as exc:
            log.debug("sink %s: could not read why buckets were lost: %s", self.sink.name, exc)
            why = {}
        by_action: dict[str, int] = {}
        for action in why.values():
            by_action[action] = by_action.get(action, 0) + 1
        for action, n in sorted(by_action.items()):
            log.info("sink %s: %s (an operator's action) re-fenced %d buckets this relay holds: what it had in "
                     "flight there is discarded, and it takes them up again under the new fence",
                     self.sink.name, action, n)
        if len(lost) > len(why):
            log.warning("sink %s: " + takeover, self.sink.name, len(lost) - len(why))

    def _landed(self, cp: Checkpoint, ok: set[int]) -> None:
        now = time.monotonic()
        for b, cursor in cp.advance.items():
            if b not in ok:
                continue
            if b in cp.defer:  # fenced, not written: the read cursor moves, the row waits (``_flush_owed``)
                self._ahead[b] = cursor
                if b not in self._owed and self._owed_oldest is not None:
                    self._owed_oldest = min(self._owed_oldest, self._written_at.get(b, 0.0))
                self._owed.add(b)
            else:
                self._cursors[b] = cursor
                self._ahead.pop(b, None)
                self._owed.discard(b)
                self._owed_oldest = None
                self._written_at[b] = now
        self._lapsed -= (cp.resets & ok) - cp.defer  # their lapses are 0 in the row now
        if cp.park:
            self._check_parked_at = 0.0
        dead = [(e, attempts, error) for e, attempts, error in cp.dead if e.bucket in ok]
        for e, attempts, error in dead:
            log.error("sink %s: event %s (key %r, type %s) dead-lettered after %s: %s",
                      self.sink.name, e.id, e.key, e.type, counted(attempts, "attempt"), error)
        delivered = [e for e in cp.delivered if e.bucket in ok]
        # A parked event with an error but no attempt added waits for a condition of the sink (held).
        retried = held = 0
        for e, attempts, _, why in cp.park:
            if why is not None and e.bucket in ok:
                if attempts > e.attempts:
                    retried += 1
                    if why != CRASH_ERROR:  # a probe's attempt counted before it is made: not a failure yet
                        self._retry_log.failed(e.id, e.key, attempts, self.settings.max_attempts, why)
                else:
                    held += 1
        if held:
            self.observer.held(self.sink.name, held)
        if delivered or dead:
            self.observer.checkpointed(self.sink.name, delivered=[e.id for e in delivered],
                                       dead=[e.id for e, _, _ in dead])
        if delivered or retried or dead:
            at = cp.landed_at
            ages = [(at - e.stored_at).total_seconds() for e in delivered if at and e.stored_at]
            if ages:
                self.observer.ages(self.sink.name, ages)
            # From when it became visible to the relay: not before the last read that could not see it
            # (nor before its storing), so a business transaction kept open is not counted as ours.
            now = time.monotonic()
            latencies = [min(age, now - e.unseen_at) if e.unseen_at is not None else age
                         for e, age in zip((e for e in delivered if at and e.stored_at), ages, strict=True)]
            self.observer.batch(self.sink.name, size=len(delivered) + retried + len(dead), delivered=len(delivered),
                                retried=retried, dead=len(dead), latencies=latencies)


class _SnapshotTimes:
    """Monotonic time each read snapshot was last taken, for the snapshots the runner's cursors may still
    hold (runner thread only). Bounded: the oldest are forgotten, which only loses precision."""

    LIMIT = 4096

    def __init__(self) -> None:
        self._at: dict[Snapshot, float] = {}

    def taken(self, snapshot: Snapshot, at: float) -> None:
        # A snapshot equal to an earlier one means no transaction ended in between: what it does not
        # show was still invisible at the later read, so the later time is the tighter bound.
        self._at.pop(snapshot, None)
        if len(self._at) >= self.LIMIT:
            for old in list(self._at)[: self.LIMIT // 2]:  # insertion order: the oldest first
                del self._at[old]
        self._at[snapshot] = at

    def at(self, snapshot: Snapshot) -> float | None:
        return self._at.get(snapshot)


class _BatchCommit:
    """The ``sink.Commit`` a runner hands its sink for one batch."""

    def __init__(self, runner: SinkRunner, events: Sequence[StoredEvent], fences: dict[int, int],
                 advance: dict[int, Cursor], resets: set[int]) -> None:
        self.runner = runner
        self.events = events
        self.fences = fences
        self.advance = advance
        self.resets = resets
        self.checkpoint: Checkpoint | None = None  # what was written, once it was
        self.waits = False  # its fence check waits for the runner's next read (``later``)
        # Where each bucket read past its cursor started (the runner's cursors change only when a
        # checkpoint lands), and the events ``partial`` already wrote.
        self.start = {b: runner._read_cursor(b) for b in advance}
        self.settled: set[uuid.UUID] = set()

    def _plan(self, outcomes: Outcomes) -> Checkpoint:
        r = self.runner
        cp = classify(self.events, outcomes, self.fences, max_attempts=r.settings.max_attempts, backoff=r.backoff)
        cp.advance = self.advance
        cp.resets = self.resets
        if self.settled:  # counted when ``partial`` wrote them
            cp.delivered = [e for e in cp.delivered if e.id not in self.settled]
        return cp

    def partial(self, outcomes: Outcomes) -> set[int]:
        """Checkpoint what of the batch is settled before all of it is (a sink without a transaction of
        its own may call this any number of times before ``__call__``): per bucket read past its cursor,
        the run of delivered events from the start of its part of the batch. The cursor then stands
        after the last of them, inside the read's delta, as between two pages of a large delta. A relay
        that loses the bucket before the batch's checkpoint hands over only the rest (fewer duplicates).
        The run stops at the first event not delivered yet, failed (the final checkpoint parks it and
        holds its key), or queued behind a parked one of its key. Returns the buckets written."""
        last: dict[int, StoredEvent] = {}
        stopped: set[int] = set()
        new: list[StoredEvent] = []
        for e in self.events:
            b = e.bucket
            if b in stopped or b not in self.start:
                continue
            if e.id not in self.settled:
                if e.parked or e.blocked or e.id not in outcomes or outcomes[e.id] is not None:
                    stopped.add(b)
                    continue
                new.append(e)
            last[b] = e
        buckets = {e.bucket for e in new}
        if not buckets:
            return set()
        advance = {}
        for b in buckets:
            end = self.advance[b]
            advance[b] = Cursor(self.start[b].seen, end.target if end.target is not None else end.seen,
                                last[b].position)
        cp = Checkpoint(fences={b: self.fences[b] for b in buckets}, advance=advance, delivered=new)
        ok = self.runner._write(cp)
        self.settled.update(e.id for e in new if e.bucket in ok)
        return ok

    def later(self, outcomes: Outcomes) -> set[int]:
        """``self(outcomes, None)`` for a sink that has delivered already and acts on nothing the answer says
        (the Kafka sink): a batch that only moves cursors, none of which must be written now, has its fence
        checked by the runner's next read, which starts the next cycle, instead of a statement of its own
        here. Returns the buckets it was read under; that read finds which held (``SinkRunner._pending``):
        the others are let go, and this batch is discarded there (redelivered by the next owner, in order),
        as a failed check is now. ``Observer.checkpointed`` comes with that read."""
        r = self.runner
        cp = self._plan(outcomes)
        if not r._foldable(cp):
            return self(outcomes, None)
        r._settle_pending()  # never two waiting: the read of this batch took the previous one's
        cp.lease_seconds = r.settings.lease_seconds
        cp.defer = set(cp.advance)
        r._ahead.update(cp.advance)  # the next read goes on from after this batch
        r._pending = cp
        self.checkpoint = cp
        self.waits = True
        return set(cp.fences)

    def __call__(self, outcomes: Outcomes, tx: Conn | None) -> set[int]:
        cp = self._plan(outcomes)
        if tx is None:  # delivered already: its cursor write may wait (never in a sink's own transaction)
            cp.defer = self.runner._deferrable(cp)
        ok = self.runner._checkpoint(cp, tx)
        self.checkpoint = cp
        return ok

    async def in_async(self, outcomes: Outcomes, tx: AsyncConn) -> set[int]:
        r = self.runner
        cp = self._plan(outcomes)
        cp.lease_seconds = r.settings.lease_seconds
        # As ``_checkpoint`` does on a sync transaction (the runner's thread waits for this one meanwhile).
        r._require_same_start(await store.aserver_started(tx))
        try:
            written = await store.acheckpoint(tx, r.sink.name, r.worker, cp)
        except psycopg.Error as exc:
            raise CheckpointFailed(f"sink {r.sink.name}: checkpoint failed: {describe_error(exc)}") from exc
        ok = r._fenced(cp, written, in_tx=True)
        self.checkpoint = cp
        return ok

