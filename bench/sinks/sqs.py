"""The SQS sink next to a plain boto3 loop sending the same messages, in one run.

    python bench/sinks/sqs.py [--events 5000] [--rate 1000] [--seconds 10] [--runs 3] [--batch-size 10]

SQS is moto's server mode over HTTP (tests/sqs_server.py, its own process); PostgreSQL 18 embedded.
Each case gets a fresh FIFO queue (and database), the events spread over ``--keys`` keys.

- drain: ``--events`` events committed at once, one relay (the SQS sink as ``outbox-relay run --sqs-url``
  composes it, concurrency ``--concurrency``), from the commit until the relay checkpointed the last
  one (after SQS acknowledged it); against the plain loop: one thread sending the same messages
  (same body, attributes, group and deduplication ids) in SendMessageBatch requests of 10, each
  waiting for SQS's answer.
- latency: a producer commits one event per transaction at ``--rate`` for ``--seconds``; commit -> SQS
  ack per event (the ack: the sink's deliver returned Delivered); against the plain loop fed at the
  same rate (each message's time from when it was made to its batch's answer; the batch: whatever
  waited, up to 10).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import threading
import time
import uuid
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "bench")]

import psycopg  # noqa: E402
from servers import Postgres, machine  # noqa: E402
from user_sink_concurrency import Count  # noqa: E402

from outbox_relay import Outbox, Relay  # noqa: E402
from outbox_relay.migrate import migrate  # noqa: E402
from outbox_relay.settings import load_settings  # noqa: E402
from outbox_relay.sinks import Delivered, SinkEvent  # noqa: E402
from outbox_relay.sinks.sqs import SqsSink  # noqa: E402
from outbox_relay.sinks.sqs.message import Message, message_of  # noqa: E402
from tests.sqs_server import DUMMY_CREDENTIALS, MotoServer, Namespace  # noqa: E402

PAYLOAD = {"order": 12345, "amount": "19.90", "currency": "EUR", "items": [1, 2, 3]}


class TimedSqsSink(SqsSink):
    """The SQS sink, noting when each event's ack came (the bench's own kind: 'sqs' is the product's)."""

    kind = "sqs_bench"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.acked: dict[uuid.UUID, float] = {}

    def deliver_many(self, events: Any) -> Any:  # what the relay calls (deliver calls it too)
        answers = super().deliver_many(events)
        now = time.time()
        for event, answer in zip(events, answers, strict=True):
            if isinstance(answer, Delivered):
                self.acked.setdefault(event.id, now)
        return answers


def _messages(n: int, keys: int) -> list[Message]:
    out = []
    for i in range(n):
        e = SinkEvent(id=uuid.uuid4(), topic="bench", key=f"k{i % keys}", type="bench.placed",
                      payload_json=str(PAYLOAD).replace("'", '"'), headers={}, time=datetime.now(UTC), version=1,
                      attempt=1)
        m = message_of(e, "outbox-relay", True)
        assert isinstance(m, Message)
        out.append(m)
    return out


def _send_batches(sqs: Any, url: str, batch: list[Message]) -> None:
    reply = sqs.send_message_batch(QueueUrl=url, Entries=[{"Id": str(i), **m.entry} for i, m in enumerate(batch)])
    assert not reply.get("Failed"), reply["Failed"]


def plain_drain(ns: Namespace, args: argparse.Namespace) -> float:
    url = ns.create(f"plain{uuid.uuid4().hex[:6]}")
    messages = _messages(args.events, args.keys)
    start = time.perf_counter()
    for i in range(0, len(messages), 10):
        _send_batches(ns.sqs, url, messages[i:i + 10])
    return args.events / (time.perf_counter() - start)


def plain_latency(ns: Namespace, args: argparse.Namespace) -> list[float]:
    url = ns.create(f"plainl{uuid.uuid4().hex[:6]}")
    total = int(args.rate * args.seconds)
    messages = _messages(total, args.keys)
    made: list[float] = [0.0] * total
    waiting: list[int] = []
    cond = threading.Condition()
    done = threading.Event()

    def produce() -> None:
        start = time.perf_counter()
        for i in range(total):
            delay = start + i / args.rate - time.perf_counter()
            if delay > 0:
                time.sleep(delay)
            with cond:
                made[i] = time.time()
                waiting.append(i)
                cond.notify()
        done.set()

    producer = threading.Thread(target=produce)
    producer.start()
    latencies: list[float] = []
    sent = 0
    while sent < total:
        with cond:
            while not waiting:
                cond.wait(0.1)
            batch, waiting[:] = waiting[:10], waiting[10:]
        _send_batches(ns.sqs, url, [messages[i] for i in batch])
        now = time.time()
        latencies += [now - made[i] for i in batch]
        sent += len(batch)
    producer.join()
    return latencies


def _relay(dsn: str, ns: Namespace, moto: MotoServer, topic: str, args: argparse.Namespace,
           count: Count | None) -> tuple[Relay, TimedSqsSink]:
    ns.create(topic)
    sink = TimedSqsSink(moto.url, name="sqs", queue_prefix=ns.prefix, concurrency=args.concurrency,
                        batch_size=args.batch_size)
    relay = Relay(load_settings(dsn=dsn, worker_id="bench", kafka=False, heartbeat_seconds=0.2,
                                worker_ttl_seconds=1.0), sinks=[sink], observer=count)
    relay.start()
    deadline = time.monotonic() + 60
    while relay.readiness() or _held(dsn) < 256:
        if time.monotonic() > deadline:
            raise RuntimeError("relay not ready")
        time.sleep(0.1)
    return relay, sink


