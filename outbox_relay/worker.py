"""A relay process: registry heartbeat and stored assignment, one thread per sink, housekeeping, LISTEN.

Threads and who owns what (each service in its own file under services/, started and stopped here):
- membership (services/membership.py): heartbeat, each sink's stored assignment (a new one when its
  live members changed) -> each runner's ``desired`` buckets, lease renewal.
- one SinkRunner per sink (relay.py): acquires/releases its own leases, delivers, checkpoints.
- housekeeping (services/housekeeper.py): every few seconds, a pass if it claims this interval's
  (outbox.housekeeping).
- listener (services/listener.py): LISTEN outbox_events_v2 and outbox_membership_v1; wakes the runners
  that hold or want the notified buckets, with hints (polling stays the baseline). On one relay per
  deployment it also watches for commits and sends those notifications (wakeups.py).
- signals (services/signals.py), for ``run``: SIGTERM/SIGINT.
First SIGTERM/SIGINT drains (leave the assignment, stop claiming, finish the batch, release,
exit); a second one, or ``drain_seconds`` passing, stops hard (drop the batch in flight; the next
owner redelivers). A sink thread that has not returned ``HARD_STOP_SECONDS`` after the hard stop is
left behind: what can be released is, and the process exits with ``EXIT_HARD_STOP``.
"""

from __future__ import annotations

import itertools
import logging
import os
import threading
import time
from collections.abc import Callable
from typing import Protocol

import psycopg
from psycopg_pool import ConnectionPool, PoolTimeout

from . import store
from .dsn import connection_problem, redact
from .errors import ConfigurationError, OutboxError, WorkerIdInUse
from .horizon import HorizonWatch
from .migrate import check_schema
from .observer import NULL_OBSERVER, Observer, guarded
from .relay import DeliveryGate, SinkRunner
from .services.housekeeper import Housekeeper
from .services.listener import Listener
from .services.membership import Membership
from .services.pool import RECONNECT, open_pool
from .services.registration import Registration
from .services.signals import SignalWatch
from .services.thread import ServiceThread
from .services.wake import wake_all
from .settings import RelaySettings
from .sinks.engine import Sink
from .store import Conn

log = logging.getLogger("outbox_relay.worker")


class Service(Protocol):
    """Something that lives as long as a worker (the metrics server)."""

    def start(self) -> None: ...

    def close(self) -> None: ...

# After a hard stop (second signal, or the drain deadline), how long the sink threads get to return
# before the process exits without them (a sink blocked in a call that never returns).
HARD_STOP_SECONDS = 5.0
EXIT_HARD_STOP = 5  # `outbox-relay run`'s exit status when it had to leave a blocked sink thread behind


