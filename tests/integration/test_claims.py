"""Claims, leases and fencing against a real PostgreSQL (G2, G4, G5, G9, G11 and part 8's five).

Leases are taken with ``store.acquire_leases`` or by a ``SinkRunner`` whose ``desired`` buckets the
test sets (what the membership thread would take from the stored assignment); no membership thread runs, so
nothing renews a lease unless the test does.
"""

from __future__ import annotations

import threading
from collections import Counter
from typing import Any

import psycopg
import pytest
from psycopg_pool import ConnectionPool

from outbox_relay import store
from outbox_relay.housekeeping import Housekeeping
from outbox_relay.positions import ORIGIN, Cursor
from outbox_relay.publish import Outbox
from outbox_relay.relay import DeliveryGate
from outbox_relay.sinks.engine import Failure
from outbox_relay.store import Checkpoint, StoredEvent
from tests.integration.relay_helpers import (  # noqa: F401  (pool_fixture provides `pool`)
    ALL_BUCKETS,
    SINK,
    TOPIC,
    RecordingSink,
    cursor_row,
    dead_letters,
    fetch,
    fetch_all,
    keys_in_bucket,
    leased,
    make_settings,
    parked_ids,
    pool_fixture,
    publish,
    register,
    run_until,
    runner_for,
    through,
    undelivered,
)
from tests.servers import wait_until

pytestmark = pytest.mark.pg15  # the PostgreSQL 15 step runs it too (scripts/test.sh)


def _lease_expired(dsn: str, bucket: int) -> bool:
    rows = fetch_all(dsn, "SELECT lease_expires_at < clock_timestamp() FROM outbox.cursors "
                          "WHERE sink = %s AND bucket = %s", (SINK, bucket))
    return bool(rows[0][0])


# -- part 8 (1): producer idempotency -----------------------------------------------------------


def test_same_idempotency_key_twice_stores_one_event(dsn: str) -> None:
    outbox = Outbox(default_topic=TOPIC)
    with psycopg.connect(dsn) as conn:
        first = outbox.publish(conn, type="order.created", key="order-1", payload={"n": 1},
                               idempotency_key="request-1")
    with psycopg.connect(dsn) as conn:  # the producer retries in a new transaction
        again = outbox.publish(conn, type="order.created", key="order-1", payload={"n": 1},
                               idempotency_key="request-1")
    assert first.created is True
    assert again.created is False and again.id == first.id
    rows = fetch_all(dsn, "SELECT id, payload FROM outbox.events WHERE idempotency_key = 'request-1'")
    assert rows == [(first.id, {"n": 1})]
    assert fetch_all(dsn, "SELECT count(*) FROM outbox.events") == [(1,)]


# -- part 8 (2) / G4: exclusive claim -----------------------------------------------------------


def test_concurrent_acquire_gives_each_bucket_to_exactly_one_worker(dsn: str) -> None:
    register(dsn)
    threads_n, rounds = 8, 4
    conns = [psycopg.connect(dsn, autocommit=True) for _ in range(threads_n)]
    try:
        for round_ in range(1, rounds + 1):
            barrier = threading.Barrier(threads_n)
            results: list[dict[int, store.Acquired]] = [{} for _ in range(threads_n)]
            errors: list[BaseException] = []

            def claim(i: int, barrier: threading.Barrier = barrier,
                      results: list[dict[int, store.Acquired]] = results,
                      errors: list[BaseException] = errors) -> None:
                try:
                    barrier.wait(10)
                    results[i] = store.acquire_leases(conns[i], SINK, f"w{i}", ALL_BUCKETS, 30.0)
                except BaseException as exc:  # surfaced below
                    errors.append(exc)

            threads = [threading.Thread(target=claim, args=(i,)) for i in range(threads_n)]
            for t in threads:
                t.start()
            for t in threads:
                t.join(30)
            assert not errors
            claimed = Counter(b for r in results for b in r)
            assert set(claimed) == set(ALL_BUCKETS), "every bucket is claimed by someone"
            assert [b for b, n in claimed.items() if n > 1] == [], "a bucket was acquired by two workers"
            expected_owner = {b: f"w{i}" for i, r in enumerate(results) for b in r}
            db = {b: (o, f) for b, o, f in fetch_all(
                dsn, "SELECT bucket, owner, fence FROM outbox.cursors WHERE sink = %s", (SINK,))}
            assert {b: o for b, (o, _) in db.items()} == expected_owner
            assert {f for _, f in db.values()} == {round_}, "each acquisition bumps the fence once"
            assert all(a.fence == round_ for r in results for a in r.values())
            # A second claim while the leases are live gets nothing.
            assert store.acquire_leases(conns[0], SINK, "latecomer", ALL_BUCKETS, 30.0) == {}
            for i, r in enumerate(results):
                released = store.release_leases(conns[i], SINK, f"w{i}", {b: a.fence for b, a in r.items()})
                assert released == set(r)
    finally:
        for c in conns:
            c.close()


