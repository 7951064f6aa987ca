"""``apublished``: the events a test's async connection can see. The one source of the reading
drivers: reading.py (``published``) is generated from it by scripts/async_to_sync.py."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from outbox_relay.sqlfiles import query

from .published_event import PublishedEvent, Source, filter_events, from_rows, local, params, refuse_other_flavour


async def apublished(source: Source, *, key: str | None = None, type: str | None = None,
                     topic: str | None = None) -> list[PublishedEvent]:
    """The events ``source`` can see, of ``key``/``type``/``topic`` if given, in position order.

    On a connection inside a transaction that includes the events that transaction published and has
    not committed; other transactions' events only once committed (what the relays see, too).
    """
    events = local(source)
    if events is not None:
        return filter_events(events, key=key, type=type, topic=topic)
    if True:  # ASYNC
        read = await reader_async(source)
    else:
        refuse_other_flavour(source, "published", "await apublished(conn, ...)", async_wanted=False)
        read = reader_async(source)
    return from_rows(await read(query("testing", "published"), params(key, type, topic)))


async def reader_async(conn: Any) -> Callable[[str, dict[str, Any]], Awaitable[list[Any]]]:
    """Run a query on ``conn`` and return its rows. Unlike ``publish``'s executor, no open
    transaction is required: reading commits nothing."""
    if True:  # ASYNC
        refuse_other_flavour(conn, "apublished", "published(...)", async_wanted=True)
    if hasattr(conn, "exec_driver_sql") or (hasattr(conn, "get_bind") and hasattr(conn, "connection")):
        sa = conn if hasattr(conn, "exec_driver_sql") else await conn.connection()  # Connection, or a Session's

        async def on_sqlalchemy(sql: str, params: dict[str, Any]) -> list[Any]:
            result = await sa.exec_driver_sql(sql, params)
            return list(result.fetchall())

        return on_sqlalchemy
    if hasattr(conn, "cursor"):  # psycopg AsyncConnection

        async def on_connection(sql: str, params: dict[str, Any]) -> list[Any]:
            async with conn.cursor() as cur:
                await cur.execute(sql, params)
                return list(await cur.fetchall())

        return on_connection
    if hasattr(conn, "execute") and hasattr(conn, "fetchall"):  # a cursor: a cursor of its connection
        return await reader_async(conn.connection)
    if True:  # ASYNC
        raise TypeError(f"cannot read events from a {type(conn).__name__}: pass a psycopg AsyncConnection or cursor, "
                        "or a SQLAlchemy AsyncConnection or AsyncSession")
    else:
        raise TypeError(f"cannot read events from a {type(conn).__name__}: pass a psycopg connection or cursor, a "
                        "SQLAlchemy Connection or Session, a FakeOutbox or a list of PublishedEvent")
