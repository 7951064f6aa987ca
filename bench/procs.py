"""Helper processes the bench starts (each in its own interpreter, so no GIL is shared).

    python bench/procs.py ref-worker ...         the seed's claim loop (claim 25, complete row by row)
    python bench/procs.py tuned-worker ...       a tuned set-based SQL relay (claim 500, one UPDATE per batch)
    python bench/procs.py latency-producer ...   publish at a fixed rate, record commit times per event id
    python bench/procs.py latency-consumer ...   assign() every partition, record receive times per event id
    python bench/procs.py enqueue ...            publish for a while, N events per transaction

Protocol with the parent: the process prints ``ready`` once connected, waits for a line on
stdin (``go``), works, and prints one JSON line with its results (or writes them to --out).
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
import threading
import time
import zlib
from typing import Any

import psycopg

# -- the seed reference loop (Durable Work in Postgres, part 1) -----------------------------

REF_SCHEMA = """
CREATE TABLE inbox (
  id               UUID PRIMARY KEY DEFAULT uuidv7(),
  partition_key    TEXT NOT NULL,
  partition_bucket INT NOT NULL
                   CHECK (partition_bucket >= 0 AND partition_bucket < 1024),
  payload          JSONB NOT NULL,
  status           TEXT NOT NULL DEFAULT 'pending',
  idempotency_key  TEXT,
  claimed_by       TEXT,
  lease_expires_at TIMESTAMPTZ,
  lease_generation BIGINT NOT NULL DEFAULT 0,
  attempts         INT NOT NULL DEFAULT 0,
  max_attempts     INT NOT NULL DEFAULT 5,
  available_at     TIMESTAMPTZ NOT NULL DEFAULT now(),
  created_at       TIMESTAMPTZ NOT NULL DEFAULT now()
);
CREATE UNIQUE INDEX idx_inbox_idempotency
  ON inbox (idempotency_key) WHERE idempotency_key IS NOT NULL;
"""

REF_ENQUEUE = """
INSERT INTO inbox (partition_key, partition_bucket, payload)
SELECT k, b, p::jsonb FROM unnest(%(keys)s::text[], %(buckets)s::int[], %(payloads)s::text[]) AS t(k, b, p)
"""

REF_CLAIM = """
WITH picked AS (
  SELECT id FROM inbox
  WHERE status = 'pending' AND available_at <= now()
  ORDER BY created_at, id
  LIMIT 25
  FOR UPDATE SKIP LOCKED
)
UPDATE inbox i
SET status = 'processing',
    claimed_by = %(worker)s,
    lease_expires_at = now() + interval '90 seconds',
    lease_generation = lease_generation + 1,
    attempts = attempts + 1
FROM picked WHERE i.id = picked.id
RETURNING i.id, i.partition_key, i.payload::text, i.lease_generation
"""

REF_COMPLETE = """
UPDATE inbox
SET status = 'completed'
WHERE id = %s
  AND claimed_by = %s
  AND lease_generation = %s
  AND lease_expires_at > now()
  AND status = 'processing'
