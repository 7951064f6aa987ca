"""What a rebuild (rebuild.py) has left to replay: counted exactly from its cursors, and its total, counted
once at its start and kept in its ``outbox.rebuilds`` row (a resumed rebuild reports against the same)."""

from __future__ import annotations

from typing import Any

import psycopg

from outbox_relay.sqlfiles import query

from .bulk import LANES


def remaining(conn: psycopg.Connection[Any], sink: str, event_filter: dict[str, Any]) -> int:
    """The events the rebuild's sink ``sink`` has not passed yet."""
    cursors = conn.execute(query("rebuild", "cursors"), {"sink": sink, "limit": LANES + 1}).fetchall()
    if len(cursors) > LANES:
        row = conn.execute(query("rebuild", "remaining"), {"sink": sink, **event_filter}).fetchone()
        return int(row[0]) if row else 0
    # The same cursor in every bucket (a start), or in each lane's (after the bulk phase): one scan per
    # cursor, from its snapshot on.
    left = 0
    for seen, target, after_xid, after_seq, buckets in cursors:
        row = conn.execute(query("rebuild", "remaining_from"), {
            "seen": seen, "target": target, "after_xid": after_xid, "after_seq": after_seq,
            "buckets": buckets if len(cursors) > 1 else None, **event_filter}).fetchone()
        left += int(row[0]) if row else 0
    return left


def total(conn: psycopg.Connection[Any], projection: str, sink: str, event_filter: dict[str, Any]) -> int:
    """The rebuild's total: what its start left to replay."""
    row = conn.execute(query("rebuild", "get"), {"projection": projection}).fetchone()
    if row is not None and row[5] is not None:
        return int(row[5])
    found = remaining(conn, sink, event_filter)
    conn.execute(query("rebuild", "set_total"), {"projection": projection, "total": found})
    return found
