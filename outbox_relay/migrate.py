"""The one migration runner: a schema's ``sql/<folder>/NNNN_*.sql`` in order, once, safe when many processes
run it at once (the outbox's ``sql/migrations/``, the inbox's ``sql/inbox/``)."""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, LiteralString

import psycopg
from psycopg import sql

from .dsn import redact
from .errors import SchemaError
from .privileges import close_to_public
from .sqlfiles import sql_dir

log = logging.getLogger("outbox_relay.migrate")

_FILE = re.compile(r"^(\d{4})_(\w+)\.sql$")
# Each schema's bookkeeping table, made before its first migration runs.
BOOTSTRAP: LiteralString = """
CREATE SCHEMA IF NOT EXISTS {schema};
CREATE TABLE IF NOT EXISTS {schema}.schema_migrations (
    version    integer     NOT NULL PRIMARY KEY,
    name       text        NOT NULL,
    applied_at timestamptz NOT NULL DEFAULT clock_timestamp()
);
"""
# A migration that older code can not run against says so in its header.
_MIN_CODE = re.compile(r"^-- min-code-version: (\d+)\s*$", re.MULTILINE)


@dataclass(frozen=True)
class Migration:
    version: int
    name: str
    path: Path

    @property
    def min_code_version(self) -> int | None:
        """The oldest code (by the schema version it was written for) that still runs once this is applied."""
        m = _MIN_CODE.search(self.path.read_text())
        return int(m.group(1)) if m else None


@dataclass(frozen=True)
class Schema:
    """One of the product's schemas with its own numbered migrations: ``outbox`` (``sql/migrations/``) and
    ``outbox_inbox`` (``sql/inbox/``). The one runner below applies either."""

    name: str  # a fixed name, never input
    folder: str  # under sql/
    lock: int  # serialises concurrent runs of this schema's migrations (transaction-scoped, never leaks)

    def migrations(self) -> list[Migration]:
        found = []
        for path in sorted((sql_dir() / self.folder).glob("*.sql")):
            m = _FILE.match(path.name)
            if m:
                found.append(Migration(int(m.group(1)), m.group(2), path))
        return found

    def sql(self, text: LiteralString) -> sql.Composed:
        """``text`` with ``{schema}`` as this schema's name."""
        return sql.SQL(text).format(schema=sql.Identifier(self.name))


OUTBOX = Schema("outbox", "migrations", 0x6F7574626F78)  # lock: "outbox"
INBOX = Schema("outbox_inbox", "inbox", 0x696E626F78)  # lock: "inbox" (not the outbox's: two schemas, two runs)


def migrations() -> list[Migration]:
    return OUTBOX.migrations()


def latest_version() -> int:
    return migrations()[-1].version


def migrate(conninfo: str) -> list[Migration]:
    """Bring the schema up to date; returns the migrations this call applied."""
    try:
        conn = psycopg.connect(conninfo, autocommit=True)
    except psycopg.OperationalError as exc:
        raise SchemaError(f"cannot connect to {redact(conninfo)}: {redact(str(exc))}") from None
    with conn:
        return apply_migrations(conn)


def apply_migrations(conn: psycopg.Connection[Any]) -> list[Migration]:
    """``migrate`` on an open connection (Django's, say): one transaction, or a savepoint of the one
    open; returns the migrations this call applied."""
    return apply(conn, OUTBOX, migrations())


def apply(conn: psycopg.Connection[Any], schema: Schema, shipped: list[Migration]) -> list[Migration]:
    """Apply what of ``shipped`` the database lacks, in order, once, in one transaction; safe when many
    processes run it at once. Returns the migrations this call applied."""
    applied: list[Migration] = []
    with conn.transaction():
        conn.execute("SELECT pg_advisory_xact_lock(%s)", (schema.lock,))
        conn.execute(schema.sql(BOOTSTRAP))
        check_names(conn, schema, shipped)
        done = {r[0] for r in conn.execute(schema.sql("SELECT version FROM {schema}.schema_migrations"))}
        for m in shipped:
            if m.version in done:
                continue
            log.info("applying %s migration %04d_%s", schema.name, m.version, m.name)
            conn.execute(m.path.read_bytes())  # trusted file shipped with the package
            conn.execute(schema.sql("INSERT INTO {schema}.schema_migrations (version, name) VALUES (%s, %s)"),
                         (m.version, m.name))
            if m.min_code_version is not None:  # outbox: the column exists from 0005 on, the first to set it
                conn.execute(schema.sql("UPDATE {schema}.schema_migrations SET min_code_version = %s "
                                        "WHERE version = %s"), (m.min_code_version, m.version))
            applied.append(m)
        if applied:  # a function a migration added starts closed
            conn.execute(close_to_public(schema.name))
    return applied


def check_names(conn: psycopg.Connection[Any], schema: Schema, shipped: list[Migration]) -> None:
    """Refuse a database whose version N was recorded under another name than this code's N (migrated by
    another build, or by a migration later withdrawn and its number reused): migrate would skip this
    code's N for good and every process would take the schema for current."""
    recorded = dict(conn.execute(schema.sql("SELECT version, name FROM {schema}.schema_migrations")).fetchall())
    for m in shipped:
        name = recorded.get(m.version)
        if name is not None and name != m.name:
            raise SchemaError(
                f"the {schema.name} schema's version {m.version} is {str(name)!r}, but this code's migration "
                f"{m.version} is {m.name!r}: the database was migrated by another build of outbox-relay. Migrate it "
                "with the build that created it, or restore it, before running this one")


def check_schema(conn: psycopg.Connection[Any]) -> None:
    """Refuse to run against a database that is not migrated, or whose migrations need newer code.

    A newer schema is fine as long as every migration past this code's says it still supports
    it (``-- min-code-version`` in the migration's header), so relays of the previous release keep
    running while a rollout migrates the database first."""
    row = conn.execute(
        "SELECT to_regclass('outbox.schema_migrations') IS NOT NULL"
    ).fetchone()
    if not row or not row[0]:
        raise SchemaError("the outbox schema is missing: run `outbox-relay migrate` first")
    current = conn.execute("SELECT coalesce(max(version), 0) FROM outbox.schema_migrations").fetchone()
    version = int(current[0]) if current else 0
    ours = latest_version()
    if version < ours:
        raise SchemaError(f"the outbox schema is at version {version}, this relay needs {ours}: "
                          "run `outbox-relay migrate`")
    check_names(conn, OUTBOX, migrations())
    # At version 5 or later: the column exists (0005 added it).
    needs = conn.execute("SELECT max(min_code_version) FROM outbox.schema_migrations").fetchone()
    required = needs[0] if needs else None
    if required is not None and int(required) > ours:
        raise SchemaError(f"the outbox schema is at version {version}, which needs outbox-relay code written for "
                          f"schema version {required} or later; this code is for version {ours}: upgrade it")
