"""Per-key order (G6) against a real PostgreSQL: failing heads, retries, transactions that commit late.

Order per key: the events of one transaction in publish order, transactions in the order they became
visible to the relay's reads (snapshot cursors, positions.py), those visible between the same two reads
in (xid, seq) order. A transaction that commits late is read in the next delta, never skipped, and an
open one holds back only its own events (docs/design-read-path.md, "What order one key gets").
"""

from __future__ import annotations

import random
import time
import uuid
from datetime import datetime
from typing import Any

import psycopg
import pytest
from psycopg import sql
from psycopg_pool import ConnectionPool

from outbox_relay.event import EARLIEST_TIME, LATEST_TIME
from outbox_relay.publish import Outbox
from outbox_relay.sinks.engine import Failure
from outbox_relay.store import StoredEvent
from tests.integration.relay_helpers import (  # noqa: F401  (pool_fixture provides `pool`)
    TOPIC,
    RecordingSink,
    cursor_row,
    dead_letters,
    dedup_per_key,
    fetch_all,
    keys_in_bucket,
    make_settings,
    parked_ids,
    pool_fixture,
    publish,
    run_until,
    runner_for,
)

pytestmark = pytest.mark.pg15  # the PostgreSQL 15 step runs it too (scripts/test.sh)


def test_failing_head_blocks_only_its_own_key(dsn: str, pool: ConnectionPool[Any]) -> None:
    bucket = 20
    k, o1, o2 = keys_in_bucket(dsn, bucket, 3)
    ids = publish(dsn, [(k, "t", {"n": 1}), (o1, "t", {}), (k, "t", {"n": 2}), (o2, "t", {}),
                        (k, "t", {"n": 3}), (o1, "t", {})])
    head, other_a, k2, other_b, k3, other_c = ids

    def fail(e: StoredEvent, n: int) -> Failure | None:
        return Failure(f"transient {n + 1}") if e.id == head and n < 2 else None

    sink = RecordingSink("w", fail=fail)
    # Backoff long enough that the second cycle below comes before the head's retry is due.
    runner = runner_for(sink, pool, make_settings(dsn, "w", backoff_base_seconds=0.6, backoff_max_seconds=1.0),
                        {bucket})

    runner.run_once()
    assert sink.delivered_ids() == {other_a, other_b, other_c}, "the other keys of the bucket must flow"
    assert [(a.event_id, a.ok) for a in sink.attempts if a.key == k] == [(head, False)]
    assert parked_ids(dsn) == {head, k2, k3}

    # New events while the key is parked: the other key flows, k's new event queues behind its head.
    k4, other_d = publish(dsn, [(k, "t", {"n": 4}), (o2, "t", {})])
    runner.run_once()
    assert other_d in sink.delivered_ids()
    assert [a.event_id for a in sink.attempts if a.key == k] == [head]
    assert parked_ids(dsn) == {head, k2, k3, k4}

    run_until(runner, lambda: {head, k2, k3, k4} <= sink.delivered_ids(), timeout=20)
    assert [(a.event_id, a.ok) for a in sink.attempts if a.key == k] == [
        (head, False), (head, False), (head, True), (k2, True), (k3, True), (k4, True)]
    assert dedup_per_key(sink.attempts) == {k: [head, k2, k3, k4], o1: [other_a, other_c], o2: [other_b, other_d]}
    assert parked_ids(dsn) == set() and dead_letters(dsn) == {}


def test_deduplicated_sequence_per_key_equals_the_published_one(dsn: str, pool: ConnectionPool[Any]) -> None:
    """Many keys, retriable failures everywhere, batches that cut keys: per key order holds."""
    rng = random.Random(7)
    keys = [f"acct-{i}" for i in range(60)]
    published: dict[str, list[Any]] = {k: [] for k in keys}
    for _ in range(15):  # publish order per key = transaction order
        batch = [(k, "t", {"r": rng.random()}) for k in rng.sample(keys, len(keys))]
        for (key, _, _), event_id in zip(batch, publish(dsn, batch), strict=True):
            published[key].append(event_id)
    total = sum(map(len, published.values()))
    sink = RecordingSink("w", fail=lambda e, n: Failure("flaky") if rng.random() < 0.25 else None)
    runner = runner_for(sink, pool, make_settings(dsn, "w", max_attempts=1000, batch_size=64))
    run_until(runner, lambda: len(sink.delivered_ids()) == total, timeout=40)
    assert dedup_per_key(sink.attempts) == published
    assert sum(not a.ok for a in sink.attempts) > 100, "the test must exercise retries"
    # Order of attempts, not only of deliveries: nothing is attempted while an earlier event of its key is
    # still undelivered (the sink skips a key after a failure within one batch, like a real sink would).
    position = {e: i for ids in published.values() for i, e in enumerate(ids)}
    done: dict[str, int] = {}
    for a in sink.attempts:
        assert position[a.event_id] <= done.get(a.key, 0), f"{a.event_id} attempted before an earlier event of {a.key}"
        if a.ok and position[a.event_id] == done.get(a.key, 0):
            done[a.key] = position[a.event_id] + 1
    assert dead_letters(dsn) == {} and parked_ids(dsn) == set()


