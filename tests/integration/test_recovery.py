"""Membership, hand-over, drain, recovery and retention against a real PostgreSQL (G8, G10, G11).

In-process ``Worker`` objects run the real threads (membership, housekeeping, one runner per sink)
with fast knobs; the sink is a ``RecordingSink`` that notes which worker delivered which bucket when,
so that "never processed by two workers at once" is checked on what actually happened.
"""

from __future__ import annotations

import contextlib
import threading
import time
import uuid
from collections import defaultdict
from collections.abc import Callable, Iterator
from typing import Any

import psycopg
import pytest
from psycopg_pool import ConnectionPool

from outbox_relay import store
from outbox_relay.housekeeping import Housekeeping, application_name
from outbox_relay.publish import Outbox
from outbox_relay.sinks.engine import Failure
from outbox_relay.store import StoredEvent
from outbox_relay.wakeups import WATCH_LOCK
from outbox_relay.worker import Worker
from tests.integration.relay_helpers import (  # noqa: F401  (pool_fixture provides `pool`)
    ALL_BUCKETS,
    DELIVER_ALL_SQL,
    SINK,
    TOPIC,
    Batch,
    RecordingSink,
    close_history,
    cursor_row,
    dead_letters,
    dedup_per_key,
    fetch_all,
    keys_in_bucket,
    make_settings,
    merged_attempts,
    owners,
    parked_ids,
    pool_fixture,
    publish,
    register,
    run_until,
    runner_for,
    settled,
    undelivered,
)
from tests.servers import wait_until

pytestmark = pytest.mark.pg15  # the PostgreSQL 15 step runs it too (scripts/test.sh)

# -- helpers ----------------------------------------------------------------------------------


class Workers:
    """Starts in-process workers and always drains them at the end of the test."""

    def __init__(self, dsn: str) -> None:
        self.dsn = dsn
        self.running: dict[str, Worker] = {}
        self.sinks: dict[str, RecordingSink] = {}

    def start(self, worker_id: str, **overrides: Any) -> RecordingSink:
        sink = self.sinks.setdefault(worker_id, RecordingSink(worker_id, hold=0.002))
        settings = make_settings(self.dsn, worker_id, **{"lease_seconds": 3.0, "heartbeat_seconds": 0.2,
                                                         "worker_ttl_seconds": 2.0, **overrides})
        worker = Worker(settings, sinks=[sink])
        assert worker.start()
        self.running[worker_id] = worker
        return sink

    def drain(self, worker_id: str) -> None:
        worker = self.running.pop(worker_id)
        worker.drain()
        worker.wait()

    def close(self) -> None:
        for w in self.running.values():
            w.drain()
        for w in self.running.values():
            w.wait()
        self.running.clear()


@pytest.fixture
def workers(dsn: str) -> Iterator[Workers]:
    ws = Workers(dsn)
    try:
        yield ws
    finally:
        ws.close()


class Producer:
    """Publishes small transactions over many keys in a thread until stopped; remembers the order per key."""

    def __init__(self, dsn: str, keys: int = 200, per_tx: int = 20, pause: float = 0.01) -> None:
        self.dsn, self.keys, self.per_tx, self.pause = dsn, [f"k{i}" for i in range(keys)], per_tx, pause
        self.published: dict[str, list[uuid.UUID]] = defaultdict(list)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self.error: BaseException | None = None

    def __enter__(self) -> Producer:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(10)
        assert self.error is None, self.error

    def _run(self) -> None:
        outbox = Outbox(default_topic=TOPIC)
        i = 0
        try:
            with psycopg.connect(self.dsn) as conn:
                while not self._stop.is_set():
                    batch = [{"key": self.keys[(i + j) % len(self.keys)], "type": "t", "payload": {"i": i + j}}
                             for j in range(self.per_tx)]
                    with conn.transaction():
                        ids = outbox.publish_many(conn, batch)
                    for e, p in zip(batch, ids, strict=True):
                        self.published[e["key"]].append(p.id)
                    i += self.per_tx
                    time.sleep(self.pause)
        except BaseException as exc:
            self.error = exc

    @property
    def ids(self) -> set[uuid.UUID]:
        return {i for ids in self.published.values() for i in ids}


