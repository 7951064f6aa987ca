"""The RabbitMQ sink against a plain pika loop publishing the same messages with the same acknowledgement.

    python bench/sinks/rabbitmq.py [--events 20000] [--keys 1000] [--runs 3] [--concurrency 1,4]
                                   [--rate 1000] [--seconds 10] [--url amqp://guest:guest@127.0.0.1:5672/%2F]

Both sides publish the messages the sink builds (message.py: CloudEvents headers, persistent, mandatory) to a
durable topic exchange bound to one durable queue, each message waiting for its publisher confirm.

- **drain**: one embedded relay (a private PostgreSQL 18, settings as ``outbox-relay run``), ready and holding
  its buckets; ``--events`` events over ``--keys`` keys committed in one transaction; events/s from the commit
  to the last confirm, per sink ``--concurrency`` (keys published at once, a connection each). The plain loop:
  the same number of messages from one thread on one connection (and from 4 threads on 4 connections).
- **latency** at ``--rate`` events/s for ``--seconds``: a producer process commits the events due every 10 ms
  (one transaction each) and records each commit's time; the sink records each confirm's time. The plain loop
  publishes the messages due every 10 ms, split over as many connections as the sink has lanes
  (``--latency-concurrency``), and records, per message, its due time and its confirm's time.
  p50/p99/max of confirm - commit (sink) and confirm - due (plain loop).

Cases are interleaved per run; medians of ``--runs`` with min-max. The queue is purged between runs.
"""

from __future__ import annotations

import argparse
import multiprocessing
import statistics
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import pika  # noqa: E402
import psycopg  # noqa: E402
from servers import Postgres, busy_fraction, machine  # noqa: E402

from outbox_relay import Outbox, Relay  # noqa: E402
from outbox_relay.migrate import migrate  # noqa: E402
from outbox_relay.settings import load_settings  # noqa: E402
from outbox_relay.sinks import Delivered, SinkEvent  # noqa: E402
from outbox_relay.sinks.rabbitmq import RabbitMQSink  # noqa: E402
from outbox_relay.sinks.rabbitmq.message import message_of  # noqa: E402

PAYLOAD = {"order": 12345, "amount": "19.90", "currency": "EUR", "items": [1, 2, 3]}
TICK = 0.01  # the producer's and the loop's commit interval


class TimedSink(RabbitMQSink):
    """The product's sink, recording when each event's confirm came (what the relay counts as delivered)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.acks: dict[uuid.UUID, float] = {}
        self.target = 1 << 62  # set by the case before its events are committed
        self.done = threading.Event()

    def deliver(self, event: SinkEvent) -> Any:
        outcome = super().deliver(event)
        if isinstance(outcome, Delivered):
            self.acks.setdefault(event.id, time.time())  # dict writes are atomic under the GIL
            if len(self.acks) >= self.target:
                self.done.set()
        return outcome


def topology(url: str, exchange: str) -> None:
    conn = pika.BlockingConnection(pika.URLParameters(url))
    ch = conn.channel()
    ch.exchange_declare(exchange, "topic", durable=True)
    ch.queue_declare(exchange, durable=True)
    ch.queue_bind(exchange, exchange, "#")
    conn.close()


def purge(url: str, exchange: str, delete: bool = False) -> None:
    conn = pika.BlockingConnection(pika.URLParameters(url))
    ch = conn.channel()
    if delete:
        ch.queue_delete(exchange)
        ch.exchange_delete(exchange)
    else:
        ch.queue_purge(exchange)
    conn.close()


def sink_events(n: int, keys: int, exchange: str) -> list[SinkEvent]:
    import json

    body = json.dumps(PAYLOAD)
    return [SinkEvent(id=uuid.uuid4(), topic=exchange, key=f"k{i % keys}", type="order.placed", payload_json=body,
                      headers={}, time=datetime.now(UTC), version=1, attempt=1) for i in range(n)]


class Plain:
    """The plain loop: the sink's messages, one connection per thread, mandatory, a confirm per message."""

    def __init__(self, url: str) -> None:
        self.conn = pika.BlockingConnection(pika.URLParameters(url))
        self.ch = self.conn.channel()
        self.ch.confirm_delivery()

    def publish(self, event: SinkEvent) -> None:
        m = message_of(event, sink="plain", source="outbox-relay", default_exchange=None, max_bytes=1 << 27)
        assert not hasattr(m, "reason")
        self.ch.basic_publish(m.exchange, m.routing_key, m.body, m.properties(str(event.id), pika),  # type: ignore[union-attr]
                              mandatory=True)

    def close(self) -> None:
        self.conn.close()


