"""The backlog per sink (what ``outbox-relay lag`` prints), as a library call.

    from outbox_relay.backlog import backlog
    with psycopg.connect(dsn) as conn:
        for sink in backlog(conn):
            print(sink.sink, sink.pending, sink.oldest_pending_seconds)

One query (sql/queries/admin.sql ``backlog``); a health check or a test can call it in-process
instead of starting the command.
"""

from __future__ import annotations

from dataclasses import dataclass
from decimal import Decimal
from typing import Any

import psycopg

from .errors import OutboxError
from .sqlfiles import query

__all__ = ["SinkBacklog", "backlog"]


@dataclass(frozen=True)
class SinkBacklog:
    """One sink's backlog: events not yet delivered (``pending``, the oldest one's age in seconds,
    None when nothing is pending), events parked for a retry, events held by paused keys, paused keys,
    dead letters, and its buckets' leases (held, and held but expired)."""

    sink: str
    kind: str
    pending: int
    oldest_pending_seconds: float | None
    parked: int
    paused: int
    paused_keys: int
    dead_letters: int
    leased_buckets: int
    expired_leases: int


def _number(value: Any) -> float | None:
    return float(value) if isinstance(value, Decimal | int | float) else None


def backlog(conn: psycopg.Connection[Any], sink: str | None = None) -> list[SinkBacklog]:
    """Every live sink's backlog, by name; only ``sink``'s if given (OutboxError if there is no such
    sink, or it was dropped). ``conn`` is a connection to a migrated database."""
    with conn.cursor() as cur:
        cur.execute(query("admin", "backlog"), {"sink": sink})  # one sink's buckets only, if given
        cols = [d.name for d in cur.description or []]
        rows = [dict(zip(cols, r, strict=True)) for r in cur.fetchall()]
    found = [SinkBacklog(sink=r["sink"], kind=r["kind"], pending=int(r["pending"]),
                         oldest_pending_seconds=_number(r["oldest_pending_seconds"]), parked=int(r["parked"]),
                         paused=int(r["paused"]), paused_keys=int(r["paused_keys"]),
                         dead_letters=int(r["dead_letters"]), leased_buckets=int(r["leased_buckets"]),
                         expired_leases=int(r["expired_leases"]))
             for r in rows if sink is None or r["sink"] == sink]
    if sink is not None and not found:
        raise OutboxError(_missing(conn, sink))
    return found


def _missing(conn: psycopg.Connection[Any], name: str) -> str:
    """Why a sink has no backlog row: it was dropped, or there is none of that name."""
    with conn.cursor() as cur:
        cur.execute(query("admin", "sink"), {"sink": name})
        found = cur.fetchone()
    if found is not None and found[1] is not None:
        return f"sink {name!r} was dropped at {found[1]:%Y-%m-%d %H:%M:%S%z}"
    return f"no sink named {name!r}"
