"""LISTEN/NOTIFY wakes only the relays that hold a bucket a commit wrote; polling stays the baseline."""

from __future__ import annotations

import threading
from typing import Any

from outbox_relay.relay import SinkRunner
from outbox_relay.ring import Ring
from outbox_relay.worker import Worker
from tests.integration.relay_helpers import RecordingSink, keys_in_bucket, make_settings, owners, publish
from tests.servers import wait_until


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
        wait_until(lambda: owners(dsn) == Ring(names).assignment(), 15, message="the ring to settle")
        bucket = min(b for b, o in Ring(names).assignment().items() if o == "relay-a")
        cycles: dict[str, Any] = {n: _count_cycles(w.runners[0]) for n, w in workers.items()}
        ids = [publish(dsn, [(k, "t", {})])[0] for k in keys_in_bucket(dsn, bucket, 20)]  # 20 commits
        wait_until(lambda: sinks["relay-a"].delivered_ids() == set(ids), 10, message="the owner to deliver")
        assert cycles["relay-a"][0] >= 1
        assert cycles["relay-b"][0] == 0, f"relay-b was woken {cycles['relay-b'][0]} times for commits it does not own"
    finally:
        for w in workers.values():
            w.drain()
        for t in waiters:
            t.join(20)
