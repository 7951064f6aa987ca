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
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Iterator, Sequence
from typing import Any

import psycopg

from outbox_relay.errors import NonRetriableDelivery, OutboxError
from outbox_relay.sink import Aborted, AsyncConn, Commit, Failure, Outcomes
from outbox_relay.sqlfiles import query
from outbox_relay.store import Conn, EventFilter, StoredEvent

from .declare import Projection, describe
from .event import ProjectionEvent

log = logging.getLogger("outbox_relay.projections")

ABORT_CHECK_EVERY = 64  # events between checks of the hard-stop flag


class _Redo(Exception):
    """The fast path failed: roll back and redo the batch event by event. When a handler itself
    raised, ``failed`` maps that event to its failure, so the redo does not call it again (an
    attempt is one call); a failed statement is only known at the pipeline's next sync."""

    def __init__(self, failed: dict[Any, Failure] | None = None) -> None:
        super().__init__()
        self.failed = failed or {}


def _failure(exc: BaseException) -> Failure:
    return Failure(describe(exc), retriable=not isinstance(exc, NonRetriableDelivery))


class _Batch:
    """One batch's walk, the same for every way of running it: which events go to the handler,
    in order, and what became of each. A key whose event failed (retriably) waits: its later
    events are left out (not attempted)."""

    def __init__(self, sink: ProjectionSink, events: Sequence[StoredEvent], fences: dict[int, int],
                 known: dict[Any, Failure] | None) -> None:
        self.sink = sink
        self.events = events
        self.fences = fences
        self.known = known or {}  # failures the fast path already saw: not called again
        self.outcomes: Outcomes = {}
        self._stuck: set[str] = set()

    def todo(self, abort: threading.Event) -> Iterator[tuple[StoredEvent, ProjectionEvent[Any]]]:
        """The events for the handler; the caller ``record``s each before asking for the next."""
        p = self.sink.projection
        for i, e in enumerate(self.events):
            if i % ABORT_CHECK_EVERY == 0 and abort.is_set():
                raise Aborted()
            if e.key in self._stuck:
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

    def record(self, e: StoredEvent, outcome: Failure | None) -> None:
        self.outcomes[e.id] = outcome
        if outcome is not None and outcome.retriable:
            self._stuck.add(e.key)


