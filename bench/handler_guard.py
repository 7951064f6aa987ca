"""What the handler time limit costs a projection's fast path (issue 15), interleaved in one run.

    python bench/handler_guard.py [--events 20000] [--runs 3] [--batch-size 1000]

A private PostgreSQL 18, N ``bench.order_paid`` events over 1,000 customers, and the bench's read model
(``bench_projection.bench_totals``: one upsert per event). Each run applies all N events with a fresh
projection sink (its own cursors, so the same events are applied again) through the real
``SinkRunner`` in this process, once with the guard (``projections/guard.py``: the batch walk on a
helper thread, one hand-off per batch, two attribute writes per handler call) and once with the walk
called directly on the runner thread, alternating which goes first. Also with small batches (one key's
2,000 events in one bucket, read 8 at a time, the least a read takes per bucket: the hand-off's cost per
event at its highest). Prints events/s, median (min-max) per mode.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import psycopg
from psycopg_pool import ConnectionPool

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import bench_projection
from servers import Postgres, machine

from outbox_relay import Outbox, store
from outbox_relay.migrate import migrate
from outbox_relay.relay import SinkRunner
from outbox_relay.settings import RelaySettings
from projections import projection
from projections.guard import Guard, Walk
from projections.sink import ProjectionSink

GUARDED_RUN = Guard.run


def direct_run(self: Guard, fn: Any, abort: Any) -> Any:
    """The walk on the calling thread, as before the guard."""
    return fn(Walk(fn))


def one_run(dsn: str, pool: ConnectionPool[Any], name: str, guarded: bool, events: int, batch_size: int,
            buckets: set[int]) -> float:
    Guard.run = GUARDED_RUN if guarded else direct_run  # type: ignore[method-assign]
    p = projection(name, events=["bench.order_paid"], tables=["bench_totals"])(bench_projection.bench_totals.handler)
    sink = ProjectionSink(p, dsn)
    with pool.connection() as conn:
        store.register_sink(conn, name, sink.kind)
    settings = RelaySettings(dsn=dsn, worker_id="bench", kafka=False, listen=False, batch_size=batch_size)
    runner = SinkRunner(sink, pool, settings)
    runner.desired = buckets
    applied = 0
    start = time.perf_counter()  # the first cycle acquires the buckets, then delivers
    while applied < events:
        n = runner.run_once()
        applied += n
        if n == 0 and applied < events:
            runner.hints.everything()
    seconds = time.perf_counter() - start
    sink.close()
    return events / seconds


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--events", type=int, default=20_000)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--batch-size", type=int, default=1000)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        pg = Postgres(Path(tmp))
        try:
            dsn = pg.dsn(pg.create_database())
            migrate(dsn)
            with psycopg.connect(dsn, autocommit=True) as conn:
                conn.execute(bench_projection.SCHEMA)
            outbox = Outbox(default_topic="bench")
            with psycopg.connect(dsn) as conn:
                for start in range(0, args.events, 1000):
                    outbox.publish_many(conn, [{"key": f"c{i % 1000}", "type": "bench.order_paid",
                                                "payload": {"customer": f"c{i % 1000}", "amount_cents": i}}
                                               for i in range(start, min(args.events, start + 1000))])
                    conn.commit()
                outbox.publish_many(conn, [{"key": "solo", "type": "bench.order_paid",
                                            "payload": {"customer": "solo", "amount_cents": i}} for i in range(2000)])
                conn.commit()
                row = conn.execute("SELECT outbox.bucket_v1('solo'), count(*) FROM outbox.events "
                                   "WHERE bucket = outbox.bucket_v1('solo')").fetchone()
                assert row is not None
                solo_bucket, solo_events = int(row[0]), int(row[1])
            pool: ConnectionPool[Any] = ConnectionPool(dsn, min_size=1, max_size=2, kwargs={"autocommit": True})
            print(f"machine: {machine()}; PostgreSQL {pg.version}; {args.events:,} events, {args.runs} runs")
            cases = ((args.batch_size, args.events + 2000, set(range(256))), (1, solo_events, {solo_bucket}))
            for batch_size, events, buckets in cases:
                rates: dict[bool, list[float]] = {True: [], False: []}
                for run in range(args.runs):
                    for guarded in ((True, False) if run % 2 == 0 else (False, True)):
                        name = f"g{int(guarded)}_{batch_size}_{run}"
                        rates[guarded].append(one_run(dsn, pool, name, guarded, events, batch_size, buckets))
                for guarded in (False, True):
                    r = rates[guarded]
                    print(f"{events:,} events, batch size {batch_size:>4}, {'guarded' if guarded else 'direct '}: "
                          f"{statistics.median(r):9,.0f} ev/s (min {min(r):,.0f}, max {max(r):,.0f})")
            pool.close()
        finally:
            pg.stop()


if __name__ == "__main__":
    main()
