"""Plan regression: the relay's read (fetch_events) stays index probes and one range scan per leased bucket.

With a couple of hundred thousand stored events, most of them delivered history to the left of the
cursors, the read must walk ``events_position`` from each cursor (no sequential scan, no sort, no
bitmap scan of the whole bucket), with the custom plan of its first executions and with the generic
plan Postgres may switch to once psycopg has prepared it (the relay's connections leave
``plan_cache_mode`` at ``auto``, services/pool.py configure_connection): GUIDE section 4's trap is a generic plan many
times slower than the custom one.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest

from outbox_relay import history, store
from outbox_relay.positions import Cursor, Snapshot
from outbox_relay.services.pool import configure_connection
from outbox_relay.sqlfiles import query
from tests.integration.relay_helpers import SINK

pytestmark = pytest.mark.pg15  # the PostgreSQL 15 step runs it too (scripts/test.sh)

ROWS = 200_000
LEASED = list(range(0, 256, 4))  # 64 buckets
LIMIT = 16
PENDING_PER_BUCKET = 20  # each cursor sits this many events before the end of its bucket


def on_events_table(n: dict[str, Any]) -> bool:
    """A plan node reading outbox.events: since 0014 one of its partitions (events_p1_default, ...)."""
    return str(n.get("Relation Name", "")).startswith("events")


def position_index(name: str | None) -> bool:
    """events_position, or its copy on a partition (events_p1_default_bucket_xid_seq_idx)."""
    return name == "events_position" or bool(name and name.startswith("events")
                                             and name.endswith("_bucket_xid_seq_idx"))


def nodes(plan: dict[str, Any]) -> Iterator[dict[str, Any]]:
    yield plan
    for child in plan.get("Plans", []):
        yield from nodes(child)


def explain(conn: psycopg.Connection[Any], sql: str, params: dict[str, Any], plan: str) -> dict[str, Any]:
    """EXPLAIN (ANALYZE, BUFFERS) of ``sql`` as Postgres runs it with a custom plan (the parameters'
    values known at planning), or with the generic plan of the prepared statement (planned once for
    any values: what a prepared statement may switch to after five executions)."""
    if plan == "custom":
        conn.execute("SET plan_cache_mode = force_custom_plan")
        row = conn.execute("EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON) " + sql, params).fetchone()
    else:
        conn.execute("SET plan_cache_mode = force_generic_plan")
        row = execute_prepared(conn, prepare(conn, sql), params, explain=True)
    conn.execute("RESET plan_cache_mode")
    assert row is not None
    doc = row[0] if not isinstance(row[0], str) else json.loads(row[0])
    return dict(doc[0]["Plan"])


def prepare(conn: psycopg.Connection[Any], sql: str) -> list[str]:
    """``sql`` as the prepared statement ``planned``, with $n in order of first use (as psycopg numbers them):
    its parameters' names, in that order."""
    names: list[str] = []
    for name in re.findall(r"%\((\w+)\)s", sql):
        if name not in names:
            names.append(name)
    body = re.sub(r"%\((\w+)\)s", lambda m: f"${names.index(m.group(1)) + 1}", sql).replace("%%", "%")
    conn.execute("DEALLOCATE ALL")
    conn.execute("PREPARE planned AS " + body)
    return names


def execute_prepared(conn: psycopg.Connection[Any], names: list[str], params: dict[str, Any], *,
                     explain: bool = False) -> Any:
    """EXECUTE ``planned`` (values passed as literals), or its EXPLAIN (ANALYZE, BUFFERS): the first row."""
    args = ", ".join(f"%({n})s" for n in names)
    head = "EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON) " if explain else ""
    return psycopg.ClientCursor(conn).execute(f"{head}EXECUTE planned({args})", params).fetchone()


