"""A projection as a sink: each batch is one transaction holding the handlers' writes and the
fenced checkpoint, so an event's effect lands exactly once (G7).

The checkpoint (sql/queries/relay.sql) is the durable dedupe record: it advances the bucket's
cursor past the batch, parks retries and records dead letters, and it is fenced (owner, fence,
unexpired lease). If the fence does not hold, ``LeaseLost`` is raised inside the transaction
and the handlers' writes roll back with it. An event is applied iff its position is at or
below its bucket's cursor and it is neither parked nor dead-lettered.

Fast path: the whole batch in one pipelined transaction. If any handler raises (or a statement
fails), that transaction rolls back and the batch runs again with a savepoint per event, so
only the failing event's key is held back and every other event still lands.

A handler that ends the transaction (``tx.execute("COMMIT")``, END, ROLLBACK) must not commit
part of a batch: the connection's commit guard (migration 0006, ``prepare_session``) makes any
COMMIT fail at the server unless ``end_batch`` ran for the batch's transaction-local token
right before the checkpoint, and its transactions are read-only unless begun by the relay, so
nothing autocommits after a ROLLBACK either. The batch then fails; the savepoint walk finds the
event whose handler ended the transaction (its savepoint is gone), and the batch is redone
without it, the event dead-lettered with the reason.

A handler that does not return within ``handler_timeout_seconds`` is abandoned (guard.py: the walk
runs on a helper thread, its transaction is ended from outside and can never commit) and charged
to its event as a failed attempt; the batch is redone without calling it.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import threading
from collections.abc import Sequence
from typing import Any

import psycopg

from outbox_relay.errors import OutboxError
from outbox_relay.observer import NULL_OBSERVER, Observer
from outbox_relay.sinks.engine import Aborted, AsyncConn, Commit, Failure
from outbox_relay.sqlfiles import query
from outbox_relay.store import Conn, EventFilter, StoredEvent

from .declare import Projection
from .drive import drive
from .drive_async import adrive
from .guard import Abandoned, Guard, TimedOut, Walk
from .live_decisions import live_decisions
from .live_decisions_async import alive_decisions
from .walk import Batch, Redo, max_runs, redo_known, walk

log = logging.getLogger("outbox_relay.projections")

END_WALK_WAIT_MS = 5000  # how long ending an abandoned walk's backend may take (pg_terminate_backend)
# Events per read of a live batched projection unless --batch-size is given (compose.build_worker): its
# read's per-bucket work and its checkpoint are the server's per-batch cost, spread over 4 times the events
# of the relays' default (1,000): 64 per bucket for a relay of four holding 64 buckets. Measured: the
# PostgreSQL sessions' CPU per event about half (bench/results/2026-11-26-live-projection.md).
BATCHED_READ_SIZE = 4096


def outside_writes_error(projection: Projection, shadow: str | None, tables: list[str]) -> OutboxError:
    """What stops a rebuild whose handler wrote ``tables`` outside its shadow schema."""
    declared = ", ".join(projection.tables)
    return OutboxError(
        f"projection {projection.name!r} wrote {', '.join(tables)} during its rebuild, outside the "
        f"rebuild's schema {shadow}: live processing writes there too, so these writes would land on "
        f"top of it. A rebuild writes only fresh copies of the declared tables (tables=[{declared}]), "
        "named without a schema in the handler: declare every table the handler writes, or rebuild keys "
        "in place with --key")


def _timed_out(sink: str, out: TimedOut, known: dict[Any, Failure] | None) -> Redo:
    """What the next run of a batch starts from after its walk was abandoned (nothing of it landed)."""
    if out.event is None:
        if known is None:
            return Redo()  # fast: which handler's statement hung (or which event of a batch call) is unknown
        raise OutboxError(f"sink {sink}: the relay's own statements of a batch made no progress for "
                          f"{out.seconds:g}s; the batch was abandoned and is tried again")
    e = out.event
    log.warning("sink %s: the handler of event %s (key %r) did not return within %gs; abandoned, its transaction "
                "ended, and the attempt counted", sink, e.id, e.key, out.seconds)
    return Redo({e.id: Failure(f"the handler did not return within {out.seconds:g}s (--handler-timeout-seconds); "
                               "it was abandoned and its transaction ended")})


def _restless(sink: str, events: Sequence[StoredEvent]) -> OutboxError:
    return OutboxError(f"sink {sink}: a batch of {len(events)} events was redone {max_runs(events)} times, its "
                       "handlers ending the transaction differently each time; it is tried again later")


class ProjectionSink:
    """Runs one ``Projection`` for a relay (or, with ``replay=True`` and ``shadow_schema``, for a
    rebuild). Owns one connection (sync or async, as the handler is), used by the runner thread."""

    kind = "projection"

    def __init__(self, projection: Projection, dsn: str, *, lease_seconds: float = 30.0, name: str | None = None,
                 replay: bool = False, shadow_schema: str | None = None,
                 application_name: str | None = None, handler_timeout_seconds: float = 30.0,
                 batch_size: int | None = None, follows: str | None = None) -> None:
        self.projection = projection
        self._follows = follows  # a rebuild's: the live projection whose dead letters its replay keeps
        self.batch_size = batch_size  # events per read of this sink (None: the relay's --batch-size)
        self.name = name or projection.name
        self.replay = replay
        self._dsn = dsn
        # The relay's own name (housekeeping.application_name), so that housekeeping can end a stalled
        # relay's projection transaction together with its lease.
        self._application_name = (application_name or f"outbox-relay projection {self.name}")[:63]
        self._shadow = shadow_schema  # a rebuild's: its batches must write nothing outside it
        self._begin = {"idle_ms": str(int(lease_seconds * 1000)), "shadow": shadow_schema}
        self.event_filter: EventFilter | None = projection.event_filter
        self._conn: Conn | None = None
        self._aconn: AsyncConn | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self.fatal: OutboxError | None = None  # set when a rebuild must stop (see _refuse_outside_writes)
        self.observer: Observer = NULL_OBSERVER  # set by the composition root (tracing: a span per handler call)
        self._guard = Guard(self.name, handler_timeout_seconds, self._end_walk)
        # Events whose batch landed (applied, parked or dead-lettered), written by the runner thread: a
        # rebuild's progress between its exact counts.
        self.passed = 0

    def _refuse_outside_writes(self, tables: list[str]) -> None:
        """A rebuild's batch wrote tables outside its shadow schema: it rolls back, and the rebuild stops."""
        if tables:
            self.fatal = outside_writes_error(self.projection, self._shadow, tables)
            raise self.fatal

    # -- sync ---------------------------------------------------------------------------------

    def deliver(self, events: Sequence[StoredEvent], fences: dict[int, int], commit: Commit,
                abort: threading.Event) -> set[int]:
        if not events:
            return commit({}, None)  # only events queued behind parked keys: nothing to apply
        known: dict[Any, Failure] | None = None  # None: the fast path first
        for _ in range(max_runs(events)):
            run = functools.partial(self._walk, events=events, fences=fences, commit=commit, abort=abort, known=known)
            try:
                result: set[int] = self._guard.run(run, abort)
                self.passed += sum(1 for e in events if e.bucket in result)
                self._guard.check_cap()  # after the batch that charged the abandoned handlers landed
                return result
            except Redo as redo:
                if redo.ended is not None:
                    log.warning("sink %s: the handler of event %s ended the relay's transaction; the batch is redone "
                                "without it", self.name, redo.ended)
                known = redo_known(events, known, redo)
            except TimedOut as out:
                known = redo_known(events, known, _timed_out(self.name, out, known))
        raise _restless(self.name, events)

    def _walk(self, walk: Walk, *, events: Sequence[StoredEvent], fences: dict[int, int], commit: Commit,
              abort: threading.Event, known: dict[Any, Failure] | None) -> set[int]:
        """One run of the batch, on the guard's helper thread."""
        if self.projection.is_async:
            loop = self._loop = self._loop or asyncio.new_event_loop()
            try:
                return loop.run_until_complete(self._adeliver(walk, events, fences, commit, abort, known))
            finally:
                if self._loop is not loop:  # abandoned (``_end_walk``): this thread is the last to use it
                    loop.close()
        conn = self._connection()
        walk.pid = conn.info.backend_pid
        try:
            return self._apply(walk, conn, events, fences, commit, abort, known)
        except psycopg.OperationalError:
            self._drop_connection(conn)
            raise
        finally:
            if self._conn is not conn:  # abandoned (``_end_walk``), or dropped just now
                conn.close()

    def _end_walk(self, walk: Walk) -> None:
        """The runner gave up on ``walk`` (guard.py): forget its connection, which its helper thread keeps,
        and end its transaction from another one (it can not commit: ``Walk.may_commit``)."""
        if self.projection.is_async:
            self._aconn = None
            self._loop = None  # still running on the abandoned thread
        else:
            self._conn = None
        if walk.pid is None:
            return
        with psycopg.connect(self._dsn, autocommit=True, connect_timeout=10,
                             application_name=self._application_name) as conn:
            row = conn.execute(query("projections", "end_walk"),
                               {"pid": walk.pid, "wait_ms": END_WALK_WAIT_MS}).fetchone()
        if not (row and row[0]):
            log.warning("sink %s: the abandoned batch's backend %d did not exit within %d ms", self.name, walk.pid,
                        END_WALK_WAIT_MS)

    def _batch(self, events: Sequence[StoredEvent], fences: dict[int, int],
               known: dict[Any, Failure] | None) -> Batch:
        return Batch(self.projection, events, fences, replay=self.replay, known=known or {}, name=self.name)

    def _apply(self, run: Walk, conn: Conn, events: Sequence[StoredEvent], fences: dict[int, int], commit: Commit,
               abort: threading.Event, known: dict[Any, Failure] | None) -> set[int]:
        """One transaction: fast (``known`` None: pipelined, all or nothing) or careful (a savepoint
        per event; ``known`` holds failures already pinned on events). The walk is walk.py's."""
        batch = self._batch(events, fences, known)
        handler = self.observer.handler(self.name, self.projection.handler)  # tracing hook
        steps = walk(batch, careful=known is not None, pipelined=known is None, begin=self._begin, abort=abort)
        with conn.transaction():  # BEGIN READ WRITE (the session's default is read-only)
            if self._follows is not None:
                batch.decided = live_decisions(conn, self._follows, events)
            if known is None:
                try:
                    with conn.pipeline():
                        drive(steps, conn, handler, run.calling)
                except (Aborted, Redo, Abandoned):
                    raise
                except Exception as exc:  # a statement failed (or the pipeline aborted after it)
                    if conn.broken:
                        raise
                    raise Redo() from exc
            else:
                drive(steps, conn, handler, run.calling)
            if self._shadow is not None:
                rows = conn.execute(query("projections", "writes_outside_shadow"), {"shadow": self._shadow}).fetchall()
                self._refuse_outside_writes([r[0] for r in rows])
            run.may_commit()
            return commit(batch.outcomes, conn)

    def _connection(self) -> Conn:
        if self._conn is None or self._conn.closed:
            conn = psycopg.connect(self._dsn, autocommit=True,
                                   application_name=self._application_name)
            try:
                conn.execute(query("projections", "prepare_session"))
                conn.read_only = False  # conn.transaction() begins READ WRITE
            except BaseException:
                conn.close()
                raise
            self._conn = conn
        return self._conn

    def _drop_connection(self, conn: Conn | None = None) -> None:
        """Close ``conn`` (default: the current connection); forget it if it is the current one (an
        abandoned walk's is not)."""
        conn = conn or self._conn
        if conn is self._conn:
            self._conn = None
        if conn is not None:
            conn.close()

    # -- async --------------------------------------------------------------------------------
    # Hand-kept twins of ``_walk``/``_apply``/``_connection`` (three of the package's at most three,
    # issue 26): the sync batch is pipelined (``conn.pipeline()``, a failed statement known only at
    # its end, turned into a Redo) and runs on the guard's thread, the async one is not pipelined and
    # runs on a per-thread event loop, and both are methods of one sink over its connection state, so
    # the module generator (scripts/async_to_sync.py, whole modules) does not fit them.

    async def _adeliver(self, walk: Walk, events: Sequence[StoredEvent], fences: dict[int, int], commit: Commit,
                        abort: threading.Event, known: dict[Any, Failure] | None) -> set[int]:
        conn = await self._aconnection()
        walk.pid = conn.info.backend_pid
        try:
            return await self._aapply(walk, conn, events, fences, commit, abort, known)
        except psycopg.OperationalError:
            if self._aconn is conn:
                self._aconn = None
            raise
        finally:
            if self._aconn is not conn:  # abandoned (``_end_walk``), or dropped just now
                await conn.close()

    async def _aapply(self, run: Walk, conn: AsyncConn, events: Sequence[StoredEvent], fences: dict[int, int],
                      commit: Commit, abort: threading.Event, known: dict[Any, Failure] | None) -> set[int]:
        """``_apply`` for async handlers (not pipelined: a failing statement is known at once)."""
        batch = self._batch(events, fences, known)
        handler = self.observer.handler(self.name, self.projection.handler)  # tracing hook
        steps = walk(batch, careful=known is not None, begin=self._begin, abort=abort)
        async with conn.transaction():
            if self._follows is not None:
                batch.decided = await alive_decisions(conn, self._follows, events)
            await adrive(steps, conn, handler, run.calling)
            if self._shadow is not None:
                cur = await conn.execute(query("projections", "writes_outside_shadow"), {"shadow": self._shadow})
                self._refuse_outside_writes([r[0] for r in await cur.fetchall()])
            run.may_commit()
            return await commit.in_async(batch.outcomes, conn)

    async def _aconnection(self) -> AsyncConn:
        if self._aconn is None or self._aconn.closed:
            conn = await psycopg.AsyncConnection.connect(
                self._dsn, autocommit=True, application_name=self._application_name)
            try:
                await conn.execute(query("projections", "prepare_session"))
                await conn.set_read_only(False)  # conn.transaction() begins READ WRITE
            except BaseException:
                await conn.close()
                raise
            self._aconn = conn
        return self._aconn

    def close(self) -> None:
        self._guard.close()
        self._drop_connection()
        if self._loop is not None:
            if self._aconn is not None:
                self._loop.run_until_complete(self._aconn.close())
                self._aconn = None
            self._loop.close()
            self._loop = None
