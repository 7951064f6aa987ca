# WARNING: generated from outbox_relay/testing/reading_async.py by scripts/async_to_sync.py: edit the source, then run
# `python scripts/async_to_sync.py --write`.
"""``published``: the events a test's async connection can see. The one source of the reading
drivers: reading.py (``published``) is generated from it by scripts/async_to_sync.py."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from outbox_relay.sqlfiles import query

from .published_event import PublishedEvent, Source, filter_events, from_rows, local, params, refuse_other_flavour


def published(source: Source, *, key: str | None = None, type: str | None = None,
              topic: str | None = None) -> list[PublishedEvent]:
    """The events ``source`` can see, of ``key``/``type``/``topic`` if given, in position order.

    On a connection inside a transaction that includes the events that transaction published and has
    not committed; other transactions' events only once committed (what the relays see, too).
    """
    events = local(source)
    if events is not None:
        return filter_events(events, key=key, type=type, topic=topic)
    refuse_other_flavour(source, "published", "await apublished(conn, ...)", async_wanted=False)
    read = reader(source)
    return from_rows(read(query("testing", "published"), params(key, type, topic)))


def reader(conn: Any) -> Callable[[str, dict[str, Any]], list[Any]]:
    """Run a query on ``conn`` and return its rows. Unlike ``publish``'s executor, no open
    transaction is required: reading commits nothing."""
    if hasattr(conn, "exec_driver_sql") or (hasattr(conn, "get_bind") and hasattr(conn, "connection")):
        sa = conn if hasattr(conn, "exec_driver_sql") else conn.connection()  # Connection, or a Session's

        def on_sqlalchemy(sql: str, params: dict[str, Any]) -> list[Any]:
            result = sa.exec_driver_sql(sql, params)
            return list(result.fetchall())

        return on_sqlalchemy
    if hasattr(conn, "cursor"):  # psycopg AsyncConnection

        def on_connection(sql: str, params: dict[str, Any]) -> list[Any]:
            with conn.cursor() as cur:
                cur.execute(sql, params)
                return list(cur.fetchall())

        return on_connection
    if hasattr(conn, "execute") and hasattr(conn, "fetchall"):  # a cursor: a cursor of its connection
        return reader(conn.connection)
    raise TypeError(f"cannot read events from a {type(conn).__name__}: pass a psycopg connection or cursor, a "
                    "SQLAlchemy Connection or Session, a FakeOutbox or a list of PublishedEvent")
