"""What one busy Kafka cycle costs: statements, client CPU and database CPU per cycle (issue 14, goal 5).

    python bench/cycle_cost.py [--cycles 3000] [--events 10] [--keys 1000] [--write-every-batch] [--profile F]

Starts its own PostgreSQL 18 (embedded) and Tansu, like bench/run.py. One in-process relay runner (the
real ``SinkRunner`` with the real ``KafkaSink``, default settings: ``cursor_flush_seconds`` 5) holds all
256 buckets and is woken for the buckets each commit wrote, as the commit watcher would. Each cycle:
one transaction of ``--events`` events over random keys is committed (outside the measurement), then
``run_once()``: the read, the produce, the acks, the checkpoint (or, since the folded fence check, none).
The relay's connections count every statement they run, by named query (``sql/queries/*.sql``).

Reported per cycle, load-insensitive (CPU time, not wall time; statements are counted): statements by
name, CPU of the runner's thread (``time.thread_time``: Python, psycopg, the produce and poll calls; not
librdkafka's own threads) and of the relay's PostgreSQL backends (/proc). Wall time per cycle is printed
too, but on a shared machine it says little.
"""

from __future__ import annotations

import argparse
import collections
import cProfile
import json
import random
import sys
import time
from pathlib import Path
from typing import Any

import psycopg
from psycopg_pool import ConnectionPool

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import cpu  # noqa: E402
from servers import Servers, machine  # noqa: E402

from outbox_relay import store  # noqa: E402
from outbox_relay.migrate import migrate  # noqa: E402
from outbox_relay.publish import Outbox  # noqa: E402
from outbox_relay.relay import SinkRunner  # noqa: E402
from outbox_relay.settings import RelaySettings  # noqa: E402
from outbox_relay.sinks.kafka import KafkaSink  # noqa: E402
from outbox_relay.sqlfiles import sql_dir  # noqa: E402

APP = "cycle-cost-relay"
COUNTS: collections.Counter[str] = collections.Counter()


def _names() -> dict[str, str]:
    """First line of each named query's body -> group.name (enough to tell the relay's statements apart)."""
    out: dict[str, str] = {}
    for path in sorted((sql_dir() / "queries").glob("*.sql")):
        name = None
        for line in path.read_text().splitlines():
            if line.startswith("-- name:"):
                name = f"{path.stem}.{line.split(':', 1)[1].strip()}"
            elif name and line.strip() and not line.startswith("--"):
                out.setdefault(line.strip(), name)
                name = None
    return out


NAMES = _names()


def label(query: Any) -> str:
    text = query if isinstance(query, str) else str(query)
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("--"):
            return NAMES.get(line, line[:50])
    return "?"


class Counting(psycopg.Connection):  # type: ignore[type-arg]
    def execute(self, query: Any, params: Any = None, **kwargs: Any) -> Any:  # type: ignore[override]
        COUNTS[label(query)] += 1
        return super().execute(query, params, **kwargs)


def _configure(conn: psycopg.Connection[Any]) -> None:
    conn.execute("SET plan_cache_mode = auto")  # as the relay's own pool does (services/pool.py configure_connection)


def backends(admin: str, database: str) -> list[int]:
    with psycopg.connect(admin, autocommit=True) as conn:
        return [r[0] for r in conn.execute(
            "SELECT pid FROM pg_stat_activity WHERE datname = %s AND application_name = %s", (database, APP))]


