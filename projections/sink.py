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
import secrets
import threading
from collections.abc import Iterator, Sequence
from typing import Any

import psycopg
from psycopg import pq

from outbox_relay.errors import NonRetriableDelivery, OutboxError
from outbox_relay.observer import NULL_OBSERVER, Observer
from outbox_relay.sink import Aborted, AsyncConn, Commit, Failure, KeyHold, Outcomes
from outbox_relay.sqlfiles import query
from outbox_relay.store import Conn, EventFilter, StoredEvent

from .declare import Projection, describe
from .event import ProjectionEvent
from .guard import Abandoned, Guard, TimedOut, Walk

log = logging.getLogger("outbox_relay.projections")

ABORT_CHECK_EVERY = 64  # events between checks of the hard-stop flag
END_WALK_WAIT_MS = 5000  # how long ending an abandoned walk's backend may take (pg_terminate_backend)

ENDED_TRANSACTION = Failure(
    "the handler ended the relay's transaction (COMMIT, END or ROLLBACK through tx): nothing of its batch was "
    "kept, and this event is not retried; a handler writes through the transaction it is given and never ends "
    "it, so that its writes commit with the relay's checkpoint", retriable=False)

SWALLOWED_ERROR = Failure(
    "a statement of the handler failed and the handler went on (it caught the error): the transaction can not "
    "go on after a failed statement, so this event's writes were undone; use a savepoint (with "
    "tx.transaction()) around a statement that may fail")

# Errors a statement gets once its handler ended the relay's transaction: the commit guard refused
# the COMMIT, a write outside the relay's (read-write) transaction, a savepoint with no transaction.
ENDED_STATES = frozenset({"2D000", "25006", "25P01"})


class _Redo(Exception):
    """Roll back and redo the batch event by event. ``failed``: failures already pinned on events,
    so the redo does not call their handlers again (an attempt is one call); a failed statement
    in the pipelined path is only known at its next sync, unpinned. ``ended``: the event whose
    handler ended the transaction; whatever failed after it failed outside the batch's
    transaction and is not pinned on those events."""

    def __init__(self, failed: dict[Any, Failure] | None = None, ended: Any = None) -> None:
        super().__init__()
        self.failed = failed or {}
        self.ended = ended


def _failure(exc: BaseException) -> Failure:
    return Failure(describe(exc), retriable=not isinstance(exc, NonRetriableDelivery))


def _ended_by(conn: AsyncConn, exc: BaseException | None) -> bool | None:
    """Whether the handler just called, with no savepoint around it, ended the relay's transaction
    (it was open before the call). None: can not tell (a failed statement also leaves the
    transaction failed), the careful walk will."""
    status = conn.info.transaction_status
    if status == pq.TransactionStatus.IDLE:
        return True
    cause, seen = exc, 0
    while cause is not None and seen < 20:  # the handler may have wrapped the statement's error
        if isinstance(cause, psycopg.Error) and cause.sqlstate in ENDED_STATES:
            return True
        cause, seen = cause.__cause__ or cause.__context__, seen + 1
    if status == pq.TransactionStatus.INERROR and exc is None:
        return None  # failed without raising: a statement error it caught, or a new transaction it began
    return False


class _Batch:
    """One batch's walk, the same for every way of running it: which events go to the handler,
    in order, and what became of each. A key whose event failed (retriably) waits: its later
    events are left out (not attempted)."""

    def __init__(self, sink: ProjectionSink, events: Sequence[StoredEvent], fences: dict[int, int],
                 known: dict[Any, Failure] | None) -> None:
        self.sink = sink
        self.events = events
        self.fences = fences
        self.known = known or {}  # failures an earlier run of this batch pinned on events: not called again
        self.outcomes: Outcomes = {}
        self.token = secrets.token_hex(8)  # this run's transaction-local token (the commit guard's)
        self._hold = KeyHold()

    def todo(self, abort: threading.Event) -> Iterator[tuple[StoredEvent, ProjectionEvent[Any]]]:
        """The events for the handler; the caller ``settle``s each before asking for the next."""
        p = self.sink.projection
        for i, e in enumerate(self.events):
            if i % ABORT_CHECK_EVERY == 0 and abort.is_set():
                raise Aborted()
            if not self._hold.allows(e):
                continue
            prepared = self.known.get(e.id) or self._prepare(p, e)
            if isinstance(prepared, ProjectionEvent):
                yield e, prepared
            else:
                self.record(e, prepared)

    def _prepare(self, p: Projection, e: StoredEvent) -> ProjectionEvent[Any] | Failure | None:
        """``p.prepare``, with any exception it raises charged to the event (it is the event's
        stored form that could not be handed over: no retry changes that)."""
        try:
            return p.prepare(e, self.fences[e.bucket], self.sink.replay)
        except Exception as exc:
            return Failure(f"the event could not be prepared for the handler: {describe(exc)}", retriable=False)

    def settle(self, e: StoredEvent, exc: Exception | None, *, ended: bool | None, undone: bool) -> None:
        """Record what became of ``e`` after its handler call: ``exc`` what it raised, ``ended``
        whether it ended the batch's transaction (None: unknown), ``undone`` whether its writes
        were undone alone (a savepoint; else the run can not go on after a failure).

        Raises ``_Redo`` to roll back and run the batch again, with what is known pinned on ``e``."""
        if ended:
            log.warning("sink %s: the handler of event %s (key %r) ended the relay's transaction; the batch is "
                        "redone without it", self.sink.name, e.id, e.key)
            raise _Redo({e.id: ENDED_TRANSACTION}, ended=e.id)
        if ended is None:
            raise _Redo()  # the careful walk tells
        outcome = None if exc is None else _failure(exc)
        if exc is None and undone:
            outcome = SWALLOWED_ERROR
        if outcome is not None and not undone:
            raise _Redo({e.id: outcome}) from exc
        self.record(e, outcome)

    def record(self, e: StoredEvent, outcome: Failure | None) -> None:
        self.outcomes[e.id] = outcome
        self._hold.record(e, outcome)


