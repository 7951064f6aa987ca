"""Plan regression: a slice of a rebuild's bulk phase (rebuild.bulk_read) reads history in (xid, seq)
order from where the last slice ended: index range scans walked in xid order, no sort of the stored
events, no scan of what lies before the slice, whatever the size of history or of one transaction
(issue 16; on an index of xid alone a slice inside a large transaction read and sorted all of it: 0017).
A lane's slice (a range of buckets, bulk.LANES) reads the same way and drops the other lanes' rows: it reads
about LANES times what it returns, never all of history.
Run it with OUTBOX_TEST_DSN pointing at a PostgreSQL 15 too, with test_relay_plan.py: an index on plain
(xid, seq) made the relay's read there walk every bucket's events (0017 says why seq + 0)."""

from __future__ import annotations

import json

import psycopg
import pytest

from outbox_relay import history
from outbox_relay.positions import Cursor, Snapshot
from outbox_relay.sqlfiles import query
from projections.bulk import LANES, lane_buckets
from tests.integration.test_relay_plan import explain, nodes, on_events_table

pytestmark = pytest.mark.pg15  # the PostgreSQL 15 step runs it too (scripts/test.sh)

RANGES = 4
PER_RANGE = 25_000
LIMIT = 2_000


@pytest.mark.parametrize("lane", [None, 1], ids=["every bucket", "one lane"])
@pytest.mark.parametrize("plan", ["custom", "generic"])
def test_a_bulk_slice_reads_only_what_it_returns_in_position_order(dsn: str, plan: str, lane: int | None) -> None:
    lo, hi = (0, 256) if lane is None else lane_buckets(lane)
    with psycopg.connect(dsn, autocommit=True) as conn:
        for r in range(RANGES):
            # Transactions of 500 events (many xids per range), and in the second range one transaction
            # of all its events (a bulk import), where the slice starts.
            size = PER_RANGE if r == 1 else 500
            for start in range(0, PER_RANGE, size):
                conn.execute("INSERT INTO outbox.events (partition_key, type, payload) "
                             "SELECT 'key-' || (g %% 5000), 'bulk', jsonb_build_object('g', g) "
                             "FROM generate_series(%s::int, %s::int) AS g", (start, start + size - 1))
            history.roll(conn, 86400.0, min_width=1000)
        conn.execute("VACUUM ANALYZE outbox.events")
        # A slice from the middle of the large transaction, to a snapshot that sees everything.
        row = conn.execute("SELECT xid::text::bigint, seq FROM outbox.events ORDER BY xid, seq "
                           "OFFSET %s LIMIT 1", (PER_RANGE + PER_RANGE // 2,)).fetchone()
        snap = conn.execute("SELECT pg_current_snapshot()::text").fetchone()
        assert row is not None and snap is not None
        cursor = Cursor(Snapshot(1, 1), Snapshot.parse(snap[0]), (int(row[0]), int(row[1])))
        params = {"lo_xid": str(row[0]), "lo_seq": row[1], "target": snap[0], "seen": str(cursor.seen),
                  "limit": LIMIT, "types": None, "topics": None, "lo": lo, "hi": hi}
        conn.execute(query("rebuild", "bulk_read_session"))  # as the reader's session
        root = explain(conn, query("rebuild", "bulk_read"), params, plan)
        got = conn.execute(query("rebuild", "bulk_read"), params).fetchall()
        want = conn.execute("SELECT xid::text::bigint, seq FROM outbox.events WHERE (xid, seq) > (%s::text::xid8, %s) "
                            "AND bucket >= %s AND bucket < %s ORDER BY xid, seq LIMIT %s",
                            (row[0], row[1], lo, hi, LIMIT)).fetchall()
    assert [(r[1], r[2]) for r in got] == [tuple(w) for w in want], "the next LIMIT events in position order"
    on_events = [n for n in nodes(root) if on_events_table(n)]
    text = json.dumps(root, indent=1)[:4000]
    assert on_events and not [n for n in on_events if n["Node Type"] in ("Seq Scan", "Bitmap Heap Scan")], text
    assert not [n for n in nodes(root) if n["Node Type"] == "Sort"], "the slice sorts stored events: " + text
    read = sum(n["Actual Rows"] * max(1, n.get("Actual Loops", 1)) + n.get("Rows Removed by Filter", 0)
               for n in on_events)
    share = 1 if lane is None else LANES
    assert read <= 2 * share * LIMIT, f"a slice of {LIMIT} events read {read} rows: " + text
