"""One sink's delivery loop: lease buckets, read past their cursors, deliver, checkpoint.

No SQL here (store.py has it). Per key, events go out in position order; a failing head
parks its key (only that key waits), retries with backoff and ends in dead letters after
``max_attempts``. Every checkpoint is fenced: a worker that lost a bucket writes nothing
there.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import defaultdict
from collections.abc import Iterable, Sequence

from psycopg_pool import ConnectionPool

from . import store
from .backoff import Backoff
from .settings import RelaySettings
from .sink import Aborted, Failure, Outcomes, Sink
from .store import Checkpoint, Conn, StoredEvent

log = logging.getLogger("outbox_relay.relay")

MIN_BUCKET_LIMIT = 8
PARKED_KEYS_PER_PASS = 256
PARKED_PER_KEY = 100


class Leases:
    """The buckets a runner holds. The runner acquires and releases; the membership thread renews
    and may mark buckets lost. Guarded by one lock because both threads touch it."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._fences: dict[int, int] = {}
        self._lapses: dict[int, int] = {}

    def snapshot(self) -> dict[int, int]:
        with self._lock:
            return dict(self._fences)

    def lapses(self, bucket: int) -> int:
        with self._lock:
            return self._lapses.get(bucket, 0)

    def add(self, acquired: dict[int, tuple[int, int]]) -> None:
        with self._lock:
            for bucket, (fence, lapses) in acquired.items():
                self._fences[bucket] = fence
                self._lapses[bucket] = lapses

    def drop(self, buckets: Iterable[int], fences: dict[int, int] | None = None) -> None:
        """Forget buckets (only if still under the given fences, when given)."""
        with self._lock:
            for b in buckets:
                if fences is None or self._fences.get(b) == fences.get(b):
                    self._fences.pop(b, None)
                    self._lapses.pop(b, None)

    def reset_lapses(self, buckets: set[int]) -> None:
        with self._lock:
            for b in buckets:
                if b in self._lapses:
                    self._lapses[b] = 0


def classify(events: Sequence[StoredEvent], outcomes: Outcomes, fences: dict[int, int], *, parked: bool,
             max_attempts: int, backoff: Backoff) -> Checkpoint:
    """Turn per-event outcomes into a checkpoint that keeps per-key order.

    Walks each key in position order: delivered events are done; the first failure parks the
    key (or dead-letters the event if it can never succeed or has no attempts left, which
    unblocks the key); everything behind a parked head is parked behind it.
    """
    cp = Checkpoint(fences=fences)
    stuck: set[str] = set()  # keys whose head is parked in this batch
    for e in events:
        outcome = outcomes.get(e.id, Failure("not attempted"))
        if e.blocked or e.key in stuck or (e.id not in outcomes):
            stuck.add(e.key)
            if not parked:  # already parked events simply stay where they are
                cp.park.append((e, e.attempts, 0.0, None))
            continue
        if outcome is None:
            if parked:
                cp.done.append(e)
            continue
        attempts = e.attempts + 1
        if not outcome.retriable or attempts >= max_attempts:
            cp.dead.append((e, attempts, outcome.error))
            if parked:
                cp.done.append(e)
        else:
            cp.park.append((e, attempts, backoff.delay(attempts), outcome.error))
            stuck.add(e.key)
    return cp


