"""Issue 15: a handler that never returns, a sink that stops checking in, connection storms.

A handler that never returns is abandoned after ``--handler-timeout-seconds`` and charged to its
event (an attempt, backoff, dead letter after max attempts) while every other key keeps flowing; a
runner that stops making progress gives its buckets up and says so; a second sink in the same
process is never held back by it.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from typing import Any

import psycopg
import pytest
from psycopg_pool import ConnectionPool

from outbox_relay import cli, store, timelimit
from outbox_relay.errors import SinkStuck
from outbox_relay.metrics import OutboxGauges
from outbox_relay.relay import SinkRunner
from outbox_relay.sinks.engine import Commit
from outbox_relay.store import StoredEvent
from outbox_relay.worker import Worker
from projections import ProjectionEvent, projection
from projections.sink import ProjectionSink
from tests.integration.relay_helpers import (  # noqa: F401  (pool_fixture provides `pool`)
    ALL_BUCKETS,
    RecordingSink,
    dead_letters,
    fetch_all,
    make_settings,
    parked_ids,
    pool_fixture,
    publish,
    register,
    release_fixture,
    run_until,
    running,
)
from tests.servers import wait_until

LOG = "CREATE TABLE applied_log (n bigserial PRIMARY KEY, event_id uuid NOT NULL, key text NOT NULL)"
LOG_SQL = "INSERT INTO applied_log (event_id, key) VALUES (%s, %s)"


def applied(dsn: str) -> list[Any]:
    return [r[0] for r in fetch_all(dsn, "SELECT event_id FROM applied_log ORDER BY n")]


def start(sink: Any, pool: ConnectionPool[Any], dsn: str, **settings: Any) -> tuple[SinkRunner, threading.Thread]:
    with pool.connection() as conn:
        store.register_sink(conn, sink.name, sink.kind)
    r = SinkRunner(sink, pool, make_settings(dsn, "w", **settings))
    r.desired = set(ALL_BUCKETS)
    loop = threading.Thread(target=r.run, daemon=True)
    loop.start()
    return r, loop


@pytest.mark.parametrize("kind", ["sync", "async"])
def test_a_handler_that_never_returns_is_charged_to_its_event_and_other_keys_flow(
        dsn: str, pool: ConnectionPool[Any], release: threading.Event, kind: str) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(LOG)
    ids = publish(dsn, [("stuck", "OrderPlaced", {}), ("stuck", "OrderPlaced", {}),
                        *[(f"ok-{i}", "OrderPlaced", {}) for i in range(30)]])
    calls: list[int] = []

    def sync_handler(event: ProjectionEvent[Any], tx: Any) -> None:
        if event.id == ids[0]:
            calls.append(event.attempt)
            tx.execute("SELECT 1")
            release.wait()  # a socket without a timeout, a deadlock in a library...
        tx.execute(LOG_SQL, (event.id, event.key))

    async def async_handler(event: ProjectionEvent[Any], tx: psycopg.AsyncConnection[Any]) -> None:
        if event.id == ids[0]:
            calls.append(event.attempt)
            await tx.execute("SELECT 1")
            release.wait()  # blocks the event loop itself: no await can be cancelled
        await tx.execute(LOG_SQL, (event.id, event.key))

    p = projection("stuckable", events=["OrderPlaced"])(sync_handler if kind == "sync" else async_handler)
    sink = ProjectionSink(p, dsn, handler_timeout_seconds=1.0)
    r, loop = start(sink, pool, dsn, max_attempts=2, handler_timeout_seconds=1.0)
    try:
        # Every other key, and the stuck key's next event once its head is dead-lettered.
        wait_until(lambda: len(applied(dsn)) == len(ids) - 1, 60, 0.05, "every event but the stuck one applied")
        wait_until(lambda: ids[0] in dead_letters(dsn, "stuckable"), 30, 0.05, "the stuck event dead-lettered")
        attempts, error = dead_letters(dsn, "stuckable")[ids[0]]
        assert attempts == 2 and "did not return within 1s" in error, error
        assert calls == [1, 2]
        assert parked_ids(dsn, "stuckable") == set()
        assert sorted(applied(dsn)) == sorted(ids[1:]), "each other event exactly once"
        # The abandoned transactions were ended: nothing of theirs holds locks or the horizon.
        assert fetch_all(dsn, "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() AND "
                              "state LIKE 'idle in transaction%%'") == [(0,)]
    finally:
        r.draining.set()
        loop.join(30)
    assert not loop.is_alive()
    release.set()  # the abandoned handlers return: their batches must land nowhere
    time.sleep(0.5)
    assert sorted(applied(dsn)) == sorted(ids[1:])
    sink.close()


def test_a_batched_handler_that_never_returns_is_charged_to_the_event_whose_call_hangs(
        dsn: str, pool: ConnectionPool[Any], release: threading.Event) -> None:
    """A hang of a call with many events can not be pinned on one: the batch is walked again one event
    per call, and the call that hangs again is charged to its event alone."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(LOG)
    ids = publish(dsn, [("stuck", "OrderPlaced", {}), ("stuck", "OrderPlaced", {}),
                        *[(f"ok-{i}", "OrderPlaced", {}) for i in range(30)]])
    sizes: list[int] = []

    def handler(events: list[ProjectionEvent[Any]], tx: Any) -> None:
        sizes.append(len(events))
        if any(e.id == ids[0] for e in events):
            release.wait()
        for e in events:
            tx.execute(LOG_SQL, (e.id, e.key))

    p = projection("stuckable", events=["OrderPlaced"], batch=True)(handler)
    sink = ProjectionSink(p, dsn, handler_timeout_seconds=1.0)
    r, loop = start(sink, pool, dsn, max_attempts=2, handler_timeout_seconds=1.0)
    try:
        wait_until(lambda: len(applied(dsn)) == len(ids) - 1, 60, 0.05, "every event but the stuck one applied")
        wait_until(lambda: ids[0] in dead_letters(dsn, "stuckable"), 30, 0.05, "the stuck event dead-lettered")
        attempts, error = dead_letters(dsn, "stuckable")[ids[0]]
        assert attempts == 2 and "did not return within 1s" in error, error
        assert set(dead_letters(dsn, "stuckable")) == {ids[0]}, "only the event whose call hangs was charged"
        assert sorted(applied(dsn)) == sorted(ids[1:]), "each other event exactly once"
        assert sizes[0] > 1 and 1 in sizes, sizes
    finally:
        r.draining.set()
        loop.join(30)
    assert not loop.is_alive()
    release.set()
    time.sleep(0.5)
    assert sorted(applied(dsn)) == sorted(ids[1:])
    sink.close()