def plain_drain(url: str, events: Sequence[SinkEvent], threads: int) -> float:
    loops = [Plain(url) for _ in range(threads)]
    parts = [events[i::threads] for i in range(threads)]
    workers = [threading.Thread(target=lambda lp=lp, part=part: [lp.publish(e) for e in part])
               for lp, part in zip(loops, parts, strict=True)]
    start = time.perf_counter()
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    rate = len(events) / (time.perf_counter() - start)
    for lp in loops:
        lp.close()
    return rate


def plain_latency(url: str, exchange: str, rate: int, seconds: float, keys: int, threads: int) -> list[float]:
    """Confirm - due time per message: the messages due every tick split over ``threads`` connections (as the
    sink's lanes), each waiting for its confirms one by one."""
    per_tick = max(1, round(rate * TICK))
    ticks = int(seconds / TICK)
    events = sink_events(per_tick * ticks, keys, exchange)
    loops = [Plain(url) for _ in range(threads)]
    out: list[list[float]] = [[] for _ in range(threads)]
    start = time.time() + 0.1

    def run(k: int) -> None:
        for t in range(ticks):
            due = start + t * TICK
            if (wait := due - time.time()) > 0:
                time.sleep(wait)
            for e in events[t * per_tick + k:(t + 1) * per_tick:threads]:
                loops[k].publish(e)
                out[k].append(time.time() - due)

    workers = [threading.Thread(target=run, args=(k,)) for k in range(threads)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    for lp in loops:
        lp.close()
    return [x for part in out for x in part]


class Embedded:
    """One relay in this process (settings as ``outbox-relay run``), ready, with the timed sink."""

    def __init__(self, pg: Postgres, url: str, concurrency: int) -> None:
        self.pg = pg
        self.name = pg.create_database()
        self.dsn = pg.dsn(self.name)
        migrate(self.dsn)
        self.sink = TimedSink(url, name="rabbitmq", concurrency=concurrency)
        self.relay = Relay(load_settings(dsn=self.dsn, worker_id="bench", kafka=False, heartbeat_seconds=0.2,
                                         worker_ttl_seconds=1.0, batch_size=1000), sinks=[self.sink])
        self.relay.start()
        deadline = time.monotonic() + 60
        while self.relay.readiness():
            if time.monotonic() > deadline:
                raise RuntimeError(f"relay not ready: {self.relay.readiness()}")
            time.sleep(0.1)

    def close(self) -> None:
        self.relay.drain(60)
        self.pg.drop_database(self.name)


def sink_drain(pg: Postgres, url: str, exchange: str, n: int, keys: int, concurrency: int) -> float:
    e = Embedded(pg, url, concurrency)
    try:
        e.sink.target = n
        with psycopg.connect(e.dsn) as conn:
            Outbox(default_topic=exchange).publish_many(conn, [
                {"key": f"k{i % keys}", "type": "order.placed", "payload": PAYLOAD} for i in range(n)])
        committed = time.time()
        if not e.sink.done.wait(900):
            raise RuntimeError(f"only {len(e.sink.acks)} of {n} confirmed")
        return n / (max(e.sink.acks.values()) - committed)
    finally:
        e.close()


def _produce(dsn: str, exchange: str, rate: int, seconds: float, keys: int,
             out: multiprocessing.Queue[dict[str, float]]) -> None:
    per_tick = max(1, round(rate * TICK))
    outbox = Outbox(default_topic=exchange)
    committed: dict[str, float] = {}
    with psycopg.connect(dsn, autocommit=False) as conn:
        start = time.time()
        for t in range(int(seconds / TICK)):
            if (wait := start + t * TICK - time.time()) > 0:
                time.sleep(wait)
            ids = outbox.publish_many(conn, [{"key": f"k{(t * per_tick + i) % keys}", "type": "order.placed",
                                              "payload": PAYLOAD} for i in range(per_tick)])
            conn.commit()
            now = time.time()
            committed.update({str(p.id): now for p in ids})
    out.put(committed)


def sink_latency(pg: Postgres, url: str, exchange: str, rate: int, seconds: float, keys: int,
                 concurrency: int) -> tuple[list[float], float]:
    """Confirm - commit per event, and the rate the producer reached."""
    e = Embedded(pg, url, concurrency)
    try:
        e.sink.target = max(1, round(rate * TICK)) * int(seconds / TICK)
        spawn = multiprocessing.get_context("spawn")  # not a fork of a process with a relay's threads
        queue: multiprocessing.Queue[dict[str, float]] = spawn.Queue()
        producer = spawn.Process(
            target=_produce, args=(e.dsn, exchange, rate, seconds, keys, queue))
        producer.start()
        committed = queue.get(timeout=seconds + 120)
        producer.join(30)
        if not e.sink.done.wait(120):
            raise RuntimeError(f"only {len(e.sink.acks)} of {len(committed)} confirmed")
        latencies = [e.sink.acks[uuid.UUID(i)] - t for i, t in committed.items()]
        return latencies, len(committed) / (max(committed.values()) - min(committed.values()) + TICK)
    finally:
        e.close()


def pct(values: Sequence[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def fmt(values: Sequence[float], scale: float = 1.0, digits: int = 0) -> str:
    return (f"{statistics.median(values) * scale:,.{digits}f} "
            f"({min(values) * scale:,.{digits}f}-{max(values) * scale:,.{digits}f})")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", default="amqp://guest:guest@127.0.0.1:5672/%2F")
    parser.add_argument("--events", type=int, default=20_000)
    parser.add_argument("--keys", type=int, default=1000)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--concurrency", default="1,4", help="sink concurrencies to compare")
    parser.add_argument("--rate", type=int, default=1000)
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--latency-concurrency", type=int, default=4)
    parser.add_argument("--cases", default="drain,latency", help="drain, latency or both")
    args = parser.parse_args()
    exchange = f"bench-{uuid.uuid4().hex[:8]}"
    topology(args.url, exchange)
    concurrencies = [int(c) for c in args.concurrency.split(",")]
    drain: dict[str, list[float]] = {}
    latency: dict[str, list[tuple[float, float, float]]] = {"sink": [], "plain loop": []}
    reached: list[float] = []
    load = busy_fraction()
    with tempfile.TemporaryDirectory() as tmp:
        pg = Postgres(Path(tmp))
        try:
            for run in range(args.runs):
                print(f"run {run + 1}/{args.runs}", file=sys.stderr)
                events = sink_events(args.events, args.keys, exchange) if "drain" in args.cases else []
                for threads in (1, 4) if events else ():
                    drain.setdefault(f"plain loop, {threads} thread(s)", []).append(
                        plain_drain(args.url, events, threads))
                    purge(args.url, exchange)
                for c in concurrencies if events else ():
                    drain.setdefault(f"sink, concurrency {c}", []).append(
                        sink_drain(pg, args.url, exchange, args.events, args.keys, c))
                    purge(args.url, exchange)
                if "latency" not in args.cases:
                    continue
                lat = plain_latency(args.url, exchange, args.rate, args.seconds, args.keys, args.latency_concurrency)
                latency["plain loop"].append((pct(lat, 0.5), pct(lat, 0.99), max(lat)))
                purge(args.url, exchange)
                lat, got = sink_latency(pg, args.url, exchange, args.rate, args.seconds, args.keys,
                                        args.latency_concurrency)
                latency["sink"].append((pct(lat, 0.5), pct(lat, 0.99), max(lat)))
                reached.append(got)
                purge(args.url, exchange)
            version = pg.version
        finally:
            pg.stop()
            purge(args.url, exchange, delete=True)
    info = machine()
    print(f"machine: {info}; PostgreSQL {version}; RabbitMQ at {args.url.split('@')[-1]}; background load before "
          f"the runs {load:.0%} of all cores; {args.runs} runs, medians (min-max)\n")
    if drain:
        print(f"drain: {args.events:,} events over {args.keys:,} keys, one relay, committed in one transaction\n")
        print("| case | events/s | vs plain loop, 1 thread | vs plain loop, 4 threads |")
        print("|---|---|---|---|")
        base = statistics.median(drain["plain loop, 1 thread(s)"])
        base4 = statistics.median(drain["plain loop, 4 thread(s)"])
        for name, rates in drain.items():
            print(f"| {name} | {fmt(rates)} | {statistics.median(rates) / base:.2f}x | "
                  f"{statistics.median(rates) / base4:.2f}x |")
    if not reached:
        return 0
    print(f"\nlatency at {args.rate:,} events/s for {args.seconds:g} s (sink concurrency {args.latency_concurrency}, "
          f"plain loop on as many connections; the producer reached {fmt(reached)} events/s)\n")
    print("| case | p50 ms | p99 ms | max ms |")
    print("|---|---|---|---|")
    for name, rows in latency.items():
        print(f"| {name}: confirm - {'commit' if name == 'sink' else 'due time'} | {fmt([r[0] for r in rows], 1e3, 1)} "
              f"| {fmt([r[1] for r in rows], 1e3, 1)} | {fmt([r[2] for r in rows], 1e3, 1)} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
