"""Plan regression for the console's reads (sql/queries/console.sql, and admin.sql's dead-letter page it
shows): on a database with many events, dead letters, parked keys, samples and audit records, each is
bounded by its LIMIT and reads by index: no sequential scan of a large table, and no sort of one."""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest

from outbox_relay import store
from outbox_relay.admin.dead_letter_ops import FIRST_PAGE
from outbox_relay.sqlfiles import query

EVENTS = 100_000
DEAD = 5_000
PARKED_KEYS = 1_000
SINKS = 64
LARGE = ("events", "dead_letters", "parked", "console_samples", "console_audit")


def nodes(plan: dict[str, Any]) -> Iterator[dict[str, Any]]:
    yield plan
    for child in plan.get("Plans", []):
        yield from nodes(child)


def on_large(n: dict[str, Any]) -> bool:
    relation = str(n.get("Relation Name", ""))
    return any(relation == t or (t == "events" and relation.startswith("events")) for t in LARGE)


@pytest.fixture(scope="module")
def seeded(pg_server: Any, pg_template: Any) -> Iterator[str]:
    """One database for the module (seeding takes a few seconds): 100,000 events over 5,000 keys, 64 sinks,
    5,000 dead letters and 1,000 parked keys of one sink, a day of samples, 10,000 audit records."""
    name = pg_server.create_database(template=pg_template.name)
    dsn = pg_server.dsn_for(name)
    with psycopg.connect(dsn, autocommit=True) as conn:
        for start in range(0, EVENTS, 25_000):
            conn.execute("INSERT INTO outbox.events (partition_key, type, payload) "
                         "SELECT 'key-' || (g %% 5000), 'placed', jsonb_build_object('g', g) "
                         "FROM generate_series(%s::int, %s::int) AS g", (start, start + 24_999))
        for i in range(SINKS):
            store.register_sink(conn, f"sink-{i}", "projection")
        conn.execute("""
            INSERT INTO outbox.dead_letters (sink, event_id, bucket, xid, seq, partition_key, attempts, last_error,
                                             dead_at)
            SELECT 'sink-0', e.id, e.bucket, e.xid, e.seq, e.partition_key, 10, 'boom',
                   clock_timestamp() - make_interval(secs => e.seq)
            FROM outbox.events e WHERE e.seq % 20 = 0""")
        conn.execute("""
            INSERT INTO outbox.parked (sink, bucket, xid, seq, partition_key, event_id, attempts, last_error)
            SELECT 'sink-0', e.bucket, e.xid, e.seq, e.partition_key, e.id, 3, 'later'
            FROM outbox.events e WHERE e.seq % 20 = 1 AND e.seq < 40000""")
        conn.execute("""
            INSERT INTO outbox.console_samples (sink, at, pending, parked, dead_letters, published)
            SELECT 'sink-' || s, date_trunc('minute', now()) - make_interval(mins => m), 0, 0, 0, 0  -- one instant
            FROM generate_series(0, 63) s, generate_series(0, 1439) m""")
        conn.execute("""
            INSERT INTO outbox.console_audit (who, action, sink, target, count)
            SELECT 'ops', 'retry-dead', 'sink-0', 'all dead letters', g FROM generate_series(1, 10000) g""")
        conn.execute("ANALYZE")
    yield dsn
    pg_server.drop_database(name)


def explain(conn: psycopg.Connection[Any], sql: str, params: dict[str, Any]) -> dict[str, Any]:
    row = conn.execute("EXPLAIN (ANALYZE, FORMAT JSON) " + sql, params).fetchone()
    assert row is not None
    doc = row[0] if not isinstance(row[0], str) else json.loads(row[0])
    return dict(doc[0]["Plan"])


def some_event(conn: psycopg.Connection[Any]) -> uuid.UUID:
    row = conn.execute("SELECT id FROM outbox.events WHERE partition_key = 'key-42' LIMIT 1").fetchone()
    assert row is not None
    return uuid.UUID(str(row[0]))


CASES: dict[str, tuple[str, str, Any]] = {
    "waiting keys": ("console", "waiting_keys", lambda c: {"sink": "sink-0", "after_bucket": None,
                                                           "after_key": None, "limit": 51}),
    "waiting keys, next page": ("console", "waiting_keys", lambda c: {"sink": "sink-0", "after_bucket": 100,
                                                                      "after_key": "key-1", "limit": 51}),
    "paused keys": ("console", "paused_keys", lambda c: {"sink": "sink-0", "limit": 200}),
    "a key's events": ("console", "key_events", lambda c: {"key": "key-42", "limit": 20}),
    "an event": ("console", "event_detail", lambda c: {"event": some_event(c)}),
    "an event's ledger": ("console", "event_ledger", lambda c: {"ids": [some_event(c)], "limit": 2000}),
    "audit page": ("console", "audit_page", lambda c: {"before": None, "limit": 100}),
    "audit, next page": ("console", "audit_page", lambda c: {"before": 5000, "limit": 100}),
    "samples of the last hour": ("console", "samples_since", lambda c: {"minutes": 61, "limit": 20000}),
    "dead letters page": ("admin", "dead_letters", lambda c: {"sink": "sink-0", "key": None, "limit": 51,
                                                              **FIRST_PAGE}),
    "dead letters of a key": ("admin", "dead_letters", lambda c: {"sink": "sink-0", "key": "key-40", "limit": 51,
                                                                  **FIRST_PAGE}),
}


@pytest.mark.parametrize("case", list(CASES))
def test_each_console_read_is_bounded_and_indexed(seeded: str, case: str) -> None:
    group, name, params = CASES[case]
    with psycopg.connect(seeded, autocommit=True) as conn, conn.transaction():
        if case == "a key's events":  # as admin.key_ledger runs it
            conn.execute(query("console", "ordered_scans"))
        root = explain(conn, query(group, name), params(conn))
    every = list(nodes(root))
    # Index scans, or bitmaps of an index range (the last hour's samples): never a whole table; a key's events
    # walk its bucket's index range in order (no bitmap of the whole bucket).
    by_bucket = case == "a key's events"
    scans = [(n["Node Type"], n.get("Relation Name")) for n in every
             if n["Node Type"] in ("Seq Scan", *(("Bitmap Heap Scan",) if by_bucket else ())) and on_large(n)
             and n.get("Actual Rows", 0) * max(1, n.get("Actual Loops", 1)) + n.get("Rows Removed by Filter", 0)]
    assert scans == [], (case, scans)
    sorts = [n for n in every if n["Node Type"] in ("Sort", "Incremental Sort")
             and any(on_large(c) for c in nodes(n)) and n.get("Actual Rows", 0) > 2000]
    assert sorts == [], (case, json.dumps(root, indent=1)[:3000])
    touched_rows = sum(n.get("Actual Rows", 0) * max(1, n.get("Actual Loops", 1)) + n.get("Rows Removed by Filter", 0)
                       for n in every if on_large(n))
    assert touched_rows < (EVENTS // 256 * 2 if by_bucket else 10_000), (case, touched_rows)  # a page, not a table
    if by_bucket:
        indexes = {n.get("Index Name", "") for n in every if n["Node Type"] == "Index Scan" and on_large(n)}
        assert indexes and all(i == "events_position" or i.endswith("_bucket_xid_seq_idx") for i in indexes), indexes
