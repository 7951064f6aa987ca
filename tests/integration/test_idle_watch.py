"""An idle commit watcher (wakeups.py) looks less often, and still wakes the owner of the first commit
after the quiet at once."""

from __future__ import annotations

import pytest

from outbox_relay import wakeups
from outbox_relay import worker as worker_module
from outbox_relay.wakeups import CommitWatcher
from outbox_relay.worker import Worker
from tests.integration.relay_helpers import RecordingSink, make_settings, publish, running, settled
from tests.servers import wait_until


def test_a_quiet_watcher_backs_off_and_the_first_commit_brings_it_back(
        dsn: str, monkeypatch: pytest.MonkeyPatch) -> None:
    # A call returns after 20 ms without a commit (not 1 s): the back-off takes a fraction of a second.
    monkeypatch.setattr(wakeups, "WATCH_WAIT_MS", 20)
    calls: list[tuple[int, bool]] = []  # (interval of the call, whether it found commits)

    class Recording(CommitWatcher):
        def watch(self) -> str | None:
            interval = self.pace.interval_ms
            buckets = super().watch()
            calls.append((interval, buckets is not None))
            return buckets

    monkeypatch.setattr(worker_module, "CommitWatcher", Recording)
    sink = RecordingSink("relay-a")
    # Polling every 30 s: within this test only the watcher's notification wakes the runner.
    worker = Worker(make_settings(dsn, "relay-a", listen=True, poll_seconds=30.0, listen_poll_seconds=30.0,
                                  watch_interval_ms=1, watch_max_interval_ms=16), sinks=[sink])
    with running(worker):
        wait_until(lambda: settled(dsn, ["relay-a"]) and worker.watching, 15, message="the relay to watch")
        wait_until(lambda: [i for i, _ in calls[-2:]] == [16, 16], 15, message="the watcher to back off")
        assert [i for i, _ in calls[:5]] == [1, 1, 2, 4, 8], "doubled after each call that found nothing"
        before = len(calls)
        [event] = publish(dsn, [("key-1", "t", {})])
        wait_until(lambda: event in sink.delivered_ids(), 10, message="the owner to be woken")
        wait_until(lambda: any(found for _, found in calls[before:]), 10, message="the watcher to find it")
        found_at = next(n for n in range(before, len(calls)) if calls[n][1])
        wait_until(lambda: len(calls) > found_at + 1, 10, message="the next call")
    assert calls[found_at][0] == 16, "the commit was found by a look at the longest interval"
    assert calls[found_at + 1][0] == 1, "the first commit brought the shortest interval back"