def test_fetch_reads_only_buckets_leased_by_the_caller(dsn: str) -> None:
    register(dsn)
    mine, free = 7, 8
    ids_mine = publish(dsn, [(k, "t", {"i": i}) for i, k in enumerate(keys_in_bucket(dsn, mine, 3) * 2)])
    publish(dsn, [(k, "t", {}) for k in keys_in_bucket(dsn, free, 3)])
    with psycopg.connect(dsn, autocommit=True) as conn:
        assert set(store.acquire_leases(conn, SINK, "a", [mine], 30.0)) == {mine}
        events = fetch(conn, SINK, "b", {mine: 100, free: 100}).events
        assert events == [], "a worker read a bucket leased by another, or one it never leased"
        read = fetch(conn, SINK, "a", {mine: 100, free: 100})
    assert [e.id for e in read.events] == ids_mine, "only the caller's bucket, in publish order"
    assert {e.bucket for e in read.events} == {mine}
    assert all(read.now.visible(e.xid) for e in read.events)


# -- part 8 (3) / G11: an expired lease is recovered -------------------------------------------


def test_expired_lease_is_freed_by_housekeeping_and_taken_over_with_the_next_fence(
        dsn: str, pool: ConnectionPool[Any]) -> None:
    bucket = 42
    sink_a = RecordingSink("worker-a")
    runner_a = runner_for(sink_a, pool, make_settings(dsn, "worker-a", lease_seconds=0.3), {bucket})
    runner_a.rebalance()  # leases the bucket; nothing renews it from here on (worker A is stuck)
    assert cursor_row(dsn, bucket)["owner"] == "worker-a"
    assert cursor_row(dsn, bucket)["fence"] == 1
    ids = publish(dsn, [(k, "t", {}) for k in keys_in_bucket(dsn, bucket, 4)])

    wait_until(lambda: _lease_expired(dsn, bucket), 5.0, message="the lease to expire")
    settings_b = make_settings(dsn, "worker-b")
    result = Housekeeping(pool, settings_b).run_once()
    assert result.ran and result.expired_leases == 1
    row = cursor_row(dsn, bucket)
    assert (row["owner"], row["lease_expires_at"], row["lapses"], row["fence"]) == (None, None, 1, 1)
    assert row["cursor"] == Cursor(ORIGIN), "expiry must not move the cursor"
    # Other buckets were never leased: housekeeping left them alone.
    assert fetch_all(dsn, "SELECT count(*) FROM outbox.cursors WHERE lapses <> 0") == [(1,)]

    sink_b = RecordingSink("worker-b")
    runner_b = runner_for(sink_b, pool, settings_b, {bucket})
    run_until(runner_b, lambda: sink_b.delivered_ids() == set(ids))
    assert [a.event_id for a in sink_b.delivered()] == ids
    assert {a.fence for a in sink_b.attempts} == {2}
    row = cursor_row(dsn, bucket)
    assert (row["owner"], row["fence"], row["lapses"]) == ("worker-b", 2, 0)
    assert undelivered(dsn) == 0, "the cursor passed every event"

    # The stuck worker wakes up: it reads and delivers nothing.
    runner_a.run_once()
    assert sink_a.attempts == []


