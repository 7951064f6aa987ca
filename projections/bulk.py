"""The bulk phase of a rebuild: stored history read in large sequential slices, before the relay phase.

A fresh rebuild's sink has the same cursor in every bucket (the start of history, or a position).
The phase is split into LANES lanes, contiguous ranges of buckets; a key lives in one bucket and a
bucket in one lane, so lanes are independent and several processes (``outbox-relay rebuild NAME``
started N times, on one host or several) run them at once, one lane per process at a time; one process
alone runs them one after another. A lane pins a snapshot ``S`` and reads the delta of its buckets from
their cursor to ``S`` in (xid, seq) order, in slices of ``slice_size`` events (``bulk_read``: an index
range scan per xid partition, the other lanes' rows filtered out, no per-bucket probes). Each slice is
one transaction on the connection that holds the lane's lock: the projection's walk (walk.py, the
relay's own, so batched handlers get the slice in one call and per-event handlers one call each), the
rebuild's guard against writes outside the shadow schema (once per slice), and the checkpoint: the
lane's buckets' cursors become ``Cursor(seen, S, last)`` (positions.py: what a relay reading that delta
in pages would have written). The lane's last slice moves them to ``Cursor(S)`` and bumps their fences,
which ends the lane. A process starts the relay phase (an ordinary Worker) only once every lane has
ended, whoever ran it; the relay phase then reads what committed after each lane's ``S`` (transactions
open at it included) and never sees the cursors it would take over change under it.

Exclusive: a session advisory lock per lane, held while a process runs it (a process skips lanes
others hold and waits for them at the end; if their process dies, the lock goes with its session and a
waiting process, or a rerun, resumes the lane from its last slice), and each slice's checkpoint is a
compare-and-set on the lane's cursors (fence 0, no owner, where the last slice left them, the same
rebuild): a process that lost the lane, or whose rebuild was cancelled or restarted, changes nothing and
rolls its slice back (G5).

An optimisation of the happy path only: any failure in a slice (a handler raising, an event that
can not be prepared, a handler that does not return within the time limit) rolls that slice back
and ends that lane where its last slice left its cursors; the relay phase takes over its buckets from
there with its retries, parking, dead letters and handler time limit. The other lanes go on in the bulk
phase: their buckets hold other keys, which the failure does not concern, and the relay phase starts
after them anyway. Async projections skip the phase, and so do rebuilds --from-time (their buckets start
at different places).
"""

from __future__ import annotations

import gc
import logging
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import psycopg

from outbox_relay.backoff import Backoff
from outbox_relay.dsn import describe_error
from outbox_relay.positions import Cursor, Snapshot
from outbox_relay.sinks.engine import Aborted
from outbox_relay.sqlfiles import query
from outbox_relay.store import event_reader

from .declare import Projection, describe
from .decoding import decode_headers, decode_json
from .drive import drive
from .event import ProjectionEvent, make_event, make_token
from .guard import Abandoned, Guard, TimedOut, Walk
from .live_decisions import live_decisions
from .sink import END_WALK_WAIT_MS, outside_writes_error
from .walk import Batch, Delivered, Redo, walk

log = logging.getLogger("outbox_relay.rebuild")

BUCKETS = 256
FENCES = dict.fromkeys(range(BUCKETS), 0)  # the phase's fence in every bucket: tokens (0, 0, xid, seq)
# Lanes of the phase: up to this many processes run it at once. A lane's read walks the whole xid range and
# drops the other lanes' rows, so one process running every lane reads history LANES times over (measured:
# bench/results/2026-11-26-rebuild-lanes.md).
LANES = 4
LOCK_POLL_SECONDS = 0.5
# A lost server (a restart, a failover): the phase reconnects after RECONNECT's delays for up to
# RECONNECT_SECONDS from the first failure with no slice landed since, then leaves the rest of history to
# the relay phase, which has its own retries and is several times slower.
RECONNECT = Backoff(0.2, 2.0)
RECONNECT_SECONDS = 60.0
READ_WAIT_STEP_SECONDS = 0.25  # how often a wait for a slice's read looks at the stop flag
COLLECT_EVERY = 16  # slices between runs of the cyclic collector (off otherwise while the phase runs)
# bulk_read's columns, in order (handed_over unpacks them by position).
READ_COLUMNS = ("bucket", "xid", "seq", "id", "partition_key", "topic", "type", "payload", "headers", "time",
                "version")


