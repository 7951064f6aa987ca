"""LISTEN/NOTIFY wakes only the relays that hold a bucket a commit wrote; polling stays the baseline."""

from __future__ import annotations

import threading
from typing import Any

import pytest

from outbox_relay.relay import SinkRunner
from outbox_relay.sinks.engine import Failure
from outbox_relay.worker import Worker
from tests.integration.relay_helpers import (
    RecordingSink,
    keys_in_bucket,
    make_settings,
    owners,
    publish,
    running,
    settled,
)
from tests.servers import wait_until

pytestmark = pytest.mark.pg15  # the PostgreSQL 15 step runs it too (scripts/test.sh)


def _count_cycles(runner: SinkRunner) -> list[int]:
    calls = [0]
    real = runner.run_once

    def counting() -> int:
        calls[0] += 1
        return real()

    runner.run_once = counting  # type: ignore[method-assign]
    return calls


def test_a_commit_wakes_the_owner_of_its_bucket_and_no_other_relay(dsn: str) -> None:
    names = ["relay-a", "relay-b"]
    sinks = {n: RecordingSink(n) for n in names}
    # Polling every 30 s: within this test only notifications wake a runner.
    workers = {n: Worker(make_settings(dsn, n, listen=True, poll_seconds=30.0), sinks=[sinks[n]]) for n in names}
    waiters = []
    try:
        for w in workers.values():
            assert w.start()
            waiters.append(threading.Thread(target=w.wait))
            waiters[-1].start()
        wait_until(lambda: settled(dsn, names), 15, message="the assignment to settle")
        bucket = min(b for b, o in owners(dsn).items() if o == "relay-a")
        cycles: dict[str, Any] = {n: _count_cycles(w.runners[0]) for n, w in workers.items()}
        ids = [publish(dsn, [(k, "t", {})])[0] for k in keys_in_bucket(dsn, bucket, 20)]  # 20 commits
        wait_until(lambda: sinks["relay-a"].delivered_ids() == set(ids), 10, message="the owner to deliver")
        assert cycles["relay-a"][0] >= 1
        # At most one cycle: a wake-up left over from settling may still be pending when counting starts.
        assert cycles["relay-b"][0] <= 1, f"relay-b was woken {cycles['relay-b'][0]} times for commits it does not own"
    finally:
        for w in workers.values():
            w.drain()
        for t in waiters:
            t.join(20)


def test_an_idle_relay_retries_a_parked_event_when_its_retry_is_due_not_at_its_next_poll(dsn: str) -> None:
    """With LISTEN up a relay polls rarely; a failed event's retry must still go out when it is due."""
    def fail_once(e: Any, n: int) -> Failure | None:
        return Failure("transient") if n == 0 else None

    sink = RecordingSink("relay-a", fail=fail_once)
    settings = make_settings(dsn, "relay-a", listen=True, poll_seconds=30.0, listen_poll_seconds=30.0,
                             backoff_base_seconds=0.3, backoff_max_seconds=0.3)
    worker = Worker(settings, sinks=[sink])
    assert worker.start()
    waiter = threading.Thread(target=worker.wait)
    waiter.start()
    try:
        wait_until(lambda: settled(dsn, ["relay-a"]), 15, message="the relay to hold every bucket")
        [event] = publish(dsn, [("k", "t", {})])
        wait_until(lambda: len(sink.attempts) == 1, 5, message="the first (failing) attempt")
        wait_until(lambda: sink.delivered_ids() == {event}, 5, message="the retry, due 0.15-0.3 s later")
    finally:
        worker.drain()
        waiter.join(20)


def test_a_woken_relay_reads_the_buckets_the_commit_wrote_not_all_it_holds(
        dsn: str, monkeypatch: Any) -> None:
    """One relay holds all 256 buckets; a single-event commit costs a read of its one bucket."""
    from outbox_relay import store

    reads: list[set[int]] = []
    real = store.fetch_events

    def recording(conn: Any, sink: str, worker: str, wanted: dict[int, Any], *args: Any, **kwargs: Any) -> Any:
        reads.append(set(wanted))
        return real(conn, sink, worker, wanted, *args, **kwargs)

    monkeypatch.setattr(store, "fetch_events", recording)
    sink = RecordingSink("relay-a")
    worker = Worker(make_settings(dsn, "relay-a", listen=True, poll_seconds=30.0, listen_poll_seconds=30.0),
                    sinks=[sink])
    assert worker.start()
    waiter = threading.Thread(target=worker.wait)
    waiter.start()
    try:
        wait_until(lambda: settled(dsn, ["relay-a"]) and worker.listening, 15, message="the relay to settle")
        bucket = 77
        keys = keys_in_bucket(dsn, bucket, 5)
        reads.clear()
        ids = [publish(dsn, [(k, "t", {})])[0] for k in keys]
        wait_until(lambda: sink.delivered_ids() == set(ids), 10, message="the events to be delivered")
        assert reads and all(r == {bucket} for r in reads), reads
    finally:
        worker.drain()
        waiter.join(20)


def test_a_commit_while_its_bucket_is_read_in_pages_is_not_left_for_the_poll(dsn: str) -> None:
    """A bucket with more events than one read takes is read in pages against one snapshot (its
    cursor's target). A later commit to that bucket is not in those pages; its wake-up may be used up
    by one of them, so the runner must read the bucket again once the pages end, not wait for the
    poll (30 s here)."""
    sink = RecordingSink("relay-a", hold=0.2)  # each batch takes 0.2 s: the pages take a while
    worker = Worker(make_settings(dsn, "relay-a", listen=True, poll_seconds=30.0, listen_poll_seconds=30.0,
                                  batch_size=5), sinks=[sink])
    with running(worker):
        wait_until(lambda: settled(dsn, ["relay-a"]) and worker.watching, 15, message="the relay to settle")
        keys = keys_in_bucket(dsn, 9, 4)
        first = publish(dsn, [(keys[i % 4], "t", {"n": i}) for i in range(20)])  # 4 pages of 5
        wait_until(lambda: len(sink.delivered_ids()) >= 5, 10, message="the first page")
        late = publish(dsn, [(keys[0], "t", {"late": True})])  # while the pages of the first are read
        wait_until(lambda: sink.delivered_ids() >= set(first) | set(late), 10,
                   message="the late commit to be delivered without waiting for the poll")