# -- part 8 (4) / G5: a worker that lost its lease writes nothing -------------------------------


def _snapshot(dsn: str) -> dict[str, Any]:
    return {
        "cursors": fetch_all(dsn, "SELECT bucket, snapshot::text, target::text, after_xid::text, after_seq, owner, "
                                  "fence, lease_expires_at, "
                                  "lapses FROM outbox.cursors ORDER BY sink, bucket"),
        "parked": fetch_all(dsn, "SELECT * FROM outbox.parked"),
        "dead": fetch_all(dsn, "SELECT * FROM outbox.dead_letters"),
    }


def test_stale_owner_cannot_checkpoint_park_dead_letter_renew_or_release(dsn: str) -> None:
    register(dsn)
    bucket = 3
    k1, k2 = keys_in_bucket(dsn, bucket, 2)
    publish(dsn, [(k1, "t", {"n": 1}), (k1, "t", {"n": 2}), (k2, "t", {"n": 3})])
    with psycopg.connect(dsn, autocommit=True) as a, psycopg.connect(dsn, autocommit=True) as b:
        assert leased(store.acquire_leases(a, SINK, "a", [bucket], 0.3)) == {bucket: (1, 0)}
        events = fetch(a, SINK, "a", {bucket: 100}).events
        assert len(events) == 3
        wait_until(lambda: _lease_expired(dsn, bucket), 5.0, message="A's lease to expire")
        # Expired but nobody took it over yet: A already can neither complete nor renew.
        expired = _snapshot(dsn)
        late = Checkpoint(fences={bucket: 1}, advance={bucket: through(events[-1])},
                          dead=[(events[0], 1, "too late")])
        assert store.checkpoint(a, SINK, "a", late) == set()
        assert store.renew_leases(a, SINK, "a", {bucket: 1}, 30.0) == set()
        assert _snapshot(dsn) == expired
        # B takes the expired lease over directly (no housekeeping in between): fence 2, one lapse.
        assert leased(store.acquire_leases(b, SINK, "b", [bucket], 30.0)) == {bucket: (2, 1)}
        before = _snapshot(dsn)

        stale = Checkpoint(fences={bucket: 1}, advance={bucket: through(events[-1])},
                           park=[(events[0], 1, 0.0, "stale failure")], done=[events[1]],
                           dead=[(events[2], 9, "stale poison")])
        assert store.checkpoint(a, SINK, "a", stale) == set()
        assert store.renew_leases(a, SINK, "a", {bucket: 1}, 30.0) == set()
        assert store.release_leases(a, SINK, "a", {bucket: 1}) == set()
        # Even with the current fence, a worker that is not the owner writes nothing.
        stale.fences = {bucket: 2}
        assert store.checkpoint(a, SINK, "a", stale) == set()
        assert store.release_leases(a, SINK, "a", {bucket: 2}) == set()
        assert _snapshot(dsn) == before, "a fenced-out worker changed cursors, parked rows or dead letters"
        assert cursor_row(dsn, bucket)["owner"] == "b"

        # Control: the current owner under its fence does move the cursor.
        assert store.checkpoint(b, SINK, "b", Checkpoint(fences={bucket: 2},
                                                         advance={bucket: through(events[-1])})) == {bucket}
        assert cursor_row(dsn, bucket)["cursor"] == through(events[-1])


def test_an_older_fence_of_the_same_worker_is_rejected(dsn: str) -> None:
    """Owner names alone are not enough: the same worker re-acquiring gets a new generation."""
    register(dsn)
    bucket = 9
    publish(dsn, [(k, "t", {}) for k in keys_in_bucket(dsn, bucket, 2)])
    with psycopg.connect(dsn, autocommit=True) as conn:
        assert leased(store.acquire_leases(conn, SINK, "a", [bucket], 0.2)) == {bucket: (1, 0)}
        events = fetch(conn, SINK, "a", {bucket: 100}).events
        wait_until(lambda: _lease_expired(dsn, bucket), 5.0)
        assert leased(store.acquire_leases(conn, SINK, "a", [bucket], 30.0)) == {bucket: (2, 1)}
        old = Checkpoint(fences={bucket: 1}, advance={bucket: through(events[-1])},
                         dead=[(events[0], 1, "from the old generation")])
        assert store.checkpoint(conn, SINK, "a", old) == set()
        assert store.renew_leases(conn, SINK, "a", {bucket: 1}, 30.0) == set()
        assert store.release_leases(conn, SINK, "a", {bucket: 1}) == set()
    row = cursor_row(dsn, bucket)
    assert (row["cursor"], row["owner"], row["fence"]) == (Cursor(ORIGIN), "a", 2)
    assert dead_letters(dsn) == {}


