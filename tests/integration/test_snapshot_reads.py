"""Reads in the order transactions became visible, against a real server: an open transaction holds
nothing back, a transaction that commits late is never skipped, even while a large delta is read in
pages, and concurrent producers that commit in any order lose nothing."""

from __future__ import annotations

import random
import threading
import time
from typing import Any

import psycopg
import pytest
from psycopg_pool import ConnectionPool

from outbox_relay.publish import Outbox
from tests.integration.relay_helpers import (  # noqa: F401  (pool_fixture provides `pool`)
    TOPIC,
    RecordingSink,
    cursor_row,
    dedup_per_key,
    keys_in_bucket,
    make_settings,
    pool_fixture,
    publish,
    run_until,
    runner_for,
    undelivered,
)
from tests.servers import wait_until

pytestmark = pytest.mark.pg15  # the PostgreSQL 15 step runs it too (scripts/test.sh)


def test_a_transaction_open_the_whole_time_holds_nothing_back(dsn: str, pool: ConnectionPool[Any]) -> None:
    """Before: nothing newer than the oldest open writing transaction on the server was read."""
    sink = RecordingSink("w")
    runner = runner_for(sink, pool, make_settings(dsn, "w"))
    with psycopg.connect(dsn) as long_tx:
        long_tx.execute("SELECT pg_current_xact_id()")  # a writer that stays open (a batch job, a stuck client)
        ids = publish(dsn, [(f"k{i}", "t", {}) for i in range(50)])
        run_until(runner, lambda: sink.delivered_ids() == set(ids), timeout=10)
        assert undelivered(dsn) == 0, "the checkpoint moved past them too"


def test_a_late_commit_while_a_large_delta_is_read_in_pages_comes_after_it_and_is_not_skipped(
        dsn: str, pool: ConnectionPool[Any]) -> None:
    bucket = 12
    keys = keys_in_bucket(dsn, bucket, 3)
    sink = RecordingSink("w")
    runner = runner_for(sink, pool, make_settings(dsn, "w", batch_size=8), {bucket})  # 8 per page
    outbox = Outbox(default_topic=TOPIC)
    with psycopg.connect(dsn) as late:
        late.execute("SELECT pg_current_xact_id()")  # older transaction id than everything below
        bulk = publish(dsn, [(keys[i % 2], "t", {"i": i}) for i in range(40)])  # one transaction, 5 pages
        runner.run_once()
        paging = cursor_row(dsn, bucket)["cursor"]
        assert paging.target is not None and paging.after is not None, "the delta is being read in pages"
        late_id = outbox.publish(late, type="t", key=keys[0], payload={"late": True}).id
    # ``late`` committed now, in the middle of the pages: it was open at the cursor's snapshot, so it
    # belongs to the next delta, after the rest of the bulk transaction.
    run_until(runner, lambda: sink.delivered_ids() == {*bulk, late_id})
    order = [a.event_id for a in sink.delivered()]
    assert order == [*bulk, late_id]
    assert len(order) == len(set(order)), "nothing delivered twice"


def test_concurrent_producers_committing_in_any_order_lose_nothing(dsn: str, pool: ConnectionPool[Any]) -> None:
    """Transactions start in one order and commit in another while the relay reads with small batches."""
    sink = RecordingSink("w")
    runner = runner_for(sink, pool, make_settings(dsn, "w", batch_size=16))
    outbox = Outbox(default_topic=TOPIC)
    published: dict[str, list[Any]] = {}
    lock = threading.Lock()
    stop = threading.Event()

    def producer(n: int) -> None:
        rng = random.Random(n)
        with psycopg.connect(dsn) as conn:
            for i in range(40):
                key = f"p{n}-k{i % 3}"  # each key written by one producer, one transaction after another
                with conn.transaction():
                    conn.execute("SELECT pg_current_xact_id()")  # the id is taken before the pause
                    time.sleep(rng.random() * 0.01)
                    e = outbox.publish(conn, type="t", key=key, payload={"i": i})
                with lock:
                    published.setdefault(key, []).append(e.id)

    def relay() -> None:
        while not stop.is_set():
            runner.run_once()

    threads = [threading.Thread(target=producer, args=(n,)) for n in range(6)]
    reader = threading.Thread(target=relay)
    reader.start()
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    try:
        wait_until(lambda: sink.delivered_ids() >= {e for ids in published.values() for e in ids}, timeout=20)
    finally:
        stop.set()
        reader.join(10)
    delivered = [a.event_id for a in sink.delivered()]
    assert len(delivered) == len(set(delivered)) == 240, "each committed event exactly once"
    assert dedup_per_key(sink.delivered()) == published, "per key, in the order the producer committed them"