def run(args: argparse.Namespace) -> dict[str, Any]:
    with Servers() as servers:
        pg, kafka = servers.postgres, servers.tansu
        assert pg is not None and kafka is not None
        database = pg.create_database("cost")
        dsn = pg.dsn(database)
        migrate(dsn)
        topic = kafka.create_topic("cycle-cost", 8)
        # No membership thread renews leases here: long ones.
        settings = RelaySettings(dsn=dsn, worker_id="cost", kafka=False, listen=False, lease_seconds=3600)
        sink = KafkaSink("kafka", {"bootstrap.servers": kafka.bootstrap}, topic, "urn:bench")
        pool: ConnectionPool[Any] = ConnectionPool(
            dsn, min_size=2, max_size=4, configure=_configure, connection_class=Counting,
            kwargs={"autocommit": True, "application_name": APP})
        with pool.connection() as conn:
            store.register_sink(conn, sink.name, sink.kind)
        runner = SinkRunner(sink, pool, settings)
        runner.desired = set(range(256))
        runner.run_once()  # acquires every bucket
        runner.listening = lambda: True  # woken for the buckets a commit wrote, as the commit watcher does
        if args.write_every_batch:  # as a live relay while no long transaction holds vacuum back
            runner.defer_writes = lambda: False
        outbox = Outbox(default_topic=topic)
        rng = random.Random(7)
        producer = psycopg.connect(dsn, autocommit=False)

        def commit() -> set[int]:
            ids = [p.id for p in outbox.publish_many(producer, [
                {"type": "bench", "key": f"order:{rng.randrange(args.keys)}", "payload": {"n": i}}
                for i in range(args.events)])]
            producer.commit()
            rows = producer.execute("SELECT DISTINCT bucket FROM outbox.events WHERE id = ANY(%s)", (ids,))
            buckets = {r[0] for r in rows}
            producer.commit()
            return buckets

        for _ in range(args.warmup):
            runner.hints.add(commit())
            runner.reads.full_read_at = time.monotonic() + 3600  # only the buckets named (no safety-net read)
            runner.run_once()
        pids = backends(pg.admin_dsn, database)
        COUNTS.clear()
        handled = 0
        db_cpu = sum(cpu.cpu_seconds(p) for p in pids)
        thread_cpu = 0.0
        # CPU time of the runner's thread only, by function (the commits in between are not profiled).
        profiler = cProfile.Profile(time.thread_time) if args.profile else None
        wall = time.monotonic()
        for _ in range(args.cycles):
            runner.hints.add(commit())
            runner.reads.full_read_at = time.monotonic() + 3600
            t = time.thread_time()
            if profiler is not None:
                profiler.enable()
            handled += runner.run_once()
            if profiler is not None:
                profiler.disable()
            thread_cpu += time.thread_time() - t
        wall = time.monotonic() - wall
        if profiler is not None:
            profiler.dump_stats(str(args.profile))
        db_cpu = sum(cpu.cpu_seconds(p) for p in backends(pg.admin_dsn, database)) - db_cpu
        counts = dict(COUNTS)  # not the release below
        runner.release_all()
        sink.close()
        pool.close()
        producer.close()
        n = args.cycles
        return {
            "version": "fold" if hasattr(runner, "_pending") else "before",
            "cycles": n, "events_per_commit": args.events, "events_handled": handled,
            "statements_per_cycle": round(sum(counts.values()) / n, 3),
            "by_statement_per_cycle": {k: round(v / n, 3) for k, v in sorted(counts.items(), key=lambda kv: -kv[1])},
            "runner_thread_cpu_us_per_cycle": round(1e6 * thread_cpu / n, 1),
            "relay_backends_cpu_us_per_cycle": round(1e6 * db_cpu / n, 1),
            "wall_ms_per_cycle_shared_machine": round(1e3 * wall / n, 2),
            "machine": machine(),
        }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cycles", type=int, default=3000)
    p.add_argument("--warmup", type=int, default=200)
    p.add_argument("--events", type=int, default=10, help="events per commit (one commit per cycle)")
    p.add_argument("--keys", type=int, default=1000)
    p.add_argument("--json", type=Path, default=None)
    p.add_argument("--write-every-batch", action="store_true",
                   help="write each batch's cursors at once, as a live relay does while nothing holds vacuum back")
    p.add_argument("--profile", type=Path, default=None,
                   help="write a cProfile of the runner thread's CPU time (time.thread_time) to this file")
    args = p.parse_args()
    out = run(args)
    text = json.dumps(out, indent=1)
    print(text)
    if args.json:
        args.json.write_text(text)


if __name__ == "__main__":
    main()
