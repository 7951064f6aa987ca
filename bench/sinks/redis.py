"""The Redis Streams sink next to a plain redis-py loop, in one run: drain events/s and latency at a
steady rate.

    python bench/sinks/redis.py [--events 20000] [--rate 1000] [--seconds 10] [--concurrency 64] [--runs 3]

Servers: a private PostgreSQL 18 (embedded, as bench/run.py) and a private ``redis-server`` (no
persistence: the same for both cases, so the ratio is the relay's own cost).

- drain: ``--events`` events (``--keys`` keys) committed in one transaction while one relay runs the
  sink (settings ``redis_url``, as ``outbox-relay run --redis-url``); timed from the commit to the last
  acknowledgement (the last entry's stream id, the server's clock). The plain loop: the same entries
  (``message.entry``), one ``XADD`` at a time, each reply waited for, from one thread (the issue's
  baseline); and the ceiling the sink's pipelines aim at: pipelines of ``--concurrency`` XADDs.
- latency: a producer process commits what is due every ``--tick-ms`` at ``--rate``/s for ``--seconds``;
  commit -> ack is the entry's stream id (server time, ms) minus the commit time. The plain loop sends
  one ``XADD`` at a time at the same rate: its latency is send -> reply. The relay's own part: the same
  producer and relay with a no-op ``EventSink`` (commit -> its ``deliver`` called).

Medians of ``--runs`` (min-max); cases interleaved run by run.
"""

from __future__ import annotations

import argparse
import multiprocessing
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent
# This script's own directory first on the path would make `import redis` import this file.
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != HERE]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import psycopg  # noqa: E402
import redis  # noqa: E402
from servers import Postgres, free_port, machine  # noqa: E402

from outbox_relay import Outbox, Relay  # noqa: E402
from outbox_relay.migrate import migrate  # noqa: E402
from outbox_relay.settings import load_settings  # noqa: E402
from outbox_relay.sinks import SinkEvent  # noqa: E402
from outbox_relay.sinks.redis import entry  # noqa: E402

PAYLOAD = {"order": 12345, "amount": "19.90", "currency": "EUR", "items": [1, 2, 3]}