def test_runner_whose_lease_was_taken_over_mid_batch_discards_its_batch(
        dsn: str, pool: ConnectionPool[Any]) -> None:
    bucket = 77
    k1, k2 = keys_in_bucket(dsn, bucket, 2)
    ids = publish(dsn, [(k1, "t", {"n": 1}), (k2, "t", {"n": 2}), (k1, "t", {"n": 3})])
    gate = threading.Event()
    # A stalls inside its batch; when it resumes it fails k1's head (it would park k1).
    sink_a = RecordingSink("worker-a", gate=gate, fail=lambda e, n: Failure("a: boom") if e.id == ids[0] else None)
    runner_a = runner_for(sink_a, pool, make_settings(dsn, "worker-a", lease_seconds=0.3), {bucket})
    a_result: list[int] = []
    t = threading.Thread(target=lambda: a_result.append(runner_a.run_once()))
    t.start()
    try:
        assert sink_a.entered.wait(10)
        wait_until(lambda: _lease_expired(dsn, bucket), 5.0)
        sink_b = RecordingSink("worker-b")
        runner_b = runner_for(sink_b, pool, make_settings(dsn, "worker-b"), {bucket})
        run_until(runner_b, lambda: sink_b.delivered_ids() == set(ids))
        after_b = cursor_row(dsn, bucket)
    finally:
        gate.set()
        t.join(10)
    assert a_result == [3]
    assert runner_a.leases.snapshot() == {}, "the fenced-out runner must forget the bucket"
    row = cursor_row(dsn, bucket)
    assert (row["cursor"], row["owner"], row["fence"]) == (after_b["cursor"], "worker-b", 2)
    assert parked_ids(dsn) == set() and dead_letters(dsn) == {}
    runner_a.run_once()  # next cycle: A wants the bucket but it is B's
    assert len(sink_a.batches) == 1


# -- part 8 (5) / G9: poison isolation ----------------------------------------------------------


def test_event_failing_max_attempts_is_dead_lettered_and_unblocks_its_key(
        dsn: str, pool: ConnectionPool[Any]) -> None:
    bucket = 11
    k, other = keys_in_bucket(dsn, bucket, 2)
    poison, k2, x, k3 = publish(dsn, [(k, "bad", {}), (k, "t", {"n": 2}), (other, "t", {}), (k, "t", {"n": 3})])

    def fail(e: StoredEvent, n: int) -> Failure | None:
        return Failure(f"handler crashed (attempt {n + 1})") if e.id == poison else None

    sink = RecordingSink("w", fail=fail)
    runner = runner_for(sink, pool, make_settings(dsn, "w", max_attempts=3), {bucket})
    run_until(runner, lambda: {k2, x, k3} <= sink.delivered_ids())

    assert dead_letters(dsn) == {poison: (3, "handler crashed (attempt 3)")}
    row = fetch_all(dsn, "SELECT partition_key, bucket FROM outbox.dead_letters WHERE event_id = %s", (poison,))
    assert row == [(k, bucket)]
    seq = [(a.event_id, a.ok) for a in sink.attempts]
    assert [ok for i, ok in seq if i == poison] == [False, False, False]
    last_poison = max(n for n, (i, _) in enumerate(seq) if i == poison)
    first_k2 = min(n for n, (i, _) in enumerate(seq) if i == k2)
    assert first_k2 > last_poison, "a later event of the key was attempted before its head was dead-lettered"
    assert [a.event_id for a in sink.delivered() if a.key == k] == [k2, k3]
    second_poison = [n for n, (i, _) in enumerate(seq) if i == poison][1]
    assert seq.index((x, True)) < second_poison, "the other key waited for the failing one"
    assert parked_ids(dsn) == set()
    runner.run_once()
    assert dead_letters(dsn) == {poison: (3, "handler crashed (attempt 3)")}
    assert len(sink.attempts_of(poison)) == 3


