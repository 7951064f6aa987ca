# WARNING: generated from outbox_relay/publish_drivers_async.py by scripts/async_to_sync.py: edit the source, then run
# `python scripts/async_to_sync.py --write`.
"""How ``Outbox.publish`` runs its statements: on psycopg Connection/Cursor or SQLAlchemy
Connection/Session, each joining the transaction the caller controls.

The one source of the drivers: publish_drivers.py is generated from it (scripts/async_to_sync.py).
The statements themselves come from a plan (``Outbox._plan``), a generator with no I/O.
"""

from __future__ import annotations

from collections.abc import Callable, Generator
from typing import Any, TypeVar

from .transactions import require_transaction

T = TypeVar("T")
Step = tuple[str, dict[str, Any]]


def run(plan: Generator[Step, list[Any], T], step: Step,
        execute: Callable[[str, dict[str, Any]], list[Any]]) -> T:
    """Feed ``plan`` the rows of each statement it yields (or the error it raised) until it returns."""
    while True:
        try:
            try:
                rows = execute(*step)
            except Exception as exc:
                step = plan.throw(exc)
            else:
                step = plan.send(rows)
        except StopIteration as done:
            return done.value  # type: ignore[no-any-return]


def executor(conn: Any) -> Callable[[str, dict[str, Any]], list[Any]]:
    """Run statements on ``conn``, once it is known that they join a transaction the caller controls."""
    if hasattr(conn, "exec_driver_sql") or (hasattr(conn, "get_bind") and hasattr(conn, "connection")):
        sa = conn if hasattr(conn, "exec_driver_sql") else conn.connection()  # Connection, or a Session's
        require_transaction(sa.connection.driver_connection, conn)

        def on_sqlalchemy(sql: str, params: dict[str, Any]) -> list[Any]:
            result = sa.exec_driver_sql(sql, params)
            return list(result.fetchall()) if result.returns_rows else [()] * max(result.rowcount, 0)

        return on_sqlalchemy
    if hasattr(conn, "cursor"):  # psycopg AsyncConnection
        require_transaction(conn, conn)

        def on_connection(sql: str, params: dict[str, Any]) -> list[Any]:
            with conn.cursor() as cur:
                cur.execute(sql, params)
                return list(cur.fetchall()) if cur.description is not None else [()] * max(cur.rowcount, 0)

        return on_connection
    if hasattr(conn, "execute") and hasattr(conn, "fetchall"):  # psycopg AsyncCursor
        require_transaction(conn.connection, conn)

        def on_cursor(sql: str, params: dict[str, Any]) -> list[Any]:
            conn.execute(sql, params)
            return list(conn.fetchall()) if conn.description is not None else [()] * max(conn.rowcount, 0)

        return on_cursor
    raise TypeError(f"cannot publish with a {type(conn).__name__}: pass a psycopg connection or cursor, "
                    "or a SQLAlchemy Connection or Session")
