"""A relay process: registry heartbeat and stored assignment, one thread per sink, housekeeping, LISTEN.

Threads and who owns what:
- membership: heartbeat, each sink's stored assignment (a new one when its live members changed)
  -> each runner's ``desired`` buckets, lease renewal.
- one SinkRunner per sink: acquires/releases its own leases, delivers, checkpoints.
- housekeeping: every few seconds, a pass if it claims this interval's (outbox.housekeeping).
- listener: LISTEN outbox_events_v2 and outbox_membership_v1; wakes the runners that hold or want
  the notified buckets, with hints (polling stays the baseline).
First SIGTERM/SIGINT drains (leave the assignment, stop claiming, finish the batch, release,
exit); a second one stops hard (drop the batch in flight; the next owner redelivers).
"""

from __future__ import annotations

import itertools
import logging
import os
import signal
import socket
import threading
import time
from collections.abc import Callable
from types import FrameType
from typing import Protocol

import psycopg
from psycopg_pool import ConnectionPool, PoolTimeout

from . import store
from .assignment import buckets_of, rebalance
from .backoff import Backoff
from .dsn import connection_problem, probe_connection, redact
from .errors import ConfigurationError, OutboxError
from .housekeeping import Housekeeping, application_name
from .migrate import check_schema
from .observer import NULL_OBSERVER, Observer
from .relay import PARKED_NOTICE, DeliveryGate, SinkRunner
from .settings import RelaySettings
from .sink import Sink
from .store import Conn

log = logging.getLogger("outbox_relay.worker")


class Service(Protocol):
    """Something that lives as long as a worker (the metrics server)."""

    def start(self) -> None: ...

    def close(self) -> None: ...

RECONNECT = Backoff(1.0, 30.0)  # waiting for the database: to start, and to listen again
NOTIFY_CHANNEL = "outbox_events_v2"  # payload: the buckets a statement wrote, comma-separated
MEMBERSHIP_CHANNEL = "outbox_membership_v1"  # payload: a sink whose assignment changed
HOUSEKEEPING_STANDBY = 6  # intervals between claim attempts of a relay that is no sink's first live member
VERSION = "0.1.0"


def _configure(conn: Conn) -> None:
    # Postgres' default, whatever the role or database says: once psycopg prepares a statement (its
    # 5th execution), Postgres may plan it once for all values. Planning was about 1 ms of each 1.5 ms
    # read and a large share of each checkpoint; with cached plans commit -> ack p99 at 1k ev/s went
    # from 16 to 12 ms (1 relay) and 49 to 21 ms (4 relays). A generic plan of a bucket-filtered
    # statement can be the GUIDE's trap (section 4): tests/integration/test_relay_plan.py pins the
    # generic plans of the read and of retention to the same index walks as the custom ones.
    conn.execute("SET plan_cache_mode = auto")


