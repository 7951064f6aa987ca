"""The lapse check (bucket_has_work_v2 vs v3, migration 0016) as xid ranges pile up.

    python bench/lapse_check.py [--ranges 1,60,300] [--reps 30] [--dsn postgresql://...]

For each count of ``--ranges``, a fresh database with that many closed xid ranges (10 events each), then
20,000 events in the newest range; 64 cursors (every 4th bucket) just before those events, leased to ``w``
with expired leases. ``acquire_leases`` by another relay takes them over, each counting a lapse (checked),
``--reps`` times with ``bucket_has_work_v2`` and as many with ``v3`` (the statement of membership.sql with
the function name swapped). Measured per statement: the backend's CPU time (``/proc/<pid>/stat``, so the
server must run on this machine) and the relation locks it holds on outbox.events' partitions and indexes;
load-insensitive, unlike wall time. On the bench's embedded PostgreSQL 18, or ``--dsn`` (a server on this
machine, e.g. the PostgreSQL 15 at 127.0.0.1:5432: databases named ``bench_lapse_*`` are made and dropped).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

import psycopg
from psycopg import sql
from psycopg.conninfo import make_conninfo

from outbox_relay import history, store
from outbox_relay.migrate import migrate
from outbox_relay.sqlfiles import query

LEASED = list(range(0, 256, 4))
ACQUIRE = {"v3": query("membership", "acquire_leases")}
ACQUIRE["v2"] = ACQUIRE["v3"].replace("bucket_has_work_v3", "bucket_has_work_v2")
LOCKS = ("SELECT count(*) FROM pg_locks l JOIN pg_class c ON c.oid = l.relation "
         "WHERE l.pid = pg_backend_pid() AND c.relname LIKE 'events%'")


def backend_cpu(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def measure(admin: str, ranges: int, reps: int) -> dict[str, tuple[float, int]]:
    name = f"bench_lapse_{ranges}"
    with psycopg.connect(admin, autocommit=True) as c:
        c.execute(sql.SQL("DROP DATABASE IF EXISTS {}").format(sql.Identifier(name)))
        c.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
    dsn = make_conninfo(admin, dbname=name)
    try:
        migrate(dsn)
        with psycopg.connect(dsn, autocommit=True) as conn:
            for _ in range(ranges):
                conn.execute("INSERT INTO outbox.events (partition_key, type, payload) "
                             "SELECT 'key-' || g, 'old', '{}' FROM generate_series(1, 10) g")
                history.roll(conn, 86400.0, min_width=1000)
            store.register_sink(conn, "s", "projection")
            conn.execute("INSERT INTO outbox.events (partition_key, type, payload) "
                         "SELECT 'key-' || (g % 5000), 'new', '{}' FROM generate_series(1, 20000) g")
            row = conn.execute("SELECT min(xid)::text::bigint FROM outbox.events WHERE type = 'new'").fetchone()
            assert row is not None
            conn.execute("UPDATE outbox.cursors SET snapshot = %s::pg_snapshot WHERE sink = 's'",
                         (f"{row[0]}:{row[0]}:",))
            conn.execute("VACUUM ANALYZE outbox.events")
        out: dict[str, tuple[float, int]] = {}
        with psycopg.connect(dsn) as conn:
            pid = int(conn.execute("SELECT pg_backend_pid()").fetchone()[0])  # type: ignore[index]
            conn.commit()
            for version, statement in sorted(ACQUIRE.items()):
                cpu: list[float] = []
                locks = 0
                for i in range(reps + 2):  # the first two: cold caches, a plan made
                    conn.execute("UPDATE outbox.cursors SET owner = 'w', lapses = 0, "
                                 "lease_expires_at = clock_timestamp() - interval '1 second' "
                                 "WHERE sink = 's' AND bucket = ANY(%s)", (LEASED,))
                    conn.commit()
                    before = backend_cpu(pid)
                    rows: list[Any] = conn.execute(statement, {"sink": "s", "worker": "other", "buckets": LEASED,
                                                               "lease_seconds": 600.0}).fetchall()
                    locks = int(conn.execute(LOCKS).fetchone()[0])  # type: ignore[index]
                    conn.commit()
                    if i >= 2:
                        cpu.append(backend_cpu(pid) - before)
                    assert len(rows) == len(LEASED) and all(r[2] == 1 for r in rows), "a lapse per bucket"
                out[version] = (statistics.mean(cpu) * 1000, locks)
        return out
    finally:
        with psycopg.connect(admin, autocommit=True) as c:
            c.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name)))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ranges", default="1,60,300", help="xid ranges kept, one database each")
    p.add_argument("--reps", type=int, default=30, help="statements measured per version")
    p.add_argument("--dsn", help="a PostgreSQL on this machine (default: the bench's embedded 18)")
    a = p.parse_args()
    pg = None
    if a.dsn:
        admin = a.dsn
    else:
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        from servers import Postgres

        pg = Postgres(Path(tempfile.mkdtemp(prefix="bench-lapse-")))
        admin = pg.admin_dsn
    try:
        with psycopg.connect(admin) as c:
            version = c.execute("SHOW server_version").fetchone()[0]  # type: ignore[index]
        print(f"PostgreSQL {version}; load average {os.getloadavg()[0]:.1f} at the start")
        for ranges in (int(x) for x in a.ranges.split(",")):
            r = measure(admin, ranges, a.reps)
            print(f"{ranges} ranges: " + "; ".join(f"{v}: {ms:.1f} ms backend CPU per statement, {locks} locks"
                                                  for v, (ms, locks) in sorted(r.items())), flush=True)
        print(f"load average {os.getloadavg()[0]:.1f} at the end")
    finally:
        if pg is not None:
            pg.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
