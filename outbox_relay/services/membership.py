"""The membership service: heartbeats, each sink's stored assignment -> each runner's ``desired``
buckets, lease renewal."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence

import psycopg
from psycopg_pool import ConnectionPool, PoolTimeout

from .. import store
from ..assignment import buckets_of, rebalance
from ..dsn import connection_problem, redact
from ..errors import WorkerIdInUse
from ..horizon import HorizonWatch
from ..relay import SinkRunner
from ..renewal import renew_interval
from ..settings import RelaySettings
from ..store import Conn
from .thread import ServiceThread

log = logging.getLogger("outbox_relay.worker")

# A membership loop that comes round this much later than it should (and later than a renewal is due)
# says so: the leases it renews may have run out meanwhile, and the takeover that follows is explained.
PROCESS_STALL_SECONDS = 2.0


class Membership(ServiceThread):
    """Keeps this relay in the registry and its runners on their share of buckets.

    It runs until ``stop`` (after the sinks ended): while the relay drains its heartbeats say so and
    it goes on renewing the leases the runners still hold."""

    name = "membership"

    def __init__(self, pool: ConnectionPool[Conn], settings: RelaySettings, runners: Sequence[SinkRunner], *,
                 draining: threading.Event, metadata: Callable[[], dict[str, object]],
                 member_lost: Callable[[], None], id_lost: Callable[[WorkerIdInUse], None]) -> None:
        super().__init__()
        self.pool = pool
        self.settings = settings
        self.runners = runners
        self._draining = draining  # the worker's: heartbeats say "draining", runners want nothing
        self._metadata = metadata
        self._member_lost = member_lost  # called when an assignment without a silent relay was stored
        self._id_lost = id_lost
        self.changed = threading.Event()  # another relay stored a new assignment: beat now
        # The fields below are written by this service's thread (and the first beat in start), read by others.
        self.beat_ok_at: float | None = None  # monotonic time of the last heartbeat that reached the database
        # Since when heartbeats have reached the database without a failure in between (runners' fence checks).
        self.reachable_since: float | None = None
        # Whether this relay comes first among the live members of one of its sinks: that relay tries to
        # claim every housekeeping pass and watches for commits, the others only now and then.
        self.first_member = True
        self.horizon = HorizonWatch()  # whether cursor writes are worth deferring now

    def start(self) -> None:
        """One heartbeat now (the runners learn their buckets before their first read), then the thread."""
        try:
            self.beat()
        except (psycopg.OperationalError, PoolTimeout) as exc:  # the thread tries again
            log.warning("membership: %s", connection_problem(exc))
        super().start()

    def run(self) -> None:
        s = self.settings
        renew_every = renew_interval(s.lease_seconds)
        next_renew = time.monotonic() + renew_every
        next_beat = time.monotonic() + s.heartbeat_seconds
        tick = min(0.5, renew_every, s.heartbeat_seconds)
        last = time.monotonic()
        while not self.stopped.is_set():
            # An assignment changed by another relay (NOTIFY) brings the next heartbeat forward.
            if self.changed.wait(tick):
                self.changed.clear()
                next_beat = 0.0
            if self.stopped.is_set():
                break
            now = time.monotonic()
            if now - last > max(PROCESS_STALL_SECONDS, renew_every):  # not its statements: the process stood still
                log.warning("membership: this thread ran %.1fs late (the process was stopped or starved of CPU, or "
                            "its last heartbeat or renewal was that slow); leases may have expired meanwhile",
                            now - last - tick)
            last = now
            try:
                if now >= next_renew:
                    next_renew = now + renew_every
                    for r in self.runners:
                        r.renew()
                else:  # a runner that got stuck gives its buckets up now, not at the next renewal
                    for r in self.runners:
                        if r.stuck() is not None and r.leases.snapshot():
                            r.renew()
                if now >= next_beat:
                    next_beat = now + s.heartbeat_seconds
                    self.beat()
                    if self.reachable_since is None:
                        self.reachable_since = now
            except Exception as exc:
                self.reachable_since = None
                log.warning("membership: %s: %s", type(exc).__name__, redact(str(exc)))

    def beat(self) -> None:
        """Heartbeat, and follow each sink's assignment: store a new one when its live members changed
        (assignment.py), then hand each runner the buckets it should hold."""
        status = "draining" if self._draining.is_set() else "alive"
        meta = self._metadata()
        by_sink = {r.sink.name: r for r in self.runners if r.stuck() is None}  # a stuck runner leaves its sink
        with self.pool.connection() as conn:
            try:
                memberships = store.heartbeat(conn, self.settings.worker_id, status, list(by_sink), meta,
                                              self.settings.worker_ttl_seconds)
            except WorkerIdInUse as exc:  # another relay took the id while this one's heartbeats lapsed
                self._id_lost(exc)
                return
            self.beat_ok_at = time.monotonic()
            me = self.settings.worker_id
            self.first_member = not memberships or any(m.live and min(m.live) == me for m in memberships)
            for m in memberships:
                owners = m.owners
                if m.live != m.members:
                    owners = rebalance(m.owners, m.live)
                    if store.reassign(conn, m.sink, m.generation, m.live, owners):
                        log.info("sink %s: members now %s; buckets reassigned", m.sink, m.live)
                        if set(m.members) - set(m.live):
                            self._member_lost()  # a housekeeping pass now frees the leases of the silent one
                    else:  # another relay stored one first: follow it at the next heartbeat
                        self.changed.set()
                        continue
                runner = by_sink[m.sink]
                desired = set() if status != "alive" else buckets_of(owners, me)
                if desired != runner.desired:
                    runner.desired = desired
                    runner.wake.set()
            if self.settings.cursor_flush_seconds > 0 and self.horizon.observe(*store.vacuum_horizon(conn)):
                for r in self.runners:  # owed cursor writes go now, or the next batches defer theirs
                    r.wake.set()
