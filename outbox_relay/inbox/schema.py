"""The inbox's tables, in their own schema ``outbox_inbox`` with their own migrations (``sql/inbox/``).

Why not a migration of the outbox schema: the service that consumes the topics usually has its own
database, without the outbox (it may publish nothing), and should not need the relay's tables,
triggers and functions to dedupe what it consumes. ``outbox-relay inbox migrate`` creates only these.
"""

from __future__ import annotations

import logging
import re
from typing import Any

import psycopg

from ..dsn import redact
from ..errors import SchemaError
from ..privileges import close_to_public
from ..sqlfiles import sql_dir

log = logging.getLogger("outbox_relay.inbox")

# Serialises concurrent `inbox migrate` runs (transaction-scoped); not the outbox's lock.
INBOX_MIGRATION_LOCK = 0x696E626F78  # "inbox"
_FILE = re.compile(r"^(\d{4})_(\w+)\.sql$")

BOOTSTRAP = """
CREATE SCHEMA IF NOT EXISTS outbox_inbox;
CREATE TABLE IF NOT EXISTS outbox_inbox.schema_migrations (
    version    integer     NOT NULL PRIMARY KEY,
    name       text        NOT NULL,
    applied_at timestamptz NOT NULL DEFAULT clock_timestamp()
);
"""


def inbox_migrations() -> list[tuple[int, str, str]]:
    """(version, name, SQL) of every file in ``sql/inbox/``, in order."""
    found = []
    for path in sorted((sql_dir() / "inbox").glob("*.sql")):
        m = _FILE.match(path.name)
        if m:
            found.append((int(m.group(1)), m.group(2), path.read_text()))
    return found


def migrate_inbox(conn: psycopg.Connection[Any]) -> list[str]:
    """Create or update the inbox tables on an open connection (one transaction); returns what it applied."""
    applied: list[str] = []
    with conn.transaction():
        conn.execute("SELECT pg_advisory_xact_lock(%s)", (INBOX_MIGRATION_LOCK,))
        conn.execute(BOOTSTRAP)
        done = {r[0] for r in conn.execute("SELECT version FROM outbox_inbox.schema_migrations")}
        for version, name, text in inbox_migrations():
            if version in done:
                continue
            log.info("applying inbox migration %04d_%s", version, name)
            conn.execute(text.encode())  # trusted file shipped with the package
            conn.execute("INSERT INTO outbox_inbox.schema_migrations (version, name) VALUES (%s, %s)", (version, name))
            applied.append(f"{version:04d}_{name}")
        if applied:  # nothing open to PUBLIC, a later migration's function included
            conn.execute(close_to_public("outbox_inbox"))
    return applied


def check_inbox_schema(conn: psycopg.Connection[Any]) -> None:
    """Refuse to consume into a database whose inbox tables are missing or older than this code."""
    row = conn.execute("SELECT to_regclass('outbox_inbox.schema_migrations') IS NOT NULL").fetchone()
    if not row or not row[0]:
        raise SchemaError("the inbox tables are missing: run `outbox-relay inbox migrate --dsn ...` first")
    current = conn.execute("SELECT coalesce(max(version), 0) FROM outbox_inbox.schema_migrations").fetchone()
    have = int(current[0]) if current else 0
    need = inbox_migrations()[-1][0]
    if have < need:
        raise SchemaError(f"the inbox tables are at version {have}, this code needs {need}: "
                          "run `outbox-relay inbox migrate`")


def connect(dsn: str, **kwargs: Any) -> psycopg.Connection[Any]:
    """A connection, or SchemaError naming the (redacted) database that can not be reached."""
    try:
        return psycopg.connect(dsn, **kwargs)
    except psycopg.OperationalError as exc:
        raise SchemaError(f"cannot connect to {redact(dsn)}: {redact(str(exc))}") from None
