"""A producer process of the fault suite: ``python -m tests.faults.producer --dsn ... --producer P ...``.

Threads publish with ``Outbox.publish_many`` at a steady rate, each thread owning its own keys
and writing each of them in sequence: the payload carries the producer, the key and the key's
sequence number ``n`` (1, 2, 3, ...), so the published order of a key is known without asking
anyone. A transaction holds 1..``--max-batch`` events of one thread's keys.

The database can fail under a producer (restarts are among the faults): a failed transaction is
retried with the same events and the same idempotency keys (``key:n``) until it commits, so a
commit whose outcome was unknown (the connection died during COMMIT) ends as one event, and
``created=False`` on the retry says it had committed. A key's next event is published only after
its previous one committed, so per-key publish order is commit order.

Stops at SIGTERM (or when stdin closes) after the transaction in flight, then prints one JSON line
with its counts on stdout.
"""

from __future__ import annotations

import argparse
import json
import logging
import random
import signal
import sys
import threading
import time
from dataclasses import dataclass, field
from types import FrameType
from typing import Any

import psycopg

from outbox_relay import Outbox

log = logging.getLogger("tests.faults.producer")

EVENT_TYPE = "faults.tick"


@dataclass
class Counts:
    transactions: int = 0
    events: int = 0
    failed_attempts: int = 0  # transactions that failed and were retried
    in_doubt: int = 0  # retried transactions whose events turned out to exist already
    errors: dict[str, int] = field(default_factory=dict)


def publish_thread(dsn: str, topic: str, producer: int, keys: list[str], rate: float, max_batch: int,
                   seed: int, stop: threading.Event, counts: Counts, lock: threading.Lock) -> None:
    outbox = Outbox(default_topic=topic)
    rnd = random.Random(seed)
    next_n = dict.fromkeys(keys, 1)
    conn: psycopg.Connection[Any] | None = None
    sent = 0
    started = time.monotonic()
    while not stop.is_set():
        chosen = rnd.sample(keys, min(len(keys), rnd.randint(1, max_batch)))
        events = [{"type": EVENT_TYPE, "key": k, "payload": {"producer": producer, "key": k, "n": next_n[k]},
                   "idempotency_key": f"{k}:{next_n[k]}"} for k in chosen]
        retried = False
        delay = 0.05
        while True:  # until this transaction committed: a key's next event waits for it
            try:
                if conn is None or conn.closed:
                    conn = psycopg.connect(dsn, application_name=f"faults-producer-{producer}", connect_timeout=5)
                with conn.transaction():
                    results = outbox.publish_many(conn, events)
                break
            except psycopg.Error as exc:
                with lock:
                    counts.failed_attempts += 1
                    name = type(exc).__name__
                    counts.errors[name] = counts.errors.get(name, 0) + 1
                retried = True
                if conn is not None and conn.broken:
                    conn.close()
                if stop.wait(delay):
                    # Stopping with an unknown outcome is fine: the database tells the checker.
                    return
                delay = min(delay * 2, 1.0)
        for k in chosen:
            next_n[k] += 1
        with lock:
            counts.transactions += 1
            counts.events += len(events)
            if retried and not any(r.created for r in results):
                counts.in_doubt += 1
        sent += len(events)
        ahead = sent / rate - (time.monotonic() - started)
        if ahead > 0:
            stop.wait(ahead)
        elif ahead < -1.0:
            # Fell behind (the database was away): go on at the steady rate, no burst to catch up.
            started = time.monotonic() - sent / rate
    if conn is not None:
        conn.close()


def _guarded(target: Any, *args: Any) -> None:
    try:
        target(*args)
    except BaseException:
        # A thread that dies would only show as a lower rate: say so loudly.
        log.exception("producer thread %s died", threading.current_thread().name)
        raise


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dsn", required=True)
    parser.add_argument("--topic", required=True)
    parser.add_argument("--producer", type=int, required=True, help="this process's number (in every payload)")
    parser.add_argument("--keys", required=True, help="comma-separated keys this process owns")
    parser.add_argument("--threads", type=int, default=4)
    parser.add_argument("--rate", type=float, required=True, help="events/s of this process")
    parser.add_argument("--max-batch", type=int, default=5)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    logging.basicConfig(level="WARNING", stream=sys.stderr, format="%(asctime)s %(levelname)s %(name)s %(message)s")

    keys = args.keys.split(",")
    threads_n = max(1, min(args.threads, len(keys)))
    stop = threading.Event()
    counts, lock = Counts(), threading.Lock()

    def on_signal(_signum: int, _frame: FrameType | None) -> None:
        stop.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    threads = [
        threading.Thread(target=_guarded, name=f"publish-{i}", daemon=True,
                         args=(publish_thread, args.dsn, args.topic, args.producer, keys[i::threads_n],
                               args.rate / threads_n, args.max_batch, args.seed * 1000 + i, stop, counts, lock))
        for i in range(threads_n)
    ]
    for t in threads:
        t.start()
    # Stdin closing (the controller died) stops this process too.
    def watch_stdin() -> None:
        sys.stdin.read()
        stop.set()

    threading.Thread(target=watch_stdin, daemon=True).start()
    while not stop.wait(0.5):
        if not any(t.is_alive() for t in threads):
            break
    stop.set()
    for t in threads:
        t.join(30)
    print(json.dumps({"producer": args.producer, "transactions": counts.transactions, "events": counts.events,
                      "failed_attempts": counts.failed_attempts, "in_doubt": counts.in_doubt,
                      "errors": counts.errors}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
