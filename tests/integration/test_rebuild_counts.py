"""What a rebuild has left to replay (rebuild.remaining, and remaining_from: the same count in one scan
when every bucket's cursor is the same, as at a rebuild's start and through its bulk phase): both
give the number of events past the cursors that the projection reads, at the start, from a position,
and with a type filter (the rebuild's progress and its "caught up" decision rest on it)."""

from __future__ import annotations

from typing import Any

import psycopg
import pytest

from outbox_relay import store
from outbox_relay.positions import Cursor
from outbox_relay.sqlfiles import query
from tests.integration.relay_helpers import publish

pytestmark = pytest.mark.pg15  # the PostgreSQL 15 step runs it too (scripts/test.sh)

SINK = "counted.rebuild"


@pytest.mark.parametrize("types", [None, ["A"]], ids=["every type", "one type"])
def test_one_scan_counts_what_the_per_bucket_count_counts(dsn: str, types: list[str] | None) -> None:
    publish(dsn, [(f"k{i % 37}", "A" if i % 3 else "B", {"i": i}) for i in range(600)])
    publish(dsn, [(f"k{i % 11}", "A", {"i": i}) for i in range(300)])
    with psycopg.connect(dsn, autocommit=True) as conn:
        store.register_sink(conn, SINK, "projection")
        stored = conn.execute("SELECT xid::text::bigint, seq, type FROM outbox.events ORDER BY xid, seq").fetchall()
        middle = (int(stored[400][0]), int(stored[400][1]))
        for at in (None, middle):
            if at is not None:  # every bucket's cursor just before the 401st event (rebuild --from-position)
                seen, target, after_xid, after_seq = Cursor.at(at).params()
                conn.execute(query("rebuild", "start_at_position"), {
                    "sink": SINK, "seen": seen, "target": target, "after_xid": after_xid, "after_seq": after_seq})
            want = sum(1 for x, s, t in stored
                       if (at is None or (x, s) >= at) and (types is None or t in types))
            cursors = conn.execute(query("rebuild", "cursors"), {"sink": SINK, "limit": 2}).fetchall()
            assert len(cursors) == 1
            params: dict[str, Any] = {"types": types, "topics": None}
            one = conn.execute(query("rebuild", "remaining_from"), dict(zip(
                ("seen", "target", "after_xid", "after_seq", "buckets"), cursors[0], strict=True),
                buckets=None, **params)).fetchone()
            per_bucket = conn.execute(query("rebuild", "remaining"), {"sink": SINK, **params}).fetchone()
            assert one is not None and per_bucket is not None
            assert (one[0], per_bucket[0]) == (want, want), at
