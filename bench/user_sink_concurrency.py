"""How a sink with slow calls gets concurrency across keys (issue 17 item 5), measured in one run.

    python bench/user_sink_concurrency.py [--events 2000] [--keys 64] [--call-ms 5] [--runs 2]
    python bench/user_sink_concurrency.py --overhead [--events 20000] [--runs 3]

A private PostgreSQL 18; per case a fresh database, R embedded relays (``outbox_relay.Relay``, one
process, R relay members splitting the buckets) each running an ``EventSink`` whose ``deliver`` sleeps
``--call-ms`` (an HTTP call's wait: the GIL is free meanwhile) with ``concurrency`` C. Once every relay
holds its share, N events over K keys are published in one transaction; the time is taken until
``Observer.checkpointed`` reported all N. Prints events/s per (R, C), median (min-max), next to the
ideal R*C*1000/call-ms.

``--overhead``: what the adapter costs per event with a ``deliver`` that does nothing: N events (1,000
keys) drained by the real ``SinkRunner`` in this process, a fresh sink per run, through (a) an engine sink
that marks every event delivered (the floor: reads and checkpoints) and (b) the adapter around a no-op
``EventSink`` with concurrency 1 and 4, interleaved. Prints events/s and microseconds per event.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import psycopg

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from servers import Postgres, machine

from outbox_relay import Outbox, Relay
from outbox_relay.migrate import migrate
from outbox_relay.observer import Observer
from outbox_relay.settings import load_settings
from outbox_relay.sinks import SinkEvent


class SlowSink:
    name = "slow"
    kind = "bench"

    def __init__(self, seconds: float, concurrency: int) -> None:
        self.seconds, self.concurrency = seconds, concurrency

    def deliver(self, event: SinkEvent) -> None:
        time.sleep(self.seconds)


class Count(Observer):
    def __init__(self, target: int) -> None:
        self.lock = threading.Lock()
        self.n, self.target = 0, target
        self.done = threading.Event()

    def checkpointed(self, sink: str, *, delivered: Sequence[uuid.UUID], dead: Sequence[uuid.UUID]) -> None:
        with self.lock:
            self.n += len(delivered) + len(dead)
            if self.n >= self.target:
                self.done.set()


def one_case(pg: Postgres, relays: int, concurrency: int, args: argparse.Namespace) -> float:
    name = pg.create_database()
    dsn = pg.dsn(name)
    migrate(dsn)
    count = Count(args.events)
    running = [Relay(load_settings(dsn=dsn, worker_id=f"bench-{i}", kafka=False, heartbeat_seconds=0.2,
                                   worker_ttl_seconds=1.0, batch_size=1000),
                     sinks=[SlowSink(args.call_ms / 1000, concurrency)], observer=count) for i in range(relays)]
    try:
        for r in running:
            r.start()
        deadline = time.monotonic() + 60
        while any(r.readiness() for r in running) or _held(dsn, relays) < 256:
            if time.monotonic() > deadline:
                raise RuntimeError(f"relays not ready: {[r.readiness() for r in running]}")
            time.sleep(0.1)
        with psycopg.connect(dsn) as conn:
            Outbox(default_topic="bench").publish_many(conn, [
                {"key": f"k{i % args.keys}", "type": "bench.slow", "payload": {"n": i}} for i in range(args.events)])
            conn.commit()
        start = time.perf_counter()
        if not count.done.wait(600):
            raise RuntimeError(f"only {count.n} of {args.events} delivered")
        return args.events / (time.perf_counter() - start)
    finally:
        for r in running:
            r.worker.drain()
        for r in running:
            r.wait(60)
        pg.drop_database(name)


def _held(dsn: str, relays: int) -> int:
    with psycopg.connect(dsn, autocommit=True) as conn:
        row = conn.execute("SELECT count(DISTINCT owner), count(*) FROM outbox.cursors "
                           "WHERE sink = 'slow' AND owner IS NOT NULL").fetchone()
    assert row is not None
    return int(row[1]) if int(row[0]) == relays else 0


class NoopEngineSink:
    kind = "bench"
    event_filter = None

    def __init__(self, name: str) -> None:
        self.name = name

    def deliver(self, events: Any, fences: Any, commit: Any, abort: Any) -> set[int]:
        landed: set[int] = commit({e.id: None for e in events}, None)
        return landed

    def close(self) -> None:
        pass


class NoopSink:
    kind = "bench"

    def __init__(self, name: str, concurrency: int) -> None:
        self.name, self.concurrency = name, concurrency

    def deliver(self, event: SinkEvent) -> None:
        return None


def overhead(pg: Postgres, args: argparse.Namespace) -> None:
    from psycopg_pool import ConnectionPool

    from outbox_relay import store
    from outbox_relay.relay import SinkRunner
    from outbox_relay.sinks.adapter import EventSinkAdapter

    dsn = pg.dsn(pg.create_database())
    migrate(dsn)
    with psycopg.connect(dsn) as conn:
        for start in range(0, args.events, 1000):
            Outbox(default_topic="bench").publish_many(conn, [
                {"key": f"k{i % 1000}", "type": "bench.noop", "payload": {"n": i}}
                for i in range(start, min(args.events, start + 1000))])
            conn.commit()
    pool: ConnectionPool[Any] = ConnectionPool(dsn, min_size=1, max_size=2, kwargs={"autocommit": True})
    modes = ["engine", "adapter-1", "adapter-4"]
    rates: dict[str, list[float]] = {m: [] for m in modes}
    for run in range(args.runs):
        for mode in modes if run % 2 == 0 else list(reversed(modes)):
            name = f"{mode}-{run}"
            sink: Any = NoopEngineSink(name) if mode == "engine" else EventSinkAdapter(
                NoopSink(name, int(mode.split("-")[1])))
            with pool.connection() as conn:
                store.register_sink(conn, name, sink.kind)
            runner = SinkRunner(sink, pool, load_settings(dsn=dsn, worker_id="bench", kafka=False, listen=False))
            runner.desired = set(range(256))
            done, start_at = 0, time.perf_counter()
            while done < args.events:
                n = runner.run_once()
                done += n
                if n == 0:
                    runner.hints.everything()
            rates[mode].append(args.events / (time.perf_counter() - start_at))
            sink.close()
    pool.close()
    floor = statistics.median(rates["engine"])
    for mode in modes:
        r = rates[mode]
        med = statistics.median(r)
        print(f"{mode:>10}: {med:8,.0f} ev/s (min {min(r):,.0f}, max {max(r):,.0f}); {1e6 / med:6.1f} us/event, "
              f"{1e6 / med - 1e6 / floor:+6.1f} us/event over the engine floor")


def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--events", type=int, default=2000)
    ap.add_argument("--keys", type=int, default=64)
    ap.add_argument("--call-ms", type=float, default=5.0)
    ap.add_argument("--runs", type=int, default=2)
    ap.add_argument("--cases", default="1x1,1x4,1x16,4x1,4x4", help="RELAYSxCONCURRENCY, comma-separated")
    ap.add_argument("--overhead", action="store_true", help="the adapter's cost per event (no-op deliver)")
    args = ap.parse_args()
    if args.overhead:
        with tempfile.TemporaryDirectory() as tmp:
            pg = Postgres(Path(tmp))
            try:
                print(f"machine: {machine()}; PostgreSQL {pg.version}; {args.events:,} events, {args.runs} runs")
                overhead(pg, args)
            finally:
                pg.stop()
        return
    cases = [tuple(int(n) for n in case.split("x")) for case in args.cases.split(",")]
    with tempfile.TemporaryDirectory() as tmp:
        pg = Postgres(Path(tmp))
        try:
            print(f"machine: {machine()}; PostgreSQL {pg.version}; {args.events:,} events over {args.keys} keys, "
                  f"{args.call_ms:g} ms per call, {args.runs} runs")
            rates: dict[tuple[int, ...], list[float]] = {case: [] for case in cases}
            for run in range(args.runs):
                for case in cases if run % 2 == 0 else list(reversed(cases)):
                    rates[case].append(one_case(pg, case[0], case[1], args))
            for case, r in rates.items():
                ideal = case[0] * case[1] * 1000 / args.call_ms
                print(f"{case[0]} relay(s) x concurrency {case[1]:>2}: {statistics.median(r):7,.0f} ev/s "
                      f"(min {min(r):,.0f}, max {max(r):,.0f}); ideal {ideal:,.0f}")
        finally:
            pg.stop()


if __name__ == "__main__":
    main()