@pytest.mark.parametrize("plan", ["custom", "generic"])
@pytest.mark.parametrize("wanted", [None, store.EventFilter(types=("bulk", "other"))], ids=["all", "by-type"])
def test_fetch_events_walks_events_position_from_each_cursor(dsn: str, wanted: store.EventFilter | None,
                                                             plan: str) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        for start in range(0, ROWS, 20_000):  # 10 transactions: 10 distinct xids
            conn.execute("INSERT INTO outbox.events (partition_key, type, payload) "
                         "SELECT 'key-' || (g %% 5000), 'bulk', jsonb_build_object('g', g) "
                         "FROM generate_series(%s::int, %s::int) AS g", (start, start + 19_999))
        conn.execute("VACUUM ANALYZE outbox.events")
        store.register_sink(conn, SINK, "projection")
        assert len(store.acquire_leases(conn, SINK, "w", LEASED, 600.0)) == len(LEASED)
        # Each cursor sits PENDING_PER_BUCKET events before the end of its bucket.
        starts = conn.execute("""
            SELECT bucket, xid::text::bigint, seq
            FROM (SELECT bucket, xid, seq,
                         count(*) OVER (PARTITION BY bucket) - row_number() OVER (PARTITION BY bucket
                                                                                   ORDER BY xid, seq) AS after
                  FROM outbox.events) s
            WHERE s.after = %s""", (PENDING_PER_BUCKET,)).fetchall()
        cursors = {b: Cursor.at((int(x), int(s) + 1)) for b, x, s in starts}
        reads = {b: (LIMIT, cursors[b]) for b in LEASED}
        params = store.fetch_params(SINK, "w", reads, wanted)
        root = explain(conn, store.fetch_sql(conn, reads), params, plan)
        # The same statement as the relay runs it returns what the plan promises.
        events = store.fetch_events(conn, SINK, "w", reads, wanted).events

    all_nodes = list(nodes(root))
    on_events = [n for n in all_nodes if on_events_table(n)]
    assert on_events, json.dumps(root, indent=1)
    # The planner may pick another index on a partition it thinks empty (here the DEFAULT range,
    # events_default): allowed where it reads nothing; every row comes by events_position.
    kinds = {(n["Node Type"], position_index(n.get("Index Name"))) for n in on_events
             if n["Actual Rows"] * max(1, n["Actual Loops"]) + n.get("Rows Removed by Filter", 0) > 0}
    assert kinds <= {("Index Scan", True), ("Index Only Scan", True)}, kinds
    assert all(n["Node Type"] in ("Index Scan", "Index Only Scan") for n in on_events), on_events
    assert not [n for n in all_nodes if n["Node Type"] in ("Seq Scan", "Bitmap Heap Scan")
                and on_events_table(n)], "the read scans the events table"
    assert not [n for n in all_nodes if n["Node Type"] in ("Sort", "Incremental Sort")
                and any(on_events_table(c) for c in nodes(n))], "the read sorts events"
    # Per bucket one range after the cursor's xmax, which returns the rows; the probe for transactions
    # open at the cursor's snapshot runs only when some of them committed since (none here: never).
    ranges = [n for n in on_events if n["Actual Rows"] > 0]
    assert ranges and all(n["Actual Loops"] == len(LEASED) for n in ranges), "one index range per leased bucket"
    assert all(n["Actual Loops"] in (0, len(LEASED)) for n in on_events), "at most one probe per leased bucket"
    scan = max(on_events, key=lambda n: n["Actual Rows"])
    assert scan.get("Rows Removed by Filter", 0) <= len(LEASED), "history before the cursor must not be read"
    assert len(events) == LIMIT * len(LEASED)
    assert root["Actual Rows"] == len(events) + 1, "the rows, and the one that carries the snapshot"
    # Buffers of the events table and its index only (on PostgreSQL 15 a generic plan probes the empty
    # park's index once per leased bucket: a few hits each, not the trap this is about).
    touched = sum(n.get("Shared Hit Blocks", 0) + n.get("Shared Read Blocks", 0) for n in on_events)
    assert touched < 40 * len(LEASED), f"{touched} buffers for {len(events)} rows: the read is not a range scan"