def assert_no_concurrent_processing(batches: list[Batch]) -> None:
    """G8: for every bucket, no two workers' batches overlap in time."""
    per_bucket: dict[int, list[Batch]] = defaultdict(list)
    for b in batches:
        for bucket in b.buckets:
            per_bucket[bucket].append(b)
    for bucket, bs in per_bucket.items():
        bs.sort(key=lambda b: b.start)
        last_end: dict[str, float] = {}
        for b in bs:
            for worker, end in last_end.items():
                assert worker == b.worker or end <= b.start, (
                    f"bucket {bucket}: {b.worker} started a batch at {b.start:.4f} while {worker}'s batch "
                    f"ran until {end:.4f}")
            last_end[b.worker] = max(last_end.get(b.worker, 0.0), b.end)


def all_batches(sinks: Any) -> list[Batch]:
    out: list[Batch] = []
    for s in sinks:
        with s.lock:
            assert all(b.end for b in s.batches), "a batch never finished"
            out.extend(s.batches)
    return out


def lapses_total(dsn: str) -> int:
    return int(fetch_all(dsn, "SELECT coalesce(sum(lapses), 0) FROM outbox.cursors")[0][0])


# -- G8: minimal movement, one owner at a time -------------------------------------------------


def test_ring_handover_moves_few_buckets_and_never_runs_a_bucket_twice(dsn: str, workers: Workers) -> None:
    a, b, c = "relay-a", "relay-b", "relay-c"
    with Producer(dsn) as producer:
        workers.start(a)
        wait_until(lambda: set(owners(dsn).values()) == {a}, 10, message="relay-a owns every bucket")
        workers.start(b)
        wait_until(lambda: settled(dsn, [a, b]), 15, message="ownership to follow the assignment of two")
        split = sum(o == a for o in owners(dsn).values()) / 256
        assert split == 0.5, f"relay-a holds {split:.0%} of the buckets with two workers"
        before = owners(dsn)
        workers.start(c)
        wait_until(lambda: settled(dsn, [a, b, c]), 15, message="ownership to follow the assignment of three")
        after = owners(dsn)
        moved = {bk for bk in ALL_BUCKETS if before[bk] != after[bk]}
        assert {after[bk] for bk in moved} == {c}, "buckets may only move to the new worker"
        assert len(moved) in (85, 86), f"{len(moved)} of 256 buckets moved: a third is the ideal"
        time.sleep(0.3)  # keep publishing a little with three owners
    sinks = list(workers.sinks.values())
    wait_until(lambda: producer.ids <= {x.event_id for s in sinks for x in s.delivered()}, 20,
               message="every published event to be delivered")
    workers.close()  # drained: every batch has finished
    assert all(len(s.batches) > 3 for s in sinks), "every worker must have delivered something"
    assert_no_concurrent_processing(all_batches(sinks))
    assert all(bt.committed == bt.buckets for bt in all_batches(sinks)), "a graceful hand-over fenced a batch out"
    assert dedup_per_key(merged_attempts(sinks)) == dict(producer.published)
    assert lapses_total(dsn) == 0, "a hand-over of the assignment must not let leases expire"


# -- G10: graceful drain -----------------------------------------------------------------------


def test_drain_finishes_the_batch_in_flight_then_releases_every_lease(dsn: str) -> None:
    gate = threading.Event()
    sink = RecordingSink("relay-d", gate=gate)
    worker = Worker(make_settings(dsn, "relay-d", lease_seconds=3.0), sinks=[sink])
    assert worker.start()
    try:
        wait_until(lambda: set(owners(dsn).values()) == {"relay-d"}, 10)
        ids = publish(dsn, [(f"order-{i}", "t", {"i": i}) for i in range(30)])
        assert sink.entered.wait(10), "the batch never reached the sink"
        worker.drain()
        wait_until(lambda: fetch_all(dsn, "SELECT status FROM outbox.workers WHERE id = 'relay-d'")
                   == [("draining",)], 5, message="the worker to announce it is draining")
        time.sleep(0.3)  # several membership and housekeeping rounds while the batch is blocked
        assert set(owners(dsn).values()) == {"relay-d"}, "a lease was released while its batch was in flight"
        assert fetch_all(dsn, "SELECT count(*) FROM outbox.cursors WHERE snapshot::text <> '1:1:'") == [(0,)]
    finally:
        gate.set()
    worker.wait()
    assert len(sink.batches) == 1 and set(sink.batches[0].events) == set(ids)
    assert sink.delivered_ids() == set(ids), "the batch in flight must be finished, not dropped"
    rows = fetch_all(dsn, "SELECT count(*) FILTER (WHERE owner IS NOT NULL OR lease_expires_at IS NOT NULL), "
                          "sum(lapses), min(fence), max(fence) FROM outbox.cursors")
    assert rows == [(0, 0, 1, 1)], "every lease released (no expiry, no lapse)"
    assert fetch_all(dsn, "SELECT count(*) FROM outbox.workers") == [(0,)], "the registry row must be gone"
    assert undelivered(dsn) == 0, "the cursors must have advanced past the finished batch"