# -- transactions that commit late -------------------------------------------------------------


def test_late_commit_same_key_goes_in_the_order_the_transactions_became_visible(
        dsn: str, pool: ConnectionPool[Any]) -> None:
    """T1 writes first and stays open; T2 writes the same key and commits. T2's event goes out at once
    (T1 holds nothing back), T1's when it commits: per key, the order transactions became visible."""
    bucket = 33
    (k,) = keys_in_bucket(dsn, bucket, 1)
    sink = RecordingSink("w")
    runner = runner_for(sink, pool, make_settings(dsn, "w"), {bucket})
    outbox = Outbox(default_topic=TOPIC)
    with psycopg.connect(dsn) as t1:
        a = outbox.publish(t1, type="t", key=k, payload={"n": "a"}).id  # T1 writes first, stays open
        (b,) = publish(dsn, [(k, "t", {"n": "b"})])  # T2 writes second and commits
        run_until(runner, lambda: sink.delivered_ids() == {b})
        for _ in range(3):
            runner.run_once()
        assert [x.event_id for x in sink.attempts] == [b], "a went out before its transaction committed"
    # T1 committed.
    run_until(runner, lambda: sink.delivered_ids() == {a, b})
    assert [x.event_id for x in sink.attempts] == [b, a]
    assert cursor_row(dsn, bucket)["cursor"].delivered(*_position(dsn, a))


def test_a_late_commit_queues_behind_its_key_s_failed_head_and_waits_for_its_retry(
        dsn: str, pool: ConnectionPool[Any]) -> None:
    """b (larger id) became visible first, failed and was parked for 3 s; then a (smaller id) commits.
    a is queued behind b: b's retry comes first, after its backoff, then a. Ordered by (xid, seq), the
    park made a the head, due at once: a went out before b and b was retried with no backoff."""
    bucket = 35
    (k,) = keys_in_bucket(dsn, bucket, 1)
    names: dict[Any, str] = {}
    sink = RecordingSink("w", fail=lambda e, n: Failure("b fails once") if names.get(e.id) == "b" and n == 0
                         else None)
    runner = runner_for(sink, pool, make_settings(dsn, "w", backoff_base_seconds=3.0, backoff_max_seconds=3.0),
                        {bucket})
    with psycopg.connect(dsn) as t1:
        a = Outbox(default_topic=TOPIC).publish(t1, type="t", key=k, payload={"n": "a"}).id  # smaller id, open
        names[a] = "a"
        (b,) = publish(dsn, [(k, "t", {"n": "b"})])
        names[b] = "b"
        run_until(runner, lambda: len(sink.attempts) == 1)  # b attempted, failed, parked for 1.5-3 s
        failed_at = time.monotonic()
    # a committed: read, and queued behind b.
    run_until(runner, lambda: len(sink.attempts) >= 2)
    next_attempt_after = time.monotonic() - failed_at
    run_until(runner, lambda: sink.delivered_ids() == {a, b})
    attempts = [(names[x.event_id], x.ok) for x in sink.attempts]
    assert attempts == [("b", False), ("b", True), ("a", True)], attempts
    assert next_attempt_after >= 1.4, f"b was retried {next_attempt_after:.2f}s after failing (backoff >= 1.5 s)"


def test_event_of_a_transaction_that_commits_late_is_not_skipped(dsn: str, pool: ConnectionPool[Any]) -> None:
    """T1 takes its xid first, T2 publishes and commits, the relay delivers it and checkpoints, then T1
    publishes and commits. T1's event has the older xid: a relay that moved a position past T2's event
    would never read it (loss). It is in the next delta, because T1 was in the snapshot's xip."""
    bucket = 34
    k, other = keys_in_bucket(dsn, bucket, 2)
    sink = RecordingSink("w")
    runner = runner_for(sink, pool, make_settings(dsn, "w"), {bucket})
    outbox = Outbox(default_topic=TOPIC)
    with psycopg.connect(dsn) as t1:
        t1.execute("SELECT pg_current_xact_id()")  # T1's business write: it has its xid now
        (b,) = publish(dsn, [(other, "t", {"n": "b"})])
        run_until(runner, lambda: sink.delivered_ids() == {b})
        assert cursor_row(dsn, bucket)["cursor"].delivered(*_position(dsn, b)), "b was checkpointed"
        a = outbox.publish(t1, type="t", key=k, payload={"n": "a"}).id
        runner.run_once()
    run_until(runner, lambda: sink.delivered_ids() == {a, b})
    assert [x.event_id for x in sink.attempts] == [b, a]
    xid = dict(fetch_all(dsn, "SELECT id, xid::text::bigint FROM outbox.events"))
    assert xid[a] < xid[b], "the scenario needs T1's event to have the older transaction id"


