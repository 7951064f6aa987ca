"""History bench (issue 16): the relay's read as stored history grows, and retention by partition.

    python bench/history.py [--sizes 10000,1000000,5000000] [--per-partition 1000000] [--runs 5]

For each size, one database: events are filled with ``INSERT ... SELECT generate_series`` (not
publish), one xid range partition per ``--per-partition`` events (a "day"; ``outbox-relay retention
roll`` between fills), delivered history to the left of every cursor. Then:

- fetch: the relay's own ``fetch_events`` for 64 leased buckets whose cursors sit 20 events before the
  end of their bucket (limit 16 per bucket), timed per call (median of ``--runs`` x 20 calls), with the
  partitions the plan opened. Flat from 10k to the largest size is the goal.
- retention: one full partition ("a day") removed by ``outbox.retire_partition_v2`` (a DROP) against
  the same number of rows removed by DELETE from a twin partition (the pre-0014 way), side by side in
  the same database, with the dead tuples each leaves.

Prints medians with min/max and the machine. Servers: the bench's embedded PostgreSQL 18.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import psycopg

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from servers import Postgres, machine

from outbox_relay import history, store
from outbox_relay.migrate import migrate
from outbox_relay.positions import Cursor
from outbox_relay.sqlfiles import query

LEASED = list(range(0, 256, 4))  # 64 buckets, as tests/integration/test_relay_plan.py
LIMIT = 16
SINK = "bench"


def fill(conn: psycopg.Connection[Any], total: int, per_partition: int) -> int:
    """``total`` events in ranges of ``per_partition``, each range closed by a roll; returns partitions."""
    done = 0
    parts = 0
    while done < total:
        n = min(per_partition, total - done)
        for start in range(0, n, 500_000):  # one transaction per 500k rows: a few xids per partition
            k = min(500_000, n - start)
            conn.execute("INSERT INTO outbox.events (partition_key, type, payload) "
                         "SELECT 'key-' || (g %% 50000), 'bulk', '{}' FROM generate_series(1, %s) AS g", (k,))
        done += n
        parts += 1
        if done < total:
            history.roll(conn, 86400.0, min_width=1000)
    conn.execute("VACUUM ANALYZE outbox.events")
    return parts


def fetch_case(conn: psycopg.Connection[Any], runs: int) -> dict[str, Any]:
    store.register_sink(conn, SINK, "projection")
    store.acquire_leases(conn, SINK, "w", LEASED, 3600.0)
    starts = conn.execute("""
        SELECT bucket, xid::text::bigint, seq
        FROM (SELECT bucket, xid, seq, row_number() OVER (PARTITION BY bucket ORDER BY xid DESC, seq DESC) AS back
              FROM outbox.events WHERE bucket = ANY(%s)
                AND xid >= (SELECT max(xid) FROM outbox.events)) s
        WHERE back = 20""", (LEASED,)).fetchall()
    cursors = {b: Cursor.at((int(x), int(s))) for b, x, s in starts}
    reads = {b: (LIMIT, cursors[b]) for b in LEASED if b in cursors}
    times: list[float] = []
    for _ in range(runs):
        for _ in range(20):
            t0 = time.perf_counter()
            got = store.fetch_events(conn, SINK, "w", reads).events
            times.append(time.perf_counter() - t0)
    # The partitions the plan opened (probed at least once).
    params = store_params(reads)
    plan = conn.execute("EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON) " + store.fetch_sql(conn, reads), params).fetchone()
    assert plan is not None
    doc = plan[0] if not isinstance(plan[0], str) else json.loads(plan[0])
    on_events = [n for n in walk(doc[0]["Plan"])
                 if str(n.get("Relation Name", "")).startswith("events") and n.get("Actual Loops", 0) > 0]
    opened = sorted({n["Relation Name"] for n in on_events})
    # Buffers the read touched in the events partitions and their indexes: the load-independent cost.
    buffers = sum(n.get("Shared Hit Blocks", 0) + n.get("Shared Read Blocks", 0) for n in on_events)
    return {"events_per_call": len(got), "buffers_per_call": buffers, "ms_median": 1000 * statistics.median(times),
            "ms_min": 1000 * min(times), "ms_max": 1000 * max(times), "partitions_opened": opened}


def store_params(reads: dict[int, tuple[int, Cursor]]) -> dict[str, Any]:
    return store.fetch_params(SINK, "w", reads)


def walk(plan: dict[str, Any]) -> Any:
    yield plan
    for child in plan.get("Plans", []):
        yield from walk(child)


def retention_case(conn: psycopg.Connection[Any], per_partition: int) -> dict[str, Any]:
    """Two closed partitions of ``per_partition`` events each, all delivered: the older is removed by
    retire_partition_v2 (DROP), the newer by DELETE (the pre-0014 way), each timed."""
    conn.execute("SELECT pg_stat_force_next_flush()")
    for _ in range(2):
        conn.execute("INSERT INTO outbox.events (partition_key, type, payload) "
                     "SELECT 'key-' || (g %% 50000), 'day', '{}' FROM generate_series(1, %s) AS g", (per_partition,))
        history.roll(conn, 86400.0, min_width=1000)
    conn.execute("VACUUM ANALYZE outbox.events")
    conn.execute("UPDATE outbox.cursors SET snapshot = pg_current_snapshot(), target = NULL, after_xid = NULL, "
                 "after_seq = NULL")
    days = [r[0] for r in conn.execute(
        "SELECT p.name FROM outbox.partitions p WHERE p.range_name IS NOT NULL "
        "AND EXISTS (SELECT FROM outbox.events e WHERE e.type = 'day' AND e.xid >= p.xid_from AND e.xid < p.xid_to) "
        "ORDER BY p.xid_from")]
    drop_day, delete_day = days[-2], days[-1]
    # Everything older than the first 'day' partition goes first (not timed): the timed call drops one.
    # Retention goes by the keep housekeeping stored (0019): 0 s, as a relay with --retention-seconds 0 stores.
    conn.execute(query("history", "store_default_keep"), {"retention": 0.0})
    while True:
        oldest = conn.execute("SELECT name FROM outbox.partitions WHERE range_name IS NOT NULL "
                              "ORDER BY xid_from LIMIT 1").fetchone()
        if oldest is None or oldest[0] == drop_day:
            break
        with conn.transaction():
            row = conn.execute("SELECT leaf FROM outbox.retire_partition_v2()").fetchone()
        if row is None:
            break
    t0 = time.perf_counter()
    with conn.transaction():
        row = conn.execute("SELECT leaf, removed FROM outbox.retire_partition_v2()").fetchone()
    drop_s = time.perf_counter() - t0
    assert row is not None and row[0] == drop_day, (row, drop_day)
    t0 = time.perf_counter()
    with conn.transaction():
        conn.execute("SET LOCAL outbox_relay.delete_events = 'on'")
        deleted = conn.execute(f'DELETE FROM outbox."{delete_day}"').rowcount
    delete_s = time.perf_counter() - t0
    conn.execute("SELECT pg_stat_force_next_flush()")
    dead = conn.execute("SELECT n_dead_tup FROM pg_stat_user_tables WHERE schemaname = 'outbox' AND relname = %s",
                        (delete_day,)).fetchone()
    return {"events_per_partition": per_partition, "drop_events": int(row[1]), "drop_ms": 1000 * drop_s,
            "delete_events": deleted, "delete_ms": 1000 * delete_s,
            "dead_tuples_after_delete": dead[0] if dead else None,
            "dead_tuples_after_drop": 0}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="10000,1000000,5000000")
    ap.add_argument("--per-partition", type=int, default=1_000_000)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--retention-events", type=int, default=1_000_000)
    args = ap.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    with tempfile.TemporaryDirectory(prefix="bench-history-") as tmp:
        pg = Postgres(Path(tmp))
        try:
            print(json.dumps({"machine": machine(), "postgres": pg.version}), flush=True)
            for size in sizes:
                name = pg.create_database()
                dsn = pg.dsn(name)
                migrate(dsn)
                with psycopg.connect(dsn, autocommit=True) as conn:
                    t0 = time.perf_counter()
                    parts = fill(conn, size, args.per_partition)
                    filled = time.perf_counter() - t0
                    result = fetch_case(conn, args.runs)
                print(json.dumps({"case": "fetch", "stored_events": size, "partitions": parts,
                                  "fill_seconds": round(filled, 1), **result}), flush=True)
                pg.drop_database(name)
            name = pg.create_database()
            dsn = pg.dsn(name)
            migrate(dsn)
            with psycopg.connect(dsn, autocommit=True) as conn:
                store.register_sink(conn, SINK, "projection")
                print(json.dumps({"case": "retention", **retention_case(conn, args.retention_events)}), flush=True)
            pg.drop_database(name)
        finally:
            pg.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