def redis_server(directory: Path) -> tuple[subprocess.Popen[bytes], int]:
    port = free_port()
    proc = subprocess.Popen(["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                             "--appendonly", "no", "--dir", str(directory)], stdout=subprocess.DEVNULL)
    client = redis.Redis(port=port)
    for _ in range(200):
        try:
            client.ping()
            return proc, port
        except redis.ConnectionError:
            time.sleep(0.05)
    raise RuntimeError("redis-server did not start")


def last_ack_ms(client: redis.Redis, stream: str, n: int, timeout: float = 300) -> float:
    """Waits until ``stream`` holds ``n`` entries; the last one's id time (ms, server clock)."""
    deadline = time.monotonic() + timeout
    while client.xlen(stream) < n:
        if time.monotonic() > deadline:
            raise RuntimeError(f"only {client.xlen(stream)} of {n} entries")
        time.sleep(0.005)
    [(last, _)] = client.xrevrange(stream, count=1)
    return float(last.split(b"-")[0])


def relay_for(dsn: str, port: int | None, prefix: str, concurrency: int, sinks: list[Any] | None = None) -> Relay:
    redis_options: dict[str, Any] = {} if port is None else {
        "redis_url": f"redis://127.0.0.1:{port}/0", "redis_stream_prefix": prefix, "redis_concurrency": concurrency}
    relay = Relay(load_settings(dsn=dsn, worker_id="bench", kafka=False, heartbeat_seconds=0.2, worker_ttl_seconds=1.0,
                                **redis_options), sinks=sinks or [])
    relay.start()
    deadline = time.monotonic() + 60
    while relay.readiness():
        if time.monotonic() > deadline:
            raise RuntimeError("relay not ready")
        time.sleep(0.1)
    time.sleep(1.0)  # its buckets taken
    return relay


def drain_sink(pg: Postgres, port: int, args: argparse.Namespace) -> float:
    name = pg.create_database()
    dsn = pg.dsn(name)
    migrate(dsn)
    prefix = f"b{uuid.uuid4().hex[:6]}:"
    relay = relay_for(dsn, port, prefix, args.concurrency)
    client = redis.Redis(port=port)
    try:
        with psycopg.connect(dsn) as conn:
            Outbox(default_topic="bench").publish_many(conn, [
                {"key": f"k{i % args.keys}", "type": "bench.redis", "payload": {**PAYLOAD, "n": i}}
                for i in range(args.events)])
        start_ms = time.time() * 1000
        end_ms = last_ack_ms(client, prefix + "bench", args.events)
        return args.events / ((end_ms - start_ms) / 1000)
    finally:
        relay.drain(60)
        client.delete(prefix + "bench")
        client.close()
        pg.drop_database(name)


def events(n: int) -> list[Any]:
    now = datetime.now(UTC)
    import json

    return [entry(SinkEvent(id=uuid.uuid4(), topic="bench", key=f"k{i % 64}", type="bench.redis",
                            payload_json=json.dumps({**PAYLOAD, "n": i}), headers={}, time=now, version=1, attempt=1),
                  "outbox-relay") for i in range(n)]


def drain_plain(port: int, args: argparse.Namespace) -> float:
    client = redis.Redis(port=port)
    stream = f"plain{uuid.uuid4().hex[:6]}"
    entries = events(args.events)
    start = time.perf_counter()
    for fields in entries:
        client.xadd(stream, fields)
    rate = args.events / (time.perf_counter() - start)
    client.delete(stream)
    client.close()
    return rate


def drain_pipelined(port: int, args: argparse.Namespace) -> float:
    """The same entries in pipelines of ``--concurrency`` XADDs (what the sink sends per wave): the ceiling."""
    client = redis.Redis(port=port)
    stream = f"pipe{uuid.uuid4().hex[:6]}"
    entries = events(args.events)
    start = time.perf_counter()
    for at in range(0, len(entries), args.concurrency):
        pipe = client.pipeline(transaction=False)
        for fields in entries[at:at + args.concurrency]:
            pipe.xadd(stream, fields)
        pipe.execute()
    rate = args.events / (time.perf_counter() - start)
    client.delete(stream)
    client.close()
    return rate


def _produce(dsn: str, rate: float, seconds: float, tick_ms: float, out: Any) -> None:
    """What is due every ``tick_ms`` in one transaction (as bench/procs.py's latency producer)."""
    outbox = Outbox(default_topic="bench")
    commits: dict[str, float] = {}
    total = int(rate * seconds)
    tick = tick_ms / 1000
    sent = 0
    with psycopg.connect(dsn) as conn:
        start = time.perf_counter()
        while sent < total:
            due = min(total, int(rate * (time.perf_counter() - start))) - sent
            if due > 0:
                published = outbox.publish_many(conn, [
                    {"type": "bench.redis", "key": f"k{(sent + n) % 64}", "payload": {**PAYLOAD, "n": sent + n}}
                    for n in range(due)])
                conn.commit()
                committed = time.time() * 1000
                commits.update((str(p.id), committed) for p in published)
                sent += due
            elapsed = time.perf_counter() - start
            time.sleep(max(0.0, start + (int(elapsed / tick) + 1) * tick - time.perf_counter()))
        out.put((commits, total / (time.perf_counter() - start)))


def pct(values: list[float], p: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(p * len(ordered)))]


class NoOp:
    """An EventSink that only notes when each event reached it: the relay's own part of the latency."""

    name = kind = "noop"

    def __init__(self, concurrency: int) -> None:
        self.concurrency = concurrency
        self.reached: dict[str, float] = {}

    def deliver(self, event: SinkEvent) -> None:
        self.reached[str(event.id)] = time.time() * 1000


def latency_sink(pg: Postgres, port: int, args: argparse.Namespace, noop: bool = False) -> tuple[float, float, float]:
    name = pg.create_database()
    dsn = pg.dsn(name)
    migrate(dsn)
    prefix = f"l{uuid.uuid4().hex[:6]}:"
    sink = NoOp(args.concurrency) if noop else None
    relay = relay_for(dsn, None if noop else port, prefix, args.concurrency, [sink] if sink else None)
    client = redis.Redis(port=port)
    try:
        out: multiprocessing.Queue[Any] = multiprocessing.Queue()
        producer = multiprocessing.Process(target=_produce, args=(dsn, args.rate, args.seconds, args.tick_ms, out))
        producer.start()
        commits, offered = out.get(timeout=args.seconds * 10 + 60)
        producer.join(30)
        if sink is not None:
            deadline = time.monotonic() + 60
            while len(sink.reached) < len(commits) and time.monotonic() < deadline:
                time.sleep(0.01)
            lat = [at - commits[i] for i, at in sink.reached.items()]
        else:
            last_ack_ms(client, prefix + "bench", len(commits))
            lat = [float(entry_id.split(b"-")[0]) - commits[fields[b"id"].decode()]
                   for entry_id, fields in client.xrange(prefix + "bench")]
        return pct(lat, 0.5), pct(lat, 0.99), offered
    finally:
        relay.drain(60)
        client.delete(prefix + "bench")
        client.close()
        pg.drop_database(name)


def latency_plain(port: int, args: argparse.Namespace) -> tuple[float, float, float]:
    client = redis.Redis(port=port)
    stream = f"lplain{uuid.uuid4().hex[:6]}"
    n = int(args.rate * args.seconds)
    entries = events(n)
    lat = []
    start = time.perf_counter()
    for i, fields in enumerate(entries):
        due = start + i / args.rate
        wait = due - time.perf_counter()
        if wait > 0:
            time.sleep(wait)
        sent = time.perf_counter()
        client.xadd(stream, fields)
        lat.append((time.perf_counter() - sent) * 1000)
    offered = n / (time.perf_counter() - start)
    client.delete(stream)
    client.close()
    return pct(lat, 0.5), pct(lat, 0.99), offered


def span(values: list[float], fmt: str = "{:,.0f}") -> str:
    return f"{fmt.format(statistics.median(values))} ({fmt.format(min(values))}-{fmt.format(max(values))})"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--events", type=int, default=20_000)
    parser.add_argument("--keys", type=int, default=64)
    parser.add_argument("--rate", type=float, default=1000.0)
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--tick-ms", type=float, default=5.0,
                        help="latency: the producer commits what is due this often")
    parser.add_argument("--concurrency", type=int, default=64, help="the sink's redis_concurrency (keys per pipeline)")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--drain-only", action="store_true", help="skip the latency cases")
    args = parser.parse_args()
    drains: dict[str, list[float]] = {"sink": [], "plain": [], "pipelined": []}
    lats: dict[str, list[tuple[float, float, float]]] = {"sink": [], "plain": [], "noop": []}
    with tempfile.TemporaryDirectory() as tmp:
        proc, port = redis_server(Path(tmp))
        pg = Postgres(Path(tmp))
        try:
            for run in range(args.runs):
                print(f"run {run + 1}/{args.runs}", file=sys.stderr, flush=True)
                drains["plain"].append(drain_plain(port, args))
                drains["pipelined"].append(drain_pipelined(port, args))
                drains["sink"].append(drain_sink(pg, port, args))
                if not args.drain_only:
                    lats["plain"].append(latency_plain(port, args))
                    lats["sink"].append(latency_sink(pg, port, args))
                    lats["noop"].append(latency_sink(pg, port, args, noop=True))
        finally:
            pg.stop()
            proc.terminate()
            proc.wait(10)
    ratio = statistics.median(drains["sink"]) / statistics.median(drains["plain"])
    server = subprocess.run(["redis-server", "--version"], capture_output=True, text=True).stdout.split()[2]
    print(f"machine: {machine()} (2 vCPU shared with other agents' work: loaded); PostgreSQL {pg.version} embedded; "
          f"redis-server {server} (private, no persistence); redis-py {redis.__version__}; "
          f"{datetime.now(UTC):%Y-%m-%d %H:%M} UTC\n")
    print(f"drain: {args.events:,} events over {args.keys} keys, 1 relay, redis_concurrency {args.concurrency}; "
          f"medians of {args.runs} (min-max)\n")
    print("| case | events/s |\n|---|---|")
    print(f"| plain loop (one XADD at a time, reply waited) | {span(drains['plain'])} |")
    print(f"| plain loop, pipelines of {args.concurrency} XADDs | {span(drains['pipelined'])} |")
    print(f"| sink (relay, commit -> last ack) | {span(drains['sink'])} ({ratio:.2f}x plain) |\n")
    if args.drain_only:
        return 0
    print(f"latency at {args.rate:g} events/s for {args.seconds:g} s, the producer committing every "
          f"{args.tick_ms:g} ms\n")
    print("| case | p50 ms | p99 ms | offered rate reached |\n|---|---|---|---|")
    for name, label in (("plain", "plain loop (send -> reply)"), ("sink", "sink (commit -> ack)"),
                        ("noop", "relay with a no-op EventSink (commit -> deliver called)")):
        rows = lats[name]
        print(f"| {label} | {span([r[0] for r in rows], '{:.2f}')} | {span([r[1] for r in rows], '{:.2f}')} | "
              f"{span([r[2] for r in rows])}/s |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
