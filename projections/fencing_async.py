"""Fenced writes into stores outside the relay's transaction: write only if the stored token is older.

A projection's own tables get exactly-once effects from the relay's transaction (see sink.py).
A write to another store (a second database, a cache, a search index) can not join it; it is
at-least-once and can race with a worker that lost its lease. Storing the event's
``FenceToken`` next to the row and writing only when the stored token is older makes such a
store converge on the last event of the key that the relay delivered: tokens grow in delivery
order per key (also for overlapping transactions of one key, whose delivery order is not their
(xid, seq) order), and a stale worker's write carries a smaller token than its successor's, so it
is refused once the successor wrote. A batch delivered again (after it failed, or by the bucket's
next owner) carries larger tokens than its first delivery and is written again: while it is
redone the row can hold an earlier event's state for a moment, and it ends on the last one.

Tokens order the writes of one partition key (one bucket's fences). A row written by events of
several keys compares fences of different buckets, which say nothing about each other.

``str(token)`` sorts like the token itself, so any store that compares strings can do the same
check (a Redis script, a conditional put, an Elasticsearch external version...).

This is fencing_async.py, the one source: fencing.py is generated from it (scripts/async_to_sync.py).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import psycopg

from .event import FenceToken
from .fenced_statement import upsert_statement


async def fenced_upsert_async(conn: psycopg.AsyncConnection[Any], table: str, key: Mapping[str, Any],
                              values: Mapping[str, Any], token: FenceToken,
                              token_column: str = "fence_token") -> bool:
    """Upsert one row unless the row holds the same or a newer token; True if it was written.

    Called with ``event.token``, the row ends with the values of the last event of its key the relay
    delivered (see the module docstring). ``table`` (optionally ``schema.table``) needs a unique
    constraint on the ``key`` columns and a text column ``token_column``; the comparison is on the
    token's text, which sorts like the token (tokens stored before reads were numbered included).
    """
    params = {**key, **values, token_column: str(token)}
    cur = await conn.execute(upsert_statement(table, key, values, token_column), params)
    return cur.rowcount == 1
