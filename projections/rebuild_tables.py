"""The live tables of a rebuild (rebuild.py): what they are, whether a swap can carry them over, their
fresh copies in the shadow schema, and the grants and owner the copies take over at the switch."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import psycopg
from psycopg import sql

from outbox_relay.sqlfiles import query

from .declare import Projection, reserved_schema
from .rebuild_error import RebuildError

PRIVILEGES = {"SELECT", "INSERT", "UPDATE", "DELETE", "TRUNCATE", "REFERENCES", "TRIGGER", "MAINTAIN"}


def template(query_name: str, **identifiers: sql.Composable) -> sql.Composed:
    """A DDL template of rebuild.sql with its {placeholders} filled by identifiers."""
    return sql.SQL(query("rebuild", query_name)).format(**identifiers)


@dataclass(frozen=True)
class LiveTable:
    oid: int
    schema: str
    name: str
    owner: str

    @property
    def qualified(self) -> str:
        return f"{self.schema}.{self.name}"


def live_table(conn: psycopg.Connection[Any], projection: Projection, name: str) -> LiveTable:
    row = conn.execute(query("rebuild", "table_info"), {"name": name}).fetchone()
    if row is None:
        raise RebuildError(f"projection {projection.name!r}: table {name!r} does not exist (a rebuild "
                           "copies the live table's definition, so create it first)")
    if row[4] != "r":
        raise RebuildError(f"projection {projection.name!r}: {name!r} is not a plain table")
    schema = str(row[1])
    if reserved_schema(schema):
        raise RebuildError(f"projection {projection.name!r}: table {name!r} is {schema}.{row[2]}, in a "
                           "schema a rebuild must never swap tables of (the relay's own, the system "
                           "catalogs', or a rebuild's); nothing was changed")
    return LiveTable(int(row[0]), schema, row[2], row[3])


def table_oid(conn: psycopg.Connection[Any], schema: str, name: str) -> int | None:
    row = conn.execute(query("rebuild", "table_oid"), {"schema": schema, "name": name}).fetchone()
    return int(row[0]) if row else None


def check_swappable(conn: psycopg.Connection[Any], tables: Sequence[LiveTable]) -> None:
    blockers = [f"{t.qualified}: {b}" for t in tables
                for (b,) in conn.execute(query("rebuild", "table_blockers"), {"oid": t.oid})]
    if blockers:
        raise RebuildError("a rebuild swaps fresh tables in and can not carry these over; drop them (and "
                           "re-create them after the rebuild) or rebuild in place with --key: "
                           + "; ".join(blockers))


def copy_table(conn: psycopg.Connection[Any], shadow: str, t: LiveTable) -> None:
    """A fresh copy of live table ``t`` in schema ``shadow``: definition, own sequences, foreign keys."""
    copy = sql.Identifier(shadow, t.name)
    conn.execute(template("create_copy", copy=copy, live=sql.Identifier(t.schema, t.name)))
    for column, sequence in conn.execute(query("rebuild", "serial_columns"), {"oid": t.oid}).fetchall():
        # LIKE copies the default, which still draws from the live table's sequence.
        conn.execute(template("own_sequence", sequence=sql.Identifier(shadow, sequence), table=copy,
                               column=sql.Identifier(column)))
        conn.execute(template("default_from_sequence", table=copy, column=sql.Identifier(column),
                               sequence_name=sql.Literal(f"{shadow}.{sequence}")))
    for name, definition in conn.execute(query("rebuild", "foreign_keys"), {"oid": t.oid}).fetchall():
        conn.execute(template("add_constraint", table=copy, name=sql.Identifier(name),
                               definition=sql.SQL(definition)))  # catalog text from pg_get_constraintdef


def carry_privileges(conn: psycopg.Connection[Any], old: LiveTable) -> None:
    new = sql.Identifier(old.schema, old.name)
    for grantee, privilege, grantable in conn.execute(query("rebuild", "table_grants"), {"oid": old.oid}):
        if privilege not in PRIVILEGES:
            continue
        conn.execute(template("grant_with_option" if grantable else "grant", privilege=sql.SQL(privilege),
                               table=new, grantee=sql.Identifier(grantee) if grantee else sql.SQL("PUBLIC")))
    current = conn.execute("SELECT current_user").fetchone()
    if current is not None and current[0] != old.owner:
        conn.execute(template("set_owner", table=new, owner=sql.Identifier(old.owner)))
