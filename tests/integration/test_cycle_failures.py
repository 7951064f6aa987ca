"""A cycle that fails as a whole: it backs off, and the failure ends up charged to the one event that
causes it (retried one event at a time, each attempt counted first), never wedging its sink."""

from __future__ import annotations

import contextlib
import logging
import threading
import time
import uuid
from collections.abc import Sequence
from typing import Any

import psycopg
import pytest
from psycopg_pool import ConnectionPool

from outbox_relay.relay import points_at_events
from outbox_relay.sinks.engine import Commit
from outbox_relay.store import StoredEvent
from outbox_relay.worker import Worker
from tests.integration.relay_helpers import (  # noqa: F401  (pool_fixture provides `pool`)
    SINK,
    RecordingSink,
    dead_letters,
    fetch_all,
    keys_in_bucket,
    make_settings,
    pool_fixture,
    publish,
    runner_for,
    running,
)
from tests.unit.test_observer import Broken  # every hook raises


class Boom(RuntimeError):
    """What a sink raises when one of the events it was given can not be handled at all."""


class WholeBatchFailure(RecordingSink):
    """Fails the whole batch (raises, no outcomes) whenever it contains one of ``poison``."""

    def __init__(self, poison: set[uuid.UUID]) -> None:
        super().__init__("w")
        self.poison = poison
        self.calls = 0

    def deliver(self, events: Sequence[StoredEvent], fences: dict[int, int], commit: Commit,
                abort: threading.Event) -> set[int]:
        self.calls += 1
        bad = [e for e in events if e.id in self.poison]
        if bad:
            raise Boom(f"cannot handle {bad[0].key}")
        return super().deliver(events, fences, commit, abort)


def _cycle(runner: Any) -> None:
    """One cycle as the runner's loop makes it: a failing cycle raises, the loop carries on."""
    with contextlib.suppress(Boom):
        runner.run_once()


def test_a_batch_that_fails_as_a_whole_is_charged_to_the_event_that_causes_it(
        dsn: str, pool: ConnectionPool[Any]) -> None:
    bucket, max_attempts = 9, 3
    keys = keys_in_bucket(dsn, bucket, 5)
    ids = publish(dsn, [(k, "t", {"n": i}) for i, k in enumerate(keys)])
    poison = ids[2]
    sink = WholeBatchFailure({poison})
    runner = runner_for(sink, pool, make_settings(dsn, "w", max_attempts=max_attempts), {bucket})

    deadline = time.monotonic() + 20
    while dead_letters(dsn) == {} or sink.delivered_ids() != set(ids) - {poison}:
        assert time.monotonic() < deadline, (f"never isolated: {sink.calls} calls, delivered "
                                             f"{len(sink.delivered_ids())}, dead {dead_letters(dsn)}")
        _cycle(runner)
        with psycopg.connect(dsn, autocommit=True) as conn:  # retries due at once
            conn.execute("UPDATE outbox.parked SET available_at = clock_timestamp()")

    letters = dead_letters(dsn)
    assert set(letters) == {poison}, "only the event that fails the batch is given up on"
    attempts, error = letters[poison]
    assert attempts == max_attempts
    assert "Boom: cannot handle" in error, "the dead letter says what went wrong, not only that it crashed"
    assert set(sink.delivered_ids()) == set(ids) - {poison}
    assert fetch_all(dsn, "SELECT count(*) FROM outbox.parked WHERE sink = %s", (SINK,)) == [(0,)]