def _position(dsn: str, event_id: Any) -> tuple[int, int]:
    [(xid, seq)] = fetch_all(dsn, "SELECT xid::text::bigint, seq FROM outbox.events WHERE id = %s", (event_id,))
    return int(xid), int(seq)


def test_rolled_back_events_are_never_delivered_and_do_not_stall(dsn: str, pool: ConnectionPool[Any]) -> None:
    bucket = 35
    (k,) = keys_in_bucket(dsn, bucket, 1)
    sink = RecordingSink("w")
    runner = runner_for(sink, pool, make_settings(dsn, "w"), {bucket})
    outbox = Outbox(default_topic=TOPIC)
    with psycopg.connect(dsn) as t1:
        outbox.publish(t1, type="t", key=k, payload={"n": "gone"})
        t1.rollback()
    (b,) = publish(dsn, [(k, "t", {"n": "b"})])
    run_until(runner, lambda: sink.delivered_ids() == {b})
    assert [x.event_id for x in sink.attempts] == [b]


# Zones whose offset is the largest west of UTC in year 1 (local mean time, -15:56) and east of it in
# year 9999 (+14): the times a session there reads back are the furthest from their UTC values.
FAR_ZONES = ("Asia/Manila", "Pacific/Kiritimati")


@pytest.mark.parametrize("zone", FAR_ZONES)
def test_the_earliest_and_latest_times_publish_accepts_are_delivered_in_any_session_time_zone(
        dsn: str, zone: str) -> None:
    """The relay loads each event's time into a Python datetime in its session's time zone (years 1-9999
    only). The bounds publish accepts are read back in any zone, and so the events around them flow."""
    bucket = 20
    early, late, other = keys_in_bucket(dsn, bucket, 3)
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(sql.SQL("ALTER DATABASE {} SET TimeZone = {}").format(
            sql.Identifier(conn.info.dbname), sql.Literal(zone)))
    outbox = Outbox(default_topic=TOPIC)
    with psycopg.connect(dsn) as conn:
        ids = [outbox.publish(conn, type="t", key=early, payload={}, time=EARLIEST_TIME).id,
               outbox.publish(conn, type="t", key=late, payload={}, time=LATEST_TIME).id,
               outbox.publish(conn, type="t", key=other, payload={}).id]
    with ConnectionPool(dsn, min_size=1, max_size=2, kwargs={"autocommit": True}) as pool:  # sessions in `zone`
        times: dict[uuid.UUID, datetime] = {}  # each event's time as the relay read it

        def note_time(e: StoredEvent, _n: int) -> None:
            times[e.id] = e.time

        sink = RecordingSink("w", fail=note_time)
        runner = runner_for(sink, pool, make_settings(dsn, "w"), {bucket})
        run_until(runner, lambda: set(ids) <= sink.delivered_ids())
    assert (times[ids[0]], times[ids[1]]) == (EARLIEST_TIME, LATEST_TIME)


@pytest.mark.parametrize("occurred_at", ["infinity", "0001-01-01 00:00:00+01", "10000-01-01 00:00:00+00"])
def test_a_sql_producers_time_python_can_not_hold_blocks_no_other_key(dsn: str, pool: ConnectionPool[Any],
                                                                      occurred_at: str) -> None:
    bucket = 20
    bad, other = keys_in_bucket(dsn, bucket, 2)
    with psycopg.connect(dsn) as conn:
        try:
            conn.execute("INSERT INTO outbox.events (topic, partition_key, type, payload, occurred_at) "
                         "VALUES (%s, %s, 't', '{}', %s)", (TOPIC, bad, occurred_at))
        except psycopg.errors.CheckViolation as exc:  # refused at INSERT (0018): nothing is stored
            assert "occurred_at" in str(exc) and "0001-01-02 to 9999-12-30 UTC" in str(exc)
            conn.rollback()
            assert fetch_all(dsn, "SELECT count(*) FROM outbox.events WHERE partition_key = %s", (bad,)) == [(0,)]
            return
        conn.commit()
    [after] = publish(dsn, [(other, "t", {})])
    sink = RecordingSink("w")
    runner = runner_for(sink, pool, make_settings(dsn, "w"), {bucket})
    run_until(runner, lambda: after in sink.delivered_ids(), timeout=10)