class Worker:
    """One relay process's engine around the sinks it is given (compose.build_worker makes them from
    settings)."""

    def __init__(self, settings: RelaySettings, sinks: list[Sink], observer: Observer = NULL_OBSERVER) -> None:
        self.settings = settings
        self.id = settings.worker_id
        self.stopping = threading.Event()  # drain requested
        self.stopped = threading.Event()  # all threads should exit now
        self._sinks = sinks
        self.observer = observer
        self.runners: list[SinkRunner] = []
        self.pool: ConnectionPool[Conn] | None = None
        self._threads: list[threading.Thread] = []
        self.fatal: OutboxError | None = None  # why the worker stopped by itself (a sink was dropped)
        # Written by the listener thread, read by heartbeats: `status` shows relays that only poll.
        self.listening = False
        self.membership_changed = threading.Event()  # another relay stored a new assignment
        self.services: list[Service] = []  # started with the worker, closed after it (metrics server)
        self._beat_ok_at: float | None = None  # monotonic time of the last heartbeat that reached the database
        # Whether this relay comes first among the live members of one of its sinks (heartbeat): that relay
        # tries to claim every housekeeping pass, the others only now and then (HOUSEKEEPING_STANDBY).
        self.first_member = True

    # -- lifecycle -------------------------------------------------------------------------

    def start(self) -> bool:
        """Connect, register and start the threads. False if asked to stop before the database came up."""
        s = self.settings
        dsn = s.dsn.get_secret_value()
        sinks = self._sinks
        if not sinks:
            raise ConfigurationError("no sink to run: enable --kafka or name a --projection")
        for service in self.services:  # first: a health endpoint answers (503) while the database is away
            service.start()
        # One connection for the runners' reads and checkpoints, heartbeats and housekeeping, which each
        # hold it for one statement (a Kafka sink not while it waits for acks; a projection applies its
        # batch on a connection of its own); one more per further sink. Plus the LISTEN connection.
        self.pool = self._open_pool(dsn, max_size=max(1, len(sinks)))
        if self.pool is None or not self._register(sinks):
            return False
        gate = DeliveryGate()  # one per process: crash-loop probes run alone across all sinks
        self.runners = [SinkRunner(sink, self.pool, s, gate=gate) for sink in sinks]
        for runner in self.runners:
            runner.listening = lambda: self.listening
            runner.observer = self.observer
        try:
            self._beat()
        except (psycopg.OperationalError, PoolTimeout) as exc:  # the membership thread tries again
            log.warning("membership: %s", connection_problem(exc))
        self._spawn("membership", self._membership_loop)
        self._spawn("housekeeping", self._housekeeping_loop)
        if s.listen:
            self._spawn("listener", self._listen_loop)
        for runner in self.runners:
            self._spawn(f"sink-{runner.sink.name}", runner.run)
        log.info("worker %s started: sinks %s, database %s", self.id, [r.sink.name for r in self.runners],
                 redact(dsn))
        return True

    def _register(self, sinks: list[Sink]) -> bool:
        """Check the schema and register the sinks, riding out a connection lost meanwhile (a database
        restart, a terminated backend); False if asked to stop first."""
        assert self.pool is not None
        for attempt in itertools.count(1):
            try:
                with self.pool.connection() as conn:
                    check_schema(conn)
                    for sink in sinks:
                        store.register_sink(conn, sink.name, sink.kind)
                return True
            except (psycopg.OperationalError, PoolTimeout) as exc:
                delay = RECONNECT.delay(attempt)
                log.warning("starting: %s; retrying in %.0fs", connection_problem(exc), delay)
            if self.stopping.wait(delay):
                return False
        raise AssertionError("unreachable")

    def _open_pool(self, dsn: str, max_size: int) -> ConnectionPool[Conn] | None:
        """Wait for the database (a relay started before it is normal in a deploy).

        None if asked to stop first. A pool whose opening timed out is closed by psycopg_pool
        and can not be reopened, so each attempt makes a new one."""
        for attempt in itertools.count(1):
            if self.stopping.is_set():
                return None
            delay = RECONNECT.delay(attempt)
            pool: ConnectionPool[Conn] = ConnectionPool(
                dsn, min_size=1, max_size=max_size, open=False, configure=_configure,
                kwargs={"autocommit": True, "application_name": application_name(self.id)},
                name="outbox-relay",
            )
            try:
                pool.open(wait=True, timeout=min(10.0, max(delay, 2.0)))
                return pool
            except PoolTimeout:
                pool.close()
            # The pool does not say why (too many connections, a wrong password, a missing database...).
            reason = probe_connection(dsn) or "the connection pool could not open a connection in time"
            log.warning("database %s is unavailable (%s); retrying in %.0fs", redact(dsn), reason, delay)
            self.stopping.wait(delay)
        raise AssertionError("unreachable")

    def run(self, install_signals: bool = True) -> None:
        """Start, then block until drained or stopped. Check ``fatal`` afterwards: set if the worker
        stopped by itself."""
        if install_signals:
            self.install_signal_handlers()
        if self.start():
            self.wait()

    def install_signal_handlers(self) -> None:
        def handler(signum: int, _frame: FrameType | None) -> None:
            if self.stopping.is_set():
                log.warning("second %s: stopping hard", signal.Signals(signum).name)
                self.stop_hard()
            else:
                log.info("%s: draining", signal.Signals(signum).name)
                self.drain()

        signal.signal(signal.SIGTERM, handler)
        signal.signal(signal.SIGINT, handler)

    def drain(self) -> None:
        """Leave the assignment (heartbeats say draining), stop claiming, finish the batch in flight, release, exit."""
        self.stopping.set()
        for r in self.runners:
            r.draining.set()
        self._wake_all()
        threading.Thread(target=self._drain_deadline, daemon=True).start()

    def _drain_deadline(self) -> None:
        if not self._sinks_done(self.settings.drain_seconds):
            log.warning("drain did not finish within %.0fs: stopping hard", self.settings.drain_seconds)
            self.stop_hard()

    def stop_hard(self) -> None:
        self.stopping.set()
        for r in self.runners:
            r.abort.set()
            r.draining.set()
        self._wake_all()

    # -- health (the metrics server's /healthz and /readyz) ----------------------------------

    def health(self) -> list[str]:
        """Why this relay is not alive and in touch with its database; empty when it is."""
        if self.stopped.is_set():
            return ["stopped"]
        if self._beat_ok_at is None:
            return ["not registered yet (waiting for the database)"]
        silent = time.monotonic() - self._beat_ok_at
        if silent > self.settings.worker_ttl_seconds:
            return [f"no heartbeat reached the database for {silent:.0f}s"]
        return []

    def readiness(self) -> list[str]:
        """Why this relay is not doing its share; empty when it holds every bucket it should and its
        sinks can reach what they deliver to."""
        problems = self.health()
        if self.stopping.is_set():
            problems.append("draining")
        for r in self.runners:
            desired = r.desired
            if desired is None:
                problems.append(f"sink {r.sink.name}: no assignment yet")
                continue
            missing = desired - r.leases.snapshot().keys()
            if missing:
                problems.append(f"sink {r.sink.name}: {len(missing)} of its {len(desired)} buckets not leased yet")
            check: Callable[[], str | None] | None = getattr(r.sink, "problem", None)
            problem = check() if check is not None else None
            if problem:
                problems.append(f"sink {r.sink.name}: {problem}")
        return problems

    def _check_fatal(self) -> None:
        fatal = next((r.fatal for r in self.runners if r.fatal is not None), None)
        if fatal is not None and self.fatal is None:
            # One sink can not go on: stop the whole process (loudly, non-zero exit) rather than run
            # the others with a gap an operator would not notice.
            self.fatal = fatal
            self.drain()

    def _sinks_done(self, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        for t in self._threads:
            if t.name.startswith("sink-"):
                t.join(max(0.0, deadline - time.monotonic()))
                if t.is_alive():
                    return False
        return True

    def wait(self) -> None:
        while not self._sinks_done(0.5):
            self._check_fatal()
        self._check_fatal()
        self.stopped.set()
        self._wake_all()
        try:
            # The membership thread first: a heartbeat of it still in flight would register us again.
            for t in self._threads:
                t.join(5.0)
            self._leave()
        finally:
            for r in self.runners:
                r.sink.close()
            if self.pool is not None:
                self.pool.close()
            for service in self.services:
                service.close()
        log.info("worker %s stopped", self.id)

    # -- threads ---------------------------------------------------------------------------

    def _wake_all(self) -> None:
        for r in self.runners:
            r.park_changed.set()  # a missed notification may have been an operator's (PARKED_NOTICE)
            r.wake.set()

    def _read_everything(self) -> None:
        """Notifications may have been missed (LISTEN connection lost): every runner reads all its buckets."""
        for r in self.runners:
            r.hints.everything()
            r.park_changed.set()  # a missed notification may have been an operator's (PARKED_NOTICE)
            r.wake.set()

    def _wake_owners(self, payload: str) -> None:
        """Wake the runners that hold or want one of the buckets a commit wrote or a relay freed (all,
        if the payload is not a list of buckets). An operator's PARKED_NOTICE also has them look at their park."""
        parked = payload.startswith(PARKED_NOTICE)
        try:
            buckets = [int(b) for b in payload.removeprefix(PARKED_NOTICE).split(",")]
        except ValueError:
            self._read_everything()
            return
        for r in self.runners:
            desired = r.desired  # replaced whole by the membership thread, never mutated
            if r.leases.holds_any(buckets) or (desired is not None and not desired.isdisjoint(buckets)):
                r.hints.add(buckets)
                if parked:
                    r.park_changed.set()
                r.wake.set()

    def _spawn(self, name: str, target: Callable[[], None]) -> None:
        t = threading.Thread(target=target, name=name, daemon=True)
        t.start()
        self._threads.append(t)

    def _membership_loop(self) -> None:
        s = self.settings
        renew_every = s.lease_seconds / 3
        next_renew = time.monotonic() + renew_every
        next_beat = time.monotonic() + s.heartbeat_seconds
        while not self.stopped.is_set():
            # An assignment changed by another relay (NOTIFY) brings the next heartbeat forward.
            if self.membership_changed.wait(min(0.5, renew_every, s.heartbeat_seconds)):
                self.membership_changed.clear()
                next_beat = 0.0
            if self.stopped.is_set():
                break
            now = time.monotonic()
            try:
                if now >= next_renew:
                    next_renew = now + renew_every
                    for r in self.runners:
                        r.renew()
                if now >= next_beat:
                    next_beat = now + s.heartbeat_seconds
                    self._beat()
            except Exception as exc:
                log.warning("membership: %s: %s", type(exc).__name__, redact(str(exc)))

    def _beat(self) -> None:
        """Heartbeat, and follow each sink's assignment: store a new one when its live members changed
        (assignment.py), then hand each runner the buckets it should hold."""
        assert self.pool is not None
        status = "draining" if self.stopping.is_set() else "alive"
        meta = {"version": VERSION, "host": socket.gethostname(), "pid": os.getpid(),
                "listening": self.listening if self.settings.listen else None}
        by_sink = {r.sink.name: r for r in self.runners}
        with self.pool.connection() as conn:
            memberships = store.heartbeat(conn, self.id, status, list(by_sink), meta, self.settings.worker_ttl_seconds)
            self._beat_ok_at = time.monotonic()
            self.first_member = not memberships or any(m.live and min(m.live) == self.id for m in memberships)
            for m in memberships:
                owners = m.owners
                if m.live != m.members:
                    owners = rebalance(m.owners, m.live)
                    if store.reassign(conn, m.sink, m.generation, m.live, owners):
                        log.info("sink %s: members now %s; buckets reassigned", m.sink, m.live)
                    else:  # another relay stored one first: follow it at the next heartbeat
                        self.membership_changed.set()
                        continue
                runner = by_sink[m.sink]
                desired = set() if status != "alive" else buckets_of(owners, self.id)
                if desired != runner.desired:
                    runner.desired = desired
                    runner.wake.set()

    def _leave(self) -> None:
        if self.pool is None:
            return
        try:
            with self.pool.connection(timeout=5.0) as conn:
                store.leave(conn, self.id)
        except Exception as exc:
            log.warning("could not leave the registry (%s); housekeeping will mark this worker dead", exc)

    def _housekeeping_loop(self) -> None:
        """Claim a housekeeping pass every interval if this relay is a sink's first live member. The others
        are standbys: every HOUSEKEEPING_STANDBY intervals they claim a pass if none finished for
        HOUSEKEEPING_STANDBY - 1 intervals (the first member's role may not claim, or it hangs). So one
        claim attempt per interval across the cluster, not one per relay. When the first member dies, the
        next one is first from the heartbeat that no longer counts it live (the same TTL after which a
        pass declares it dead), and claims at once."""
        assert self.pool is not None
        hk = Housekeeping(self.pool, self.settings)
        interval = self.settings.housekeeping_seconds
        last_try = time.monotonic()
        while not self.stopping.wait(interval * (0.75 + 0.5 * (time.monotonic() % 1))):
            first = self.first_member
            if not first and time.monotonic() - last_try < HOUSEKEEPING_STANDBY * interval:
                continue
            last_try = time.monotonic()
            try:
                # The first member's own timer paces its passes (an interval, jittered); the gap only keeps
                # two relays that both think they are first (a moment of changing members) from doubling up.
                result = hk.run_once(min_gap_seconds=interval / 2 if first else (HOUSEKEEPING_STANDBY - 1) * interval)
                if result.ran:
                    self.observer.housekeeping(seconds=result.seconds, dead_workers=result.dead_workers,
                                               expired_leases=result.expired_leases,
                                               deleted_events=result.deleted_events)
                if result.expired_leases or result.dead_workers:
                    self._wake_all()
            except Exception as exc:
                log.warning("housekeeping: %s: %s", type(exc).__name__, redact(str(exc)))

    def _listen_loop(self) -> None:
        dsn = self.settings.dsn.get_secret_value()
        failures = 0
        while not self.stopped.is_set():
            try:
                with psycopg.connect(dsn, autocommit=True, application_name=application_name(self.id)) as conn:
                    conn.execute(f"LISTEN {NOTIFY_CHANNEL}")
                    conn.execute(f"LISTEN {MEMBERSHIP_CHANNEL}")
                    self.listening = True
                    failures = 0
                    self._read_everything()  # notifications may have been missed while disconnected
                    self.membership_changed.set()
                    while not self.stopped.is_set():
                        for note in conn.notifies(timeout=1.0, stop_after=1):
                            if note.channel == MEMBERSHIP_CHANNEL:
                                self.membership_changed.set()
                            else:
                                self._wake_owners(note.payload)
            except Exception as exc:
                self.listening = False
                if self.stopped.is_set():
                    return
                failures += 1
                delay = RECONNECT.delay(failures)
                log.warning("listener: %s: %s; polling until it reconnects (in %.0fs)", type(exc).__name__,
                            redact(str(exc)), delay)
                self.stopped.wait(delay)

