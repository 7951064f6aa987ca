"""The console's pages: server time per page (p50, p99) over a large seeded database (issue 29: 10M stored
events, 10,000 dead letters, 64 relays; target p99 <= 200 ms).

    python bench/console_pages.py [--events 10000000] [--dead 10000] [--relays 64] [--requests 100]

On the bench's embedded PostgreSQL 18 (defaults but max_wal_size). Seeded server-side: events with
``INSERT ... SELECT generate_series`` in transactions of 100,000 over 50,000 keys, ids from uuidv7(), a
new history range every 1,000,000 (``history.roll``); 4 sinks (a kafka sink and 3 projections) whose
cursors stand after all of it but a fresh head of 10,000 pending events, held by ``--relays`` registered
relays; ``--dead`` dead letters and 500 waiting keys (1,000 parked events) and 20 paused keys on the kafka
sink; a day of per-minute samples; 1,000 audit records. Then each page is requested ``--requests`` times
(after 5 warm-ups) through the real app in-process (Starlette's TestClient: routing, the queries,
template rendering; no network), and the server time of each request is measured around the call.
Prints one JSON line per page, and the machine.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import psycopg

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from servers import Postgres, machine

from outbox_relay import history, migrate, store

SINKS = ("kafka", "orders_view", "totals_view", "search_view")
TX = 100_000
PER_RANGE = 1_000_000
TOKEN = "bench-token-0123456789abcdef"


def seed(dsn: str, events: int, dead: int, relays: int) -> dict[str, Any]:
    t0 = time.monotonic()
    with psycopg.connect(dsn, autocommit=True) as conn:
        history.roll(conn, 86400.0, min_width=1000)
        stored = 0
        while stored < events:
            n = min(TX, events - stored, PER_RANGE - stored % PER_RANGE)
            conn.execute("INSERT INTO outbox.events (id, partition_key, topic, type, payload) "
                         "SELECT uuidv7(), 'key-' || (g %% 50000), 'orders', 'OrderPlaced', "
                         "jsonb_build_object('customer', 'c-' || (g %% 50000), 'amount_cents', g %% 1000) "
                         "FROM generate_series(1, %s) AS g", (n,))
            stored += n
            if stored % PER_RANGE == 0 and stored < events:
                history.roll(conn, 86400.0, min_width=1000)
        for i, sink in enumerate(SINKS):
            store.register_sink(conn, sink, "kafka" if i == 0 else "projection")
        conn.execute("INSERT INTO outbox.workers (id, sinks, metadata) "
                     "SELECT 'relay-' || g, %s, jsonb_build_object('host', 'host-' || (g %% 8), 'pid', 1000 + g, "
                     "'ttl_seconds', 10, 'listening', true) FROM generate_series(1, %s) g", (list(SINKS), relays))
        conn.execute("UPDATE outbox.cursors SET snapshot = pg_current_snapshot(), "
                     "owner = 'relay-' || (1 + bucket %% %s), "
                     "lease_expires_at = clock_timestamp() + interval '1 hour', advanced_at = clock_timestamp()",
                     (relays,))
        conn.execute("INSERT INTO outbox.events (id, partition_key, topic, type, payload) "
                     "SELECT uuidv7(), 'key-' || (g % 50000), 'orders', 'OrderPaid', '{}' "
                     "FROM generate_series(1, 10000) AS g")  # the pending head
        conn.execute("""
            INSERT INTO outbox.dead_letters (sink, event_id, bucket, xid, seq, partition_key, attempts, last_error,
                                             dead_at)
            SELECT 'kafka', e.id, e.bucket, e.xid, e.seq, e.partition_key, 10,
                   'KafkaError: MSG_SIZE_TOO_LARGE (message ' || e.seq || ')',
                   clock_timestamp() - make_interval(secs => e.seq %% 86400)
            FROM outbox.events e WHERE e.seq %% %s = 7 LIMIT %s""", (max(1, events // dead), dead))
        conn.execute("""
            INSERT INTO outbox.parked (sink, bucket, xid, seq, partition_key, event_id, attempts, available_at,
                                       last_error)
            SELECT 'kafka', e.bucket, e.xid, e.seq, e.partition_key, e.id, 3, clock_timestamp() + interval '40 seconds',
                   'broker said no'
            FROM outbox.events e WHERE e.type = 'OrderPaid' AND e.seq % 10 < 1 LIMIT 1000""")
        conn.execute("INSERT INTO outbox.paused_keys (sink, partition_key, paused_by, reason) "
                     "SELECT 'kafka', 'key-' || g, 'ops@bench', 'checking' FROM generate_series(1, 20) g "
                     "ON CONFLICT DO NOTHING")
        conn.execute("""
            INSERT INTO outbox.console_samples (sink, at, pending, parked, dead_letters, published)
            SELECT s, date_trunc('minute', now()) - make_interval(mins => m), 100 + m %% 50, 0, %s, 60000
            FROM unnest(%s::text[]) s, generate_series(0, 1439) m""", (dead, list(SINKS)))
        conn.execute("INSERT INTO outbox.console_audit (who, action, sink, target, count) "
                     "SELECT 'ops', 'retry-dead', 'kafka', 'all dead letters', g FROM generate_series(1, 1000) g")
        conn.execute("VACUUM ANALYZE")
        ids = conn.execute("SELECT event_id, partition_key FROM outbox.dead_letters ORDER BY dead_at DESC "
                           "OFFSET 60 LIMIT 1").fetchone()
        parts = conn.execute("SELECT count(*) FROM outbox.partitions").fetchone()
    assert ids is not None and parts is not None
    return {"seed_seconds": round(time.monotonic() - t0, 1), "event": str(ids[0]), "key": ids[1],
            "partitions": parts[0]}


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--events", type=int, default=10_000_000)
    parser.add_argument("--dead", type=int, default=10_000)
    parser.add_argument("--relays", type=int, default=64)
    parser.add_argument("--requests", type=int, default=100)
    args = parser.parse_args()
    from starlette.testclient import TestClient

    from outbox_relay.console import create_app

    with tempfile.TemporaryDirectory() as tmp:
        pg = Postgres(Path(tmp), config={"max_wal_size": "8GB"})
        try:
            dsn = pg.dsn(pg.create_database("console"))
            migrate(dsn)
            seeded = seed(dsn, args.events, args.dead, args.relays)
            print(json.dumps({"seeded": seeded, "events": args.events, "dead": args.dead, "relays": args.relays,
                              "postgres": pg.version, "machine": machine()}), flush=True)
            tokens = Path(tmp) / "tokens"
            tokens.write_text(f"bench {TOKEN}\n")
            pages = {
                "overview": "/",
                "sink": "/sinks/kafka",
                "sink, dead letters page 2": f"/sinks/kafka?after={seeded['event']}",
                "sink, dead letters of a key": f"/sinks/kafka?key={seeded['key']}",
                "event by id": f"/events?id={seeded['event']}",
                "events of a key": f"/events?key={seeded['key']}",
                "history": "/history",
                "audit": "/audit",
            }
            with TestClient(create_app(dsn, token_file=tokens, sample_seconds=None),
                            base_url="http://127.0.0.1") as client:
                measure(client, pages, args.requests, "10,000 pending per sink")
                with psycopg.connect(dsn, autocommit=True) as conn:  # the relays caught up
                    conn.execute("UPDATE outbox.cursors SET snapshot = pg_current_snapshot()")
                measure(client, {k: pages[k] for k in ("overview", "sink")}, args.requests, "nothing pending")
        finally:
            pg.stop()
    return 0


def measure(client: Any, pages: dict[str, str], requests: int, state: str) -> None:
    """Each page ``requests`` times after 5 warm-ups: server time of each request, p50 and p99."""
    for name, path in pages.items():
        for _ in range(5):
            assert client.get(path).status_code == 200, (name, path)
        times = []
        for _ in range(requests):
            t = time.perf_counter()
            response = client.get(path)
            times.append((time.perf_counter() - t) * 1000)
            assert response.status_code == 200
        print(json.dumps({"page": name, "path": path, "p50_ms": round(percentile(times, 0.5), 1),
                          "p99_ms": round(percentile(times, 0.99), 1), "max_ms": round(max(times), 1),
                          "requests": requests, "bytes": len(response.content), "state": state}), flush=True)


if __name__ == "__main__":
    sys.exit(main())