def test_a_generic_plan_made_while_the_table_was_empty_still_walks_the_index_once_it_has_grown(dsn: str) -> None:
    """The relay's read is prepared (psycopg, after five executions) on a table that may be new and analysed
    empty; Postgres keeps the generic plan until the partition is next analysed. The commit watcher's plan
    made that way read the whole partition at every look (0024); the read's must stay on events_position,
    on a connection set up as the relay's pool sets up each of its own."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        configure_connection(conn)
        for (leaf,) in conn.execute("SELECT relid::regclass::text FROM pg_partition_tree('outbox.events') "
                                    "WHERE isleaf").fetchall():
            conn.execute(f"ALTER TABLE {leaf} SET (autovacuum_enabled = false)")  # no analyse while it grows
        conn.execute("ANALYZE outbox.events")  # empty, and believed
        store.register_sink(conn, SINK, "projection")
        assert len(store.acquire_leases(conn, SINK, "w", LEASED, 600.0)) == len(LEASED)
        reads = {b: (LIMIT, Cursor.at((0, 0))) for b in LEASED}
        names = prepare(conn, store.fetch_sql(conn, reads))
        conn.execute("SET plan_cache_mode = force_generic_plan")
        execute_prepared(conn, names, store.fetch_params(SINK, "w", reads))  # planned now, on the empty table
        conn.execute("INSERT INTO outbox.events (partition_key, type, payload) "
                     "SELECT 'key-' || (g % 5000), 'bulk', '{}' FROM generate_series(1, 100000) AS g")
        tail = conn.execute("SELECT xid::text::bigint, max(seq) - %s FROM outbox.events GROUP BY xid",
                            (PENDING_PER_BUCKET * 256,)).fetchone()
        assert tail is not None
        reads = {b: (LIMIT, Cursor.at((int(tail[0]), int(tail[1])))) for b in LEASED}
        row = execute_prepared(conn, names, store.fetch_params(SINK, "w", reads), explain=True)
        conn.execute("RESET plan_cache_mode")
    assert row is not None
    root = (row[0] if not isinstance(row[0], str) else json.loads(row[0]))[0]["Plan"]
    on_events = [n for n in nodes(root) if on_events_table(n)]
    assert on_events and not [n for n in on_events if n["Node Type"] in ("Seq Scan", "Bitmap Heap Scan")], \
        json.dumps(root, indent=1)
    touched = sum(n.get("Shared Hit Blocks", 0) + n.get("Shared Read Blocks", 0) for n in on_events)
    assert touched < 40 * len(LEASED), f"{touched} buffers: the read is not a range scan from each cursor"


@pytest.mark.parametrize("plan", ["custom", "generic"])
def test_a_read_probes_only_the_partitions_of_its_snapshots(dsn: str, plan: str) -> None:
    """0014: outbox.events is partitioned by xid ranges. A read whose cursors sit in the newest range
    probes that range's partitions only; older history (here three closed ranges of 20,000 events each,
    all delivered) is not opened, however much of it there is (run-time pruning on the cursors' xids)."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        for _ in range(3):
            conn.execute("INSERT INTO outbox.events (partition_key, type, payload) "
                         "SELECT 'key-' || (g % 5000), 'old', '{}' FROM generate_series(1, 20000) AS g")
            history.roll(conn, 86400.0, min_width=1000)
        conn.execute("INSERT INTO outbox.events (partition_key, type, payload) "
                     "SELECT 'key-' || (g % 5000), 'new', '{}' FROM generate_series(1, 5000) AS g")
        conn.execute("VACUUM ANALYZE outbox.events")
        store.register_sink(conn, SINK, "projection")
        assert len(store.acquire_leases(conn, SINK, "w", LEASED, 600.0)) == len(LEASED)
        # Every cursor just before the newest range's first event of its bucket.
        newest = conn.execute("SELECT min(xid)::text::bigint FROM outbox.events WHERE type = 'new'").fetchone()
        assert newest is not None
        cursors = {b: Cursor.at((int(newest[0]), 0)) for b in LEASED}
        params = store.fetch_params(SINK, "w", {b: (LIMIT, cursors[b]) for b in LEASED})
        ranges = [r[0] for r in conn.execute(
            "SELECT DISTINCT range_name FROM outbox.partitions WHERE range_name IS NOT NULL ORDER BY 1")]
        current = conn.execute("SELECT range_name FROM outbox.partitions WHERE xid_from <= %s::text::xid8 "
                               "AND xid_to > %s::text::xid8", (newest[0], newest[0])).fetchone()
        assert current is not None and len(ranges) >= 4, ranges
        root = explain(conn, store.fetch_sql(conn, {b: (LIMIT, cursors[b]) for b in LEASED}), params, plan)
        events = store.fetch_events(conn, SINK, "w", {b: (LIMIT, cursors[b]) for b in LEASED}).events
    probed = {str(n["Relation Name"]) for n in nodes(root) if on_events_table(n) and n.get("Actual Loops", 0) > 0}
    assert probed, json.dumps(root, indent=1)
    # The newest range's leaves, and events_default (the DEFAULT range: never pruned by a lower bound).
    assert {p for p in probed if p != "events_default"} <= {f"{current[0]}_default"}, probed
    assert events and {e.type for e in events} == {"new"}
    kinds = {(n["Node Type"], position_index(n.get("Index Name"))) for n in nodes(root) if on_events_table(n)
             and n["Actual Rows"] * max(1, n["Actual Loops"]) + n.get("Rows Removed by Filter", 0) > 0}
    assert kinds <= {("Index Scan", True), ("Index Only Scan", True)}, kinds  # (see the test above)


RANGES = 60


def many_ranges(conn: psycopg.Connection[Any]) -> tuple[str, Snapshot]:
    """RANGES closed xid ranges of delivered history, then 20,000 events in the newest range that the
    sink's cursors (leased to "w", at the snapshot before them) have not seen: the newest range's
    leaf and that snapshot."""
    for _ in range(RANGES):
        conn.execute("INSERT INTO outbox.events (partition_key, type, payload) "
                     "SELECT 'key-' || g, 'old', '{}' FROM generate_series(1, 10) AS g")
        history.roll(conn, 86400.0, min_width=1000)
    store.register_sink(conn, SINK, "projection")
    conn.execute("UPDATE outbox.cursors SET snapshot = pg_current_snapshot() WHERE sink = %s", (SINK,))
    assert len(store.acquire_leases(conn, SINK, "w", LEASED, 600.0)) == len(LEASED)
    seen = conn.execute("SELECT pg_current_snapshot()::text").fetchone()
    assert seen is not None
    conn.execute("INSERT INTO outbox.events (partition_key, type, payload) "
                 "SELECT 'key-' || (g % 5000), 'new', '{}' FROM generate_series(1, 20000) AS g")
    conn.execute("VACUUM ANALYZE outbox.events")
    newest = conn.execute("SELECT name FROM outbox.partitions WHERE range_name IS NOT NULL "
                          "ORDER BY xid_from DESC LIMIT 1").fetchone()
    leaves = conn.execute("SELECT count(*) FROM outbox.partitions").fetchone()
    assert newest is not None and leaves is not None and leaves[0] > RANGES
    return str(newest[0]), Snapshot.parse(seen[0])


def test_a_read_plans_and_locks_only_the_newest_partitions(dsn: str) -> None:
    """With many xid ranges (history kept for good: a range a day), a read at the head plans and locks
    the newest range's partitions only, as the relay runs it (prepared, plan_cache_mode auto): a plan
    over every partition cost tens of ms per read at a few hundred ranges and a lock per partition
    and index, and at ~1,000 ranges the read failed with "out of shared memory"
    (bench/results/2026-11-26-read-cost.md)."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        newest, seen = many_ranges(conn)
        reads = {b: (LIMIT, Cursor(seen)) for b in LEASED}
        root = explain(conn, store.fetch_sql(conn, reads), store.fetch_params(SINK, "w", reads), "custom")
    planned = {str(n["Relation Name"]) for n in nodes(root) if on_events_table(n)}
    assert planned <= {newest, "events_default"}, f"the read planned {len(planned)} partitions"

    # As a relay runs it: psycopg prepares it on the 5th execution, Postgres then picks custom or generic
    # plans by cost. Locks held at the end of the read's transaction: the partitions it planned and
    # their indexes, and the few other tables it reads (not the 5 relations of each of 60 ranges).
    with psycopg.connect(dsn) as conn:
        conn.execute("SET plan_cache_mode = auto")
        conn.commit()
        for _ in range(10):
            events = store.fetch_events(conn, SINK, "w", reads, formatted=False).events
            locks = conn.execute("SELECT count(*) FROM pg_locks WHERE pid = pg_backend_pid() "
                                 "AND locktype = 'relation'").fetchone()
            conn.commit()
            assert locks is not None and locks[0] < 60, f"the read locked {locks[0]} relations"
    assert len(events) == LIMIT * len(LEASED) and {e.type for e in events} == {"new"}


def test_a_parked_retry_plans_only_the_partitions_from_its_oldest_event(dsn: str) -> None:
    """The park's retries look their events up from the range of the oldest parked one on: over 300
    ranges each call planned every partition (120-400 ms, 4,500 locks)."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        newest, _ = many_ranges(conn)
        parked = conn.execute(
            "INSERT INTO outbox.parked (sink, bucket, xid, seq, partition_key, event_id, available_at) "
            "SELECT DISTINCT ON (bucket) %s, bucket, xid, seq, partition_key, id, clock_timestamp() "
            "FROM outbox.events WHERE type = 'new' AND bucket = ANY(%s) ORDER BY bucket, xid, seq RETURNING event_id",
            (SINK, LEASED)).fetchall()
        params = {"sink": SINK, "buckets": LEASED, "keys": 100, "per_key": 10, "worker": None,
                  "fences": [None] * len(LEASED)}
        root = explain(conn, store.parked_sql(conn, params), params, "custom")
        events = store.fetch_parked(conn, SINK, LEASED, 100, 10)
    planned = {str(n["Relation Name"]) for n in nodes(root) if on_events_table(n)}
    assert planned <= {newest, "events_default"}, f"fetch_parked planned {len(planned)} partitions"
    assert sorted(e.id for e in events) == sorted(r[0] for r in parked)


@pytest.mark.parametrize("name", ["sinks", "key_lag"])
def test_the_backlog_metrics_plan_only_the_partitions_of_undelivered_events(dsn: str, name: str) -> None:
    """The metrics' backlog queries (refreshed every few seconds by each relay with --metrics-port) plan
    only the partitions from the cursors' lowest xmin on: over 300 ranges they took 0.4-2 s and held
    4,500 locks per refresh."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        newest, _ = many_ranges(conn)
        floor = conn.execute(query("metrics", "floor")).fetchone()
        assert floor is not None
        root = explain(conn, query("metrics", name), {"floor": floor[0], "top": 5}, "custom")
        counted = conn.execute(query("metrics", "sinks"), {"floor": floor[0]}).fetchall()
    planned = {str(n["Relation Name"]) for n in nodes(root) if on_events_table(n)}
    assert planned <= {newest, "events_default"}, f"{name} planned {len(planned)} partitions"
    # The 20,000 new events are undelivered (the sink's cursors are before them), the old ones not.
    assert [(r[0], r[1]) for r in counted] == [(SINK, 20_000)]


@pytest.mark.parametrize("plan", ["custom", "generic"])
def test_a_read_from_the_start_of_history_reads_only_what_it_returns(dsn: str, plan: str) -> None:
    """A rebuild's cursors start before all of history, with no transaction open at their snapshot: no
    probe may walk a bucket's history (an empty list of open transactions once made the first probe
    read every event of each bucket at every fetch on PostgreSQL 15, which made a rebuild quadratic;
    run this file with OUTBOX_TEST_DSN pointing at a 15 to see it)."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("INSERT INTO outbox.events (partition_key, type, payload) "
                     "SELECT 'key-' || (g %% 5000), 'bulk', jsonb_build_object('g', g) "
                     "FROM generate_series(1, %s) AS g", (ROWS // 4,))
        conn.execute("VACUUM ANALYZE outbox.events")
        store.register_sink(conn, SINK, "projection")
        assert len(store.acquire_leases(conn, SINK, "w", LEASED, 600.0)) == len(LEASED)
        start = Cursor.at((0, 0))  # everything stored is ahead of it
        params = store.fetch_params(SINK, "w", {b: (LIMIT, start) for b in LEASED})
        root = explain(conn, store.fetch_sql(conn, {b: (LIMIT, start) for b in LEASED}), params, plan)
        events = store.fetch_events(conn, SINK, "w", {b: (LIMIT, start) for b in LEASED}).events
    on_events = [n for n in nodes(root) if on_events_table(n)]
    assert len(events) == LIMIT * len(LEASED)
    removed = sum(n.get("Rows Removed by Filter", 0) for n in on_events)
    read = sum(n["Actual Rows"] * max(1, n["Actual Loops"]) + n.get("Rows Removed by Filter", 0) for n in on_events)
    assert removed <= len(LEASED) and read <= 2 * LIMIT * len(LEASED), (
        f"a read of {len(events)} events from the start of history read {read} rows: "
        + json.dumps(on_events, indent=1)[:3000])


def relation_locks(conn: psycopg.Connection[Any]) -> int:
    """Relation locks this session holds on outbox.events, its partitions and their indexes."""
    row = conn.execute("SELECT count(*) FROM pg_locks l JOIN pg_class c ON c.oid = l.relation "
                       "WHERE l.pid = pg_backend_pid() AND l.locktype = 'relation' "
                       "AND c.relnamespace = 'outbox'::regnamespace AND c.relname LIKE 'events%'").fetchone()
    assert row is not None
    return int(row[0])


@pytest.mark.parametrize("statement", ["expire_leases", "acquire_leases"])
def test_a_lapse_check_locks_only_the_partitions_from_its_cursors_snapshots(dsn: str, statement: str) -> None:
    """Whether a lost lease's bucket had work (bucket_has_work_v3, 0016: housekeeping's expire_leases, and
    acquire_leases taking a lease over) plans and locks the partitions from the cursor snapshot's xmin on
    only: bucket_has_work_v2's plan covered every xid range (300 ranges: 4,500 locks and 0.8 s for 64
    buckets taken over). The answer is the same: a lapse where the bucket has undelivered events, none
    where its cursor is past them."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        many_ranges(conn)
        # Snapshots of their own, not the server's (whose xmin other sessions on a shared server hold back): the
        # cursors just before the newest range's events' transaction, and past it where all was delivered.
        row = conn.execute("SELECT min(xid)::text::bigint FROM outbox.events WHERE type = 'new'").fetchone()
        assert row is not None
        new = int(row[0])
        done = LEASED[::2]  # these cursors delivered everything: no work, no lapse
        conn.execute("UPDATE outbox.cursors SET snapshot = (CASE WHEN bucket = ANY(%s) THEN %s ELSE %s END)"
                     "::pg_snapshot WHERE sink = %s", (done, f"{new + 1}:{new + 1}:", f"{new}:{new}:", SINK))
        conn.execute("UPDATE outbox.cursors SET lease_expires_at = clock_timestamp() - interval '1 second' "
                     "WHERE sink = %s AND owner = 'w'", (SINK,))
        v2 = dict(conn.execute("SELECT bucket, outbox.bucket_has_work_v2(sink, bucket, snapshot, target, after_xid, "
                               "after_seq) FROM outbox.cursors WHERE sink = %s AND bucket = ANY(%s)",
                               (SINK, LEASED)).fetchall())
    assert v2 == {b: b not in done for b in LEASED}, "the setup: work where the cursors are behind"
    with psycopg.connect(dsn) as conn:
        if statement == "expire_leases":
            freed = conn.execute(query("housekeeping", "expire_leases")).fetchall()
            assert len(freed) == len(LEASED)
        else:
            assert len(store.acquire_leases(conn, SINK, "other", LEASED, 600.0)) == len(LEASED)
        locks = relation_locks(conn)
        conn.commit()
        lapses = dict(conn.execute("SELECT bucket, lapses FROM outbox.cursors WHERE sink = %s AND bucket = ANY(%s)",
                                   (SINK, LEASED)).fetchall())
    assert lapses == {b: 0 if b in done else 1 for b in LEASED}
    # The newest range's parent, leaf and indexes, events_default's, outbox.events' (not 5 of each of 60 ranges).
    assert locks < 30, f"{statement} locked {locks} relations of outbox.events"