class BlockingSink(RecordingSink):
    """A sink written against the contract that blocks on key "block" without ever checking its stop flag."""

    def __init__(self, *, release: threading.Event, **options: Any) -> None:
        super().__init__(**options)
        self.release = release
        self.blocked = threading.Event()

    def deliver(self, events: Sequence[StoredEvent], fences: dict[int, int], commit: Commit,
                abort: threading.Event) -> set[int]:
        if any(e.key == "block" for e in events):
            self.blocked.set()
            self.release.wait()
            raise RuntimeError("released at teardown")
        return super().deliver(events, fences, commit, abort)


def test_a_stuck_sink_gives_its_buckets_up_says_so_and_holds_no_other_sink_back(
        dsn: str, release: threading.Event) -> None:
    """Issue 15: lease renewal depends on the runner making progress. Relay A's "blocky" sink blocks
    forever in a call that never checks its stop flag; A's other sink delivers everything, A's
    readiness says the sink is stuck, and relay B takes blocky's buckets over and delivers them."""
    ids = set(publish(dsn, [("block", "T", {}), *[(f"k-{i}", "T", {}) for i in range(30)]]))
    for name in ("blocky", "other"):
        register(dsn, name)
    knobs: dict[str, Any] = {"handler_timeout_seconds": 1.0, "drain_seconds": 1.0}
    stuck = BlockingSink(worker="a", name="blocky", release=release)
    other = RecordingSink(worker="a", name="other")
    a = Worker(make_settings(dsn, "a", **knobs), [stuck, other])
    taker = RecordingSink(worker="b", name="blocky")
    with running(a):
        wait_until(stuck.blocked.is_set, 30, 0.05, "A's blocky sink blocked")
        wait_until(lambda: other.delivered_ids() >= ids, 30, 0.05, "A's other sink delivering everything")
        wait_until(lambda: any("blocky: stuck" in p for p in a.readiness()), 30, 0.05, "A's readiness saying so")
        gauges = {tuple(s.labels.values()): s.value for m in OutboxGauges(a, dsn, 15.0).collect()
                  if m.name == "outbox_relay_sink_stuck" for s in m.samples}
        assert gauges == {("blocky",): 1.0, ("other",): 0.0}, gauges
        with running(Worker(make_settings(dsn, "b", **knobs), [taker])):
            wait_until(lambda: taker.delivered_ids() >= ids, 60, 0.05, "B delivering the stuck sink's events")
        assert not a.runners[0].leases.snapshot(), "A holds none of blocky's buckets"