def _redo_known(events: Sequence[StoredEvent], known: dict[Any, Failure] | None, redo: _Redo) -> dict[Any, Failure]:
    """The failures the next run of a batch starts from."""
    merged = dict(known or {})
    if redo.ended is not None:
        # Later events failed outside the batch's transaction (e.g. read-only after a ROLLBACK):
        # not their fault. The next run calls them again.
        order = {e.id: i for i, e in enumerate(events)}
        merged = {k: v for k, v in merged.items() if order[k] < order[redo.ended]}
    merged.update(redo.failed)
    return merged


def _max_runs(events: Sequence[StoredEvent]) -> int:
    """Runs of one batch: the fast one, then careful ones. A careful run is redone only when it
    pinned one more event (whose handler ended the transaction) and never calls a pinned one
    again, so handlers that behave the same each time need at most one careful run per event."""
    return len(events) + 2


def _timed_out(sink: str, out: TimedOut, known: dict[Any, Failure] | None) -> _Redo:
    """What the next run of a batch starts from after its walk was abandoned (nothing of it landed)."""
    if out.event is None:
        if known is None:
            return _Redo()  # pipelined: which handler's statement hung is unknown; the careful walk tells
        raise OutboxError(f"sink {sink}: the relay's own statements of a batch made no progress for "
                          f"{out.seconds:g}s; the batch was abandoned and is tried again")
    e = out.event
    log.warning("sink %s: the handler of event %s (key %r) did not return within %gs; abandoned, its transaction "
                "ended, and the attempt counted", sink, e.id, e.key, out.seconds)
    return _Redo({e.id: Failure(f"the handler did not return within {out.seconds:g}s (--handler-timeout-seconds); "
                                "it was abandoned and its transaction ended")})


def _restless(sink: str, events: Sequence[StoredEvent]) -> OutboxError:
    return OutboxError(f"sink {sink}: a batch of {len(events)} events was redone {_max_runs(events)} times, its "
                       "handlers ending the transaction differently each time; it is tried again later")


