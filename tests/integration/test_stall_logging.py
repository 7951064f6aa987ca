"""No silent stall (issue 25): a relay process that stood still (stopped, starved of CPU, or held up by a
slow statement of its membership thread) says so when it runs again, since the leases it renews may
have run out meanwhile and the takeover that follows needs a reason in the log. Real PostgreSQL; the
stand-still is one heartbeat that takes 2.5 s."""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

import pytest

from outbox_relay import store
from outbox_relay.worker import Worker
from tests.integration.relay_helpers import RecordingSink, make_settings, running
from tests.servers import wait_until


def test_a_membership_thread_that_comes_round_late_says_so(
        dsn: str, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch) -> None:
    beat = store.heartbeat
    slowed = threading.Event()

    def slow_once(*args: Any, **kwargs: Any) -> Any:
        if not slowed.is_set() and threading.current_thread().name == "membership":
            slowed.set()
            time.sleep(2.5)
        return beat(*args, **kwargs)

    monkeypatch.setattr(store, "heartbeat", slow_once)
    # Lease 3 s: renewals every second, so a loop 2.5 s late is past one (and past PROCESS_STALL_SECONDS).
    worker = Worker(make_settings(dsn, "relay-s", lease_seconds=3.0), [RecordingSink("relay-s")])
    with caplog.at_level(logging.WARNING, logger="outbox_relay.worker"), running(worker):
        wait_until(lambda: any("ran" in r.getMessage() and "late" in r.getMessage() for r in caplog.records),
                   15, 0.05, "the warning")
    [said] = [r.getMessage() for r in caplog.records if "late" in r.getMessage()]
    assert "leases may have expired" in said and "starved of CPU" in said, said