class ProjectionSink:
    """Runs one ``Projection`` for a relay (or, with ``replay=True`` and ``shadow_schema``, for a
    rebuild). Owns one connection (sync or async, as the handler is), used by the runner thread."""

    kind = "projection"

    def __init__(self, projection: Projection, dsn: str, *, lease_seconds: float = 30.0, name: str | None = None,
                 replay: bool = False, shadow_schema: str | None = None,
                 guarded_tables: Sequence[int] = ()) -> None:
        self.projection = projection
        self.name = name or projection.name
        self.replay = replay
        self._dsn = dsn
        self._begin = {"idle_ms": str(int(lease_seconds * 1000)), "shadow": shadow_schema}
        self._guarded = list(guarded_tables)  # oids of live tables a rebuild must not write
        self.event_filter: EventFilter | None = projection.event_filter
        self._conn: Conn | None = None
        self._aconn: AsyncConn | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self.fatal: OutboxError | None = None  # set when a rebuild must stop (see _refuse_live_writes)

    def _refuse_live_writes(self, written: int) -> None:
        if written:
            self.fatal = OutboxError(
                f"projection {self.projection.name!r} wrote {written} rows to its live tables during a rebuild: "
                "its handler must name its tables without a schema so that the rebuild's shadow copies are used")
            raise self.fatal

    # -- sync ---------------------------------------------------------------------------------

    def deliver(self, events: Sequence[StoredEvent], fences: dict[int, int], commit: Commit,
                abort: threading.Event) -> set[int]:
        if not events:
            return commit({}, None)  # only events queued behind parked keys: nothing to apply
        if self.projection.is_async:
            loop = self._loop = self._loop or asyncio.new_event_loop()
            return loop.run_until_complete(self._adeliver(events, fences, commit, abort))
        conn = self._connection()
        try:
            try:
                return self._apply(conn, events, fences, commit, abort, None)
            except _Redo as redo:
                return self._apply(conn, events, fences, commit, abort, redo.failed)
        except psycopg.OperationalError:
            self._drop_connection()
            raise

    def _apply(self, conn: Conn, events: Sequence[StoredEvent], fences: dict[int, int], commit: Commit,
               abort: threading.Event, known: dict[Any, Failure] | None) -> set[int]:
        """One transaction: fast (``known`` None: pipelined, all or nothing) or careful (a savepoint
        per event; ``known`` holds failures already observed in the fast path)."""
        batch = _Batch(self, events, fences, known)
        handler = self.projection.handler
        with conn.transaction():
            if known is None:
                try:
                    with conn.pipeline():
                        conn.execute(query("projections", "begin_batch"), self._begin)
                        for e, event in batch.todo(abort):
                            try:
                                handler(event, conn)
                            except psycopg.Error:
                                raise  # pipelined: which statement failed is only known at the next sync
                            except Exception as exc:  # the handler's own: attributed exactly
                                raise _Redo({e.id: _failure(exc)}) from exc
                            batch.record(e, None)
                except (Aborted, _Redo, psycopg.OperationalError):
                    raise
                except Exception as exc:
                    if conn.broken:
                        raise
                    raise _Redo() from exc
            else:
                conn.execute(query("projections", "begin_batch"), self._begin)
                for e, event in batch.todo(abort):
                    try:
                        with conn.transaction():  # a savepoint: undo only this event's writes
                            handler(event, conn)
                        batch.record(e, None)
                    except Exception as exc:
                        if conn.broken:
                            raise
                        batch.record(e, _failure(exc))
            if self._guarded:
                row = conn.execute(query("projections", "live_table_writes"), {"tables": self._guarded}).fetchone()
                self._refuse_live_writes(int(row[0]) if row else 0)
            return commit(batch.outcomes, conn)

    def _connection(self) -> Conn:
        if self._conn is None or self._conn.closed:
            self._conn = psycopg.connect(self._dsn, autocommit=True,
                                         application_name=f"outbox-relay projection {self.name}"[:63])
        return self._conn

    def _drop_connection(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            conn.close()

    # -- async --------------------------------------------------------------------------------

    async def _adeliver(self, events: Sequence[StoredEvent], fences: dict[int, int], commit: Commit,
                        abort: threading.Event) -> set[int]:
        conn = await self._aconnection()
        try:
            try:
                return await self._aapply(conn, events, fences, commit, abort, None)
            except _Redo as redo:
                return await self._aapply(conn, events, fences, commit, abort, redo.failed)
        except psycopg.OperationalError:
            self._aconn = None
            await conn.close()
            raise

    async def _aapply(self, conn: AsyncConn, events: Sequence[StoredEvent], fences: dict[int, int],
                      commit: Commit, abort: threading.Event, known: dict[Any, Failure] | None) -> set[int]:
        """``_apply`` for async handlers (not pipelined: a failing statement is known at once)."""
        batch = _Batch(self, events, fences, known)
        handler = self.projection.handler
        async with conn.transaction():
            await conn.execute(query("projections", "begin_batch"), self._begin)
            for e, event in batch.todo(abort):
                try:
                    if known is None:
                        await handler(event, conn)
                    else:
                        async with conn.transaction():  # a savepoint
                            await handler(event, conn)
                    batch.record(e, None)
                except Exception as exc:
                    if conn.broken:
                        raise
                    if known is None:
                        raise _Redo({e.id: _failure(exc)}) from exc
                    batch.record(e, _failure(exc))
            if self._guarded:
                cur = await conn.execute(query("projections", "live_table_writes"), {"tables": self._guarded})
                row = await cur.fetchone()
                self._refuse_live_writes(int(row[0]) if row else 0)
            return await commit.in_async(batch.outcomes, conn)

    async def _aconnection(self) -> AsyncConn:
        if self._aconn is None or self._aconn.closed:
            self._aconn = await psycopg.AsyncConnection.connect(
                self._dsn, autocommit=True, application_name=f"outbox-relay projection {self.name}"[:63])
        return self._aconn

    def close(self) -> None:
        self._drop_connection()
        if self._loop is not None:
            if self._aconn is not None:
                self._loop.run_until_complete(self._aconn.close())
                self._aconn = None
            self._loop.close()
            self._loop = None

