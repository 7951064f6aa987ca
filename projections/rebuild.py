"""Rebuild a projection from stored history (G12), without readers ever seeing a half-built model.

1. Start (or resume): fresh copies of the projection's tables in a shadow schema
   ``outbox_rebuild_<name>``, and a sink of its own, ``<name>.rebuild``, whose cursors start at
   the beginning of retained history (or at a position or time).
2. Replay: an ordinary relay ``Worker`` runs that sink with ``replay=True`` and the shadow
   schema first on the search path, so the handler's unqualified table names land in the
   copies. It has its own leases, retries and dead letters; several ``rebuild`` processes share
   the work through the stored assignment; an interrupted rebuild resumes from its cursors. A
   guard refuses any batch that wrote to the live tables.
3. Switch, once caught up, in one transaction: lock the live tables and cursors, wait until the
   rebuild has applied every event the live projection did (the relay phase still runs meanwhile;
   otherwise readers could lose an event they saw), move the live tables out and the
   copies in (grants and owner carried over), give the live projection the rebuild's cursors,
   its parked events and dead letters merged with the live ones (decisions.py: what live
   processing decided stays decided, G12), bump its fences (relays holding its buckets are fenced out
   and their open batches roll back), drop the rebuild's sink. Live processing goes on from
   there; events that arrived during the rebuild are applied once, to the new tables
   (rebuild_switch.py).

``Rebuild`` composes the parts: the start and the phases here, ``RunningRebuild`` (which rebuild this
process runs, rebuild_running.py), ``rebuild_backlog`` (what is left to replay), ``BulkPhase`` (bulk.py)
and ``SwitchOver``.

``rebuild_key`` is the in-place variant for one partition key: in one transaction, holding the
key's bucket cursor, it clears the key's state (the projection's ``key_reset``) and replays the
key's events that live processing applied.
"""

from __future__ import annotations

import json
import logging
import sys
import threading
import time
from datetime import datetime
from typing import Any, TextIO

import psycopg
from psycopg import sql

from outbox_relay import store
from outbox_relay.errors import ConfigurationError, OutboxError
from outbox_relay.housekeeping import application_name
from outbox_relay.migrate import check_schema
from outbox_relay.positions import Cursor
from outbox_relay.progress_line import ProgressLine
from outbox_relay.settings import RelaySettings
from outbox_relay.sqlfiles import query
from outbox_relay.worker import Worker

from . import rebuild_backlog
from .bulk import BulkPhase
from .declare import RETIRED_PREFIX, SHADOW_PREFIX, Projection
from .history_gap import HistoryGap as HistoryGap
from .history_gap import history_gap as history_gap
from .key_rebuild import rebuild_key as rebuild_key
from .rebuild_checks import check_history, check_start, history_unchecked
from .rebuild_error import RebuildError as RebuildError
from .rebuild_result import RebuildResult as RebuildResult
from .rebuild_running import RunningRebuild
from .rebuild_switch import SWITCH_TRIES, SwitchOver
from .rebuild_tables import LiveTable as LiveTable
from .rebuild_tables import check_swappable, copy_table, live_table, template
from .sink import ProjectionSink

log = logging.getLogger("outbox_relay.rebuild")

SINK_SUFFIX = ".rebuild"
MAX_POSITION = 2**63 - 1  # positions are read as bigint (ce_sequence prints them the same way)
PROGRESS_SECONDS = 2.0
# Events a rebuild of a batched projection reads per batch unless --batch-size (OUTBOX_BATCH_SIZE)
# says otherwise. A read spreads its batch over the 256 buckets and the batch's checkpoint writes
# each bucket's cursor, so the per-batch costs (a read's per-bucket index probes, 256 cursor rows,
# the statements' round trips) are spread over 32 events per bucket instead of the relay's 8; a
# batch transaction of 8k events stays well inside the lease. Per-event handlers keep the relay's
# size: one statement per event, the larger batch measured no faster for them.
REBUILD_BATCH_SIZE = 8192