"""


def ref_bucket(key: str) -> int:
    return zlib.crc32(key.encode()) % 1024


def _ready_then_wait() -> None:
    print("ready", flush=True)
    line = sys.stdin.readline()
    if line.strip() != "go":
        sys.exit(0)


def ref_worker(args: argparse.Namespace) -> None:
    from confluent_kafka import Producer

    from outbox_relay.sinks.kafka import PRODUCER_DEFAULTS

    producer = Producer({**PRODUCER_DEFAULTS, "bootstrap.servers": args.bootstrap})
    producer.list_topics(args.topic, timeout=10)  # metadata fetched before the clock starts
    conn = psycopg.connect(args.dsn, autocommit=True)
    worker = args.id
    failures: list[str] = []

    def on_delivery(err: Any, _msg: Any) -> None:
        if err is not None:
            failures.append(str(err))

    _ready_then_wait()
    processed = 0
    stale = 0
    last_done = time.time()
    while True:
        batch = conn.execute(REF_CLAIM, {"worker": worker}).fetchall()
        if not batch:
            break
        if args.per_row_flush:
            # The seed's handler literally: one row, one produce, wait for the ack, complete.
            for row_id, key, payload, generation in batch:
                producer.produce(args.topic, payload.encode(), key.encode(),
                                 headers=[("ce_id", str(row_id).encode())], on_delivery=on_delivery)
                producer.flush()
                if failures:
                    raise RuntimeError(failures[0])
                stale += conn.execute(REF_COMPLETE, (row_id, worker, generation)).rowcount != 1
                processed += 1
        else:
            # Produce the claimed 25, wait for every ack, then complete row by row.
            for row_id, key, payload, _generation in batch:
                producer.produce(args.topic, payload.encode(), key.encode(),
                                 headers=[("ce_id", str(row_id).encode())], on_delivery=on_delivery)
            producer.flush()
            if failures:
                raise RuntimeError(failures[0])
            for row_id, _key, _payload, generation in batch:
                stale += conn.execute(REF_COMPLETE, (row_id, worker, generation)).rowcount != 1
                processed += 1
        last_done = time.time()
    print(json.dumps({"processed": processed, "stale": stale, "last_done": last_done}), flush=True)


# -- a tuned set-based SQL relay (the GUIDE's anchor) -------------------------------------------
#
# What a competent team would write with a status column and no ordering: one UPDATE claims up to
# 500 pending rows (FOR UPDATE SKIP LOCKED, through a partial index that matches the claim's ORDER
# BY) and marks them delivered, RETURNING them; the rows are produced, and the transaction commits
# once the broker acknowledged all of them. Its row locks are the lease: a crash or a failed batch
# rolls back and the rows are pending again. One row update per event, one statement per batch; no
# bucket assignment, no per-key order, no retries or dead letters. (Claiming with SELECT ... FOR UPDATE and
# completing with a second UPDATE writes every row twice and drained at half the rate here.)

TUNED_SCHEMA = """
CREATE TABLE tuned_outbox (
  id            BIGINT GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
  event_id      UUID NOT NULL,
  partition_key TEXT NOT NULL,
  topic         TEXT NOT NULL,
  payload       JSONB NOT NULL,
  status        SMALLINT NOT NULL DEFAULT 0,  -- 0 pending, 1 delivered
  created_at    TIMESTAMPTZ NOT NULL DEFAULT now(),
  delivered_at  TIMESTAMPTZ
);
-- The claim's ORDER BY, pending rows only: a claim reads the head of this index, never delivered rows.
CREATE INDEX tuned_outbox_claim ON tuned_outbox (id) WHERE status = 0;
-- Wake idle workers at once (one notification per insert statement, as the relay's own trigger).
CREATE FUNCTION tuned_outbox_notify() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
  PERFORM pg_notify('tuned_outbox', '');
  RETURN NULL;
END $$;
CREATE TRIGGER tuned_outbox_notify AFTER INSERT ON tuned_outbox
  FOR EACH STATEMENT EXECUTE FUNCTION tuned_outbox_notify();
"""

TUNED_ENQUEUE = """
INSERT INTO tuned_outbox (event_id, partition_key, topic, payload)
SELECT * FROM unnest(%(ids)s::uuid[], %(keys)s::text[], %(topics)s::text[], %(payloads)s::jsonb[])
"""

TUNED_CLAIM = """
UPDATE tuned_outbox t SET status = 1, delivered_at = now()
FROM (SELECT id FROM tuned_outbox WHERE status = 0 ORDER BY id LIMIT %(limit)s FOR UPDATE SKIP LOCKED) c
WHERE t.id = c.id
RETURNING t.id, t.event_id::text, t.partition_key, t.topic, t.payload::text
"""


def tuned_worker(args: argparse.Namespace) -> None:
    """Drain mode (default): exit once a claim finds nothing. --serve: wait for notifications (polling
    every --poll-seconds as a fallback) until a ``stop`` line, then write each event's ack time (its
    delivery report, served by ``flush()``; the claim that marked it delivered commits after) to --out."""
    from confluent_kafka import Producer

    from outbox_relay.sinks.kafka import PRODUCER_DEFAULTS

    producer = Producer({**PRODUCER_DEFAULTS, "bootstrap.servers": args.bootstrap})
    producer.list_topics(args.topic, timeout=10)  # metadata fetched before the clock starts
    conn = psycopg.connect(args.dsn, application_name="bench-tuned")  # not autocommit: the claim commits after the acks
    listener = None
    stop = threading.Event()
    if args.serve:
        listener = psycopg.connect(args.dsn, autocommit=True, application_name="bench-tuned")
        listener.execute("LISTEN tuned_outbox")
    failures: list[str] = []

    acks: dict[str, float] = {}  # event id -> when its delivery report was served (first one)

    def on_delivery(event_id: str, err: Any, _msg: Any) -> None:
        if err is not None:
            failures.append(str(err))
        elif args.serve:
            acks.setdefault(event_id, time.time())

    _ready_then_wait()
    if args.serve:
        def control() -> None:
            for line in sys.stdin:
                if line.strip() == "stop":
                    break
            stop.set()  # a "stop" line, or the parent went away

        threading.Thread(target=control, daemon=True).start()
    processed = batches = 0
    last_done = time.time()
    while not stop.is_set():
        rows = conn.execute(TUNED_CLAIM, {"limit": args.batch_size}).fetchall()
        if not rows:
            conn.commit()
            if listener is None:
                break
            for _ in listener.notifies(timeout=args.poll_seconds, stop_after=1):
                pass
            continue
        for _id, event_id, key, topic, payload in rows:
            producer.produce(topic, payload.encode(), key.encode(), headers=[("ce_id", event_id.encode())],
                             on_delivery=functools.partial(on_delivery, event_id))
        producer.flush()
        if failures:
            raise RuntimeError(failures[0])  # the claim rolls back with the connection
        conn.commit()
        last_done = time.time()
        processed += len(rows)
        batches += 1
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"acks": acks}, f)
    print(json.dumps({"processed": processed, "batches": batches, "last_done": last_done}), flush=True)


# -- steady-state latency ---------------------------------------------------------------------


def latency_producer(args: argparse.Namespace) -> None:
    import uuid

    from outbox_relay import Outbox

    outbox = Outbox(default_topic=args.topic)
    conn = psycopg.connect(args.dsn, application_name="bench-producer")

    def publish(batch: list[dict[str, Any]]) -> list[str]:
        if args.target == "outbox":
            return [str(p.id) for p in outbox.publish_many(conn, batch)]
        # The tuned SQL relay's table: one INSERT for the tick's events, as publish_many does.
        ids = [str(uuid.uuid4()) for _ in batch]
        conn.execute(TUNED_ENQUEUE, {"ids": ids, "keys": [e["key"] for e in batch], "topics": [args.topic] * len(batch),
                                     "payloads": [json.dumps(e["payload"]) for e in batch]})
        return ids

    tick = args.tick_ms / 1000.0
    commits: dict[str, float] = {}
    txs = 0
    _ready_then_wait()
    start = time.monotonic()
    sent = 0
    i = 0
    while True:
        now = time.monotonic()
        elapsed = now - start
        if elapsed >= args.duration:
            break
        due = int(args.rate * elapsed) - sent
        if due > 0:
            batch = []
            for _ in range(due):
                batch.append({"type": "bench.latency", "key": f"order:{i % args.keys}",
                              "payload": {"n": i, "note": "steady-state latency probe"}})
                i += 1
            # --per-tx 0: the tick's events in one transaction; N: N events per transaction (1: a
            # commit per event, as a service that writes one business row per request does).
            step = args.per_tx or len(batch)
            for first in range(0, len(batch), step):
                if first and time.monotonic() - start >= args.duration:
                    due = first  # a producer that can not keep up: what it committed in time is what was sent
                    break
                published = publish(batch[first:first + step])
                conn.commit()
                committed = time.time()
                for event_id in published:
                    commits[event_id] = committed
                txs += 1
            sent += due
        next_tick = start + (int(elapsed / tick) + 1) * tick
        time.sleep(max(0.0, next_tick - time.monotonic()))
    actual = time.monotonic() - start
    with open(args.out, "w") as f:
        json.dump({"commits": commits, "seconds": actual, "transactions": txs}, f)
    print(json.dumps({"sent": sent, "seconds": actual, "transactions": txs}), flush=True)


def latency_consumer(args: argparse.Namespace) -> None:
    from confluent_kafka import OFFSET_BEGINNING, TIMESTAMP_CREATE_TIME, Consumer, TopicPartition

    consumer = Consumer({
        "bootstrap.servers": args.bootstrap,
        "group.id": "outbox-bench-latency",  # required by the client; assign() never joins the group
        "enable.auto.commit": False,
        "fetch.wait.max.ms": 5,
        "fetch.error.backoff.ms": 5,
        "fetch.queue.backoff.ms": 0,
    })
    consumer.assign([TopicPartition(args.topic, p, OFFSET_BEGINNING) for p in range(args.partitions)])
    consumer.consume(num_messages=1, timeout=1.0)  # connect and fetch once before the clock starts
    received: dict[str, float] = {}
    produced: dict[str, float] = {}  # the message's CreateTime: when the relay called produce()
    duplicates = 0
    expect: list[int] = []
    stop = threading.Event()

    def control() -> None:
        # "expect N": stop once N distinct events arrived (or --timeout later); "stop": now.
        # End of input alone does not stop it: the parent's communicate() closes stdin.
        for line in sys.stdin:
            parts = line.split()
            if parts and parts[0] == "expect":
                expect.append(int(parts[1]))
            if parts and parts[0] == "stop":
                stop.set()
                return

    print("ready", flush=True)
    threading.Thread(target=control, daemon=True).start()
    deadline: float | None = None
    reason = "stop"
    while not stop.is_set():
        msgs = consumer.consume(num_messages=1000, timeout=0.05)
        now = time.time()
        for m in msgs:
            if m.error():
                continue
            ce_id = next((v.decode() for k, v in (m.headers() or []) if k == "ce_id"), None)
            if ce_id is None:
                continue
            if ce_id in received:
                duplicates += 1
            else:
                received[ce_id] = now
                kind, ts = m.timestamp()
                if kind == TIMESTAMP_CREATE_TIME:
                    produced[ce_id] = ts / 1000.0
        if expect:
            if len(received) >= expect[0]:
                reason = "count"
                break
            if deadline is None:
                deadline = time.monotonic() + args.timeout
            elif time.monotonic() > deadline:
                reason = "timeout"
                break
    consumer.close()
    with open(args.out, "w") as f:
        json.dump({"received": received, "produced": produced, "duplicates": duplicates, "exit": reason}, f)
    print(json.dumps({"received": len(received), "duplicates": duplicates, "exit": reason}), flush=True)


# -- enqueue rate ---------------------------------------------------------------------------


def enqueue(args: argparse.Namespace) -> None:
    from outbox_relay import Outbox

    outbox = Outbox(default_topic=args.topic)
    conn = psycopg.connect(args.dsn)
    _ready_then_wait()
    start = time.monotonic()
    n = 0
    txs = 0
    while time.monotonic() - start < args.duration:
        if args.per_tx == 1:
            outbox.publish(conn, type="bench.enqueue", key=f"order:{(args.id * 7919 + n) % args.keys}",
                           payload={"n": n, "producer": args.id, "note": "enqueue rate probe"})
        else:
            outbox.publish_many(conn, [
                {"type": "bench.enqueue", "key": f"order:{(args.id * 7919 + n + j) % args.keys}",
                 "payload": {"n": n + j, "producer": args.id, "note": "enqueue rate probe"}}
                for j in range(args.per_tx)])
        conn.commit()
        n += args.per_tx
        txs += 1
    elapsed = time.monotonic() - start
    print(json.dumps({"events": n, "transactions": txs, "seconds": elapsed}), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("ref-worker")
    p.add_argument("--dsn", required=True)
    p.add_argument("--bootstrap", required=True)
    p.add_argument("--topic", required=True)
    p.add_argument("--id", required=True)
    p.add_argument("--per-row-flush", action="store_true")
    p = sub.add_parser("tuned-worker")
    p.add_argument("--dsn", required=True)
    p.add_argument("--bootstrap", required=True)
    p.add_argument("--topic", required=True, help="fetch its metadata before the clock starts")
    p.add_argument("--batch-size", type=int, default=500)
    p.add_argument("--serve", action="store_true", help="keep serving (LISTEN) until a 'stop' line")
    p.add_argument("--poll-seconds", type=float, default=1.0)
    p.add_argument("--out", default=None, help="--serve: write each event's ack time here")
    p = sub.add_parser("latency-producer")
    p.add_argument("--dsn", required=True)
    p.add_argument("--topic", required=True)
    p.add_argument("--rate", type=float, required=True)
    p.add_argument("--duration", type=float, required=True)
    p.add_argument("--tick-ms", type=float, default=10.0)
    p.add_argument("--per-tx", type=int, default=0, help="latency producer: events per transaction (0: a tick's)")
    p.add_argument("--keys", type=int, default=1000)
    p.add_argument("--target", choices=("outbox", "tuned"), default="outbox",
                   help="outbox: Outbox.publish_many; tuned: the tuned SQL relay's table")
    p.add_argument("--out", required=True)
    p = sub.add_parser("latency-consumer")
    p.add_argument("--bootstrap", required=True)
    p.add_argument("--topic", required=True)
    p.add_argument("--partitions", type=int, required=True)
    p.add_argument("--timeout", type=float, default=30.0)
    p.add_argument("--out", required=True)
    p = sub.add_parser("enqueue")
    p.add_argument("--dsn", required=True)
    p.add_argument("--topic", required=True)
    p.add_argument("--per-tx", type=int, required=True)
    p.add_argument("--duration", type=float, required=True)
    p.add_argument("--id", type=int, required=True)
    p.add_argument("--keys", type=int, default=1000)
    args = parser.parse_args()
    {"ref-worker": ref_worker, "tuned-worker": tuned_worker, "latency-producer": latency_producer,
     "latency-consumer": latency_consumer, "enqueue": enqueue}[args.cmd](args)


if __name__ == "__main__":
    main()