def lane_buckets(lane: int) -> tuple[int, int]:
    """The buckets of a lane: lo <= bucket < hi, a contiguous range."""
    return lane * BUCKETS // LANES, (lane + 1) * BUCKETS // LANES


class SliceFailed(Exception):
    """A slice did not land (rolled back): the relay phase takes over from the last one that did. Its
    message says why as an operator reads it (a handler's error as ``KeyError: 'customer'``)."""


class Lost(Exception):
    """The checkpoint's compare-and-set matched nothing: another process moved the cursors, or the
    rebuild was cancelled or restarted; the slice rolled back."""


@dataclass(frozen=True)
class Outcome:
    result: str  # "done" (over: relay phase next), "stopped" (resumable) or "skipped" (not eligible)
    events: int  # events this process applied in the phase
    # Every lane is over and none this process ran was handed over or lost: what is left (if anything) most
    # likely committed after the lanes' snapshots (the rebuild counts it before it switches over without a
    # relay phase).
    finished: bool = False


def handed_over(projection: Projection, rows: Sequence[Sequence[Any]]) -> list[ProjectionEvent[Any]] | None:
    """The events a handler gets for a slice's rows (bulk_read's columns), as ``Projection.prepare`` makes
    them in the bulk phase (fence 0, read 0, first attempt, a replay), built straight from the rows: no
    StoredEvent in between. None if any row is not plainly handed over (a type the projection does not
    take, a payload or headers that do not decode, an upcaster or a model that refuses it): then the slice
    takes the general path (StoredEvents and ``prepare``), which decides what becomes of such an event.
    tests/unit/test_bulk_rows.py checks both paths give the same events."""
    wanted = frozenset(projection.events) if projection.events is not None else None
    upcasters = projection.upcasters
    models = projection.models or None
    events: list[ProjectionEvent[Any]] = []
    append = events.append
    try:
        for _, xid, seq, id_, key, topic, type_, payload_text, headers_text, time_, version in rows:
            if wanted is not None and type_ not in wanted:
                return None
            payload: Any = decode_json(payload_text)
            headers = decode_headers(headers_text)
            if not isinstance(headers, dict):
                return None
            if upcasters is not None:
                payload, version = upcasters.upcast(type_, version, payload)
            if models is not None:
                model = models.get(type_)
                if model is not None:
                    payload = model.model_validate(payload)
            append(make_event(id_, type_, key, topic, payload, headers, time_, (xid, seq),
                              make_token(0, 0, xid, seq), 1, True, version))
    except Exception:  # whatever it is, prepare says what becomes of the event
        return None
    return events


@dataclass(frozen=True)
class _Read:
    """A slice as read: its events (as the handler gets them, or as stored for the general path), how
    many rows, and the position of the last one (None: none)."""

    events: Sequence[Delivered]
    rows: int
    last: tuple[int, int] | None