class SinkRunner:
    """Runs one sink in its own thread. ``desired`` is set by the membership thread."""

    def __init__(self, sink: Sink, pool: ConnectionPool[Conn], settings: RelaySettings,
                 backoff: Backoff | None = None) -> None:
        self.sink = sink
        self.pool = pool
        self.settings = settings
        self.worker = settings.worker_id
        self.wake = threading.Event()  # set by the listener, ring changes and stop requests
        self.backoff = backoff or Backoff(settings.backoff_base_seconds, settings.backoff_max_seconds)
        self.leases = Leases()
        self.desired: set[int] | None = None  # None until the first ring is known
        self.draining = threading.Event()  # stop claiming, finish the batch, release, exit
        self.abort = threading.Event()  # hard stop: drop the batch in flight
        self._saturated: set[int] = set()
        self._check_parked_at = 0.0
        self._rotation = 0

    # -- loop ------------------------------------------------------------------------------

    def run(self) -> None:
        failures = 0
        while not (self.draining.is_set() or self.abort.is_set()):
            try:
                n = self.run_once()
                failures = 0
            except Aborted:
                break
            except Exception as exc:  # one failure never kills the worker
                failures += 1
                delay = min(30.0, 0.5 * 2 ** min(failures, 6))
                log.warning("sink %s: cycle failed (%s: %s); retrying in %.1fs", self.sink.name,
                            type(exc).__name__, exc, delay)
                self.wake.wait(delay)
                continue
            if n == 0:
                self.wake.wait(self.settings.poll_seconds * (0.8 + 0.4 * (time.monotonic() % 1)))
                self.wake.clear()
        self._release_all()

    def run_once(self) -> int:
        """One cycle: rebalance leases, retry due parked keys, deliver new events. Returns events handled."""
        self.rebalance()
        held = self.leases.snapshot()
        if not held:
            return 0
        handled = 0
        if time.monotonic() >= self._check_parked_at:
            handled += self._retry_parked(held)
        handled += self._deliver_new(held)
        return handled

    # -- leases ----------------------------------------------------------------------------

    def rebalance(self) -> None:
        desired = self.desired
        if desired is None:
            return
        held = self.leases.snapshot()
        surplus = {b: f for b, f in held.items() if b not in desired}
        with self.pool.connection() as conn:
            if surplus:
                store.release_leases(conn, self.sink.name, self.worker, surplus)
                self.leases.drop(surplus.keys(), surplus)
                log.info("sink %s: released %d buckets", self.sink.name, len(surplus))
            wanted = desired - held.keys()
            if wanted and not self.draining.is_set():
                acquired = store.acquire_leases(conn, self.sink.name, self.worker, wanted,
                                                self.settings.lease_seconds)
                if acquired:
                    self.leases.add(acquired)
                    self._check_parked_at = 0.0  # new buckets may come with parked keys
                    log.info("sink %s: acquired %d buckets", self.sink.name, len(acquired))

    def renew(self) -> None:
        """Called by the membership thread: extend every lease, forget the lost ones."""
        fences = self.leases.snapshot()
        if not fences:
            return
        with self.pool.connection() as conn:
            kept = store.renew_leases(conn, self.sink.name, self.worker, fences, self.settings.lease_seconds)
        lost = set(fences) - kept
        if lost:
            log.warning("sink %s: lost the lease on %d buckets (fenced out)", self.sink.name, len(lost))
            self.leases.drop(lost, fences)

    def _release_all(self) -> None:
        fences = self.leases.snapshot()
        if not fences:
            return
        try:
            with self.pool.connection() as conn:
                store.release_leases(conn, self.sink.name, self.worker, fences)
            log.info("sink %s: released all %d buckets", self.sink.name, len(fences))
        except Exception as exc:
            log.warning("sink %s: could not release leases (%s); they will expire", self.sink.name, exc)
        self.leases.drop(fences.keys(), fences)

    # -- delivery --------------------------------------------------------------------------

    def _limits(self, held: dict[int, int]) -> dict[int, int]:
        """Per-bucket read limits, in a rotating order: busy buckets share the batch budget."""
        batch = self.settings.batch_size
        base = max(MIN_BUCKET_LIMIT, batch // max(1, len(held)))
        busy = self._saturated & held.keys()
        hot = max(base, batch // max(1, len(busy)))
        order = sorted(held)
        self._rotation = (self._rotation + 1) % len(order)
        order = order[self._rotation:] + order[: self._rotation]
        limits = {}
        for b in order:
            if self.leases.lapses(b) >= self.settings.max_lapses:
                limits[b] = 1  # crash-loop suspect: one event at a time
            else:
                limits[b] = hot if b in busy else base
        return limits

    def _deliver_new(self, held: dict[int, int]) -> int:
        limits = self._limits(held)
        with self.pool.connection() as conn:
            events, horizon = store.fetch_events(conn, self.sink.name, self.worker, limits)
        if not events:
            self._saturated = set()
            return 0
        by_bucket: dict[int, list[StoredEvent]] = defaultdict(list)
        for e in events:
            by_bucket[e.bucket].append(e)
        self._saturated = {b for b, evs in by_bucket.items() if len(evs) >= limits[b]}
        assert horizon is not None
        # A full bucket may have more: advance to its last row. Otherwise everything below
        # the horizon was read, so the cursor may jump to it.
        advance = {b: (evs[-1].position if b in self._saturated else (horizon, 0)) for b, evs in by_bucket.items()}
        forced: Outcomes = {}
        for b, evs in by_bucket.items():
            lapses = self.leases.lapses(b)
            if lapses >= 2 * self.settings.max_lapses and not evs[0].blocked:
                forced[evs[0].id] = Failure(
                    f"the lease lapsed {lapses} times while this event was being delivered "
                    "(a worker crashed or stalled on it); isolated as poison", retriable=False)
        fences = {b: held[b] for b in by_bucket}
        if any(e.blocked for e in events):
            self._check_parked_at = 0.0
        to_send = [e for e in events if not e.blocked and e.id not in forced]

        def commit(outcomes: Outcomes, tx: Conn | None) -> set[int]:
            cp = classify(events, {**outcomes, **forced}, fences, parked=False,
                          max_attempts=self.settings.max_attempts, backoff=self.backoff)
            cp.advance = advance
            return self._write(cp, tx)

        self.sink.deliver(to_send, fences, commit, self.abort)
        return len(events)

    def _retry_parked(self, held: dict[int, int]) -> int:
        with self.pool.connection() as conn:
            events = store.fetch_parked(conn, self.sink.name, list(held), PARKED_KEYS_PER_PASS, PARKED_PER_KEY)
        if not events:
            self._check_parked_at = time.monotonic() + self.settings.poll_seconds
            return 0
        fences = {e.bucket: held[e.bucket] for e in events}

        def commit(outcomes: Outcomes, tx: Conn | None) -> set[int]:
            cp = classify(events, outcomes, fences, parked=True,
                          max_attempts=self.settings.max_attempts, backoff=self.backoff)
            return self._write(cp, tx)

        self.sink.deliver(events, fences, commit, self.abort)
        return len(events)

    def _write(self, cp: Checkpoint, tx: Conn | None) -> set[int]:
        if tx is not None:
            ok = store.checkpoint(tx, self.sink.name, self.worker, cp)
        else:
            with self.pool.connection() as conn:
                ok = store.checkpoint(conn, self.sink.name, self.worker, cp)
        lost = set(cp.fences) - ok
        if lost:
            log.warning("sink %s: fenced out of %d buckets; their batch is discarded and will be redelivered "
                        "by the new owner", self.sink.name, len(lost))
            self.leases.drop(lost, cp.fences)
        if cp.park:
            self._check_parked_at = 0.0
        for e, attempts, error in cp.dead:
            log.error("sink %s: event %s (key %r, type %s) dead-lettered after %d attempts: %s",
                      self.sink.name, e.id, e.key, e.type, attempts, error)
        self.leases.reset_lapses({b for b in ok if b in cp.advance})
        return ok