def _held(dsn: str) -> int:
    with psycopg.connect(dsn, autocommit=True) as conn:
        row = conn.execute("SELECT count(*) FROM outbox.cursors WHERE owner IS NOT NULL").fetchone()
    return int(row[0]) if row else 0


def sink_drain(pg: Postgres, ns: Namespace, moto: MotoServer, args: argparse.Namespace) -> float:
    name = pg.create_database()
    dsn = pg.dsn(name)
    migrate(dsn)
    count = Count(args.events)
    topic = f"drain{uuid.uuid4().hex[:6]}"
    relay, _sink = _relay(dsn, ns, moto, topic, args, count)
    try:
        with psycopg.connect(dsn) as conn:
            Outbox(default_topic=topic).publish_many(conn, [
                {"key": f"k{i % args.keys}", "type": "bench.placed", "payload": PAYLOAD} for i in range(args.events)])
        start = time.perf_counter()
        if not count.done.wait(600):
            raise RuntimeError(f"only {count.n} of {args.events} delivered")
        return args.events / (time.perf_counter() - start)
    finally:
        relay.drain(60)
        pg.drop_database(name)


def sink_latency(pg: Postgres, ns: Namespace, moto: MotoServer, args: argparse.Namespace) -> tuple[list[float], float]:
    """commit -> ack per event, and the rate the producer reached."""
    name = pg.create_database()
    dsn = pg.dsn(name)
    migrate(dsn)
    topic = f"lat{uuid.uuid4().hex[:6]}"
    total = int(args.rate * args.seconds)
    relay, sink = _relay(dsn, ns, moto, topic, args, None)
    committed: dict[uuid.UUID, float] = {}
    try:
        outbox = Outbox(default_topic=topic)
        with psycopg.connect(dsn) as conn:
            start = time.perf_counter()
            for i in range(total):
                delay = start + i / args.rate - time.perf_counter()
                if delay > 0:
                    time.sleep(delay)
                with conn.transaction():
                    published = outbox.publish(conn, key=f"k{i % args.keys}", type="bench.placed", payload=PAYLOAD)
                committed[published.id] = time.time()
            reached = total / (time.perf_counter() - start)
        deadline = time.monotonic() + 120
        while len(sink.acked) < total and time.monotonic() < deadline:
            time.sleep(0.05)
        return [sink.acked[i] - t for i, t in committed.items() if i in sink.acked], reached
    finally:
        relay.drain(60)
        pg.drop_database(name)


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] * 1000


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--events", type=int, default=5000)
    parser.add_argument("--keys", type=int, default=64)
    parser.add_argument("--rate", type=float, default=1000.0)
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--concurrency", type=int, default=10)
    parser.add_argument("--batch-size", type=int, default=10)
    parser.add_argument("--drain-only", action="store_true", help="skip the latency cases")
    args = parser.parse_args()
    import os

    os.environ.update(DUMMY_CREDENTIALS)
    drains: dict[str, list[float]] = {"sink": [], "plain": []}
    lat: dict[str, list[tuple[float, float]]] = {"sink": [], "plain": []}
    reached: list[float] = []
    with tempfile.TemporaryDirectory() as tmp:
        moto = MotoServer(Path(tmp) / "moto.log").start()
        pg = Postgres(Path(tmp))
        ns = Namespace(moto.url)
        try:
            for run in range(args.runs):
                order = ["sink", "plain"] if run % 2 == 0 else ["plain", "sink"]
                for case in order:
                    drains[case].append(sink_drain(pg, ns, moto, args) if case == "sink" else plain_drain(ns, args))
                for case in order if not args.drain_only else []:
                    if case == "sink":
                        values, r = sink_latency(pg, ns, moto, args)
                        reached.append(r)
                    else:
                        values = plain_latency(ns, args)
                    lat[case].append((pct(values, 0.5), pct(values, 0.99)))
                print(f"run {run + 1}: drain {drains['sink'][-1]:.0f} vs {drains['plain'][-1]:.0f} ev/s; "
                      f"p50/p99 {lat['sink'][-1:]} vs {lat['plain'][-1:]}", file=sys.stderr)
        finally:
            ns.close()
            pg.stop()
            moto.kill()

    def med(values: list[float]) -> str:
        return f"{statistics.median(values):,.0f} ({min(values):,.0f}-{max(values):,.0f})"

    print(f"machine: {machine()}; PostgreSQL {pg.version}; moto server mode (tests/sqs_server.py); "
          f"{args.runs} runs, medians (min-max)\n")
    if args.drain_only:
        print(f"| case | drain ev/s ({args.events:,} events, {args.keys} keys) |\n|---|---|")
        print(f"| SQS sink (concurrency {args.concurrency}, batch {args.batch_size}) | {med(drains['sink'])} |")
        print(f"| plain boto3 loop (batches of 10) | {med(drains['plain'])} |")
        return 0
    print(f"| case | drain ev/s ({args.events:,} events, {args.keys} keys) | p50 ms at {args.rate:g}/s | "
          f"p99 ms at {args.rate:g}/s |")
    print("|---|---|---|---|")
    for case, label in (("sink", f"SQS sink (1 relay, concurrency {args.concurrency}, batch {args.batch_size})"),
                        ("plain", "plain boto3 loop (batches of 10, one request at a time)")):
        print(f"| {label} | {med(drains[case])} | {med([p for p, _ in lat[case]])} | "
              f"{med([p for _, p in lat[case]])} |")
    ratio = statistics.median(drains["sink"]) / statistics.median(drains["plain"])
    print(f"\ndrain ratio sink/plain: {ratio:.2f}; the producer reached {med(reached)} of {args.rate:g} ev/s offered")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