# -- crash-loop isolation ----------------------------------------------------------------------


def _set_lapses(dsn: str, bucket: int, lapses: int) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("UPDATE outbox.cursors SET lapses = %s WHERE sink = %s AND bucket = %s", (lapses, SINK, bucket))


def test_suspect_bucket_counts_each_attempt_before_making_it_alone(dsn: str, pool: ConnectionPool[Any]) -> None:
    """A bucket that lapsed max_lapses times delivers its head alone, with the attempt already
    recorded in outbox.parked: if the process dies now, the attempt counts against that event, and so do
    the deaths that made the bucket a suspect (charged from the first)."""
    bucket, max_lapses = 5, 3
    k, other = keys_in_bucket(dsn, bucket, 2)
    head, nxt, third = publish(dsn, [(k, "t", {"n": 1}), (k, "t", {"n": 2}), (other, "t", {"n": 3})])
    seen_while_delivering: list[tuple[Any, ...]] = []

    def look(e: StoredEvent, n: int) -> Failure | None:
        seen_while_delivering.extend(fetch_all(
            dsn, "SELECT event_id, attempts, last_error FROM outbox.parked WHERE sink = %s", (SINK,)))
        return None

    sink = RecordingSink("w", fail=look)
    runner = runner_for(sink, pool, make_settings(dsn, "w", max_lapses=max_lapses), {bucket})
    _set_lapses(dsn, bucket, max_lapses)
    runner.run_once()
    assert [a.event_id for a in sink.attempts] == [head], "a suspect bucket's head is delivered alone"
    [(event_id, attempts, error)] = seen_while_delivering
    assert (event_id, attempts) == (head, 1 + max_lapses) and "counted as a failed attempt" in error
    assert parked_ids(dsn) == set(), "the probe succeeded: its event left the park"
    assert cursor_row(dsn, bucket)["lapses"] == max_lapses, "one probe does not end the isolation"

    run_until(runner, lambda: sink.delivered_ids() == {head, nxt, third})
    assert [a.event_id for a in sink.delivered()] == [head, nxt, third]
    assert dead_letters(dsn) == {}


def test_an_event_that_crashed_the_relay_max_attempts_times_is_dead_lettered_with_the_reason(
        dsn: str, pool: ConnectionPool[Any]) -> None:
    bucket, max_attempts = 7, 3
    k, other = keys_in_bucket(dsn, bucket, 2)
    poison, behind, fine = publish(dsn, [(k, "t", {}), (k, "t", {}), (other, "t", {})])
    settings = make_settings(dsn, "w", max_lapses=1, max_attempts=max_attempts)
    # The lapse is one death (of a batch the poison was in), charged to it with its first alone attempt: the
    # owners after it die max_attempts - 1 times with the poison in flight alone.
    for i in range(max_attempts - 1):
        runner = runner_for(RecordingSink(f"w{i}", fail=_crash_on(poison)), pool, settings, {bucket})
        _set_lapses(dsn, bucket, 1)
        with pytest.raises(Crash):
            runner.run_once()
        attempts = fetch_all(dsn, "SELECT attempts FROM outbox.parked WHERE event_id = %s", (poison,))
        assert attempts == [(i + 2,)]
        _expire_all(dsn)
        with psycopg.connect(dsn, autocommit=True) as conn:  # its retry is due now
            conn.execute("UPDATE outbox.parked SET available_at = clock_timestamp()")
    sink = RecordingSink("survivor")
    runner = runner_for(sink, pool, settings, {bucket})
    run_until(runner, lambda: sink.delivered_ids() == {behind, fine})
    assert poison not in {a.event_id for a in sink.attempts}, "an exhausted event is not delivered again"
    letters = dead_letters(dsn)
    assert set(letters) == {poison}
    assert letters[poison][0] == max_attempts and "counted as a failed attempt" in letters[poison][1]
    assert [a.event_id for a in sink.delivered()] in ([behind, fine], [fine, behind])