class Worker:
    """One relay process's engine around the sinks it is given (compose.build_worker makes them from
    settings): it opens the pool, registers, and composes the runners with the services (services/)."""

    def __init__(self, settings: RelaySettings, sinks: list[Sink], observer: Observer = NULL_OBSERVER) -> None:
        self.settings = settings
        self.id = settings.worker_id
        self.stopping = threading.Event()  # drain requested
        self.stopped = threading.Event()  # all threads should exit now
        self._sinks = sinks
        self.observer = observer
        self.runners: list[SinkRunner] = []
        self.pool: ConnectionPool[Conn] | None = None
        self._sink_threads: list[threading.Thread] = []
        self.fatal: OutboxError | None = None  # why the worker stopped by itself (a sink was dropped)
        self.services: list[Service] = []  # started with the worker, closed after it (metrics server)
        self.registration = Registration(settings)
        # Made by start once the pool is open; membership first (see wait), the listener with --listen.
        self.membership: Membership | None = None
        self.housekeeper: Housekeeper | None = None
        self.listener: Listener | None = None
        self._hard_deadline: float | None = None  # set by the hard stop: the sink threads' last moment
        self._owns_process = False  # run() installed the signal handlers: it may end the process (EXIT_HARD_STOP)

    @property
    def instance(self) -> str:
        return self.registration.instance

    @property
    def listening(self) -> bool:
        """Whether this relay's LISTEN connection is up (the runners poll less often then)."""
        return self.listener is not None and self.listener.listening

    @property
    def watching(self) -> bool:
        """Whether this relay is the one watching for commits (wakeups.py)."""
        return self.listener is not None and self.listener.watching

    @property
    def horizon(self) -> HorizonWatch:
        """Whether cursor writes are worth deferring now (observed by the membership service)."""
        if self.membership is None:
            raise RuntimeError("the worker has not started")
        return self.membership.horizon

    def _threads(self) -> list[ServiceThread]:
        return [t for t in (self.membership, self.housekeeper, self.listener) if t is not None]

    # -- lifecycle -------------------------------------------------------------------------

    def start(self) -> bool:
        """Connect, register and start the threads. False if asked to stop before the database came up."""
        s = self.settings
        dsn = s.dsn.get_secret_value()
        sinks = self._sinks
        if not sinks:
            raise ConfigurationError("no sink to run: enable --kafka, name a --projection or a --sink")
        for service in self.services:  # first: a health endpoint answers (503) while the database is away
            service.start()
        # One connection for the runners' reads and checkpoints, heartbeats and housekeeping, which each
        # hold it for one statement (a Kafka sink not while it waits for acks; a projection applies its
        # batch on a connection of its own); one more per further sink. Plus the LISTEN connection.
        self.pool = open_pool(dsn, max(1, len(sinks)), self.id, self.stopping)
        try:
            if self.pool is None or not self._register(sinks):
                return False
        except ConfigurationError:  # refused before anything started (an id in use): nothing of this relay stays
            if self.pool is not None:
                self.pool.close()
            for service in self.services:
                service.close()
            self.registration.forget()
            raise
        # One per process: crash-loop probes run alone across all sinks; a batch in longer than the handler
        # time limit (a stuck sink) stops counting, so it holds no other sink back.
        gate = DeliveryGate(stale_seconds=s.handler_timeout_seconds)
        observer = guarded(self.observer)  # a hook that raises is logged, the work goes on
        self.runners = [SinkRunner(sink, self.pool, s, gate=gate) for sink in sinks]
        membership = self.membership = Membership(
            self.pool, s, self.runners, draining=self.stopping, metadata=self._metadata,
            member_lost=self._member_lost, id_lost=self._lost_id)
        if s.listen:
            self.listener = Listener(s, self.runners, draining=self.stopping,
                                     first_member=lambda: membership.first_member,
                                     membership_changed=membership.changed.set)
        self.housekeeper = Housekeeper(self.pool, s, observer, first_member=lambda: membership.first_member,
                                       recovered=self._wake_all)
        if self.stopping.is_set():  # a drain that came before the housekeeper and the runners existed
            self.housekeeper.stop()
            for runner in self.runners:
                runner.draining.set()
                if self._hard_deadline is not None:  # a hard stop, not a drain
                    runner.abort.set()
        for runner in self.runners:
            runner.listening = lambda: self.listening
            runner.reachable_since = lambda: membership.reachable_since
            runner.defer_writes = membership.horizon.held
            runner.observer = observer
        for thread in self._threads():
            thread.start()  # membership first: its first heartbeat hands the runners their buckets
        for runner in self.runners:
            t = threading.Thread(target=runner.run, name=f"sink-{runner.sink.name}", daemon=True)
            t.start()
            self._sink_threads.append(t)
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
                        wanted = getattr(sink, "event_filter", None)
                        store.register_sink(conn, sink.name, sink.kind, wanted.topics if wanted is not None else None)
                    self.registration.claim(conn, [sink.name for sink in sinks], self._metadata())
                return True
            except (psycopg.OperationalError, PoolTimeout) as exc:
                delay = RECONNECT.delay(attempt)
                log.warning("starting: %s; retrying in %.0fs", connection_problem(exc), delay)
            if self.stopping.wait(delay):
                return False
        raise AssertionError("unreachable")

    def _metadata(self) -> dict[str, object]:
        return self.registration.metadata(self.listening if self.settings.listen else None, self.watching)

    def _member_lost(self) -> None:
        if self.housekeeper is not None:
            self.housekeeper.run_now()

    def _lost_id(self, exc: WorkerIdInUse) -> None:
        if self.fatal is None:
            log.error("%s; this relay stops (its leases are fenced out already)", exc)
            self.fatal = exc
            self.drain()

    def run(self, install_signals: bool = True) -> None:
        """Start, then block until drained or stopped. Check ``fatal`` afterwards: set if the worker
        stopped by itself."""
        if install_signals:
            self.install_signal_handlers()
            self._owns_process = True
        if self.start():
            self.wait()

    def install_signal_handlers(self) -> None:
        """SIGTERM/SIGINT: the first drains, the second stops hard (main thread only; services/signals.py)."""
        SignalWatch(self.stopping, self.drain, self.stop_hard).install()

    def drain(self) -> None:
        """Leave the assignment (heartbeats say draining), stop claiming, finish the batch in flight, release, exit."""
        self.stopping.set()
        if self.housekeeper is not None:
            self.housekeeper.stop()
        for r in self.runners:
            r.draining.set()
        self._wake_all()
        threading.Thread(target=self._drain_deadline, daemon=True).start()

    def _drain_deadline(self) -> None:
        if not self.sinks_done(self.settings.drain_seconds):
            log.warning("drain did not finish within %.0fs: stopping hard", self.settings.drain_seconds)
            self.stop_hard()

    def stop_hard(self) -> None:
        if self._hard_deadline is None:
            self._hard_deadline = time.monotonic() + HARD_STOP_SECONDS
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
        beat_ok_at = self.membership.beat_ok_at if self.membership is not None else None
        if beat_ok_at is None:
            return ["not registered yet (waiting for the database)"]
        silent = time.monotonic() - beat_ok_at
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
            stuck = r.stuck()
            if stuck:
                problems.append(f"sink {r.sink.name}: stuck: {stuck}; its buckets were given up")
            elif missing:
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

    def sinks_done(self, timeout: float) -> bool:
        """Wait up to ``timeout`` seconds for the sink threads to end (after ``drain``: once they finished
        their batches); whether they did. A rebuild's switch-over lets its relay phase's last batch land."""
        deadline = time.monotonic() + timeout
        for t in self._sink_threads:
            t.join(max(0.0, deadline - time.monotonic()))
            if t.is_alive():
                return False
        return True

    def wait(self) -> None:
        while not self.sinks_done(0.5):
            self._check_fatal()
            if self._hard_deadline is not None and time.monotonic() >= self._hard_deadline:
                break
        self._check_fatal()
        self.stopped.set()
        self._wake_all()
        blocked = [r for r, t in zip(self.runners, self._sink_threads, strict=True) if t.is_alive()]
        try:
            threads = self._threads()
            for thread in threads:
                thread.stop()
            # The membership thread first: a heartbeat of it still in flight would register us again.
            for thread in threads:
                thread.join(5.0)
            for r in blocked:
                self._release_blocked(r)
            self.registration.leave(self.pool)
        finally:
            for r in self.runners:
                if r not in blocked:  # a blocked sink's close could block too
                    r.sink.close()
            if self.pool is not None:
                self.pool.close(timeout=1.0 if blocked else 5.0)
            for service in self.services:
                service.close()
        if blocked:
            names = ", ".join(r.sink.name for r in blocked)
            log.error("worker %s stopped hard with sink %s still blocked %.0fs after the hard stop", self.id, names,
                      HARD_STOP_SECONDS)
            if self._owns_process:  # a thread can not be killed: end the process (exit status EXIT_HARD_STOP)
                for handler in logging.getLogger().handlers:
                    handler.flush()
                os._exit(EXIT_HARD_STOP)
            return
        log.info("worker %s stopped", self.id)

    def _wake_all(self) -> None:
        wake_all(self.runners)

    def _release_blocked(self, runner: SinkRunner) -> None:
        """Release the leases of a runner whose thread is blocked, so that the next owners need not wait for
        them to expire; fenced, so whatever the thread still does lands nowhere."""
        fences = runner.leases.snapshot()
        if not fences or self.pool is None:
            return
        try:
            with self.pool.connection(timeout=2.0) as conn:
                store.announce_buckets(conn, store.release_leases(conn, runner.sink.name, self.id, fences))
            runner.leases.drop(fences.keys(), fences)
        except Exception as exc:
            log.warning("sink %s: could not release the leases of its blocked runner (%s); they will expire",
                        runner.sink.name, redact(str(exc)))