def test_a_head_skipped_while_an_attempt_of_it_lands_is_not_applied_twice_after_a_retry(
        dsn: str, pool: ConnectionPool[Any], capsys: pytest.CaptureFixture[str]) -> None:
    """Issue 15, probe 5: the relay is applying a parked head again (the attempt will succeed) when the
    operator skips it; then `dead-letters retry --all` puts it back. Skipping fences the bucket, so the
    attempt in flight lands nothing: the event's effect is applied exactly once."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(LOG)
    ids = publish(dsn, [("k", "OrderPlaced", {}), ("k", "OrderPlaced", {})])
    entered, go = threading.Event(), threading.Event()

    def handler(event: ProjectionEvent[Any], tx: Any) -> None:
        if event.id == ids[0]:
            if event.attempt == 1:
                raise RuntimeError("fails once")
            entered.set()
            go.wait(30)  # the retry in flight: the operator skips the head now
        tx.execute(LOG_SQL, (event.id, event.key))

    sink = ProjectionSink(projection("skippable", events=["OrderPlaced"])(handler), dsn)
    with pool.connection() as conn:
        store.register_sink(conn, sink.name, sink.kind)
    r = SinkRunner(sink, pool, make_settings(dsn, "w", backoff_base_seconds=0.01, backoff_max_seconds=0.01))
    r.desired = set(ALL_BUCKETS)
    in_flight = threading.Thread(target=lambda: run_until(r, entered.is_set, timeout=20), daemon=True)
    in_flight.start()
    try:
        assert entered.wait(20), "the retry did not start"
        assert cli.main(["keys", "skip", "k", "--dsn", dsn, "--sink", "skippable"]) == cli.EXIT_OK
    finally:
        go.set()
        in_flight.join(20)
    assert cli.main(["dead-letters", "retry", "--all", "--dsn", dsn, "--sink", "skippable"]) == cli.EXIT_OK
    run_until(r, lambda: len(applied(dsn)) >= 2 and not parked_ids(dsn, "skippable"), timeout=20)
    time.sleep(0.2)
    r.run_once()
    # Skipped, then retried: the key moved on without its head, which lands last; each effect once.
    assert applied(dsn) == [ids[1], ids[0]], "the skipped head's effect landed twice"
    assert dead_letters(dsn, "skippable") == {}
    capsys.readouterr()
    sink.close()


def test_past_the_cap_of_abandoned_handlers_the_runner_stops_the_relay(
        dsn: str, pool: ConnectionPool[Any], release: threading.Event, monkeypatch: pytest.MonkeyPatch) -> None:
    """Threads left to handlers that never return are capped (timelimit.MAX_ABANDONED per process): past it the
    runner stops with SinkStuck, which stops the relay (`outbox-relay run` exits 4) and a fresh process
    takes over; the attempts were counted already."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(LOG)
    ids = publish(dsn, [("stuck", "OrderPlaced", {})])

    def handler(event: ProjectionEvent[Any], tx: Any) -> None:
        release.wait()

    monkeypatch.setattr(timelimit, "MAX_ABANDONED", timelimit.abandoned_threads() + 1)
    sink = ProjectionSink(projection("capped", events=["OrderPlaced"])(handler), dsn, handler_timeout_seconds=0.5)
    r, loop = start(sink, pool, dsn, max_attempts=10, handler_timeout_seconds=0.5)
    try:
        loop.join(60)
        assert not loop.is_alive(), "the runner did not stop"
        assert isinstance(r.fatal, SinkStuck), r.fatal
        # Both abandoned calls were charged before it stopped.
        assert fetch_all(dsn, "SELECT attempts FROM outbox.parked WHERE event_id = %s", (ids[0],)) == [(2,)]
    finally:
        r.draining.set()
        loop.join(10)
        sink.close()


class FailingSink(RecordingSink):
    """A sink whose every batch fails as a whole with a connection error (not an event's fault)."""

    def deliver(self, events: Sequence[StoredEvent], fences: dict[int, int], commit: Commit,
                abort: threading.Event) -> set[int]:
        raise psycopg.OperationalError("connection to the downstream lost")


def test_a_runner_whose_every_cycle_fails_gives_its_buckets_up(dsn: str) -> None:
    """Issue 15: a runner that can not make progress while the database answers its relay (every cycle
    fails) gives its buckets up after --handler-timeout-seconds, so another relay delivers them."""
    ids = set(publish(dsn, [(f"k-{i}", "T", {}) for i in range(20)]))
    register(dsn, "downstream")
    knobs: dict[str, Any] = {"handler_timeout_seconds": 1.0, "drain_seconds": 1.0}
    a = Worker(make_settings(dsn, "a", **knobs), [FailingSink(worker="a", name="downstream")])
    taker = RecordingSink(worker="b", name="downstream")
    with running(a):
        wait_until(lambda: any("every cycle failed" in p for p in a.readiness()), 30, 0.05, "A saying it is stuck")
        with running(Worker(make_settings(dsn, "b", **knobs), [taker])):
            wait_until(lambda: taker.delivered_ids() >= ids, 60, 0.05, "B delivering A's events")
