"""``aapply_projection``: a projection's handler run in a test's transaction over events published in
it, by the relay's own batch walk (projections/walk.py), so the kit can not drift from the relay.

The one source: testing.py (``apply_projection``) is generated from it by scripts/async_to_sync.py;
the decisions without I/O are in testing_parts.py.
"""

from __future__ import annotations

from collections.abc import Iterable
from contextlib import nullcontext
from typing import Any

import psycopg
from psycopg import pq

from outbox_relay.sinks.engine import Failure
from outbox_relay.sqlfiles import query
from outbox_relay.testing.published_event import refuse_other_flavour
from outbox_relay.testing.reading_async import reader_async

from .declare import Projection
from .drive_async import adrive
from .event import ProjectionEvent
from .testing_parts import (
    RELEASE,
    ROLLBACK,
    SAVEPOINT,
    EventRef,
    batch_of,
    check_handler,
    next_known,
    not_psycopg,
    result,
    select,
    selection,
    undo,
)
from .walk import Redo, max_runs, walk


async def aapply_projection(conn: Any, projection: Projection, events: EventRef | Iterable[EventRef] | None = None,
                            *, key: str | None = None, topic: str | None = None,
                            fence: int = 1) -> list[ProjectionEvent[Any]]:
    """Run ``projection``'s handler on ``conn``, in its transaction, over published events, as a relay
    would apply them; return the ``ProjectionEvent`` each handler call got, in order.

    ``events``: ``Published`` results, ``PublishedEvent``s or ids (one, or an iterable); None: every
    event the connection can see. ``key`` / ``topic`` narrow either. The events are read from
    ``outbox.events`` (an id the connection can not see raises ``UnknownEvent``) and applied by the
    relay's own walk (projections/walk.py): in position order, only the types and topics the
    projection takes, each payload upcast and decoded or validated into the declared model,
    ``replay=False``, ``attempt=1``, ``token=FenceToken(fence, 1, xid, seq)`` (as from a relay's
    first read of a bucket it just took), each event under a savepoint, so that a failing handler's
    writes are undone alone. A ``batch=True`` projection gets all the events in one call first, as
    the relay's fast path; if that call fails, its writes are undone and the events are applied one
    at a time, as the relay does.

    The handler gets the connection itself (a SQLAlchemy one's psycopg driver connection), so its
    writes are part of the test's transaction. A connection with no transaction open (autocommit)
    gets one for the call, committed at its end, like a relay's batch.

    Failures end as the relay's first attempt would end: every other event is applied (except the
    later events of a key whose handler raised: they wait behind it), then the first failure is
    raised, with notes naming the others: the handler's own exception, or ``EventDeadLettered`` for
    an event the relay dead-letters without calling the handler (a payload its model refuses, a type
    refused by ``on_unknown="reject"``). Not simulated: leases and fencing (the token is made up),
    checkpoints (applying an event twice applies it twice), retries and backoff, the relay's commit
    guard (a handler that ends the transaction is reported, but what it committed stays committed),
    the session settings of the relay's connection, rebuilds.
    """
    if True:  # ASYNC
        check_handler(projection, conn, async_wanted=True)
    else:
        check_handler(projection, conn, async_wanted=False)
        refuse_other_flavour(conn, "apply_projection", "await aapply_projection(conn, ...)", async_wanted=False)
    query_params, ids = selection(events, key, topic)
    read = await reader_async(conn)
    stored = select(projection, await read(query("testing", "published"), query_params), ids, key, topic)
    tx = await apsycopg_connection(conn)
    async with tx.transaction() if tx.info.transaction_status == pq.TransactionStatus.IDLE else nullcontext():
        known: dict[Any, Failure] | None = None if projection.batch else {}
        for _ in range(max_runs(stored)):
            batch = batch_of(projection, stored, fence, known)
            fast = known is None
            if fast:
                await tx.execute(SAVEPOINT)
            try:
                await adrive(walk(batch, careful=not fast, end=False), tx, projection.handler)
            except Redo as redo:
                if fast:
                    undo(projection, tx.info.transaction_status)
                    await tx.execute(ROLLBACK)
                known = next_known(projection, stored, known, redo)
                continue
            if fast:
                await tx.execute(RELEASE)
            break
        else:
            raise AssertionError("unreachable: a careful walk is redone only when a handler ended the transaction")
    return result(projection, batch)  # after the commit of a transaction begun here: failures keep the rest


async def apsycopg_connection(conn: Any) -> psycopg.AsyncConnection[Any]:
    """The psycopg connection a handler gets: ``conn``, a cursor's, or a SQLAlchemy one's driver connection."""
    if isinstance(conn, psycopg.AsyncCursor):
        conn = conn.connection
    if isinstance(conn, psycopg.AsyncConnection):
        return conn
    if hasattr(conn, "exec_driver_sql"):
        if True:  # ASYNC
            driver = (await conn.get_raw_connection()).driver_connection
        else:
            driver = conn.connection.driver_connection
    elif hasattr(conn, "get_bind") and hasattr(conn, "connection"):
        if True:  # ASYNC
            driver = (await (await conn.connection()).get_raw_connection()).driver_connection
        else:
            driver = conn.connection().connection.driver_connection
    else:
        if True:  # ASYNC
            raise TypeError(f"cannot apply a projection on a {type(conn).__name__}: pass a psycopg AsyncConnection "
                            "or cursor, or a SQLAlchemy AsyncConnection or AsyncSession")
        else:
            raise TypeError(f"cannot apply a projection on a {type(conn).__name__}: pass a psycopg connection or "
                            "cursor, or a SQLAlchemy Connection or Session")
    if not isinstance(driver, psycopg.AsyncConnection):
        raise TypeError(not_psycopg(conn, driver))
    return driver