def test_a_suspect_bucket_ramps_back_to_full_batches(dsn: str, pool: ConnectionPool[Any]) -> None:
    bucket = 6
    ids = publish(dsn, [(k, "t", {}) for k in keys_in_bucket(dsn, bucket, 12)])
    sink = RecordingSink("w")
    runner = runner_for(sink, pool, make_settings(dsn, "w", max_lapses=3, batch_size=8), {bucket})
    _set_lapses(dsn, bucket, 3)
    run_until(runner, lambda: sink.delivered_ids() == set(ids))
    assert [a.event_id for a in sink.attempts] == ids
    assert [len(b.events) for b in sink.batches] == [1, 2, 4, 5], "1, 2, 4, then a full batch again"
    assert cursor_row(dsn, bucket)["lapses"] == 0, "back to normal: lapses reset"
    assert dead_letters(dsn) == {} and parked_ids(dsn) == set()


def test_an_idle_suspect_bucket_is_healthy_at_once(dsn: str, pool: ConnectionPool[Any]) -> None:
    bucket = 8
    sink = RecordingSink("w")
    runner = runner_for(sink, pool, make_settings(dsn, "w", max_lapses=2), {bucket})
    _set_lapses(dsn, bucket, 5)
    runner.run_once()
    assert cursor_row(dsn, bucket)["lapses"] == 0
    ids = publish(dsn, [(k, "t", {}) for k in keys_in_bucket(dsn, bucket, 3)])
    run_until(runner, lambda: sink.delivered_ids() == set(ids))
    assert len(sink.batches) == 1, "no longer a suspect: one batch"


def test_a_probe_waits_until_no_other_batch_of_the_process_is_in_flight(
        dsn: str, pool: ConnectionPool[Any]) -> None:
    """The probe's delivery is alone in the process (DeliveryGate): a crash during it can only be
    its event's doing. Another sink's batch in flight holds it back; it goes once that ends."""
    gate = DeliveryGate()
    busy_bucket, probe_bucket = 20, 21
    publish(dsn, [(k, "t", {}) for k in keys_in_bucket(dsn, busy_bucket, 2)])
    (suspect,) = publish(dsn, [(keys_in_bucket(dsn, probe_bucket, 1)[0], "t", {})])
    release = threading.Event()
    busy_sink = RecordingSink("w", name="busy", gate=release)  # holds its batch until released
    busy = runner_for(busy_sink, pool, make_settings(dsn, "w"), {busy_bucket})
    probe_sink = RecordingSink("w", name="probe")
    probe = runner_for(probe_sink, pool, make_settings(dsn, "w", max_lapses=1), {probe_bucket})
    busy.gate = probe.gate = gate  # one process
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("UPDATE outbox.cursors SET lapses = 1 WHERE sink = 'probe' AND bucket = %s", (probe_bucket,))
    threads = [threading.Thread(target=busy.run_once), threading.Thread(target=probe.run_once)]
    threads[0].start()
    assert busy_sink.entered.wait(10)
    threads[1].start()
    assert not probe_sink.entered.wait(0.5), "a probe was delivered while another batch was in flight"
    release.set()
    for t in threads:
        t.join(10)
    assert [a.event_id for a in probe_sink.attempts] == [suspect]
    assert len(busy_sink.delivered()) == 2


class Crash(BaseException):
    """Stands for the process dying mid-delivery: nothing after it runs (a BaseException, so that no
    ``except Exception`` of the relay sees it: an ordinary exception is charged to its event)."""


def _crash_on(event_id: Any) -> Any:
    def fail(e: StoredEvent, n: int) -> Failure | None:
        if e.id == event_id:
            raise Crash(str(e.id))
        return None
    return fail


def _expire_all(dsn: str) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("UPDATE outbox.cursors SET owner = NULL, lease_expires_at = NULL WHERE owner IS NOT NULL")