def test_a_drain_while_starting_reaches_the_runners_built_after_it(dsn: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """SIGTERM while start() registers the sinks: drain() found no runners yet, and the ones start() built
    next never drained (the relay ran on until its drain deadline stopped it hard)."""
    real = store.register_sink
    worker = Worker(make_settings(dsn, "relay-early", drain_seconds=60.0), sinks=[RecordingSink("relay-early")])

    def drained_meanwhile(conn: psycopg.Connection[Any], sink: str, kind: str, *args: Any) -> None:
        worker.drain()  # as the signal handler would, from another thread, before the runners exist
        real(conn, sink, kind, *args)

    monkeypatch.setattr(store, "register_sink", drained_meanwhile)
    try:
        assert worker.start() is True
        assert all(r.draining.is_set() for r in worker.runners), "a runner built after the drain is not draining"
        assert worker.sinks_done(10), "the sink threads did not end after the drain"
    finally:
        worker.stop_hard()
        worker.wait()


def test_a_connection_lost_while_starting_is_ridden_out(dsn: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A backend terminated (or the database restarting) between opening the pool and registering the
    sinks made the relay exit (found by the fault suite)."""
    real = store.register_sink
    failures = [psycopg.OperationalError("terminating connection due to administrator command")]

    def flaky(conn: psycopg.Connection[Any], sink: str, kind: str, *args: Any) -> None:
        if failures:
            raise failures.pop()
        real(conn, sink, kind, *args)

    monkeypatch.setattr(store, "register_sink", flaky)
    worker = Worker(make_settings(dsn, "relay-s"), sinks=[RecordingSink("relay-s")])
    try:
        assert worker.start() is True
        assert not failures and fetch_all(dsn, "SELECT count(*) FROM outbox.cursors") == [(256,)]
    finally:
        worker.stop_hard()
        worker.wait()


def test_a_heartbeat_in_flight_at_exit_does_not_bring_the_registry_row_back(
        dsn: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The membership thread's last heartbeat raced the exit's DELETE and left a 'draining' row behind."""
    real = store.heartbeat
    slow = threading.Event()

    def late_heartbeat(conn: psycopg.Connection[Any], worker: str, status: str, *args: Any) -> Any:
        if status == "draining":
            slow.set()
            time.sleep(0.6)  # still in flight when the worker leaves the registry
        return real(conn, worker, status, *args)

    monkeypatch.setattr(store, "heartbeat", late_heartbeat)
    worker = Worker(make_settings(dsn, "relay-x", heartbeat_seconds=0.1), sinks=[RecordingSink("relay-x")])
    assert worker.start()
    worker.drain()
    assert slow.wait(5), "the membership thread never sent a draining heartbeat"
    worker.wait()
    time.sleep(0.8)
    assert fetch_all(dsn, "SELECT id, status FROM outbox.workers") == [], "a stopped worker left its row behind"


def test_rolling_deploy_hands_every_bucket_over_without_expired_leases(dsn: str, workers: Workers) -> None:
    old_a, old_b, new_a, new_b = "relay-1", "relay-2", "relay-1b", "relay-2b"
    with Producer(dsn, pause=0.02) as producer:
        workers.start(old_a)
        workers.start(old_b)
        wait_until(lambda: settled(dsn, [old_a, old_b]), 15)
        for old, new in ((old_a, new_a), (old_b, new_b)):  # replace one process at a time
            workers.start(new)
            workers.drain(old)
            assert fetch_all(dsn, "SELECT count(*) FROM outbox.workers WHERE id = %s", (old,)) == [(0,)]
            live = sorted(workers.running)
            wait_until(lambda live=live: settled(dsn, live), 15)  # type: ignore[misc]
        assert set(owners(dsn).values()) == {new_a, new_b}
    sinks = list(workers.sinks.values())
    wait_until(lambda: producer.ids <= {x.event_id for s in sinks for x in s.delivered()}, 20)
    workers.close()
    assert lapses_total(dsn) == 0, "a rolling deploy must not let a lease expire"
    assert_no_concurrent_processing(all_batches(sinks))
    assert dedup_per_key(merged_attempts(sinks)) == dict(producer.published)


# -- G11: dead workers and housekeeping -------------------------------------------------------


def _ghost(conn: psycopg.Connection[Any], worker: str, silent_for: str) -> None:
    conn.execute("INSERT INTO outbox.workers (id, status, sinks, last_seen_at) "
                 "VALUES (%s, 'alive', %s, clock_timestamp() - %s::interval)", (worker, [SINK], silent_for))


def test_silent_worker_is_marked_dead_and_its_unexpired_leases_are_freed(
        dsn: str, pool: ConnectionPool[Any]) -> None:
    register(dsn)
    buckets = [1, 2, 3]
    ids = publish(dsn, [(k, "t", {}) for b in buckets for k in keys_in_bucket(dsn, b, 2)])
    with psycopg.connect(dsn, autocommit=True) as conn:
        _ghost(conn, "ghost", "30 seconds")  # it was SIGKILLed a while ago...
        assert set(store.acquire_leases(conn, SINK, "ghost", buckets, 3600.0)) == set(buckets)  # ...with long leases
        [membership] = store.heartbeat(conn, "live", "alive", [SINK], {}, ttl=2.0)
        assert membership.live == ["live"], "a silent worker is not live"
    settings = make_settings(dsn, "live", worker_ttl_seconds=2.0)
    result = Housekeeping(pool, settings).run_once()
    assert (result.ran, result.dead_workers, result.expired_leases) == (True, 1, 3)
    assert fetch_all(dsn, "SELECT id, status FROM outbox.workers ORDER BY id") == [("ghost", "dead"), ("live", "alive")]
    with psycopg.connect(dsn, autocommit=True) as conn:
        [membership] = store.heartbeat(conn, "live", "alive", [SINK], {}, ttl=3600 * 24.0)
        assert membership.live == ["live"], "a dead worker stays out of the assignment"
    for b in buckets:
        row = cursor_row(dsn, b)
        assert (row["owner"], row["lease_expires_at"], row["lapses"]) == (None, None, 1)
    again = Housekeeping(pool, settings).run_once()
    assert (again.dead_workers, again.expired_leases) == (0, 0)

    sink = RecordingSink("live")
    runner = runner_for(sink, pool, settings, buckets)
    run_until(runner, lambda: sink.delivered_ids() == set(ids))


def test_after_a_database_outage_nobody_is_declared_dead_until_heartbeats_resume(
        dsn: str, pool: ConnectionPool[Any]) -> None:
    """Every heartbeat, the housekeeper's own included, was held up by the outage: declaring everyone
    dead would free every lease and redeliver every batch in flight (found by the fault suite)."""
    settings = make_settings(dsn, "hk", worker_ttl_seconds=2.0)
    with psycopg.connect(dsn, autocommit=True) as conn:
        for worker in ("hk", "a", "b"):
            _ghost(conn, worker, "30 seconds")
    result = Housekeeping(pool, settings).run_once()
    assert result.ran and result.dead_workers == 0
    with psycopg.connect(dsn, autocommit=True) as conn:
        store.heartbeat(conn, "hk", "alive", [SINK], {})  # the housekeeper's heartbeats get through again
    assert Housekeeping(pool, settings).run_once().dead_workers == 2
    assert fetch_all(dsn, "SELECT id, status FROM outbox.workers ORDER BY id") == [
        ("a", "dead"), ("b", "dead"), ("hk", "alive")], "never itself"


def test_only_one_housekeeper_runs_at_a_time(dsn: str, pool: ConnectionPool[Any]) -> None:
    settings = make_settings(dsn, "hk", worker_ttl_seconds=2.0)
    with psycopg.connect(dsn, autocommit=True) as conn:
        _ghost(conn, "ghost", "30 seconds")
        store.heartbeat(conn, "hk", "alive", [SINK], {})  # the first housekeeper is a live worker
    results: dict[str, Any] = {}
    with psycopg.connect(dsn) as blocker:
        # Hold the ghost's registry row: the first housekeeper blocks inside its pass.
        blocker.execute("SELECT 1 FROM outbox.workers WHERE id = 'ghost' FOR UPDATE")
        first = threading.Thread(target=lambda: results.__setitem__("first", Housekeeping(pool, settings).run_once()))
        first.start()
        wait_until(lambda: fetch_all(dsn, "SELECT run_by FROM outbox.housekeeping WHERE finished_at < started_at")
                   == [("hk",)], 5, message="the first housekeeper to claim the pass")
        other = make_settings(dsn, "hk2", worker_ttl_seconds=2.0)
        second = Housekeeping(pool, other).run_once()  # concurrently, from this thread
        assert second.ran is False and second.dead_workers == 0
        blocker.rollback()
    first.join(10)
    assert results["first"].ran is True and results["first"].dead_workers == 1
    assert fetch_all(dsn, "SELECT status FROM outbox.workers WHERE id = 'ghost'") == [("dead",)]
    # The pass is over: the next one may run at once (tests), or an interval later (the relays' schedule).
    assert Housekeeping(pool, other).run_once().ran is True
    assert Housekeeping(pool, settings).run_once(min_gap_seconds=60).ran is False


def test_one_pass_per_interval_however_many_relays_try(dsn: str, pool: ConnectionPool[Any]) -> None:
    """32 relays that all come round in the same interval: one of them does the pass."""
    passes = [Housekeeping(pool, make_settings(dsn, f"r{i}")).run_once(min_gap_seconds=60) for i in range(32)]
    assert sum(p.ran for p in passes) == 1


def _passes(dsn: str, seconds: float) -> list[str]:
    """Who ran each housekeeping pass that finished in the next ``seconds`` (not the one finished before)."""
    seen: dict[Any, str] = {}
    before = fetch_all(dsn, "SELECT finished_at FROM outbox.housekeeping")
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        for run_by, finished in fetch_all(dsn, "SELECT run_by, finished_at FROM outbox.housekeeping "
                                               "WHERE finished_at >= started_at"):
            if (finished,) not in before:
                seen.setdefault(finished, run_by)
        time.sleep(0.02)
    return list(seen.values())


def test_the_first_live_member_runs_housekeeping_and_the_next_takes_over(workers: Workers, dsn: str) -> None:
    """Only a sink's first live member tries to claim every pass (one claim attempt per interval across the
    cluster, not one per relay); the others only take a pass that is several intervals overdue. When it
    leaves, the next member runs the passes."""
    workers.start("hk-b", housekeeping_seconds=0.3)  # started first: its tries come first
    workers.start("hk-a", housekeeping_seconds=0.3)
    wait_until(lambda: fetch_all(dsn, "SELECT count(*) FROM outbox.workers WHERE status = 'alive'") == [(2,)], 10,
               message="both relays registered")
    # hk-b, alone at first, ran passes until its heartbeat saw hk-a: once hk-a ran one, hk-a knows it is
    # first; one more heartbeat round (0.5 s) and hk-b knows too, however slow the machine's start was.
    wait_until(lambda: fetch_all(dsn, "SELECT run_by FROM outbox.housekeeping") == [("hk-a",)], 20, 0.02,
               "the first member ran a pass")
    time.sleep(0.5)
    ran = _passes(dsn, 4.0)  # 13 intervals, 2 or 3 standby attempts by hk-b
    assert len(ran) >= 5, ran
    assert set(ran) == {"hk-a"}, f"passes by {ran}: hk-b claimed passes although hk-a is the first member"
    workers.drain("hk-a")

    def only_hk_b() -> bool:
        ran = _passes(dsn, 1.5)
        return bool(ran) and set(ran) == {"hk-b"}

    wait_until(only_hk_b, 15, message="hk-b to run the passes once hk-a left")


def test_a_role_holding_the_old_advisory_lock_does_not_stop_housekeeping(
        dsn: str, pool: ConnectionPool[Any]) -> None:
    """Any role can take any advisory lock; the claim row can only be updated by roles granted it."""
    with psycopg.connect(dsn) as squatter:
        squatter.execute("SELECT pg_advisory_lock(%s)", (0x6F7574626F7801,))  # the key 0.1 used
        squatter.execute("SELECT pg_advisory_lock(0)")
        assert Housekeeping(pool, make_settings(dsn, "hk")).run_once().ran is True


def test_a_pass_left_by_a_dead_relay_is_taken_over_without_waiting(dsn: str, pool: ConnectionPool[Any]) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        _ghost(conn, "ghost", "30 seconds")  # claimed a pass, then was SIGKILLed mid-pass
        conn.execute("UPDATE outbox.housekeeping SET run_by = 'ghost', started_at = clock_timestamp()")
    assert Housekeeping(pool, make_settings(dsn, "hk", worker_ttl_seconds=2.0)).run_once().ran is True


def test_a_stalled_owners_open_transaction_is_terminated_with_its_lease(
        dsn: str, pool: ConnectionPool[Any]) -> None:
    """A relay stopped inside a projection transaction keeps its row locks until its transaction ends;
    the housekeeper that takes its expired lease back ends that transaction too."""
    register(dsn)
    with psycopg.connect(dsn, autocommit=True) as conn:
        store.heartbeat(conn, "stalled", "alive", [SINK], {})
        store.acquire_leases(conn, SINK, "stalled", [4], 1.0)
    stalled = psycopg.connect(dsn, application_name=application_name("stalled"))
    bystander = psycopg.connect(dsn, application_name="someone else")
    busy = psycopg.connect(dsn, application_name=application_name("stalled"))
    try:
        for conn in (stalled, bystander):  # both inside a transaction, holding a row lock
            conn.execute("SELECT 1 FROM outbox.sinks WHERE name = %s FOR SHARE", (SINK,))
        time.sleep(1.2)  # the lease (1 s) runs out; the transactions are now older than it
        busy.execute("SELECT 1")  # a transaction of the same (live) relay, younger than the lease
        settings = make_settings(dsn, "hk", lease_seconds=1.0, worker_ttl_seconds=60.0)
        result = Housekeeping(pool, settings).run_once()
        assert result.expired_leases == 1 and result.terminated_connections == 1
        with pytest.raises(psycopg.OperationalError):
            stalled.execute("SELECT 1")
        assert bystander.execute("SELECT 1").fetchone() == (1,), "only the stalled relay's connections"
        assert busy.execute("SELECT 1").fetchone() == (1,), "a live relay's younger transaction goes on"
    finally:
        stalled.close()
        bystander.close()
        busy.close()


def test_housekeeping_that_has_not_run_for_long_is_reported(
        dsn: str, pool: ConnectionPool[Any], caplog: pytest.LogCaptureFixture,
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("outbox_relay.housekeeping.OVERDUE_CHECK_SECONDS", 0.0)
    with psycopg.connect(dsn, autocommit=True) as conn:  # a pass in progress for ten minutes
        store.heartbeat(conn, "busy", "alive", [SINK], {})
        conn.execute("UPDATE outbox.housekeeping SET run_by = 'busy', started_at = clock_timestamp(), "
                     "finished_at = clock_timestamp() - interval '10 minutes'")
    hk = Housekeeping(pool, make_settings(dsn, "hk", housekeeping_seconds=1.0))
    with caplog.at_level("WARNING", logger="outbox_relay.housekeeping"):
        assert hk.run_once(min_gap_seconds=1.0).ran is False
    [message] = [r.getMessage() for r in caplog.records]
    assert "housekeeping last finished 600s ago (in progress on busy)" in message


def test_housekeeping_log_names_the_owners_of_expired_leases(
        dsn: str, pool: ConnectionPool[Any], caplog: pytest.LogCaptureFixture) -> None:
    register(dsn)
    with psycopg.connect(dsn, autocommit=True) as conn:
        _ghost(conn, "ghost", "30 seconds")
        store.acquire_leases(conn, SINK, "ghost", [1], 3600.0)
        store.heartbeat(conn, "hk", "alive", [SINK], {})  # the housekeeper is a live worker itself
    with caplog.at_level("WARNING", logger="outbox_relay.housekeeping"):
        assert Housekeeping(pool, make_settings(dsn, "hk")).run_once().expired_leases == 1
    [message] = [r.getMessage() for r in caplog.records if "expired leases" in r.getMessage()]
    assert "ghost" in message, message


# -- retention ---------------------------------------------------------------------------------


def test_retention_drops_only_partitions_every_sink_passed_and_keeps_parked_and_dead_as_copies(
        dsn: str, pool: ConnectionPool[Any]) -> None:
    """0014: retention removes whole partitions. One whose events every sink delivered goes; one that
    holds an event a sink has not delivered stays, all of it. 0015: one that holds a parked event or a
    dead letter goes too, those events kept as copies for their retries."""
    b1, b2 = 30, 31
    k_ok, k_park, k_dead = keys_in_bucket(dsn, b1, 3)
    (k_other,) = keys_in_bucket(dsn, b2, 1)
    # One partition per line: ok1 | park, behind | dead | other | ok2 (the one being written).
    (ok1,) = publish(dsn, [(k_ok, "t", {})])
    close_history(dsn)
    park, behind = publish(dsn, [(k_park, "t", {}), (k_park, "t", {})])
    close_history(dsn)
    (dead,) = publish(dsn, [(k_dead, "t", {})])
    close_history(dsn)
    (other,) = publish(dsn, [(k_other, "t", {})])
    close_history(dsn)
    (ok2,) = publish(dsn, [(k_ok, "t", {})])

    def fail(e: StoredEvent, n: int) -> Failure | None:
        if e.id == park:
            return Failure("retry much later")
        if e.id == dead:
            return Failure("never", retriable=False)
        return None

    settings = make_settings(dsn, "w", retention_seconds=0.0, backoff_base_seconds=60.0, backoff_max_seconds=60.0)
    first = RecordingSink("w", fail=fail)
    run_until(runner_for(first, pool, settings), lambda: first.delivered_ids() == {ok1, ok2, other})
    assert parked_ids(dsn) == {park, behind} and set(dead_letters(dsn)) == {dead}
    # A second sink that has passed bucket b1 only.
    second = RecordingSink("w", name="second")
    run_until(runner_for(second, pool, settings, {b1}), lambda: len(second.delivered_ids()) == 5)

    kept_all = {ok1, park, behind, dead, ok2, other}
    patient = make_settings(dsn, "w", retention_seconds=3600.0)
    assert Housekeeping(pool, patient).run_once().deleted_events == 0
    assert {r[0] for r in fetch_all(dsn, "SELECT id FROM outbox.events")} == kept_all

    result = Housekeeping(pool, settings).run_once()
    remaining = {r[0] for r in fetch_all(dsn, "SELECT id FROM outbox.events")}
    assert remaining == {other, ok2}, "kept: not passed by every sink, being written"
    assert result.deleted_events == 4
    assert {r[0] for r in fetch_all(dsn, "SELECT id FROM outbox.kept_events")} == {park, behind, dead}
    holds = dict(fetch_all(dsn, "SELECT p.name, outbox.partition_hold_v1(p.name, '0') FROM outbox.partitions p "
                                "WHERE p.range_name IS NOT NULL ORDER BY p.xid_from"))
    reasons = list(holds.values())
    assert reasons[0] == f"sink second has not delivered all of bucket {b2}", holds
    assert reasons[1] == "still being written", holds


# -- crash-loop isolation under real crashes ---------------------------------------------------


class Crash(BaseException):
    """Stands for the relay process dying while a batch is in flight (nothing checkpointed; a
    BaseException, so that no ``except Exception`` of the relay sees it)."""


def crash_cycles(dsn: str, pool: ConnectionPool[Any], buckets: set[int], crashes_on: Callable[[uuid.UUID], bool],
                 done: Callable[[], bool], max_cycles: int = 12, max_lapses: int = 2) -> list[RecordingSink]:
    """Run fresh workers on ``buckets`` one after another. A worker handed an event ``crashes_on`` dies
    mid-batch: its leases run out and housekeeping frees them. Stops when ``done()`` or after max_cycles."""
    sinks = []

    def retry_due() -> bool:  # a cycle that starts before a parked retry is due does nothing
        return bool(fetch_all(dsn, "SELECT coalesce(min(available_at) <= clock_timestamp(), true) "
                                   "FROM outbox.parked")[0][0])

    for i in range(max_cycles):
        worker = f"crasher-{i}"
        wait_until(retry_due, 5, message="the parked retry to be due")

        def fail(e: StoredEvent, n: int) -> Failure | None:
            if crashes_on(e.id):
                raise Crash(str(e.id))
            return None

        sink = RecordingSink(worker, fail=fail)
        sinks.append(sink)
        runner = runner_for(sink, pool, make_settings(dsn, worker, max_lapses=max_lapses, max_attempts=3), buckets)
        try:
            runner.run_once()
        except Crash:
            with psycopg.connect(dsn, autocommit=True) as conn:  # time passes: the dead worker's lease runs out
                conn.execute("UPDATE outbox.cursors SET lease_expires_at = clock_timestamp() - interval '1 ms' "
                             "WHERE owner = %s", (worker,))
            assert Housekeeping(pool, make_settings(dsn, "hk")).run_once().expired_leases >= 1
            continue
        else:
            with contextlib.suppress(Exception):
                runner.release_all()
        if done():
            break
    return sinks


def test_crash_loop_isolation_dead_letters_only_the_poison_event(dsn: str, pool: ConnectionPool[Any]) -> None:
    poison_bucket, innocent_bucket = 60, 61
    (k,) = keys_in_bucket(dsn, poison_bucket, 1)
    (other,) = keys_in_bucket(dsn, innocent_bucket, 1)
    poison, innocent = publish(dsn, [(k, "t", {"segfault": True}), (other, "t", {})])
    crash_cycles(dsn, pool, {poison_bucket, innocent_bucket}, lambda i: i == poison,
                 done=lambda: poison in dead_letters(dsn))
    assert poison in dead_letters(dsn), "the crash loop was never broken"
    assert innocent not in dead_letters(dsn), f"an innocent event was dead-lettered: {dead_letters(dsn)[innocent]}"


def test_lapses_of_an_idle_bucket_do_not_poison_its_next_event(dsn: str, pool: ConnectionPool[Any]) -> None:
    bucket = 62
    register(dsn)
    hk = Housekeeping(pool, make_settings(dsn, "hk"))
    for i in range(4):  # four workers holding the idle bucket die, one after another (max_lapses=2)
        with psycopg.connect(dsn, autocommit=True) as conn:
            assert store.acquire_leases(conn, SINK, f"gone-{i}", [bucket], 0.01)
        wait_until(lambda: fetch_all(dsn, "SELECT lease_expires_at < clock_timestamp() FROM outbox.cursors "
                                          "WHERE sink = %s AND bucket = %s", (SINK, bucket))[0][0], 5)
        assert hk.run_once().expired_leases == 1
    ids = publish(dsn, [(keys_in_bucket(dsn, bucket, 1)[0], "t", {"fine": True})])
    sink = RecordingSink("w")
    runner = runner_for(sink, pool, make_settings(dsn, "w", max_lapses=2), {bucket})
    run_until(runner, lambda: bool(sink.delivered_ids() or dead_letters(dsn)))
    assert dead_letters(dsn) == {}, f"a healthy event was dead-lettered: {dead_letters(dsn)}"
    assert sink.delivered_ids() == set(ids)


def test_a_parked_event_that_crashes_the_worker_is_eventually_isolated(dsn: str, pool: ConnectionPool[Any]) -> None:
    bucket = 63
    k, other = keys_in_bucket(dsn, bucket, 2)
    (poison,) = publish(dsn, [(k, "t", {})])
    # First attempt fails normally: the key is parked with a retry due almost at once.
    sink = RecordingSink("w", fail=lambda e, n: Failure("timeout"))
    runner = runner_for(sink, pool, make_settings(dsn, "w"), {bucket})
    runner.run_once()
    runner.release_all()
    assert parked_ids(dsn) == {poison}
    (later,) = publish(dsn, [(other, "t", {})])
    time.sleep(0.1)  # the retry is due
    sinks = crash_cycles(dsn, pool, {bucket}, lambda i: i == poison,
                         done=lambda: poison in dead_letters(dsn), max_cycles=10)
    assert poison in dead_letters(dsn), "the crash loop on the parked event was never broken"
    assert later in {x.event_id for s in sinks for x in s.delivered()}


def test_a_dead_relay_that_watched_for_commits_frees_watching_with_its_connections(
        dsn: str, pool: ConnectionPool[Any]) -> None:
    """A relay stopped (SIGSTOP, a partition) between two looks keeps an idle LISTEN connection that
    holds the watch lock (wakeups.py); the housekeeper that declares it dead ends that connection,
    so another relay can watch for commits."""
    register(dsn)
    with psycopg.connect(dsn, autocommit=True) as conn:
        _ghost(conn, "ghost", "30 seconds")
        store.acquire_leases(conn, SINK, "ghost", [4], 3600.0)
        store.heartbeat(conn, "hk", "alive", [SINK], {})  # the housekeeper's own heartbeats get through
    listener = psycopg.connect(dsn, autocommit=True, application_name=application_name("ghost"))
    try:
        assert listener.execute("SELECT pg_try_advisory_lock(%s)", (WATCH_LOCK,)).fetchone() == (True,)
        settings = make_settings(dsn, "hk", worker_ttl_seconds=2.0)
        result = Housekeeping(pool, settings).run_once()
        assert result.dead_workers == 1 and result.terminated_connections == 1
        with pytest.raises(psycopg.OperationalError):
            listener.execute("SELECT 1")
        with psycopg.connect(dsn, autocommit=True) as conn:
            assert conn.execute("SELECT pg_try_advisory_lock(%s)", (WATCH_LOCK,)).fetchone() == (True,)
    finally:
        listener.close()
