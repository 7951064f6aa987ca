"""Read cost as history grows to 50M stored events, and as partitions pile up (issue 16).

    python bench/read_cost.py [--sizes 10000,1000000,10000000,50000000] [--per-partition 500000]
                              [--tx-events 10000] [--ranges 1,100,500,1000,2000] [--runs 5]

Two parts, both on the bench's embedded PostgreSQL 18 (defaults, except a larger max_wal_size so that
filling tens of millions of rows is not one checkpoint after another):

- ``grow``: ONE database grown through ``--sizes`` (10k, then to 1M, 10M, 50M): events written
  server-side (``INSERT ... SELECT generate_series``) in transactions of ``--tx-events``, ids from
  ``uuidv7()`` as the library makes them, over 50,000 keys; a retention class ``orders`` for the
  topic ``orders`` (a tenth of the events), so each xid range has two leaves; a new range every
  ``--per-partition`` events, made by ``outbox_relay.history.roll`` (``add_partition_v1``). All of it
  is delivered: the cursors of the bench sink stand after it. Then at each size a fresh batch at the
  head (4,096 events in 8 transactions) and the relay's read of it: ``store.fetch_events`` for 64
  leased buckets, limit 15 per bucket (1000 // 64, the relay's), on a connection configured as a
  relay's (``plan_cache_mode = auto``, psycopg prepares it on the 5th call), timed per call; and
  ``EXPLAIN (ANALYZE, BUFFERS)`` of it with a custom and with a generic plan: planning and execution
  time, buffers of the events partitions, partitions in the plan and opened, locks the read holds.
  Then ``publish`` (one event per transaction, ``Outbox.publish`` + commit) for ``--publish-seconds``.
- ``ranges``: for each count of ``--ranges`` a fresh database with that many xid ranges (two leaves
  each, empty but the newest, which gets the head batch), the same read and publish measures. It
  isolates what the number of partitions costs, apart from the number of rows.

Prints one JSON line per measure (medians with min/max) and the machine; the load average beside each.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from servers import Postgres, machine

from outbox_relay import Outbox, history, store
from outbox_relay.positions import Cursor, Snapshot
from outbox_relay.sqlfiles import query

LEASED = list(range(0, 256, 4))  # 64 buckets, as tests/integration/test_relay_plan.py
LIMIT = 1000 // len(LEASED)  # the relay's per-bucket share of a 1,000-event batch
SINK = "bench"
HEAD_EVENTS = 4096
# The read before it named a partition floor (store.fetch_sql): only run-time bounds per bucket.
BEFORE = re.sub(r"\s*AND e\.xid >= \{floor\}::xid8", "", query("relay", "fetch_events"))
assert "{floor}" not in BEFORE


def load() -> float:
    return os.getloadavg()[0]


def setup(conn: psycopg.Connection[Any]) -> None:
    store.register_sink(conn, SINK, "projection")
    history.set_class(conn, "orders", None)
    history.map_topic(conn, "orders", "orders")
    history.roll(conn, 86400.0, min_width=1000)  # the first range with both leaves


def insert(conn: psycopg.Connection[Any], n: int, kind: str) -> None:
    """``n`` events in one transaction, ids from uuidv7() (PostgreSQL 18) as the library makes them."""
    conn.execute("INSERT INTO outbox.events (id, partition_key, topic, type, payload) "
                 "SELECT uuidv7(), 'key-' || (g %% 50000), CASE WHEN g %% 10 = 0 THEN 'orders' END, %s, "
                 "jsonb_build_object('customer', 'c-' || (g %% 50000), 'amount_cents', g %% 1000) "
                 "FROM generate_series(1, %s) AS g", (kind, n))


def grow(conn: psycopg.Connection[Any], stored: int, target: int, per_partition: int, tx_events: int) -> int:
    """Add events until ``target`` are stored, a new range every ``per_partition``; returns the count."""
    while stored < target:
        room = per_partition - stored % per_partition
        n = min(tx_events, target - stored, room)
        insert(conn, n, "history")
        stored += n
        if stored % per_partition == 0 and stored < target:
            history.roll(conn, 86400.0, min_width=1000)
    return stored


def deliver_all(conn: psycopg.Connection[Any]) -> None:
    """Every event stored so far is delivered history: the bench sink's cursors stand after it."""
    conn.execute("UPDATE outbox.cursors SET snapshot = pg_current_snapshot(), target = NULL, after_xid = NULL, "
                 "after_seq = NULL, owner = NULL WHERE sink = %s", (SINK,))