def test_failed_cycles_back_off_while_notifications_keep_waking_the_runner(
        dsn: str, pool: ConnectionPool[Any]) -> None:
    """Before: the failure path waited on the wake event, which notifications keep set, and retried
    hundreds of times a second. Now a failing cycle sleeps its backoff and each event is charged once."""
    bucket = 11
    ids = publish(dsn, [(k, "t", {}) for k in keys_in_bucket(dsn, bucket, 3)])
    sink = WholeBatchFailure(set(ids))  # every batch with any of them fails
    settings = make_settings(dsn, "w", backoff_base_seconds=30.0, backoff_max_seconds=30.0)
    runner = runner_for(sink, pool, settings, {bucket})
    storm = threading.Event()

    def notify_storm() -> None:
        while not storm.is_set():
            runner.wake.set()
            time.sleep(0.001)

    threads = [threading.Thread(target=runner.run), threading.Thread(target=notify_storm)]
    for t in threads:
        t.start()
    try:
        deadline = time.monotonic() + 10
        while fetch_all(dsn, "SELECT count(*) FROM outbox.parked WHERE sink = %s AND attempts = 1", (SINK,)) != [(3,)]:
            assert time.monotonic() < deadline, f"the events were never charged ({sink.calls} calls)"
            time.sleep(0.05)
        # The one-at-a-time probes that follow the failed batch may still be finishing here (within the 6
        # calls below); what the 30 s backoff forbids is a second attempt of any event.
        time.sleep(1.0)
        assert fetch_all(dsn, "SELECT max(attempts) FROM outbox.parked WHERE sink = %s", (SINK,)) == [(1,)], \
            "parked with a 30 s backoff: nothing is retried meanwhile"
        assert sink.calls <= 6, f"{sink.calls} deliveries within the backoff"
    finally:
        storm.set()
        runner.draining.set()
        runner.wake.set()
        for t in threads:
            t.join(10)
    # The first batch (all three), then each event alone once.
    assert sink.calls <= 6, f"{sink.calls} deliveries: the failing cycle was retried without backing off"
    errors = fetch_all(dsn, "SELECT last_error FROM outbox.parked WHERE sink = %s", (SINK,))
    assert all("Boom" in e for (e,) in errors)


@pytest.mark.parametrize(("exc", "expected"), [
    (RuntimeError("handler bug"), True),
    (RecursionError("deep"), True),
    (psycopg.errors.QueryCanceled("statement timeout"), True),
    (psycopg.errors.IdleInTransactionSessionTimeout("idle in transaction"), True),
    (psycopg.OperationalError("server closed the connection unexpectedly"), False),
    (psycopg.errors.AdminShutdown("terminating connection due to administrator command"), False),
    (psycopg.errors.CannotConnectNow("the database system is starting up"), False),
])
def test_which_failures_can_be_an_events_doing(exc: BaseException, expected: bool) -> None:
    """A database outage says nothing about the events; a timeout that cut the batch short may."""
    assert points_at_events(exc) is expected


def test_an_observer_that_raises_fails_no_cycle(dsn: str, caplog: pytest.LogCaptureFixture) -> None:
    """A relay given an observer whose hooks raise delivers as usual: no cycle fails (a failed cycle backed
    off after every batch, and a raising cycle_failed ended the runner's thread), and each hook's failure is
    logged once, not per call."""
    observer = Broken()
    sink = RecordingSink("relay-o")
    worker = Worker(make_settings(dsn, "relay-o"), [sink], observer)
    ids: list[uuid.UUID] = []
    with caplog.at_level(logging.ERROR, logger="outbox_relay.observer"), running(worker):
        for round_ in range(5):  # several batches
            ids += publish(dsn, [(f"k{i}", "t", {"round": round_}) for i in range(20)])
            deadline = time.monotonic() + 30
            while not set(ids) <= set(sink.delivered_ids()) and time.monotonic() < deadline:
                time.sleep(0.05)
    assert set(ids) <= set(sink.delivered_ids())
    assert observer.calls["batch"] >= 5 and observer.calls["leases"] >= 1
    assert observer.calls["cycle_failed"] == 0, "a raising hook failed the runner's cycle"
    logged = [r for r in caplog.records if r.name == "outbox_relay.observer"]
    assert len(logged) == len(observer.calls), [r.getMessage() for r in logged]  # each hook once (within a minute)
