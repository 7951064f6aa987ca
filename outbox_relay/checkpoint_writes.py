# WARNING: generated from outbox_relay/checkpoint_writes_async.py by scripts/async_to_sync.py: edit the source, then run
# `python scripts/async_to_sync.py --write`.
"""The writes an async projection makes in its own transaction: its batch's checkpoint, and the
server's start time that fences it (an async projection's connection is its own).

The one source: checkpoint_writes.py (the relay's, on sync connections) is generated from it by
scripts/async_to_sync.py.
"""

from __future__ import annotations

import weakref
from datetime import datetime
from typing import Any

import psycopg

from .checkpoint import Checkpoint
from .sqlfiles import query

# One read per connection (sync and async connections each have their own module, so their own map).
_server_started: weakref.WeakKeyDictionary[Any, datetime] = weakref.WeakKeyDictionary()


def server_started(conn: psycopg.Connection[Any]) -> datetime:
    """When the server ``conn`` talks to started (``server_started`` in relay.sql), read once per
    connection: every connection made after a restart reads it anew."""
    started = _server_started.get(conn)
    if started is None:
        cur = conn.execute(query("relay", "server_started"))
        row = cur.fetchone()
        assert row is not None
        started = _server_started[conn] = row[0]
    return started


def checkpoint(conn: psycopg.Connection[Any], sink: str, worker: str, cp: Checkpoint) -> set[int]:
    """Write the batch outcome; returns the buckets whose fence held (the others were lost)."""
    if not cp.fences:
        return set()
    cur = conn.execute(cp.statement(), cp.params(sink, worker))
    rows = cur.fetchall()
    cp.landed_at = rows[0][1] if rows else None
    return {r[0] for r in rows}
