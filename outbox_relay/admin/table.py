"""What every admin query returns (``Table``), how one runs, and the relays' defaults the actions assume."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Any

import psycopg

from .. import history
from ..settings import RelaySettings
from ..sqlfiles import query

Conn = psycopg.Connection[Any]

# The relays' defaults: "attempt 3 of N", and how recently a relay running a sink was heard from.
DEFAULT_MAX_ATTEMPTS = int(RelaySettings.model_fields["max_attempts"].default)
DEFAULT_WORKER_TTL_SECONDS = float(RelaySettings.model_fields["worker_ttl_seconds"].default)
# What the default retention class keeps unless set (the relays' --retention-seconds), and the span of
# the partition a roll starts (the relays' --partition-seconds).
DEFAULT_RETENTION_SECONDS = float(RelaySettings.model_fields["retention_seconds"].default)
DEFAULT_PARTITION_SECONDS = float(RelaySettings.model_fields["partition_seconds"].default)


@dataclass(frozen=True)
class Table:
    """Rows of one admin query, with its column names (what the CLI prints as a table)."""

    columns: tuple[str, ...]
    rows: list[tuple[Any, ...]]

    def records(self) -> list[dict[str, Any]]:
        """Each row as a mapping of column name to value."""
        return [dict(zip(self.columns, r, strict=True)) for r in self.rows]


def fetch_table(conn: Conn, name: str, params: dict[str, Any] | None = None, *, group: str = "admin") -> Table:
    """Run the query ``name`` of sql/queries/<group>.sql (admin.sql; console.sql for the console's reads)."""
    with conn.cursor() as cur:
        cur.execute(query(group, name), params or {})
        return Table(tuple(d.name for d in cur.description or []), list(cur.fetchall()))


def fetch_history(conn: Conn, name: str, retention_seconds: float) -> Table:
    """Run history.sql's query ``name`` (history.py)."""
    columns, found = history.rows(conn, name, retention_seconds)
    return Table(tuple(columns), found)


def time_text(value: datetime | None) -> str:
    """A timestamp as the CLI shows it (empty for None)."""
    return "" if value is None else value.isoformat(sep=" ", timespec="seconds")
