"""A relay process: registry heartbeat and stored assignment, one thread per sink, housekeeping, LISTEN.

Threads and who owns what:
- membership: heartbeat, each sink's stored assignment (a new one when its live members changed)
  -> each runner's ``desired`` buckets, lease renewal.
- one SinkRunner per sink: acquires/releases its own leases, delivers, checkpoints.
- housekeeping: every few seconds, a pass if it claims this interval's (outbox.housekeeping).
- listener: LISTEN outbox_events_v2 and outbox_membership_v1; wakes the runners that hold or want
  the notified buckets, with hints (polling stays the baseline). On one relay per deployment it also
  watches for commits and sends those notifications (wakeups.py).
First SIGTERM/SIGINT drains (leave the assignment, stop claiming, finish the batch, release,
exit); a second one, or ``drain_seconds`` passing, stops hard (drop the batch in flight; the next
owner redelivers). A sink thread that has not returned ``HARD_STOP_SECONDS`` after the hard stop is
left behind: what can be released is, and the process exits with ``EXIT_HARD_STOP``.
"""

from __future__ import annotations

import functools
import itertools
import logging
import os
import signal
import socket
import threading
import time
import uuid
from collections.abc import Callable
from types import FrameType
from typing import Protocol

import psycopg
from psycopg_pool import ConnectionPool, PoolTimeout

from . import __version__, store
from .assignment import buckets_of, rebalance
from .backoff import Backoff
from .dsn import connection_problem, probe_connection, redact
from .errors import ConfigurationError, OutboxError, WorkerIdInUse
from .horizon import HorizonWatch
from .hosts import pid_alive
from .housekeeping import Housekeeping, application_name
from .migrate import check_schema, latest_version
from .observer import NULL_OBSERVER, Observer, guarded
from .relay import PARKED_NOTICE, DeliveryGate, SinkRunner
from .settings import RelaySettings
from .sinks.engine import Sink
from .store import Conn
from .wakeups import MEMBERSHIP_CHANNEL, NOTIFY_CHANNEL, CommitWatcher

log = logging.getLogger("outbox_relay.worker")


class Service(Protocol):
    """Something that lives as long as a worker (the metrics server)."""

    def start(self) -> None: ...

    def close(self) -> None: ...

RECONNECT = Backoff(1.0, 30.0)  # waiting for the database: to start, and to listen again
HOUSEKEEPING_STANDBY = 6  # intervals between claim attempts of a relay that is no sink's first live member
# After a hard stop (second signal, or the drain deadline), how long the sink threads get to return
# before the process exits without them (a sink blocked in a call that never returns).
HARD_STOP_SECONDS = 5.0
EXIT_HARD_STOP = 5  # `outbox-relay run`'s exit status when it had to leave a blocked sink thread behind


# Worker ids registered by the workers of this process ((dsn, id) -> instance), so that a second Worker
# given the same id for the same database (two ``Relay`` objects left with the default, per-process id)
# is refused at its start instead of being taken for a previous run of this process and taking the
# registration over.
_ids_lock = threading.Lock()
_ids_in_process: dict[tuple[str, str], str] = {}


# A membership loop that comes round this much later than it should (and later than a renewal is due)
# says so: the leases it renews may have run out meanwhile, and the takeover that follows is explained.
PROCESS_STALL_SECONDS = 2.0


def _ignore(_signum: int, _frame: FrameType | None) -> None:
    """The Python-level handler of SIGTERM/SIGINT: nothing (``Worker.install_signal_handlers``)."""


def _configure(conn: Conn) -> None:
    # Postgres' default, whatever the role or database says: once psycopg prepares a statement (its
    # 5th execution), Postgres may plan it once for all values. Planning was about 1 ms of each 1.5 ms
    # read and a large share of each checkpoint; with cached plans commit -> ack p99 at 1k ev/s went
    # from 16 to 12 ms (1 relay) and 49 to 21 ms (4 relays). A generic plan of a bucket-filtered
    # statement can be the GUIDE's trap (section 4): tests/integration/test_relay_plan.py pins the
    # generic plans of the read and of retention to the same index walks as the custom ones.
    conn.execute("SET plan_cache_mode = auto")



