"""The check that a write joins a transaction the caller controls (publish's, the testing kit's)."""

from __future__ import annotations

from typing import Any

from .errors import NoTransaction

# libpq's PQTransactionStatus (psycopg 3 and psycopg2 both report it): no transaction open.
IDLE = 0


def require_transaction(driver: Any, given: Any) -> None:
    """Refuse a driver connection that would commit the events on their own: autocommit mode with no
    transaction open. The status is the server's own (libpq's, from its last reply), so a transaction
    opened by ``conn.transaction()`` or a plain BEGIN counts, and a connection without autocommit is
    fine (the driver opens one). A driver that reports neither is trusted."""
    status = getattr(getattr(driver, "info", None), "transaction_status", None)
    if getattr(driver, "autocommit", False) is not True or status is None or int(status) != IDLE:
        return
    if hasattr(given, "exec_driver_sql") or hasattr(given, "get_bind"):
        how = ("it runs with isolation_level='AUTOCOMMIT'; publish with a Connection or Session of an engine "
               "without it (or .execution_options(isolation_level='READ COMMITTED') before the transaction)")
    else:
        how = "it is in autocommit mode; publish inside `with conn.transaction():`, or on a connection without " \
              "autocommit"
    raise NoTransaction(f"publish refused: no transaction is open on this {type(given).__name__} and {how}. "
                        "Otherwise the event would commit at once, on its own, and stay published even if the "
                        "business change is rolled back. Nothing was written.")