class _Reader:
    """Reads the bulk phase's slices on a connection and a thread of its own, one slice ahead of the one
    being applied: the read's server time and turning its rows into events overlap the applying slice's
    statements. A read that fails raises in ``result()``; one not needed any more is dropped."""

    def __init__(self, projection: Projection, dsn: str, application_name: str, slice_size: int,
                 event_filter: dict[str, Any]) -> None:
        self.projection = projection
        self.dsn = dsn
        self.application_name = application_name
        self.slice_size = slice_size
        self._filter = event_filter
        self._conn: psycopg.Connection[Any] | None = None  # the reader thread's
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="rebuild-read")

    def read(self, cursor: Cursor, target: Snapshot) -> Future[_Read]:
        """The slice after ``cursor`` of the delta to ``target``."""
        return self._pool.submit(self._read, cursor, target)

    def _read(self, cursor: Cursor, target: Snapshot) -> _Read:
        if self._conn is None:
            self._conn = psycopg.connect(self.dsn, autocommit=True, application_name=self.application_name)
            self._conn.execute(query("rebuild", "bulk_read_session"))
        lo = cursor.after if cursor.after is not None else (cursor.seen.xmin, -1)
        cur = self._conn.execute(query("rebuild", "bulk_read"), {
            "lo_xid": str(lo[0]), "lo_seq": lo[1], "target": str(target), "seen": str(cursor.seen),
            "limit": self.slice_size, **self._filter})
        rows = cur.fetchall()
        if not rows:
            return _Read([], 0, None)
        last = (rows[-1][1], rows[-1][2])
        names = tuple(d.name for d in cur.description or ())
        events = handed_over(self.projection, rows) if names == READ_COLUMNS else None
        if events is not None:
            return _Read(events, len(rows), last)
        read, _ = event_reader(cur)
        return _Read([read(r) for r in rows], len(rows), last)

    def close(self) -> None:
        # A read still in flight (blocked behind a lock, say) is cancelled, not waited out.
        if self._conn is not None and not self._conn.closed:
            self._conn.cancel_safe(timeout=5.0)
        self._pool.shutdown(wait=True, cancel_futures=True)
        if self._conn is not None:
            self._conn.close()


