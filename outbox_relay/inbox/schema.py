"""The inbox's tables, in their own schema ``outbox_inbox`` with their own migrations (``sql/inbox/``).

Why not a migration of the outbox schema: the service that consumes the topics usually has its own
database, without the outbox (it may publish nothing), and should not need the relay's tables,
triggers and functions to dedupe what it consumes. ``outbox-relay inbox migrate`` creates only these.
"""

from __future__ import annotations

from typing import Any

import psycopg

from ..dsn import redact
from ..errors import SchemaError
from ..migrate import INBOX, apply


def inbox_migrations() -> list[tuple[int, str, str]]:
    """(version, name, SQL) of every file in ``sql/inbox/``, in order."""
    return [(m.version, m.name, m.path.read_text()) for m in INBOX.migrations()]


def migrate_inbox(conn: psycopg.Connection[Any]) -> list[str]:
    """Create or update the inbox tables on an open connection (one transaction); returns what it applied.
    The outbox's runner (``migrate.apply``), over ``sql/inbox/``."""
    return [f"{m.version:04d}_{m.name}" for m in apply(conn, INBOX, INBOX.migrations())]


def check_inbox_schema(conn: psycopg.Connection[Any]) -> None:
    """Refuse to consume into a database whose inbox tables are missing or older than this code."""
    row = conn.execute("SELECT to_regclass('outbox_inbox.schema_migrations') IS NOT NULL").fetchone()
    if not row or not row[0]:
        raise SchemaError("the inbox tables are missing: run `outbox-relay inbox migrate --dsn ...` first")
    current = conn.execute("SELECT coalesce(max(version), 0) FROM outbox_inbox.schema_migrations").fetchone()
    have = int(current[0]) if current else 0
    need = INBOX.migrations()[-1].version
    if have < need:
        raise SchemaError(f"the inbox tables are at version {have}, this code needs {need}: "
                          "run `outbox-relay inbox migrate`")


def connect(dsn: str, **kwargs: Any) -> psycopg.Connection[Any]:
    """A connection, or SchemaError naming the (redacted) database that can not be reached."""
    try:
        return psycopg.connect(dsn, **kwargs)
    except psycopg.OperationalError as exc:
        raise SchemaError(f"cannot connect to {redact(dsn)}: {redact(str(exc))}") from None
