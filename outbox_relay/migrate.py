"""Apply ``sql/migrations/NNNN_*.sql`` in order, once, safe when many processes run it at once."""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psycopg

from .dsn import redact
from .errors import SchemaError
from .sqlfiles import sql_dir

log = logging.getLogger("outbox_relay.migrate")

# Serialises concurrent `outbox-relay migrate` runs (transaction-scoped, never leaks).
MIGRATION_LOCK = 0x6F7574626F78  # "outbox"
_FILE = re.compile(r"^(\d{4})_(\w+)\.sql$")

BOOTSTRAP = """
CREATE SCHEMA IF NOT EXISTS outbox;
CREATE TABLE IF NOT EXISTS outbox.schema_migrations (
    version    integer     NOT NULL PRIMARY KEY,
    name       text        NOT NULL,
    applied_at timestamptz NOT NULL DEFAULT clock_timestamp()
);
"""


@dataclass(frozen=True)
class Migration:
    version: int
    name: str
    path: Path


def migrations() -> list[Migration]:
    found = []
    for path in sorted((sql_dir() / "migrations").glob("*.sql")):
        m = _FILE.match(path.name)
        if m:
            found.append(Migration(int(m.group(1)), m.group(2), path))
    return found


def latest_version() -> int:
    return migrations()[-1].version


def migrate(conninfo: str) -> list[Migration]:
    """Bring the schema up to date; returns the migrations this call applied."""
    try:
        conn = psycopg.connect(conninfo, autocommit=True)
    except psycopg.OperationalError as exc:
        raise SchemaError(f"cannot connect to {redact(conninfo)}: {redact(str(exc))}") from None
    applied: list[Migration] = []
    with conn, conn.transaction():
        conn.execute("SELECT pg_advisory_xact_lock(%s)", (MIGRATION_LOCK,))
        conn.execute(BOOTSTRAP)
        done = {r[0] for r in conn.execute("SELECT version FROM outbox.schema_migrations")}
        for m in migrations():
            if m.version in done:
                continue
            log.info("applying migration %04d_%s", m.version, m.name)
            conn.execute(m.path.read_text())  # trusted file shipped with the package
            conn.execute("INSERT INTO outbox.schema_migrations (version, name) VALUES (%s, %s)", (m.version, m.name))
            applied.append(m)
    return applied


def check_schema(conn: psycopg.Connection[Any]) -> None:
    """Refuse to run against a database that is not migrated, or migrated past this version."""
    row = conn.execute(
        "SELECT to_regclass('outbox.schema_migrations') IS NOT NULL"
    ).fetchone()
    if not row or not row[0]:
        raise SchemaError("the outbox schema is missing: run `outbox-relay migrate` first")
    current = conn.execute("SELECT coalesce(max(version), 0) FROM outbox.schema_migrations").fetchone()
    version = int(current[0]) if current else 0
    if version < latest_version():
        raise SchemaError(f"the outbox schema is at version {version}, this relay needs {latest_version()}: "
                          "run `outbox-relay migrate`")