class BulkPhase:
    """Runs the bulk phase of one rebuild (see the module docstring); ``run()`` blocks."""

    def __init__(self, projection: Projection, dsn: str, *, sink: str, shadow: str, started_at: datetime,
                 slice_size: int, lease_seconds: float, handler_timeout_seconds: float, application_name: str,
                 stopping: threading.Event, on_slice: Callable[[int], None] | None = None) -> None:
        self.projection = projection
        self.dsn = dsn
        self.sink = sink
        self.live = projection.name  # whose dead letters the slices keep (decisions.py)
        self.shadow = shadow
        self.started_at = started_at
        self.slice_size = slice_size
        self.application_name = application_name[:63]
        self.stopping = stopping
        self.on_slice = on_slice or (lambda n: None)
        self.events = 0
        self._begin = {"idle_ms": str(int(lease_seconds * 1000)), "shadow": shadow}
        self._filter = projection.event_filter.params()
        self._guard = Guard(sink, handler_timeout_seconds, self._end_walk)
        self._read_limit = handler_timeout_seconds  # a slice's read, as its handler calls
        self._abandoned = False  # the current connection was left to an abandoned slice
        self._never = threading.Event()  # the walk is never aborted mid-slice: a stop waits for the slice
        self._handed = False  # a lane this process ran was handed over to the relay phase, or lost

    def run(self) -> Outcome:
        if self.projection.is_async:
            return Outcome("skipped", 0)
        failures = 0
        lost_since = 0.0
        landed = -1  # self.events at the last failure: a slice landed since starts the window again
        try:
            while True:
                try:
                    result = self._lanes()
                    return Outcome(result, self.events, result == "done" and not self._handed)
                except psycopg.OperationalError as exc:  # the session (and its lock) is gone: look again
                    now = time.monotonic()
                    if self.events != landed:
                        failures, lost_since, landed = 0, now, self.events
                    failures += 1
                    if now - lost_since >= RECONNECT_SECONDS:
                        log.warning("rebuild %s: the bulk phase could not reconnect for %.0fs (%s); the relay "
                                    "phase goes on from its last slice", self.projection.name, now - lost_since,
                                    describe_error(exc))
                        break
                    delay = RECONNECT.delay(failures)
                    log.warning("rebuild %s: the bulk phase lost its connection (%s); reconnecting in %.1fs",
                                self.projection.name, describe_error(exc), delay)
                    if self.stopping.wait(delay):
                        return Outcome("stopped", self.events)
            # Safe to go on without it: the relay phase's first lease bumps the fences, so any slice still
            # in flight elsewhere rolls back (bulk_advance).
            return Outcome("done", self.events)
        finally:
            self._guard.close()

    # -- the lanes ------------------------------------------------------------------------------

    def _lanes(self) -> str:
        """Run every lane no other process runs, one after another, until each is over (ended by its last
        slice, handed over to the relay phase, or not in the phase: another process ran it, or it is not
        eligible); meanwhile wait for lanes that other processes hold (if one dies, its lock goes and
        this process resumes its lane). "done" once every lane is over, "stopped" on a stop. One
        connection looks at the lanes, holds the lock of the one it runs and commits its slices."""
        over: set[int] = set()
        conn: psycopg.Connection[Any] | None = None
        try:
            while True:
                for lane in range(LANES):
                    if lane in over:
                        continue
                    if self.stopping.is_set():
                        return "stopped"
                    if conn is None or self._abandoned:  # the last one was left to an abandoned slice
                        conn = self._connect()
                    result = self._lane(conn, lane)
                    if result == "stopped":
                        return "stopped"
                    if result != "busy":
                        over.add(lane)
                if len(over) == LANES:
                    return "done"
                # Other processes run the rest: the relay phase must not start before they end (its leases
                # would bump the fences under their slices, which then roll back: safe, but work lost).
                if self.stopping.wait(LOCK_POLL_SECONDS):
                    return "stopped"
        finally:
            # An abandoned slice's helper thread still holds the connection (its session was ended, the
            # lock with it): leave it to that thread, as the projection sink does.
            if conn is not None and not self._abandoned:
                conn.close()  # ends the session: a lane's lock goes with it

    def _connect(self) -> psycopg.Connection[Any]:
        conn = psycopg.connect(self.dsn, autocommit=True, application_name=self.application_name)
        self._abandoned = False
        conn.execute(query("projections", "prepare_session"))
        conn.read_only = False  # conn.transaction() begins READ WRITE
        return conn

    def _lane(self, conn: psycopg.Connection[Any], lane: int) -> str:
        """One lane, if no other process runs it: "over" (it ended, or was not in the phase), "busy"
        (another process holds it) or "stopped" (resumable)."""
        lo, hi = lane_buckets(lane)
        if self._state(conn, lo, hi) is None:
            return "over"  # ended, or not eligible: the relay phase does the rest
        lock = {"projection": self.projection.name, "lane": lane}
        locked = conn.execute(query("rebuild", "bulk_lock"), lock).fetchone()
        if not (locked and locked[0]):
            return "busy"
        state = self._state(conn, lo, hi)  # again, under the lock: a peer may have moved it meanwhile
        result = "over" if state is None else self._phase(conn, lo, hi, *state)
        if not self._abandoned:  # (an abandoned slice's session was ended, and the lock with it)
            conn.execute(query("rebuild", "bulk_unlock"), lock)
        return result

    def _state(self, conn: psycopg.Connection[Any], lo: int, hi: int) -> tuple[Cursor, Snapshot] | None:
        """The cursor of the lane's buckets and the current snapshot while the lane is in the phase; None
        once it is over (fences bumped), for a start that is not the same in each of its buckets
        (--from-time), or when the rebuild is gone."""
        row = conn.execute(query("rebuild", "bulk_state"),
                           {"sink": self.sink, "started_at": self.started_at, "lo": lo, "hi": hi}).fetchone()
        if row is None or row[0] != hi - lo or row[1] != 1 or not row[2]:
            return None
        return Cursor.from_row(row[3], row[4], row[5], row[6]), Snapshot.parse(row[7])

    def _phase(self, conn: psycopg.Connection[Any], lo: int, hi: int, cursor: Cursor, now: Snapshot) -> str:
        reader = _Reader(self.projection, self.dsn, self.application_name, self.slice_size,
                         {**self._filter, "lo": lo, "hi": hi})
        # The cyclic collector stays off for the phase: it would scan each slice's tens of thousands of
        # young objects (rows, events, tokens) again and again while they are built, for no garbage
        # (they are freed by reference counting); measured at a quarter of a slice's Python time. What
        # cyclic garbage there is goes every COLLECT_EVERY slices.
        collecting = gc.isenabled()
        gc.disable()
        try:
            return self._slices(conn, reader, (lo, hi), cursor, now)
        finally:
            reader.close()
            if collecting:
                gc.enable()

    def _slices(self, conn: psycopg.Connection[Any], reader: _Reader, lane: tuple[int, int], cursor: Cursor,
                now: Snapshot) -> str:
        """A lane's slices, from ``cursor``: "over" when it ended or was handed over or lost, or "stopped"."""
        slices = 0
        while True:
            # A cursor with a target is a delta being read (a slice landed before an interruption, or a
            # start from a position): finish it, then read the delta to a fresh snapshot.
            fresh = cursor.target is None
            target = now if fresh else cursor.target
            assert target is not None
            # The next slice is read (on the reader's connection) while this one is applied: a slice's
            # read depends only on where the one before it ends, not on its transaction.
            ahead = reader.read(cursor, target)
            while True:
                if self.stopping.is_set():
                    return "stopped"
                try:
                    got = self._wait(ahead)
                except SliceFailed as exc:
                    self._hand_over(lane, cursor, exc)
                    return "over"
                if got is None:
                    return "stopped"
                last = got.rows < self.slice_size
                if not last:
                    assert got.last is not None
                    ahead = reader.read(Cursor(cursor.seen, target, got.last), target)
                try:
                    cursor = self._slice(conn, lane, cursor, target, got, last=last, end=fresh)
                except (SliceFailed, TimedOut) as exc:
                    self._abandoned = isinstance(exc, TimedOut)
                    self._hand_over(lane, cursor, exc)
                    return "over"
                except Lost:
                    log.info("rebuild %s: lane %d-%d of the bulk phase was taken over or its rebuild changed; "
                             "it stops here", self.projection.name, lane[0], lane[1] - 1)
                    self._handed = True
                    return "over"
                slices += 1
                if slices % COLLECT_EVERY == 0:
                    gc.collect(1)
                if last:
                    break
            if fresh:
                return "over"
            row = conn.execute("SELECT pg_current_snapshot()::text").fetchone()
            assert row is not None
            now = Snapshot.parse(row[0])

    def _wait(self, ahead: Future[_Read]) -> _Read | None:
        """The slice read ahead; None once the rebuild is stopping. A read that does not return within the
        handler time limit fails the slice, as a handler over its limit does (the relay phase goes on)."""
        deadline = time.monotonic() + self._read_limit
        while True:
            try:
                return ahead.result(timeout=READ_WAIT_STEP_SECONDS)
            except FutureTimeout:
                if self.stopping.is_set():
                    return None
                if time.monotonic() >= deadline:
                    raise SliceFailed(f"a slice's read did not return within {self._read_limit:g}s") from None

    def _slice(self, conn: psycopg.Connection[Any], lane: tuple[int, int], cursor: Cursor, target: Snapshot,
               got: _Read, *, last: bool, end: bool) -> Cursor:
        """One slice of a lane (``got``: read from ``cursor``) in one transaction; the cursor after it.
        ``last``: the delta's last slice; ``end``: that also ends the lane's phase (bumps its fences)."""
        after = Cursor(target) if last else Cursor(cursor.seen, target, got.last)

        def run(w: Walk) -> None:
            w.pid = conn.info.backend_pid
            with conn.transaction():
                if got.events:
                    self._apply(conn, w, got.events)
                w.may_commit()
                seen, old_target, after_xid, after_seq = cursor.params()
                new = after.params()
                moved = conn.execute(query("rebuild", "bulk_advance"), {
                    "sink": self.sink, "started_at": self.started_at, "lo": lane[0], "hi": lane[1],
                    "seen": seen, "target": old_target, "after_xid": after_xid, "after_seq": after_seq,
                    "new_seen": new[0], "new_target": new[1], "new_after_xid": new[2], "new_after_seq": new[3],
                    "fence_by": 1 if (last and end) else 0}).fetchall()
                if len(moved) != lane[1] - lane[0]:
                    raise Lost()

        self._guard.run(run, self._never)
        self.events += got.rows
        self.on_slice(got.rows)
        return after

    def _apply(self, conn: psycopg.Connection[Any], w: Walk, events: Sequence[Delivered]) -> None:
        """The slice's walk, fast and pipelined as a relay batch's first run; any failure fails the slice."""
        batch = Batch(self.projection, events, FENCES, replay=True, name=self.sink,
                      decided=live_decisions(conn, self.live, events))
        steps = walk(batch, careful=False, pipelined=True, begin=self._begin)
        try:
            with conn.pipeline():
                drive(steps, conn, self.projection.handler, w.calling)
        except (Abandoned, Aborted):
            raise
        except psycopg.OperationalError:
            if conn.broken:
                raise
            raise SliceFailed("a statement failed") from None
        except Redo as exc:
            cause = exc.__cause__
            raise SliceFailed(describe(cause) if cause is not None else "a handler failed") from exc
        except Exception as exc:
            raise SliceFailed(describe(exc)) from exc
        # An event decided without its handler (not preparable, an unknown type, held for live processing:
        # the relay phase parks it) fails the slice; one dead-lettered live is dead here too (below).
        failed = next((f for i, f in batch.outcomes.items()
                       if f is not None and (f.retriable or i not in batch.decided)), None)
        if failed is not None:
            raise SliceFailed(failed.error)
        rows = conn.execute(query("projections", "writes_outside_shadow"), {"shadow": self.shadow}).fetchall()
        if rows:
            # A rebuild cancelled meanwhile dropped its schema, so the handler's tables resolved to the live
            # ones: the phase lost (the rebuild says it was cancelled), the handler did nothing wrong.
            current = conn.execute(query("rebuild", "get"), {"projection": self.projection.name}).fetchone()
            if current is None or current[6] != self.started_at:
                raise Lost()
            raise outside_writes_error(self.projection, self.shadow, [r[0] for r in rows])
        dead = [i for i, f in batch.decided.items() if not f.retriable]
        if dead:  # dead-lettered live: dead for the rebuild too, never applied (decisions.py)
            conn.execute(query("rebuild", "bulk_dead_letters"), {"sink": self.sink, "live": self.live, "ids": dead})

    def _hand_over(self, lane: tuple[int, int], cursor: Cursor, exc: BaseException) -> None:
        """End the lane's phase where its last slice left its cursors (bump their fences): the relay phase
        goes on from there, with retries, parking and dead letters for what failed. The other lanes go on
        (see the module docstring)."""
        self._handed = True
        reason = (f"a handler did not return within {exc.seconds:g}s" if isinstance(exc, TimedOut)
                  else str(exc) if isinstance(exc, SliceFailed) else describe(exc))
        log.info("rebuild %s: a slice of lane %d-%d of the bulk phase failed (%s); the relay phase takes over "
                 "that lane's buckets from its last slice", self.projection.name, lane[0], lane[1] - 1,
                 reason[:300])
        seen, target, after_xid, after_seq = cursor.params()
        with psycopg.connect(self.dsn, autocommit=True, application_name=self.application_name) as conn:
            conn.execute(query("rebuild", "bulk_advance"), {
                "sink": self.sink, "started_at": self.started_at, "lo": lane[0], "hi": lane[1],
                "seen": seen, "target": target, "after_xid": after_xid, "after_seq": after_seq,
                "new_seen": seen, "new_target": target, "new_after_xid": after_xid, "new_after_seq": after_seq,
                "fence_by": 1})

    def _end_walk(self, w: Walk) -> None:
        """The guard gave up on a slice (a handler that never returned): end its session, lock and all."""
        if w.pid is None:
            return
        with psycopg.connect(self.dsn, autocommit=True, connect_timeout=10,
                             application_name=self.application_name) as conn:
            conn.execute(query("projections", "end_walk"), {"pid": w.pid, "wait_ms": END_WALK_WAIT_MS})
