"""Acceptance: relay processes under load while the broker restarts several times without its state.

Tansu keeps everything in memory: each restart forgets topics, messages and producer ids, and hands
producer ids out again from 1 (as a Kafka cluster rebuilt from scratch would). A relay whose producer
survived a restart can then share its id with a new producer; its batches are answered
DUPLICATE_SEQUENCE_NUMBER, which librdkafka reports as delivered although nothing was stored. The
test makes that collision certain: right after each restart, before the relays go on, new producers
take the low ids and write to every partition. Then it reads the topic and checks that every
published event arrived (G3) and that each key's de-duplicated sequence is the published one (G6).

Since a restart empties the topic, what the broker holds is read before each restart, while the relays
are stopped (SIGSTOP: no delivery report can be handled, so nothing counts as delivered that the read
could miss), twice (a fetch can skip a batch written concurrently), and once more at the end.
"""

from __future__ import annotations

import signal
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import pytest

from tests.acceptance.test_relay_processes import (
    Producers,
    Published,
    Record,
    Relays,
    Tansu,
    create_topic,
    db_rows,
    owned_buckets,
    wait_drained,
)
from tests.integration.test_kafka_broker_amnesia import take_producer_ids
from tests.servers import free_port, wait_until

pytestmark = pytest.mark.slow

SINK = "kafka"
RELAYS = 3
RESTARTS = 3
THIEVES = 8  # producer ids taken after each restart: more than the relays' producers could hold
PER_PARTITION = 200  # above any sequence number a relay's producer reaches on a partition here
# Leases longer than the time the relays are stopped around a restart; a stalled producer is
# replaced after 5 s (the old code's only way out of a forgotten producer id).
KNOBS = ["--lease-seconds", "30", "--heartbeat-seconds", "0.5", "--worker-ttl-seconds", "15",
         "--backoff-base-seconds", "0.1", "--backoff-max-seconds", "0.5", "--kafka-stall-seconds", "5"]


def read_everything(bootstrap: str, topic: str, quiet: float = 1.0, timeout: float = 30.0) -> list[Record]:
    """The outbox events on ``topic`` (messages with a ``ce_id``), read from offset 0 until nothing new
    arrived for ``quiet`` seconds. Only for a topic nobody writes to any more."""
    from confluent_kafka import OFFSET_BEGINNING, Consumer, TopicPartition

    consumer = Consumer({"bootstrap.servers": bootstrap, "group.id": f"restarts-{uuid.uuid4().hex[:8]}",
                         "enable.auto.commit": False, "log_level": 3})
    records: list[Record] = []
    try:
        md = wait_until(lambda: consumer.list_topics(topic, timeout=5).topics.get(topic), 15, 0.05, topic)
        consumer.assign([TopicPartition(topic, p, OFFSET_BEGINNING) for p in md.partitions])
        deadline = time.monotonic() + timeout
        last_news = time.monotonic()
        while time.monotonic() - last_news < quiet:
            assert time.monotonic() < deadline, f"{topic} kept growing for {timeout:.0f}s"
            for m in consumer.consume(num_messages=5000, timeout=0.1):
                if m.error():
                    continue
                last_news = time.monotonic()
                headers = {k: v for k, v in (m.headers() or [])}
                if "ce_id" in headers:
                    records.append(Record(m.partition(), m.offset(), (m.key() or b"").decode(),
                                          (headers["ce_id"] or b"").decode(), 0))
    finally:
        consumer.close()
    return records


def read_twice(bootstrap: str, topic: str) -> list[Record]:
    """Two full reads, merged: a fetch can skip a batch whose offset was reserved but not yet written."""
    merged = {(r.partition, r.offset): r for r in read_everything(bootstrap, topic)}
    merged.update({(r.partition, r.offset): r for r in read_everything(bootstrap, topic)})
    return list(merged.values())


def last_checkpoints(dsn: str) -> dict[str, Any]:
    """Per relay, its latest Kafka checkpoint (a checkpoint follows the broker's acknowledgement)."""
    return dict(db_rows(dsn, "SELECT owner, max(advanced_at) FROM outbox.cursors WHERE sink = %s "
                             "AND owner IS NOT NULL GROUP BY owner", (SINK,)))


def test_restarts_of_a_broker_that_forgets_producer_ids_lose_and_reorder_nothing(
        dsn: str, relays: Relays, tmp_path: Path) -> None:
    broker = Tansu(tmp_path, free_port())
    topic = f"restarts-{uuid.uuid4().hex[:8]}"
    broker.start()
    stop = threading.Event()
    try:
        create_topic(broker.bootstrap, topic, 4)
        fleet = [relays.start(f"r{i}", dsn, broker.bootstrap, topic, KNOBS) for i in range(RELAYS)]
        wait_until(lambda: len(owned_buckets(dsn)) == RELAYS and sum(owned_buckets(dsn).values()) == 256,
                   30, 0.2, "the relays sharing the 256 buckets")
        keys = [f"restart-{i:02d}" for i in range(30)]
        published = Published()
        producers = Producers(dsn, topic, keys, 10**9, published, producers=2, rate=100, max_batch=5, stop=stop)
        epochs: list[list[Record]] = []
        since = db_rows(dsn, "SELECT clock_timestamp()")[0][0]
        for _ in range(RESTARTS):
            # Every relay delivered since the last restart: its producer holds an id the broker will forget.
            wait_until(lambda: (len(done := last_checkpoints(dsn)) == RELAYS
                                and all(t is not None and t > since for t in done.values())),  # noqa: B023
                       60, 0.1, "a delivery by every relay")
            for r in fleet:
                r.signal(signal.SIGSTOP)
            epochs.append(read_twice(broker.bootstrap, topic))
            broker.kill()
            broker.start()
            create_topic(broker.bootstrap, topic, 4)  # a real cluster would still have it
            take_producer_ids(broker.bootstrap, topic, count=THIEVES, per_partition=PER_PARTITION)
            since = db_rows(dsn, "SELECT clock_timestamp()")[0][0]
            for r in fleet:
                r.signal(signal.SIGCONT)
        stop.set()
        producers.join()
        final = wait_drained(dsn, timeout=60)
        assert int(final["dead_letters"]) == 0, final
        assert all(r.running for r in fleet), "a relay died"
        epochs.append(read_twice(broker.bootstrap, topic))
    finally:
        stop.set()
        broker.kill()

    seen = {r.event_id for epoch in epochs for r in epoch}
    missing = published.ids() - seen
    assert not missing, (f"{len(missing)} of {published.count()} published events never reached the broker, "
                         f"e.g. {sorted(missing)[:3]}")
    # Per key, the first occurrences across the broker's lives (each read in partition order) are the
    # published sequence: duplicates allowed, reordering never.
    first: dict[str, list[str]] = {}
    for epoch in epochs:
        for r in sorted(epoch, key=lambda r: (r.partition, r.offset)):
            ids = first.setdefault(r.key, [])
            if r.event_id not in ids:
                ids.append(r.event_id)
    wrong = [k for k in keys if first.get(k, []) != published.by_key.get(k, [])]
    assert not wrong, f"{len(wrong)} keys out of order, e.g. {wrong[0]!r}"
    print(f"{published.count()} events, {sum(len(e) for e in epochs)} messages over {len(epochs)} broker lives")