@functools.cache
def _schema_version() -> int:
    """The schema version this code was written for (the newest shipped migration)."""
    return latest_version()

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
        # The observer as the engine calls it (a hook that raises is logged, the work goes on), made at start:
        # `run` may be handed another observer before (cli/relays.py adds one).
        self._observing: Observer = guarded(observer)
        self.runners: list[SinkRunner] = []
        self.pool: ConnectionPool[Conn] | None = None
        self._threads: list[threading.Thread] = []
        self.fatal: OutboxError | None = None  # why the worker stopped by itself (a sink was dropped)
        # Written by the listener thread, read by heartbeats: `status` shows relays that only poll.
        self.listening = False
        self.watching = False  # ... and whether this relay is the one watching for commits (wakeups.py)
        self.membership_changed = threading.Event()  # another relay stored a new assignment
        # Set by a heartbeat that stored an assignment without a relay that went silent (or left): the
        # housekeeping thread runs a pass at once, so its leases are freed now, not up to an interval later.
        self.member_lost = threading.Event()
        self.services: list[Service] = []  # started with the worker, closed after it (metrics server)
        self._beat_ok_at: float | None = None  # monotonic time of the last heartbeat that reached the database
        # Whether this relay comes first among the live members of one of its sinks (heartbeat): that relay
        # tries to claim every housekeeping pass, the others only now and then (HOUSEKEEPING_STANDBY).
        self.first_member = True
        # This process's registration under self.id (workers.metadata): a second relay given the same
        # --worker-id is told apart from this one, and from a previous run of this one (_claim_id).
        self.instance = uuid.uuid4().hex
        # Membership thread: since when its heartbeats have reached the database without a failure in between.
        self._reachable_since: float | None = None
        self.horizon = HorizonWatch()  # membership thread: whether cursor writes are worth deferring now
        self._hard_deadline: float | None = None  # set by the hard stop: the sink threads' last moment
        self._owns_process = False  # run() installed the signal handlers: it may end the process (EXIT_HARD_STOP)
        self._signal_sockets: tuple[socket.socket, socket.socket] | None = None

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
        self.pool = self._open_pool(dsn, max_size=max(1, len(sinks)))
        try:
            if self.pool is None or not self._register(sinks):
                return False
        except ConfigurationError:  # refused before anything started (an id in use): nothing of this relay stays
            if self.pool is not None:
                self.pool.close()
            for service in self.services:
                service.close()
            self._forget_id()
            raise
        # One per process: crash-loop probes run alone across all sinks; a batch in longer than the handler
        # time limit (a stuck sink) stops counting, so it holds no other sink back.
        gate = DeliveryGate(stale_seconds=s.handler_timeout_seconds)
        observer = self._observing = guarded(self.observer)
        self.runners = [SinkRunner(sink, self.pool, s, gate=gate) for sink in sinks]
        for runner in self.runners:
            runner.listening = lambda: self.listening
            runner.reachable_since = lambda: self._reachable_since
            runner.defer_writes = self.horizon.held
            runner.observer = observer
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
                        wanted = getattr(sink, "event_filter", None)
                        store.register_sink(conn, sink.name, sink.kind, wanted.topics if wanted is not None else None)
                    self._claim_id(conn, [sink.name for sink in sinks])
                return True
            except (psycopg.OperationalError, PoolTimeout) as exc:
                delay = RECONNECT.delay(attempt)
                log.warning("starting: %s; retrying in %.0fs", connection_problem(exc), delay)
            if self.stopping.wait(delay):
                return False
        raise AssertionError("unreachable")

    def _metadata(self) -> dict[str, object]:
        """What a heartbeat records: who this relay process is, and the TTL the others judge it by."""
        # schema_version: the schema this code was written for (partition_hold_v1 keeps what older relays need).
        return {"version": __version__, "schema_version": _schema_version(), "host": socket.gethostname(),
                "pid": os.getpid(), "instance": self.instance,
                "ttl_seconds": self.settings.worker_ttl_seconds,
                "listening": self.listening if self.settings.listen else None, "watching": self.watching}

    def _claim_id(self, conn: Conn, sinks: list[str]) -> None:
        """Register under self.id, or raise WorkerIdInUse: another relay process holds it with a fresh
        heartbeat. A registration on this host whose pid is gone, or is this process's own pid (a
        container's pid 1), is a previous run's (a crash, a restart): taken over at once."""
        ttl = self.settings.worker_ttl_seconds
        with _ids_lock:
            if _ids_in_process.setdefault(self._id_key(), self.instance) != self.instance:
                raise ConfigurationError(f"worker id {self.id!r} is used by another Relay in this process: give each "
                                         "relay member its own worker_id (RelaySettings(worker_id=...))")
        try:
            store.heartbeat(conn, self.id, "alive", sinks, self._metadata(), ttl)
            return
        except WorkerIdInUse as exc:
            if exc.host != socket.gethostname() or (exc.pid is not None and exc.pid != os.getpid()
                                                    and pid_alive(exc.pid)):
                store.record_clash(conn, self.id, socket.gethostname(), os.getpid())
                raise
            log.warning("worker id %s: taking over the registration of a previous run on this host (pid %s, "
                        "heard from %.1fs ago)", self.id, exc.pid, exc.seen_seconds_ago)
        store.heartbeat(conn, self.id, "alive", sinks, self._metadata(), ttl, take_over=True)

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
            self._owns_process = True
        if self.start():
            self.wait()

    def install_signal_handlers(self) -> None:
        """SIGTERM/SIGINT: the first drains, the second stops hard (main thread only).

        The Python handlers do nothing: one runs on the main thread between two bytecodes, possibly
        inside a lock the main thread holds (``Event.set`` in the first signal's own handling), and
        taking that lock again deadlocks: a second signal 1 ms after the first hung the relay for good.
        The C handler writes each signal's number to a socket (``signal.set_wakeup_fd``); the
        ``signals`` thread reads it and acts."""
        reader, writer = socket.socketpair()
        writer.setblocking(False)
        signal.set_wakeup_fd(writer.fileno())
        self._signal_sockets = (reader, writer)  # open for the life of the process
        for signum in (signal.SIGTERM, signal.SIGINT):
            signal.signal(signum, _ignore)
        threading.Thread(target=self._signal_loop, args=(reader,), name="signals", daemon=True).start()

    def _signal_loop(self, reader: socket.socket) -> None:
        while data := reader.recv(64):
            for signum in data:
                if signum not in (signal.SIGTERM, signal.SIGINT):
                    continue
                if self.stopping.is_set():
                    log.warning("second %s: stopping hard", signal.Signals(signum).name)
                    self.stop_hard()
                else:
                    log.info("%s: draining", signal.Signals(signum).name)
                    self.drain()

    def drain(self) -> None:
        """Leave the assignment (heartbeats say draining), stop claiming, finish the batch in flight, release, exit."""
        self.stopping.set()
        self.member_lost.set()  # wakes the housekeeping thread, which then ends
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
        for t in self._threads:
            if t.name.startswith("sink-"):
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
        blocked = [r for r, t in zip(self.runners, self._sink_threads(), strict=True) if t.is_alive()]
        try:
            # The membership thread first: a heartbeat of it still in flight would register us again.
            for t in self._threads:
                if not t.name.startswith("sink-"):
                    t.join(5.0)
            for r in blocked:
                self._release_blocked(r)
            self._leave()
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

    def _sink_threads(self) -> list[threading.Thread]:
        return [t for t in self._threads if t.name.startswith("sink-")]

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
        tick = min(0.5, renew_every, s.heartbeat_seconds)
        last = time.monotonic()
        while not self.stopped.is_set():
            # An assignment changed by another relay (NOTIFY) brings the next heartbeat forward.
            if self.membership_changed.wait(tick):
                self.membership_changed.clear()
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
                    self._beat()
                    if self._reachable_since is None:
                        self._reachable_since = now
            except Exception as exc:
                self._reachable_since = None
                log.warning("membership: %s: %s", type(exc).__name__, redact(str(exc)))

    def _beat(self) -> None:
        """Heartbeat, and follow each sink's assignment: store a new one when its live members changed
        (assignment.py), then hand each runner the buckets it should hold."""
        assert self.pool is not None
        status = "draining" if self.stopping.is_set() else "alive"
        meta = self._metadata()
        by_sink = {r.sink.name: r for r in self.runners if r.stuck() is None}  # a stuck runner leaves its sink
        with self.pool.connection() as conn:
            try:
                memberships = store.heartbeat(conn, self.id, status, list(by_sink), meta,
                                              self.settings.worker_ttl_seconds)
            except WorkerIdInUse as exc:  # another relay took the id while this one's heartbeats lapsed
                self._lost_id(exc)
                return
            self._beat_ok_at = time.monotonic()
            self.first_member = not memberships or any(m.live and min(m.live) == self.id for m in memberships)
            for m in memberships:
                owners = m.owners
                if m.live != m.members:
                    owners = rebalance(m.owners, m.live)
                    if store.reassign(conn, m.sink, m.generation, m.live, owners):
                        log.info("sink %s: members now %s; buckets reassigned", m.sink, m.live)
                        if set(m.members) - set(m.live):
                            self.member_lost.set()  # a housekeeping pass now frees the leases of the silent one
                    else:  # another relay stored one first: follow it at the next heartbeat
                        self.membership_changed.set()
                        continue
                runner = by_sink[m.sink]
                desired = set() if status != "alive" else buckets_of(owners, self.id)
                if desired != runner.desired:
                    runner.desired = desired
                    runner.wake.set()
            if self.settings.cursor_flush_seconds > 0 and self.horizon.observe(*store.vacuum_horizon(conn)):
                for r in self.runners:  # owed cursor writes go now, or the next batches defer theirs
                    r.wake.set()

    def _lost_id(self, exc: WorkerIdInUse) -> None:
        if self.fatal is None:
            log.error("%s; this relay stops (its leases are fenced out already)", exc)
            self.fatal = exc
            self.drain()

    def _id_key(self) -> tuple[str, str]:
        return self.settings.dsn.get_secret_value(), self.id

    def _forget_id(self) -> None:
        with _ids_lock:
            if _ids_in_process.get(self._id_key()) == self.instance:
                del _ids_in_process[self._id_key()]

    def _leave(self) -> None:
        self._forget_id()
        if self.pool is None:
            return
        try:
            with self.pool.connection(timeout=5.0) as conn:
                store.leave(conn, self.id, self.instance)
        except Exception as exc:
            log.warning("could not leave the registry (%s); housekeeping will mark this worker dead", exc)

    def _housekeeping_loop(self) -> None:
        """Claim a housekeeping pass every interval if this relay is a sink's first live member. The others
        are standbys: every HOUSEKEEPING_STANDBY intervals they claim a pass if none finished for
        HOUSEKEEPING_STANDBY - 1 intervals (the first member's role may not claim, or it hangs). So one
        claim attempt per interval across the cluster, not one per relay. When the first member dies, the
        next one is first from the heartbeat that no longer counts it live (the same TTL after which a
        pass declares it dead), and claims at once. A heartbeat that stored an assignment without a silent
        relay (``member_lost``) has this relay claim a pass at once: a killed relay's buckets move about
        --worker-ttl-seconds after its last heartbeat, not up to one more housekeeping interval later."""
        assert self.pool is not None
        hk = Housekeeping(self.pool, self.settings)
        interval = self.settings.housekeeping_seconds
        last_try = time.monotonic()
        while not self.stopping.is_set():
            lost = self.member_lost.wait(interval * (0.75 + 0.5 * (time.monotonic() % 1)))
            if self.stopping.is_set():
                break
            self.member_lost.clear()
            first = self.first_member or lost
            if not first and time.monotonic() - last_try < HOUSEKEEPING_STANDBY * interval:
                continue
            last_try = time.monotonic()
            try:
                # The first member's own timer paces its passes (an interval, jittered); the gap only keeps
                # two relays that both think they are first (a moment of changing members) from doubling up.
                gap = 0.0 if lost else interval / 2 if first else (HOUSEKEEPING_STANDBY - 1) * interval
                result = hk.run_once(min_gap_seconds=gap)
                if result.ran:
                    self._observing.housekeeping(seconds=result.seconds, dead_workers=result.dead_workers,
                                                 expired_leases=result.expired_leases,
                                                 deleted_events=result.deleted_events)
                if result.expired_leases or result.dead_workers:
                    self._wake_all()
            except Exception as exc:
                log.warning("housekeeping: %s: %s", type(exc).__name__, redact(str(exc)))

    def _lead(self, watcher: CommitWatcher) -> bool:
        try:
            return watcher.lead(self.first_member)
        except psycopg.Error as exc:
            if watcher.conn.broken or watcher.conn.closed:
                raise
            watcher.failed(exc)  # e.g. no EXECUTE on the watch function: listening goes on
            return False

    def _listen_loop(self) -> None:
        """LISTEN for wake-ups; on the relay that watches for commits (wakeups.py), also watch."""
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
                    watcher = CommitWatcher(conn, self.settings.watch_interval_ms, self.settings.watch_max_interval_ms)
                    own_pid = conn.info.backend_pid
                    while not self.stopped.is_set():
                        if self.stopping.is_set():
                            watcher.step_down()  # a draining relay hands watching over
                        if not self.stopping.is_set() and self._lead(watcher):
                            self.watching = True
                            try:
                                buckets = watcher.watch()
                            except psycopg.Error as exc:
                                if conn.broken or conn.closed:
                                    raise
                                watcher.failed(exc)  # e.g. cancelled: listening goes on
                                buckets = None
                            if buckets is not None:
                                self._wake_owners(buckets)
                            notes = conn.notifies(timeout=0)  # those that arrived meanwhile
                        else:
                            self.watching = False
                            notes = conn.notifies(timeout=1.0, stop_after=1)
                        for note in notes:
                            if note.channel == MEMBERSHIP_CHANNEL:
                                self.membership_changed.set()
                            elif note.pid != own_pid:  # our own watch's buckets were handled above
                                self._wake_owners(note.payload)
            except Exception as exc:
                self.listening = False
                self.watching = False
                if self.stopped.is_set():
                    return
                failures += 1
                delay = RECONNECT.delay(failures)
                log.warning("listener: %s: %s; polling until it reconnects (in %.0fs)", type(exc).__name__,
                            redact(str(exc)), delay)
                self.stopped.wait(delay)