class ProjectionSink:
    """Runs one ``Projection`` for a relay (or, with ``replay=True`` and ``shadow_schema``, for a
    rebuild). Owns one connection (sync or async, as the handler is), used by the runner thread."""

    kind = "projection"

    def __init__(self, projection: Projection, dsn: str, *, lease_seconds: float = 30.0, name: str | None = None,
                 replay: bool = False, shadow_schema: str | None = None,
                 application_name: str | None = None, handler_timeout_seconds: float = 30.0) -> None:
        self.projection = projection
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

    def _refuse_outside_writes(self, tables: list[str]) -> None:
        """A rebuild's batch wrote tables outside its shadow schema: it rolls back, and the rebuild stops."""
        if tables:
            declared = ", ".join(self.projection.tables)
            self.fatal = OutboxError(
                f"projection {self.projection.name!r} wrote {', '.join(tables)} during its rebuild, outside the "
                f"rebuild's schema {self._shadow}: live processing writes there too, so these writes would land on "
                f"top of it. A rebuild writes only fresh copies of the declared tables (tables=[{declared}]), "
                "named without a schema in the handler: declare every table the handler writes, or rebuild keys "
                "in place with --key")
            raise self.fatal

    # -- sync ---------------------------------------------------------------------------------

    def deliver(self, events: Sequence[StoredEvent], fences: dict[int, int], commit: Commit,
                abort: threading.Event) -> set[int]:
        if not events:
            return commit({}, None)  # only events queued behind parked keys: nothing to apply
        known: dict[Any, Failure] | None = None  # None: the fast path first
        for _ in range(_max_runs(events)):
            run = functools.partial(self._walk, events=events, fences=fences, commit=commit, abort=abort, known=known)
            try:
                result: set[int] = self._guard.run(run, abort)
                self._guard.check_cap()  # after the batch that charged the abandoned handlers landed
                return result
            except _Redo as redo:
                known = _redo_known(events, known, redo)
            except TimedOut as out:
                known = _redo_known(events, known, _timed_out(self.name, out, known))
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

    def _apply(self, walk: Walk, conn: Conn, events: Sequence[StoredEvent], fences: dict[int, int], commit: Commit,
               abort: threading.Event, known: dict[Any, Failure] | None) -> set[int]:
        """One transaction: fast (``known`` None: pipelined, all or nothing) or careful (a savepoint
        per event; ``known`` holds failures already pinned on events)."""
        batch = _Batch(self, events, fences, known)
        handler = self.observer.handler(self.name, self.projection.handler)  # tracing hook
        with conn.transaction():  # BEGIN READ WRITE (the session's default is read-only)
            if known is None:
                try:
                    with conn.pipeline():
                        conn.execute(query("projections", "begin_batch"), {**self._begin, "token": batch.token})
                        for e, event in batch.todo(abort):
                            walk.calling(e)
                            try:
                                handler(event, conn)
                            except psycopg.Error:
                                raise  # pipelined: which statement failed is only known at the next sync
                            except Exception as exc:  # the handler's own: attributed exactly
                                raise _Redo({e.id: _failure(exc)}) from exc
                            walk.returned()
                            batch.record(e, None)
                        conn.execute(query("projections", "end_batch"), {"token": batch.token})
                except (Aborted, _Redo, Abandoned):
                    raise
                except Exception as exc:  # a statement failed (or the pipeline aborted after it)
                    if conn.broken:
                        raise
                    raise _Redo() from exc
            else:
                conn.execute(query("projections", "begin_batch"), {**self._begin, "token": batch.token})
                for e, event in batch.todo(abort):
                    conn.execute(query("projections", "event_savepoint"))  # undo only this event's writes
                    error: Exception | None = None
                    walk.calling(e)
                    try:
                        handler(event, conn)
                    except Exception as exc:
                        error = exc
                    walk.returned()
                    state = self._close_savepoint(conn, error)
                    batch.settle(e, error, ended=state == "ended", undone=state == "undone")
                conn.execute(query("projections", "end_batch"), {"token": batch.token})
            if self._shadow is not None:
                rows = conn.execute(query("projections", "writes_outside_shadow"), {"shadow": self._shadow}).fetchall()
                self._refuse_outside_writes([r[0] for r in rows])
            walk.may_commit()
            return commit(batch.outcomes, conn)

    @staticmethod
    def _close_savepoint(conn: Conn, error: Exception | None) -> str:
        """After an event's handler: "kept" (its writes released into the batch), "undone" (rolled
        back to its savepoint), or "ended": the savepoint is gone, so the handler ended the batch's
        transaction (COMMIT, END or ROLLBACK, maybe followed by a BEGIN)."""
        if conn.broken and error is not None:
            raise error
        status = conn.info.transaction_status
        if status == pq.TransactionStatus.IDLE:
            return "ended"
        keep = error is None and status == pq.TransactionStatus.INTRANS
        try:
            conn.execute(query("projections", "event_release" if keep else "event_rollback"))
        except psycopg.Error:
            if conn.broken:
                raise
            return "ended"
        return "kept" if keep else "undone"

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

    async def _aapply(self, walk: Walk, conn: AsyncConn, events: Sequence[StoredEvent], fences: dict[int, int],
                      commit: Commit, abort: threading.Event, known: dict[Any, Failure] | None) -> set[int]:
        """``_apply`` for async handlers (not pipelined: a failing statement is known at once)."""
        batch = _Batch(self, events, fences, known)
        handler = self.observer.handler(self.name, self.projection.handler)  # tracing hook
        async with conn.transaction():
            await conn.execute(query("projections", "begin_batch"), {**self._begin, "token": batch.token})
            for e, event in batch.todo(abort):
                if known is not None:
                    await conn.execute(query("projections", "event_savepoint"))
                error: Exception | None = None
                walk.calling(e)
                try:
                    await handler(event, conn)
                except Exception as exc:
                    error = exc
                walk.returned()
                if known is None:
                    if conn.broken and error is not None:
                        raise error
                    batch.settle(e, error, ended=_ended_by(conn, error), undone=False)
                else:
                    state = await self._aclose_savepoint(conn, error)
                    batch.settle(e, error, ended=state == "ended", undone=state == "undone")
            try:
                await conn.execute(query("projections", "end_batch"), {"token": batch.token})
            except psycopg.Error as exc:
                if known is not None or conn.broken:
                    raise
                raise _Redo() from exc  # a handler ended the transaction and began another: the careful walk finds it
            if self._shadow is not None:
                cur = await conn.execute(query("projections", "writes_outside_shadow"), {"shadow": self._shadow})
                self._refuse_outside_writes([r[0] for r in await cur.fetchall()])
            walk.may_commit()
            return await commit.in_async(batch.outcomes, conn)

    @staticmethod
    async def _aclose_savepoint(conn: AsyncConn, error: Exception | None) -> str:
        """``_close_savepoint`` on an async connection."""
        if conn.broken and error is not None:
            raise error
        status = conn.info.transaction_status
        if status == pq.TransactionStatus.IDLE:
            return "ended"
        keep = error is None and status == pq.TransactionStatus.INTRANS
        try:
            await conn.execute(query("projections", "event_release" if keep else "event_rollback"))
        except psycopg.Error:
            if conn.broken:
                raise
            return "ended"
        return "kept" if keep else "undone"

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