def head_batch(conn: psycopg.Connection[Any]) -> None:
    for _ in range(8):
        insert(conn, HEAD_EVENTS // 8, "head")


def reads(conn: psycopg.Connection[Any]) -> dict[int, tuple[int, Cursor]]:
    store.acquire_leases(conn, SINK, "w", LEASED, 3600.0)
    rows = conn.execute("SELECT bucket, snapshot::text FROM outbox.cursors WHERE sink = %s AND bucket = ANY(%s)",
                        (SINK, LEASED)).fetchall()
    return {b: (LIMIT, Cursor(Snapshot.parse(s))) for b, s in rows}


def params(r: dict[int, tuple[int, Cursor]]) -> dict[str, Any]:
    return store.fetch_params(SINK, "w", r, formatted=False)


def walk(plan: dict[str, Any]) -> Iterator[dict[str, Any]]:
    yield plan
    for child in plan.get("Plans", []):
        yield from walk(child)


def explain(conn: psycopg.Connection[Any], sql: str, p: dict[str, Any], mode: str) -> dict[str, Any]:
    """EXPLAIN (ANALYZE, BUFFERS) with a custom plan, or the generic plan of the prepared statement, and
    the locks the statement leaves held in its transaction (relations: partitions and their indexes)."""
    with conn.transaction():
        if mode == "custom":
            conn.execute("SET LOCAL plan_cache_mode = force_custom_plan")
            row = conn.execute("EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON) " + sql, p).fetchone()
        else:
            names: list[str] = []
            for name in re.findall(r"%\((\w+)\)s", sql):
                if name not in names:
                    names.append(name)
            body = re.sub(r"%\((\w+)\)s", lambda m: f"${names.index(m.group(1)) + 1}", sql).replace("%%", "%")
            if conn.execute("SELECT 1 FROM pg_prepared_statements WHERE name = 'planned'").fetchone():
                conn.execute("DEALLOCATE planned")  # left by a failed call (PREPARE is not transactional)
            conn.execute("PREPARE planned AS " + body)
            conn.execute("SET LOCAL plan_cache_mode = force_generic_plan")
            args = ", ".join(f"%({n})s" for n in names)
            cur = psycopg.ClientCursor(conn)
            cur.execute(f"EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON) EXECUTE planned({args})", p)  # warm: plan
            row = cur.execute(f"EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON) EXECUTE planned({args})", p).fetchone()
        locks = conn.execute("SELECT count(*), count(*) FILTER (WHERE fastpath) FROM pg_locks "
                             "WHERE pid = pg_backend_pid() AND locktype = 'relation'").fetchone()
    if mode != "custom":
        conn.execute("DEALLOCATE planned")
    assert row is not None and locks is not None
    doc = row[0] if not isinstance(row[0], str) else json.loads(row[0])
    plan = doc[0]["Plan"]
    on_events = [n for n in walk(plan) if str(n.get("Relation Name", "")).startswith("events")]
    opened = [n for n in on_events if n.get("Actual Loops", 0) > 0]
    removed = sum(n.get("Subplans Removed", 0) for n in walk(plan))
    return {"planning_ms": round(doc[0].get("Planning Time", 0.0), 2),
            "execution_ms": round(doc[0]["Execution Time"], 2),
            "buffers": sum(n.get("Shared Hit Blocks", 0) + n.get("Shared Read Blocks", 0) for n in opened),
            "scans_in_plan": len(on_events), "scans_opened": len(opened), "subplans_removed": removed,
            "leaves_opened": sorted({n["Relation Name"] for n in opened}),
            "rows": plan.get("Actual Rows"), "locks": int(locks[0]), "fastpath_locks": int(locks[1])}


def timed_reads(dsn: str, sql: str, p: dict[str, Any], calls: int) -> dict[str, Any]:
    """``calls`` reads of the same delta, as a relay's connection runs them (psycopg prepares the
    statement on the 5th, plan_cache_mode auto), each in its own transaction; the relation locks held
    at the end of the last one."""
    with psycopg.connect(dsn) as conn:
        conn.execute("SET plan_cache_mode = auto")
        conn.commit()
        times: list[float] = []
        got = 0
        locks = 0
        for i in range(calls):
            t0 = time.perf_counter()
            got = len(conn.execute(sql, p).fetchall()) - 1  # the last row carries the snapshot
            times.append(1000 * (time.perf_counter() - t0))
            if i == calls - 1:
                row = conn.execute("SELECT count(*) FROM pg_locks WHERE pid = pg_backend_pid() "
                                   "AND locktype = 'relation'").fetchone()
                locks = int(row[0]) if row else 0
            conn.commit()
        plans = conn.execute("SELECT generic_plans, custom_plans FROM pg_prepared_statements").fetchall()
    first, rest = times[:5], times[5:]
    return {"events_per_read": got, "first5_ms": round(statistics.median(first), 2),
            "ms_median": round(statistics.median(rest), 2), "ms_min": round(min(rest), 2),
            "ms_max": round(max(rest), 2), "locks_held": locks,
            "generic_custom_plans": [list(x) for x in plans]}


def publish_for(conn: psycopg.Connection[Any], seconds: float, outbox: Outbox) -> list[float]:
    """One event per transaction, back to back (Outbox.publish + commit), for ``seconds``: latencies."""
    lat: list[float] = []
    end = time.perf_counter() + seconds
    i = 0
    while time.perf_counter() < end:
        t0 = time.perf_counter()
        outbox.publish(conn, type="publish", key=f"key-{i % 50000}", payload={"n": i},
                       topic="orders" if i % 10 == 0 else None)
        conn.commit()
        lat.append(1000 * (time.perf_counter() - t0))
        i += 1
    return lat


def timed_publish(dsn: str, baseline_dsn: str, seconds: float, rounds: int = 3) -> dict[str, Any]:
    """Publish into this database and into a baseline one (a single xid range) in turns: tx/s of
    each and their ratio per round, so that the machine's load cancels out."""
    outbox = Outbox(default_topic="bench")
    ratios: list[float] = []
    here: list[float] = []
    base: list[float] = []
    p99: list[float] = []
    with psycopg.connect(dsn) as conn, psycopg.connect(baseline_dsn) as bconn:
        for _ in range(rounds):
            b = publish_for(bconn, seconds, outbox)
            h = publish_for(conn, seconds, outbox)
            here.append(len(h) / seconds)
            base.append(len(b) / seconds)
            ratios.append(len(h) / len(b))
            h.sort()
            p99.append(h[int(len(h) * 0.99)])
    return {"publish_tx_per_s": round(statistics.median(here)), "baseline_tx_per_s": round(statistics.median(base)),
            "publish_ratio_median": round(statistics.median(ratios), 2),
            "publish_ratio_min": round(min(ratios), 2), "publish_ratio_max": round(max(ratios), 2),
            "publish_p99_ms": round(statistics.median(p99), 3)}


def measure(dsn: str, baseline_dsn: str, conn: psycopg.Connection[Any], args: argparse.Namespace) -> dict[str, Any]:
    conn.execute("VACUUM ANALYZE outbox.events")
    r = reads(conn)
    p = params(r)
    out: dict[str, Any] = {"load_before": round(load(), 2)}
    def failed(exc: psycopg.Error) -> dict[str, Any]:
        return {"error": f"{type(exc).__name__}: {str(exc).splitlines()[0]}"}

    for label, sql in (("before", BEFORE), ("after", store.fetch_sql(conn, r))):
        try:
            out[label] = timed_reads(dsn, sql, p, 5 + 20 * args.runs)
        except psycopg.Error as exc:
            out[label] = failed(exc)
        for mode in ("custom", "generic"):
            try:
                plans = [explain(conn, sql, p, mode) for _ in range(3)]
            except psycopg.Error as exc:
                out[label][mode] = failed(exc)
                continue
            out[label][mode] = {k: plans[-1][k] for k in ("buffers", "scans_in_plan", "scans_opened",
                                                            "subplans_removed", "leaves_opened", "locks")}
            out[label][mode]["planning_ms"] = statistics.median(x["planning_ms"] for x in plans)
            out[label][mode]["execution_ms"] = statistics.median(x["execution_ms"] for x in plans)
    out.update(timed_publish(dsn, baseline_dsn, args.publish_seconds))
    out["load_after"] = round(load(), 2)
    return out


def counts(conn: psycopg.Connection[Any]) -> dict[str, Any]:
    row = conn.execute("SELECT count(DISTINCT range_name), count(*) FROM outbox.partitions "
                       "WHERE range_name IS NOT NULL").fetchone()
    size = conn.execute("SELECT sum(pg_total_relation_size(format('outbox.%I', name)::regclass)) "
                        "FROM outbox.partitions").fetchone()
    assert row is not None and size is not None
    return {"ranges": int(row[0]), "leaves": int(row[1]) + 1, "bytes": int(size[0] or 0)}


def fresh(pg: Postgres) -> tuple[str, str]:
    from outbox_relay.migrate import migrate

    name = pg.create_database()
    dsn = pg.dsn(name)
    migrate(dsn)
    return name, dsn


def grow_case(pg: Postgres, baseline_dsn: str, args: argparse.Namespace) -> None:
    sizes = [int(s) for s in args.sizes.split(",") if s]
    if not sizes:
        return
    name, dsn = fresh(pg)
    with psycopg.connect(dsn, autocommit=True, prepare_threshold=None) as conn:
        setup(conn)
        stored = 0
        for size in sizes:
            t0 = time.perf_counter()
            stored = grow(conn, stored, size, args.per_partition, args.tx_events)
            filled = time.perf_counter() - t0
            deliver_all(conn)
            head_batch(conn)
            result = measure(dsn, baseline_dsn, conn, args)
            print(json.dumps({"case": "grow", "stored_events": stored, **counts(conn),
                              "fill_seconds": round(filled, 1), **result}), flush=True)
            # The head batch and the publishes are history at the next size (delivered by deliver_all).
    if not args.keep_data:
        pg.drop_database(name)


def ranges_case(pg: Postgres, baseline_dsn: str, args: argparse.Namespace) -> None:
    for n in [int(s) for s in args.ranges.split(",") if s]:
        name, dsn = fresh(pg)
        with psycopg.connect(dsn, autocommit=True, prepare_threshold=None) as conn:
            setup(conn)
            t0 = time.perf_counter()
            made = 1
            error = None
            roll_ms: list[float] = []
            try:
                for _ in range(n - 1):
                    insert(conn, 10, "history")
                    t1 = time.perf_counter()
                    history.roll(conn, 86400.0, min_width=1000)
                    roll_ms.append(1000 * (time.perf_counter() - t1))
                    made += 1
            except psycopg.Error as exc:  # housekeeping's partition making has limits of its own
                error = f"roll {made + 1}: {type(exc).__name__}: {str(exc).splitlines()[0]}"
            seconds = time.perf_counter() - t0
            deliver_all(conn)
            head_batch(conn)
            result = measure(dsn, baseline_dsn, conn, args)
            print(json.dumps({"case": "ranges", "asked": n, **counts(conn), "make_seconds": round(seconds, 1),
                              "last_roll_ms": round(statistics.median(roll_ms[-10:]), 1) if roll_ms else None,
                              "roll_error": error, **result}), flush=True)
        pg.drop_database(name)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="10000,1000000,10000000,50000000", help="grow: stored events ('' skips)")
    ap.add_argument("--per-partition", type=int, default=500_000)
    ap.add_argument("--tx-events", type=int, default=10_000)
    ap.add_argument("--ranges", default="1,100,500,1000,2000", help="xid ranges per database ('' skips)")
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--publish-seconds", type=float, default=3.0)
    ap.add_argument("--dir", default=None, help="data directory parent (default: a temporary one)")
    ap.add_argument("--keep-data", action="store_true")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-readcost-", dir=args.dir) as tmp:
        pg = Postgres(Path(tmp), config={"max_wal_size": "8GB"})
        try:
            print(json.dumps({"machine": machine(), "postgres": pg.version, "settings": pg.settings,
                              "load": round(load(), 2)}), flush=True)
            _, baseline_dsn = fresh(pg)
            with psycopg.connect(baseline_dsn, autocommit=True) as conn:
                setup(conn)
            ranges_case(pg, baseline_dsn, args)
            grow_case(pg, baseline_dsn, args)
        finally:
            pg.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
