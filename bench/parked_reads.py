"""Parked reads after 0015: the relay's ``fetch_parked`` with events in their partitions and with their
partition dropped (read from ``outbox.kept_events``), against the query before 0015 (a plain join).

    python bench/parked_reads.py [--history 1000000] [--keys 2000] [--behind 3] [--runs 5]

One database: ``--history`` delivered events in a class kept for good (a few partitions), then two sinks
with ``--keys`` parked chains each (a head and ``--behind`` events queued behind it): sink ``kept``
over events in a partition kept for good, sink ``copied`` over events whose partition retention
dropped (so they are read from their copies). Per run, interleaved: the pre-0015 query on ``kept``,
today's on ``kept``, today's on ``copied``; each timed over 20 calls reading every chain
(256 buckets, keys = all, per_key = behind + 1). Also one housekeeping-sized ``release_kept_events``
call (nothing to release: its cost every pass) and the retire of the partition that made the copies.

Prints medians with min/max and the machine. Server: the bench's embedded PostgreSQL 18.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import psycopg

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from servers import Postgres, busy_fraction, machine

from outbox_relay import history, store
from outbox_relay.sqlfiles import compact, query

ROOT = Path(__file__).resolve().parent.parent
BUCKETS = list(range(256))


def old_fetch_parked() -> str:
    """fetch_parked as schema version 14 shipped it (git: the commit before 0015)."""
    text = subprocess.run(["git", "-C", str(ROOT), "show", "f327db6:sql/queries/relay.sql"], check=True,
                          capture_output=True, text=True).stdout
    block = text[text.index("-- name: fetch_parked"):text.index("-- name: next_parked_retry")]
    return compact("\n".join(block.splitlines()[2:]))


def park(conn: psycopg.Connection[Any], sink: str, topic: str, keys: int, behind: int) -> None:
    """``keys`` chains of ``behind + 1`` events of ``topic``, parked for ``sink`` in publish order."""
    store.register_sink(conn, sink, "projection")
    conn.execute("INSERT INTO outbox.events (topic, partition_key, type, payload) "
                 "SELECT %s, %s || '-' || k, 'parked', jsonb_build_object('n', n) "
                 "FROM generate_series(1, %s) AS k CROSS JOIN generate_series(0, %s) AS n ORDER BY k, n",
                 (topic, sink, keys, behind))
    conn.execute("INSERT INTO outbox.parked (sink, bucket, xid, seq, partition_key, event_id, attempts, available_at) "
                 "SELECT %s, e.bucket, e.xid, e.seq, e.partition_key, e.id, 0, clock_timestamp() - interval '1 s' "
                 "FROM outbox.events e WHERE e.topic = %s ORDER BY e.xid, e.seq", (sink, topic))


def timed(conn: psycopg.Connection[Any], sql: str, sink: str, per_key: int, keys: int) -> tuple[float, int]:
    times = []
    rows = 0
    for _ in range(20):
        t0 = time.perf_counter()
        rows = len(conn.execute(sql, {"sink": sink, "buckets": BUCKETS, "keys": keys, "per_key": per_key,
                                        "worker": None, "fences": [None] * len(BUCKETS)}).fetchall())
        times.append(time.perf_counter() - t0)
    return statistics.median(times), rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--history", type=int, default=1_000_000)
    ap.add_argument("--keys", type=int, default=2000)
    ap.add_argument("--behind", type=int, default=3)
    ap.add_argument("--runs", type=int, default=5)
    args = ap.parse_args()
    per_key = args.behind + 1
    with tempfile.TemporaryDirectory(prefix="bench-parked-") as tmp:
        pg = Postgres(Path(tmp))
        try:
            print(json.dumps({"machine": machine(), "postgres": pg.version, "busy_before": round(busy_fraction(), 2)}),
                  flush=True)
            name = pg.create_database()
            dsn = pg.dsn(name)
            from outbox_relay.migrate import migrate
            migrate(dsn)
            with psycopg.connect(dsn, autocommit=True) as conn:
                history.set_class(conn, "keep", None)
                history.set_class(conn, "short", 0.0)
                history.map_topic(conn, "history", "keep")
                history.map_topic(conn, "kept", "keep")
                history.map_topic(conn, "copied", "short")
                history.roll(conn, 86400.0, min_width=1000)
                for start in range(0, args.history, 500_000):
                    conn.execute("INSERT INTO outbox.events (topic, partition_key, type, payload) "
                                 "SELECT 'history', 'key-' || (g %% 50000), 'bulk', '{}' "
                                 "FROM generate_series(1, %s) AS g", (min(500_000, args.history - start),))
                    history.roll(conn, 86400.0, min_width=1000)
                park(conn, "kept", "kept", args.keys, args.behind)
                park(conn, "copied", "copied", args.keys, args.behind)
                history.roll(conn, 86400.0, min_width=1000)
                conn.execute("UPDATE outbox.cursors SET snapshot = pg_current_snapshot()")
                conn.execute("VACUUM ANALYZE")
                t0 = time.perf_counter()
                retired = history.retire(conn, 0.0, 60.0)
                retire_s = time.perf_counter() - t0
                kept = conn.execute("SELECT count(*) FROM outbox.kept_events").fetchone()
                print(json.dumps({"case": "retire", "partitions": [(r.partition, r.events) for r in retired],
                                  "copies_made": kept[0] if kept else None, "seconds": round(retire_s, 3)}),
                      flush=True)
                conn.execute("VACUUM ANALYZE outbox.kept_events")
                cases = {"before_0015_kept": (old_fetch_parked(), "kept"),
                         "today_kept": (query("relay", "fetch_parked"), "kept"),
                         "today_copied": (query("relay", "fetch_parked"), "copied")}
                results: dict[str, list[float]] = {c: [] for c in cases}
                rows: dict[str, int] = {}
                for _ in range(args.runs):
                    for case, (sql, sink) in cases.items():
                        t, rows[case] = timed(conn, sql, sink, per_key, args.keys)
                        results[case].append(t)
                for case, ts in results.items():
                    print(json.dumps({"case": "fetch_parked", "variant": case, "rows": rows[case],
                                      "median_ms": round(1000 * statistics.median(ts), 2),
                                      "min_ms": round(1000 * min(ts), 2), "max_ms": round(1000 * max(ts), 2)}),
                          flush=True)
                release = []
                for _ in range(20):
                    t0 = time.perf_counter()
                    conn.execute(query("history", "release_kept_events"))
                    release.append(time.perf_counter() - t0)
                print(json.dumps({"case": "release_kept_events", "copies": kept[0] if kept else None,
                                  "median_ms": round(1000 * statistics.median(release), 2)}), flush=True)
            pg.drop_database(name)
        finally:
            pg.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