class Rebuild:
    """One rebuild of one projection. ``run()`` blocks until switched over (or ``stop()``)."""

    def __init__(self, projection: Projection, settings: RelaySettings, *, from_time: datetime | None = None,
                 from_position: tuple[int, int] | None = None, restart: bool = False, keep_old: bool = False,
                 accept_partial: bool = False, progress: TextIO | None = sys.stderr) -> None:
        if from_time is not None and from_position is not None:
            raise ConfigurationError("rebuild from a time or from a position, not both")
        if from_position is not None and not (
                len(from_position) == 2 and all(isinstance(v, int) and 0 <= v <= MAX_POSITION for v in from_position)):
            raise RebuildError(f"--from-position {':'.join(map(str, from_position))} is not a position: a position is "
                               f"XID:SEQ, two integers from 0 to {MAX_POSITION} (as in an event's ce_sequence)")
        if from_time is not None and from_time.tzinfo is None:
            raise RebuildError(f"--from-time {from_time.isoformat()} has no time zone: give one (e.g. ...Z or +01:00)")
        if not projection.tables:
            raise ConfigurationError(f"projection {projection.name!r} declares no tables=: a rebuild builds fresh "
                                     "copies of them and swaps them in, so it must know them")
        self.projection = projection
        self.settings = settings
        self.dsn = settings.dsn.get_secret_value()
        self.live_sink = projection.name
        self.sink = projection.name + SINK_SUFFIX
        self.shadow = SHADOW_PREFIX + projection.name
        self.retired = RETIRED_PREFIX + projection.name
        self.options = {"from_time": from_time.isoformat() if from_time else None,
                        "from_position": list(from_position) if from_position else None}
        self.from_time = from_time
        self.from_position = from_position
        self.restart = restart
        self.keep_old = keep_old
        self.accept_partial = accept_partial  # build from what is stored even if retention removed some of it
        self.progress = progress
        self.stopping = threading.Event()
        # Not chosen (--batch-size, OUTBOX_BATCH_SIZE): a batched projection's larger batches.
        chosen = "batch_size" in settings.model_fields_set
        self.batch_size = REBUILD_BATCH_SIZE if projection.batch and not chosen else settings.batch_size
        # The bulk phase's slice (bulk.py): its per-slice costs (the read, 256 cursor rows, the guard, the
        # commit) are spread over more events for per-event handlers too (measured 1.6x at 8,192 over 1,000).
        self.slice_size = settings.batch_size if chosen else REBUILD_BATCH_SIZE
        self._filter = projection.event_filter.params()
        self._running: RunningRebuild | None = None  # the rebuild this process runs, set by _start

    def stop(self) -> None:
        """Stop replaying (from another thread or a signal handler); ``run`` returns None, resumable."""
        self.stopping.set()

    # -- run ----------------------------------------------------------------------------------

    def run(self) -> RebuildResult | None:
        started = time.monotonic()
        with psycopg.connect(self.dsn, autocommit=True) as conn:
            check_schema(conn)
            running, resumed = self._start(conn)
            if not self.accept_partial and (not resumed or history_unchecked(conn, self.projection)):
                self._check_retained(conn)
            total = rebuild_backlog.total(conn, self.projection.name, self.sink, self._filter)
        switch = SwitchOver(self.projection, self.dsn, running, live_sink=self.live_sink, shadow=self.shadow,
                            retired=self.retired, keep_old=self.keep_old, event_filter=self._filter)
        log.info("rebuild %s: %s, %d events to replay into %s", self.projection.name,
                 "resumed" if resumed else "started", total, self.shadow)
        worker_id = f"{self.settings.worker_id}-rebuild"[:200]
        bulk = self._bulk(total, application_name(worker_id))
        if bulk == "stopped":
            log.info("rebuild %s: stopped; run it again to resume", self.projection.name)
            return None
        if bulk == "finished" and self._nothing_left() and switch.switch(None):
            # Every lane ended and nothing committed after the lanes' snapshots: the relay phase would find
            # nothing to do (and a start, a count and a drain cost a second or two): switched over without it.
            bulk = "switched"
        if bulk == "switched":
            return self._switched(total, time.monotonic() - started, resumed, switch)
        while True:
            sink = ProjectionSink(self.projection, self.dsn, name=self.sink,
                                  lease_seconds=self.settings.lease_seconds, replay=True, shadow_schema=self.shadow,
                                  application_name=application_name(worker_id),
                                  handler_timeout_seconds=self.settings.handler_timeout_seconds,
                                  follows=self.live_sink)
            worker = Worker(self.settings.model_copy(update={
                "worker_id": worker_id, "kafka": False, "projection": [], "batch_size": self.batch_size}),
                sinks=[sink])
            if not worker.start():
                return None
            try:
                outcome = self._replay(worker, sink, total)
                # While this relay phase still runs: the switch waits for it to pass the live cursors.
                if outcome == "caught up" and not switch.switch(worker):
                    outcome = "behind"
            finally:
                worker.drain()
                worker.wait()
            if outcome != "behind":
                break
            log.info("rebuild %s: live processing got ahead of the rebuild during the switch-over; catching up "
                     "again", self.projection.name)
        if outcome == "stopped":
            log.info("rebuild %s: stopped; run it again to resume", self.projection.name)
            return None
        return self._switched(total, time.monotonic() - started, resumed, switch)

    def _switched(self, total: int, seconds: float, resumed: bool, switch: SwitchOver) -> RebuildResult:
        result = RebuildResult(self.projection.name, total, seconds, resumed, tuple(switch.waiting),
                               tuple(switch.dropped))
        failing = result.failing
        ProgressLine(self.progress, f"rebuild {self.projection.name}", total).finish(
            f"switched over ({total:,} events replayed)" + (f"; {len(failing)} keys still fail" if failing else ""))
        for w in failing:
            log.warning("rebuild %s: switched over, but %s", self.projection.name, w.describe())
        return result

    def cancel(self) -> bool:
        """Abandon a rebuild in progress: drop its shadow tables and its sink. False if none."""
        with psycopg.connect(self.dsn, autocommit=True) as conn, conn.transaction():
            conn.execute(query("rebuild", "lock_projection"), {"projection": self.projection.name})
            row = conn.execute(query("rebuild", "get"), {"projection": self.projection.name}).fetchone()
            if row is None:
                return False
            conn.execute(template("drop_schema", schema=sql.Identifier(row[2])))
            conn.execute(query("rebuild", "drop_sink"), {"sink": row[1]})
        return True

    # -- start --------------------------------------------------------------------------------

    def _start(self, conn: psycopg.Connection[Any]) -> tuple[RunningRebuild, bool]:
        with conn.transaction():
            conn.execute(query("rebuild", "lock_projection"), {"projection": self.projection.name})
            row = conn.execute(query("rebuild", "get"), {"projection": self.projection.name}).fetchone()
            if row is not None and self.restart:
                conn.execute(template("drop_schema", schema=sql.Identifier(row[2])))
                conn.execute(query("rebuild", "drop_sink"), {"sink": row[1]})
                row = None
            if row is not None:
                if row[4] != self.options:
                    raise RebuildError(
                        f"a rebuild of {self.projection.name!r} started {row[6]:%Y-%m-%d %H:%M} with options "
                        f"{json.dumps(row[4])} is in progress: run it again with the same options to resume it, "
                        "or pass --restart to start over")
                tables = [live_table(conn, self.projection, name) for name in row[3]]
                self._running = RunningRebuild.remember(conn, row, tables, self.shadow)
                return self._running, True
            check_start(conn, self.from_position, self.from_time)
            tables = [live_table(conn, self.projection, name) for name in self.projection.tables]
            twice = {t.qualified for t in tables if sum(u.oid == t.oid for u in tables) > 1}
            if twice:
                raise RebuildError(f"projection {self.projection.name!r}: tables= names {', '.join(sorted(twice))} "
                                   "more than once")
            check_swappable(conn, tables)
            conn.execute(template("drop_schema", schema=sql.Identifier(self.shadow)))  # a crashed start's
            conn.execute(template("create_schema", schema=sql.Identifier(self.shadow)))
            for t in tables:
                copy_table(conn, self.shadow, t)
            conn.execute(query("rebuild", "drop_sink"), {"sink": self.sink})
            store.register_sink(conn, self.sink, "projection", self.projection.topics)
            if self.from_position is not None:
                seen, target, after_xid, after_seq = Cursor.at(self.from_position).params()
                conn.execute(query("rebuild", "start_at_position"), {
                    "sink": self.sink, "seen": seen, "target": target, "after_xid": after_xid, "after_seq": after_seq})
            elif self.from_time is not None:
                conn.execute(query("rebuild", "start_at_time"), {"sink": self.sink, "time": self.from_time})
            conn.execute(query("rebuild", "insert"), {
                "projection": self.projection.name, "sink": self.sink, "shadow_schema": self.shadow,
                "live_tables": [t.qualified for t in tables], "options": json.dumps(self.options)})
            row = conn.execute(query("rebuild", "get"), {"projection": self.projection.name}).fetchone()
            assert row is not None
            self._running = RunningRebuild.remember(conn, row, tables, self.shadow)
        return self._running, False

    def _check_retained(self, conn: psycopg.Connection[Any]) -> None:
        """Refuse a rebuild whose history retention removed part of, once its own sink holds retention back.

        The check comes after the start committed the rebuild's sink: a removal that looks after that sees
        its cursors, which hold every leaf it has still to replay (partition_hold_v1), and one that looked
        before locks its leaf and looks again (0020). The read here waits for a removal that holds a leaf
        to commit, so the check sees what it removed. Before, the check ran first, in the start's
        transaction, whose sink nothing saw until it committed (a start waiting on the projection's table
        widened that window): a leaf dropped in between was replayed without, and status said complete.
        A refused rebuild is undone: the live model and projection are as they were."""
        for attempt in range(1, SWITCH_TRIES + 1):
            try:
                with conn.transaction():
                    conn.execute(query("rebuild", "wait_for_retention"))
                    check_history(conn, self.projection, self.live_sink, self.from_position, self.from_time)
                return
            except psycopg.errors.DeadlockDetected:
                # A removal of a leaf this rebuild does not hold locks its leaf, then the parent table: the
                # read here locks them the other way round. The removal goes on; look again after it.
                if attempt == SWITCH_TRIES:
                    raise
            except RebuildError:
                self.cancel()
                raise

    # -- replay -------------------------------------------------------------------------------

    def _nothing_left(self) -> bool:
        with psycopg.connect(self.dsn, autocommit=True) as conn:
            return rebuild_backlog.remaining(conn, self.sink, self._filter) == 0

    def _replay(self, worker: Worker, sink: ProjectionSink, total: int) -> str:
        """Report progress until the rebuild has "caught up", was "stopped", or was "switched" over
        by a peer (another rebuild process); raises RebuildError if it was cancelled meanwhile.

        Caught up: nothing left, or, for a long replay under live traffic, at most a batch (and
        1% of the total) behind: the live projection applies the rest after the switch, from the
        rebuild's positions, as it would any new event.

        What is left is counted exactly (``remaining``: a scan of what the cursors have not passed,
        about a second per million events on an idle machine) only as often as it costs at most a
        tenth of the time, and at once when this process's own progress says the end is near; in
        between, progress is this process's batches (``sink.passed``) since the last count."""
        running = self._running
        assert running is not None
        first = time.monotonic()
        line = ProgressLine(self.progress, f"rebuild {self.projection.name}", total)
        with psycopg.connect(self.dsn, autocommit=True) as conn:
            start_left = left = rebuild_backlog.remaining(conn, self.sink, self._filter)
            counted_at, passed_then, next_count = time.monotonic(), sink.passed, 0.0
            while not (self.stopping.is_set() or worker.stopping.is_set()):
                # Before anything else: a rebuild cancelled elsewhere has no cursors left (0 to do).
                if not running.still_running(conn):
                    return "switched"
                if sink.fatal is not None:
                    raise RebuildError(str(sink.fatal))
                near = min(self.batch_size, total // 100)
                estimate = left - (sink.passed - passed_then)
                if time.monotonic() >= next_count or estimate <= near:
                    started = time.monotonic()
                    left, passed_then = rebuild_backlog.remaining(conn, self.sink, self._filter), sink.passed
                    counted_at = time.monotonic()
                    next_count = counted_at + max(PROGRESS_SECONDS, 10 * (counted_at - started))
                    estimate = left
                    if left == 0 or left <= near:
                        return "caught up"
                line.update(max(0, total - estimate), (start_left - estimate) / max(1e-3, time.monotonic() - first))
                self.stopping.wait(PROGRESS_SECONDS if estimate > self.batch_size else 0.1)
        return "stopped"

    def _bulk(self, total: int, app: str) -> str:
        """The bulk phase (bulk.py) before the relay phase: "done", "finished" (done: every lane ended, and
        none that this process ran was handed over), "stopped" (resumable), or "switched" (a peer finished
        the whole rebuild meanwhile). Raises RebuildError if it was cancelled."""
        assert self._running is not None
        if self.from_time is not None:
            return "done"  # each bucket starts at its own place: the relay phase does it all
        line = ProgressLine(self.progress, f"rebuild {self.projection.name}", total)
        first = time.monotonic()

        def progress(_: int) -> None:
            rate = phase.events / max(1e-3, time.monotonic() - first)
            line.update(min(total, phase.events), rate)

        phase = BulkPhase(self.projection, self.dsn, sink=self.sink, shadow=self.shadow,
                          started_at=self._running.started_at, slice_size=self.slice_size,
                          lease_seconds=self.settings.lease_seconds,
                          handler_timeout_seconds=self.settings.handler_timeout_seconds, application_name=app,
                          stopping=self.stopping, on_slice=progress)
        try:
            outcome = phase.run()
        except OutboxError as exc:
            if isinstance(exc, RebuildError):
                raise
            raise RebuildError(str(exc)) from exc
        if outcome.events:
            log.info("rebuild %s: bulk phase applied %d events in %.1fs", self.projection.name, outcome.events,
                     time.monotonic() - first)
        if outcome.result == "stopped":
            return "stopped"
        with psycopg.connect(self.dsn, autocommit=True) as conn:  # cancelled or switched by a peer meanwhile?
            if not self._running.still_running(conn):
                return "switched"
        return "finished" if outcome.finished else "done"
