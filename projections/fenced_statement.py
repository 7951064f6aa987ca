"""The statement of a fenced upsert (fencing.py, fencing_async.py): write unless the stored token is as new."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from psycopg import sql


def upsert_statement(table: str, key: Mapping[str, Any], values: Mapping[str, Any], token_column: str) -> sql.Composed:
    if not key:
        raise ValueError("fenced_upsert needs at least one key column")
    target = sql.Identifier(*table.split("."))
    columns = [*key, *values, token_column]
    updates = [*values, token_column]
    return sql.SQL(
        "INSERT INTO {table} ({columns}) VALUES ({params}) "
        "ON CONFLICT ({key}) DO UPDATE SET {updates} "
        "WHERE {table}.{token} < EXCLUDED.{token}"
    ).format(
        table=target,
        columns=sql.SQL(", ").join(map(sql.Identifier, columns)),
        params=sql.SQL(", ").join(sql.Placeholder(c) for c in columns),
        key=sql.SQL(", ").join(map(sql.Identifier, key)),
        updates=sql.SQL(", ").join(sql.SQL("{c} = EXCLUDED.{c}").format(c=sql.Identifier(c)) for c in updates),
        token=sql.Identifier(token_column),
    )
