"""The inbox consumer's apply rate next to a bare consumer loop, side by side in one run.

Both read the same N messages (4 partitions) from Tansu with ``assign()`` and apply each with the
same handler (one INSERT) in its own transaction on PostgreSQL 18. The bare loop does nothing else;
the inbox adds the lease check, the dedupe record, a savepoint around the handler, the position
update and the handler's thread (time limit); the last case also serves /metrics (handler timing,
watermark reads). Cases alternate, each ``--runs`` times; medians with
min/max. Usage: ``python bench/inbox.py [--events 5000] [--runs 3]``.
"""

from __future__ import annotations

import argparse
import json
import socket
import statistics
import sys
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import psycopg
from confluent_kafka import OFFSET_BEGINNING, Consumer, Producer, TopicPartition

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench.servers import Servers, machine
from outbox_relay.inbox import InboxConsumer, InboxMessage, InboxSettings, migrate_inbox

PARTITIONS = 4
TABLE = "CREATE TABLE effects (id text, n bigint)"


def handler(message: InboxMessage, conn: psycopg.Connection[Any]) -> None:
    conn.execute("INSERT INTO effects VALUES (%s, %s)", (message.id, message.offset))


def produce(bootstrap: str, topic: str, n: int) -> None:
    producer = Producer({"bootstrap.servers": bootstrap, "linger.ms": 5, "log_level": 3})
    for i in range(n):
        producer.produce(topic, value=json.dumps({"n": i}).encode(), key=f"k{i % 97}".encode(),
                         partition=i % PARTITIONS, headers=[("ce_id", str(uuid.uuid4()).encode())])
        if i % 10_000 == 0:
            producer.poll(0)
    assert producer.flush(30) == 0


def bare(dsn: str, bootstrap: str, topic: str, n: int) -> float:
    consumer = Consumer({"bootstrap.servers": bootstrap, "group.id": "bench-bare", "enable.auto.commit": False,
                         "log_level": 3})
    consumer.assign([TopicPartition(topic, p, OFFSET_BEGINNING) for p in range(PARTITIONS)])
    done = 0
    start = time.perf_counter()
    with psycopg.connect(dsn) as conn:
        while done < n:
            for m in consumer.consume(500, 0.1):
                if m.error():
                    continue
                conn.execute("INSERT INTO effects VALUES (%s, %s)", (m.headers()[0][1].decode(), m.offset()))
                conn.commit()
                done += 1
    elapsed = time.perf_counter() - start
    consumer.close()
    return n / elapsed


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def inbox(dsn: str, bootstrap: str, topic: str, n: int, batch_size: int = 100, metrics: bool = False) -> float:
    s = InboxSettings(dsn=dsn, bootstrap_servers=bootstrap, topics=[topic], consumer=f"bench-{uuid.uuid4().hex[:6]}",
                      poll_seconds=0.1, batch_size=batch_size,
                      metrics_port=free_port() if metrics else None, metrics_host="127.0.0.1")
    consumer = InboxConsumer(s, handler)
    consumer.start()
    stop = threading.Event()
    try:
        consumer.run_once()  # leases taken before the clock starts, like the bare loop's assign
        start = time.perf_counter()
        while consumer.stats.applied < n and not stop.is_set():
            consumer.run_once()
        elapsed = time.perf_counter() - start
    finally:
        consumer.close()
    return n / elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--events", type=int, default=5000)
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()
    cases: dict[str, Any] = {
        "bare loop": bare,
        "inbox --batch-size 1": lambda *a: inbox(*a, batch_size=1),
        "inbox --batch-size 100": inbox,
        "inbox --batch-size 100 --metrics-port": lambda *a: inbox(*a, metrics=True),
    }
    rates: dict[str, list[float]] = {case: [] for case in cases}
    with Servers() as servers:
        assert servers.postgres is not None and servers.tansu is not None
        for run in range(args.runs):
            for case, fn in cases.items():
                name = servers.postgres.create_database()
                dsn = servers.postgres.dsn(name)
                with psycopg.connect(dsn, autocommit=True) as conn:
                    migrate_inbox(conn)
                    conn.execute(TABLE)
                topic = servers.tansu.create_topic("inbox-bench", PARTITIONS)
                produce(servers.tansu.bootstrap, topic, args.events)
                rate = fn(dsn, servers.tansu.bootstrap, topic, args.events)
                print(f"run {run + 1} {case}: {rate:,.0f} msg/s", file=sys.stderr)
                rates[case].append(rate)
                servers.postgres.drop_database(name)
    print(f"machine: {machine()}; N={args.events}, {PARTITIONS} partitions, one consumer process, runs={args.runs}\n")
    print("| case | msg/s median | min | max |\n|---|---|---|---|")
    for case, values in rates.items():
        print(f"| {case} | {statistics.median(values):,.0f} | {min(values):,.0f} | {max(values):,.0f} |")
    base = statistics.median(rates["bare loop"])
    print()
    for case in list(cases)[1:]:
        print(f"{case} / bare loop: {statistics.median(rates[case]) / base:.2f}x")


if __name__ == "__main__":
    main()
