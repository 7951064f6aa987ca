"""How ``Outbox.apublish`` runs its statements: on psycopg AsyncConnection/AsyncCursor or SQLAlchemy
AsyncConnection/AsyncSession, each joining the transaction the caller controls.

The one source of the drivers: publish_drivers.py is generated from it (scripts/async_to_sync.py).
The statements themselves come from a plan (``Outbox._plan``), a generator with no I/O.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Generator
from typing import Any, TypeVar

from .transactions import require_transaction

T = TypeVar("T")
Step = tuple[str, dict[str, Any]]


async def run_async(plan: Generator[Step, list[Any], T], step: Step,
                    execute: Callable[[str, dict[str, Any]], Awaitable[list[Any]]]) -> T:
    """Feed ``plan`` the rows of each statement it yields (or the error it raised) until it returns."""
    while True:
        try:
            try:
                rows = await execute(*step)
            except Exception as exc:
                step = plan.throw(exc)
            else:
                step = plan.send(rows)
        except StopIteration as done:
            return done.value  # type: ignore[no-any-return]


async def executor_async(conn: Any) -> Callable[[str, dict[str, Any]], Awaitable[list[Any]]]:
    """Run statements on ``conn``, once it is known that they join a transaction the caller controls."""
    if hasattr(conn, "exec_driver_sql") or (hasattr(conn, "get_bind") and hasattr(conn, "connection")):
        sa = conn if hasattr(conn, "exec_driver_sql") else await conn.connection()  # Connection, or a Session's
        if True:  # ASYNC
            require_transaction((await sa.get_raw_connection()).driver_connection, conn)
        else:
            require_transaction(sa.connection.driver_connection, conn)

        async def on_sqlalchemy(sql: str, params: dict[str, Any]) -> list[Any]:
            result = await sa.exec_driver_sql(sql, params)
            return list(result.fetchall()) if result.returns_rows else [()] * max(result.rowcount, 0)

        return on_sqlalchemy
    if hasattr(conn, "cursor"):  # psycopg AsyncConnection
        require_transaction(conn, conn)

        async def on_connection(sql: str, params: dict[str, Any]) -> list[Any]:
            async with conn.cursor() as cur:
                await cur.execute(sql, params)
                return list(await cur.fetchall()) if cur.description is not None else [()] * max(cur.rowcount, 0)

        return on_connection
    if hasattr(conn, "execute") and hasattr(conn, "fetchall"):  # psycopg AsyncCursor
        require_transaction(conn.connection, conn)

        async def on_cursor(sql: str, params: dict[str, Any]) -> list[Any]:
            await conn.execute(sql, params)
            return list(await conn.fetchall()) if conn.description is not None else [()] * max(conn.rowcount, 0)

        return on_cursor
    if True:  # ASYNC
        raise TypeError(f"cannot publish with a {type(conn).__name__}: pass a psycopg AsyncConnection or cursor, "
                        "or a SQLAlchemy AsyncConnection or AsyncSession")
    else:
        raise TypeError(f"cannot publish with a {type(conn).__name__}: pass a psycopg connection or cursor, "
                        "or a SQLAlchemy Connection or Session")
