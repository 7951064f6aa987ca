"""Bounded checkpoint writes (issue 16): a sink without a transaction of its own (Kafka, or the test sink
here, which commits with ``tx=None`` as the Kafka sink does) writes a bucket's cursor row at most once
per ``cursor_flush_seconds``; its other batches only check their fence. Every row write is a dead row
version that a long transaction keeps from vacuum, so the write count is what these tests pin, with a
trigger that logs each write of a cursor row. Real PostgreSQL.

G3 (no loss), G5 (a fenced-out relay writes nothing) and G6 (redelivery duplicates, never reorders)
hold across deferred writes: a released bucket's cursor is written at once, a crashed relay's next
owner starts from the last written cursor and sends the rest again in order.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest
from psycopg import sql
from psycopg_pool import ConnectionPool

from outbox_relay import store
from outbox_relay.observer import Observer
from outbox_relay.relay import SinkRunner
from outbox_relay.services.pool import configure_connection as configure
from outbox_relay.worker import Worker
from projections import ProjectionEvent, projection
from projections.sink import ProjectionSink
from tests.integration.relay_helpers import (  # noqa: F401  (pool_fixture provides `pool`)
    SINK,
    RecordingSink,
    cursor_row,
    dedup_per_key,
    fetch_all,
    keys_in_bucket,
    make_settings,
    pool_fixture,
    publish,
    run_until,
    runner_for,
    running,
    undelivered,
)
from tests.servers import PgServer, require_restartable, wait_until

pytestmark = pytest.mark.pg15  # the PostgreSQL 15 step runs it too (scripts/test.sh)

BUCKET = 91
BATCHES = 20

WRITE_LOG = """
CREATE TABLE public.cursor_writes (bucket int, fence bigint, at timestamptz NOT NULL DEFAULT clock_timestamp());
CREATE FUNCTION public.log_cursor_write() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    INSERT INTO public.cursor_writes (bucket, fence) VALUES (NEW.bucket, NEW.fence);
    RETURN NULL;
END $$;
CREATE TRIGGER log_cursor_write AFTER UPDATE ON outbox.cursors FOR EACH ROW EXECUTE FUNCTION public.log_cursor_write();
"""


def log_writes(dsn: str) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(WRITE_LOG)


def writes(dsn: str, bucket: int = BUCKET) -> int:
    return int(fetch_all(dsn, "SELECT count(*) FROM public.cursor_writes WHERE bucket = %s", (bucket,))[0][0])


def deliver_one_by_one(dsn: str, runner: Any, sink: RecordingSink, key: str, n: int) -> list[uuid.UUID]:
    """``n`` transactions of one event each, each delivered (a batch of its own) before the next commits."""
    ids: list[uuid.UUID] = []
    for i in range(n):
        ids += publish(dsn, [(key, "t", {"n": i})])
        wanted = ids[-1]

        def delivered(wanted: uuid.UUID = wanted) -> bool:
            return wanted in sink.delivered_ids()

        run_until(runner, delivered)
    return ids


def test_many_batches_of_one_bucket_write_its_cursor_once_per_flush_interval(
        dsn: str, pool: ConnectionPool[Any]) -> None:
    [key] = keys_in_bucket(dsn, BUCKET, 1)
    sink = RecordingSink("worker-a", kind="kafka")
    runner = runner_for(sink, pool, make_settings(dsn, "worker-a", cursor_flush_seconds=60.0), {BUCKET})
    runner.run_once()  # acquires the lease (a write)
    log_writes(dsn)
    ids = deliver_one_by_one(dsn, runner, sink, key, BATCHES)
    assert len(sink.batches) == BATCHES
    assert writes(dsn) == 0, "every batch checked its fence without writing the cursor row"
    assert all(b.committed == {BUCKET} for b in sink.batches), "and learned that its fence held"
    assert undelivered(dsn) == BATCHES, "the stored cursor is where the lease began"
    runner.release_all()  # a graceful stop (drain) or a hand-over: the cursor is written before the release
    assert writes(dsn) == 2, "one cursor write, then the release"
    assert undelivered(dsn) == 0
    assert [a.event_id for a in sink.delivered()] == ids


def test_every_batch_writes_its_cursor_with_a_flush_interval_of_zero(dsn: str, pool: ConnectionPool[Any]) -> None:
    [key] = keys_in_bucket(dsn, BUCKET, 1)
    sink = RecordingSink("worker-a", kind="kafka")
    runner = runner_for(sink, pool, make_settings(dsn, "worker-a", cursor_flush_seconds=0), {BUCKET})
    runner.run_once()
    log_writes(dsn)
    deliver_one_by_one(dsn, runner, sink, key, 5)
    assert writes(dsn) == 5
    assert undelivered(dsn) == 0


def test_a_deferred_cursor_is_written_once_the_interval_passed_without_more_batches(
        dsn: str, pool: ConnectionPool[Any]) -> None:
    [key] = keys_in_bucket(dsn, BUCKET, 1)
    sink = RecordingSink("worker-a", kind="kafka")
    runner = runner_for(sink, pool, make_settings(dsn, "worker-a", cursor_flush_seconds=0.3), {BUCKET})
    runner.run_once()
    log_writes(dsn)
    deliver_one_by_one(dsn, runner, sink, key, 3)
    run_until(runner, lambda: undelivered(dsn) == 0, timeout=5.0, interval=0.05)
    assert 1 <= writes(dsn) <= 2, "the batches' cursor moves coalesced"
    assert runner.book.owed == set()


def test_a_crash_before_the_write_redelivers_the_rest_in_order_and_loses_nothing(
        dsn: str, pool: ConnectionPool[Any]) -> None:
    keys = keys_in_bucket(dsn, BUCKET, 2)
    sink_a = RecordingSink("worker-a", kind="kafka")
    runner_a = runner_for(sink_a, pool, make_settings(dsn, "worker-a", cursor_flush_seconds=60.0), {BUCKET})
    runner_a.run_once()
    first = [*deliver_one_by_one(dsn, runner_a, sink_a, keys[0], 3),
             *deliver_one_by_one(dsn, runner_a, sink_a, keys[1], 3)]
    # Worker A dies (no release, no flush): its lease runs out.
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("UPDATE outbox.cursors SET lease_expires_at = clock_timestamp() - interval '1 ms' "
                     "WHERE sink = %s AND bucket = %s", (SINK, BUCKET))
    later = publish(dsn, [(k, "t", {"n": "later"}) for k in keys])
    sink_b = RecordingSink("worker-b", kind="kafka")
    runner_b = runner_for(sink_b, pool, make_settings(dsn, "worker-b", cursor_flush_seconds=60.0), {BUCKET})
    run_until(runner_b, lambda: set(later) <= sink_b.delivered_ids())
    # B starts from the last written cursor: A's six events again, then the new ones, per key in order.
    assert [a.event_id for a in sink_b.delivered()] == [*first, *later]
    merged = dedup_per_key([*sink_a.attempts, *sink_b.attempts])
    assert merged == {keys[0]: [*first[:3], later[0]], keys[1]: [*first[3:], later[1]]}


def test_a_relay_fenced_out_while_its_cursor_write_waits_writes_nothing(dsn: str, pool: ConnectionPool[Any]) -> None:
    [key] = keys_in_bucket(dsn, BUCKET, 1)
    sink = RecordingSink("worker-a", kind="kafka")
    runner = runner_for(sink, pool, make_settings(dsn, "worker-a", cursor_flush_seconds=60.0), {BUCKET})
    runner.run_once()
    deliver_one_by_one(dsn, runner, sink, key, 2)
    before = cursor_row(dsn, BUCKET)
    with psycopg.connect(dsn, autocommit=True) as conn:  # an operator's `keys skip` or a new owner: a new fence
        conn.execute("UPDATE outbox.cursors SET fence = fence + 1 WHERE sink = %s AND bucket = %s", (SINK, BUCKET))
    log_writes(dsn)
    publish(dsn, [(key, "t", {"n": 2})])
    assert runner.run_once() == 0, "the read is fenced too: it returns nothing of the bucket"
    assert len(sink.batches) == 2, "nothing more of the bucket was delivered"
    assert BUCKET not in runner.leases.snapshot(), "the relay let the bucket go"
    runner.release_all()  # a stop: nothing of the lost bucket is flushed
    assert writes(dsn) == 0
    after = cursor_row(dsn, BUCKET)
    assert after["cursor"] == before["cursor"] and after["fence"] == before["fence"] + 1


def test_a_renewal_leaves_a_lease_a_cursor_write_just_extended_alone(dsn: str, pool: ConnectionPool[Any]) -> None:
    [key] = keys_in_bucket(dsn, BUCKET, 1)
    other = BUCKET + 1
    sink = RecordingSink("worker-a", kind="kafka")
    runner = runner_for(sink, pool, make_settings(dsn, "worker-a", cursor_flush_seconds=0), {BUCKET, other})
    runner.run_once()
    deliver_one_by_one(dsn, runner, sink, key, 1)  # writes BUCKET's cursor, and its lease with it
    with psycopg.connect(dsn, autocommit=True) as conn:  # OTHER's lease has run for a while
        conn.execute("UPDATE outbox.cursors SET lease_expires_at = clock_timestamp() + interval '10 s' "
                     "WHERE sink = %s AND bucket = %s", (SINK, other))
    log_writes(dsn)
    runner.renew()
    assert runner.leases.snapshot().keys() == {BUCKET, other}, "both still held"
    assert (writes(dsn, BUCKET), writes(dsn, other)) == (0, 1), "only the lease that was not fresh is written"
    with psycopg.connect(dsn, autocommit=True) as conn:  # a new owner's fence
        conn.execute("UPDATE outbox.cursors SET fence = fence + 1 WHERE sink = %s AND bucket = %s", (SINK, BUCKET))
    runner.renew()
    assert runner.leases.snapshot().keys() == {other}, "a fresh lease under another fence is lost all the same"


def test_a_projection_writes_its_cursor_with_every_batch(dsn: str, pool: ConnectionPool[Any]) -> None:
    """G7: a projection's checkpoint commits with its read-model writes, whatever cursor_flush_seconds says."""
    from tests.integration.test_projections import setup_tables, totals_projection

    setup_tables(dsn)
    sink = ProjectionSink(totals_projection("totals_cursor_writes"), dsn, lease_seconds=30.0)
    try:
        with pool.connection() as conn:
            store.register_sink(conn, sink.name, sink.kind)
        runner = SinkRunner(sink, pool, make_settings(dsn, "worker-a", cursor_flush_seconds=60.0))
        runner.desired = {BUCKET}
        runner.run_once()
        log_writes(dsn)
        [key] = keys_in_bucket(dsn, BUCKET, 1)
        for n in range(1, 4):
            publish(dsn, [(key, "OrderPlaced", {"customer": key})])

            def applied(n: int = n) -> bool:
                return int(fetch_all(dsn, "SELECT count(*) FROM applied_log")[0][0]) == n

            run_until(runner, applied)
            assert undelivered(dsn, sink.name) == 0, "the cursor row moved with the batch"
        assert writes(dsn) == 3
    finally:
        sink.close()


@pytest.fixture
def durable_crashes(pg_server: PgServer) -> Iterator[PgServer]:
    """The session's server with commits that survive a crash (tests run it with synchronous_commit off),
    and WAL written only at commit (``wal_writer_delay`` 10 s): a transaction that rolls back just
    before a crash leaves no trace, and its id is handed out again after it."""
    require_restartable(pg_server)
    settings = {"synchronous_commit": "on", "wal_writer_delay": "10s"}
    with pg_server.admin() as conn:
        for name, value in settings.items():
            conn.execute(sql.SQL("ALTER SYSTEM SET {} = {}").format(sql.Identifier(name), sql.Literal(value)))
        conn.execute("SELECT pg_reload_conf()")
    try:
        yield pg_server
    finally:
        with pg_server.admin() as conn:
            for name in settings:
                conn.execute(sql.SQL("ALTER SYSTEM RESET {}").format(sql.Identifier(name)))
            conn.execute("SELECT pg_reload_conf()")


def test_read_cursors_held_in_memory_are_dropped_when_the_database_server_restarts(
        dsn: str, durable_crashes: PgServer) -> None:
    """After a crash restart PostgreSQL hands out again the transaction ids whose WAL had not reached
    disk (here: a transaction rolled back just before the crash), so a read cursor held only in memory
    (a deferred write, an empty delta passed) whose snapshot was taken after that rollback counted the
    next transaction as seen and skipped its events (G3, G6; the fault suite saw it as a key out of
    order when the bucket's next owner sent the skipped event late). The runner reads again from the
    written cursor instead: duplicates, never a gap."""
    [key] = keys_in_bucket(dsn, BUCKET, 1)
    with ConnectionPool(dsn, min_size=1, max_size=4, configure=configure, kwargs={"autocommit": True}) as pool:
        sink = RecordingSink("worker-a", kind="kafka")
        runner = runner_for(sink, pool, make_settings(dsn, "worker-a", cursor_flush_seconds=60.0), {BUCKET})
        runner.run_once()
        first = deliver_one_by_one(dsn, runner, sink, key, 2)  # their cursor write waits: held in memory
        with psycopg.connect(dsn) as conn:
            conn.execute("CREATE TEMP TABLE scratch (n int)")
            conn.execute("INSERT INTO scratch VALUES (1)")
            conn.rollback()
        runner.run_once()  # an empty delta: the read cursor passes the rolled-back transaction's id
        durable_crashes.stop("immediate")  # type: ignore[call-arg]  (EmbeddedPg: a crash)
        durable_crashes.start()
        pool.check()  # the pool drops the connections the restart closed (a relay's cycle would fail once)
        later = publish(dsn, [(key, "t", {"n": "later"})])
        run_until(runner, lambda: set(later) <= sink.delivered_ids(), timeout=20)
        assert [a.event_id for a in sink.delivered()] == [*first, *first, *later]


@pytest.mark.parametrize("handler", ["sync", "async"])
def test_a_projection_batch_read_before_a_crash_restart_is_not_checkpointed_after_it(
        dsn: str, durable_crashes: PgServer, handler: str) -> None:
    """The same crash restart, between a projection batch's read and its transaction: the batch's cursor
    comes from a snapshot taken before the crash, which counts the transaction that got the rolled-back
    id again after it as seen. Checkpointed, that transaction's event would never be applied (G3). The
    checkpoint is refused instead (the transaction rolls back) and the batch is read again from the stored
    cursor: the sync projection's own transaction checked this; the async one's did not."""
    from tests.integration.test_projections import setup_tables

    setup_tables(dsn)
    [key] = keys_in_bucket(dsn, BUCKET, 1)
    log_sql = "INSERT INTO applied_log (event_id, key, worker, replay) VALUES (%s, %s, 'w', false)"
    if handler == "sync":
        @projection("restart_" + handler, events=["OrderPlaced"], tables=["applied_log"])
        def apply(event: ProjectionEvent[Any], tx: Any) -> None:
            tx.execute(log_sql, (event.id, event.key))
    else:
        @projection("restart_" + handler, events=["OrderPlaced"], tables=["applied_log"])
        async def apply(event: ProjectionEvent[Any], tx: psycopg.AsyncConnection[Any]) -> None:
            await tx.execute(log_sql, (event.id, event.key))
    assert apply.is_async == (handler == "async")
    later: list[uuid.UUID] = []

    class CrashBeforeTheBatch(Observer):
        """Crashes the server once, after the first batch was read and before the sink applies it, and
        publishes at once after the restart (the transaction that gets the rolled-back id again)."""

        def delivering(self, sink: Any, events: Any) -> Any:
            if not later:
                durable_crashes.stop("immediate")  # type: ignore[call-arg]  (EmbeddedPg: a crash)
                durable_crashes.start()
                pool.check()
                later.extend(publish(dsn, [(key, "OrderPlaced", {"customer": key})]))
            return super().delivering(sink, events)

    sink = ProjectionSink(apply, dsn, lease_seconds=30.0)
    try:
        with ConnectionPool(dsn, min_size=1, max_size=4, configure=configure, kwargs={"autocommit": True}) as pool:
            runner = runner_for(sink, pool, make_settings(dsn, "worker-a"), {BUCKET})
            runner.run_once()  # the lease, and the server's start time as the runner knows it
            first = publish(dsn, [(key, "OrderPlaced", {"customer": key})])
            with psycopg.connect(dsn) as conn:  # an id handed out again after the crash
                conn.execute("CREATE TEMP TABLE scratch (n int)")
                conn.execute("INSERT INTO scratch VALUES (1)")
                conn.rollback()
            runner.observer = CrashBeforeTheBatch()

            def applied() -> set[Any]:
                return {r[0] for r in fetch_all(dsn, "SELECT event_id FROM applied_log")}

            def all_applied() -> bool:
                return bool(later) and {*first, *later} <= applied()

            failures: list[str] = []
            deadline = time.monotonic() + 20
            while not all_applied() and time.monotonic() < deadline:
                try:
                    runner.run_once()
                except Exception as exc:  # a refused checkpoint fails the cycle (the runner backs off)
                    failures.append(str(exc))
            assert all_applied(), f"applied {applied()} of {[*first, *later]}; cycles failed: {failures}"
            assert any("restarted" in f for f in failures), failures
    finally:
        sink.close()


MOVE_LOG = """
CREATE TABLE public.cursor_moves (bucket int, at timestamptz NOT NULL DEFAULT clock_timestamp());
CREATE FUNCTION public.log_cursor_move() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    INSERT INTO public.cursor_moves (bucket) VALUES (NEW.bucket);
    RETURN NULL;
END $$;
CREATE TRIGGER log_cursor_move AFTER UPDATE ON outbox.cursors FOR EACH ROW
    WHEN (OLD.snapshot::text IS DISTINCT FROM NEW.snapshot::text OR OLD.after_seq IS DISTINCT FROM NEW.after_seq)
    EXECUTE FUNCTION public.log_cursor_move();
"""


@pytest.mark.parametrize("hold", [
    pytest.param(["BEGIN", "SELECT pg_current_xact_id()"], id="a writing transaction"),
    pytest.param(["BEGIN ISOLATION LEVEL REPEATABLE READ", "SELECT count(*) FROM outbox.cursors"], id="a snapshot"),
])
def test_a_relay_defers_cursor_writes_a_second_at_most_unless_a_transaction_holds_vacuum_back(
        dsn: str, hold: list[str]) -> None:
    """Issue 25 and 27: a deferred cursor write saves a dead row version only while something holds the
    vacuum horizon; otherwise it saves a statement and a commit per batch (as much CPU as the batch's read)
    at the price of a next owner resending up to a second more after a crash. So while nothing holds the
    horizon, a busy relay writes its cursors together at most once a second and a batch after a quiet
    second writes at once; while a writing transaction stays open it defers up to cursor_flush_seconds,
    and writes what it owes once the transaction ends."""
    [key] = keys_in_bucket(dsn, BUCKET, 1)
    sink = RecordingSink("relay-h", kind="kafka")
    worker = Worker(make_settings(dsn, "relay-h", cursor_flush_seconds=60.0), [sink])
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(MOVE_LOG)

    def moves() -> int:
        return int(fetch_all(dsn, "SELECT count(*) FROM public.cursor_moves WHERE bucket = %s", (BUCKET,))[0][0])

    def one_by_one(n: int) -> float:
        started = time.monotonic()
        for i in range(n):
            [wanted] = publish(dsn, [(key, "t", {"n": i})])
            wait_until(lambda wanted=wanted: wanted in sink.delivered_ids(), 15, 0.01, "delivery")
        return time.monotonic() - started

    with running(worker):
        wait_until(lambda: worker.runners and BUCKET in worker.runners[0].leases.snapshot(), 15, 0.02, "the lease")
        took = one_by_one(5)
        wait_until(lambda: undelivered(dsn) == 0, 5, 0.02, "the cursor at the last event")
        assert 2 <= moves() <= 2 + int(took), (
            f"nothing holds vacuum back: the first batch wrote at once, the next ones together a second later "
            f"(5 batches in {took:.2f}s)")
        time.sleep(1.2)  # a quiet second
        before = moves()
        one_by_one(1)
        wait_until(lambda: undelivered(dsn) == 0, 0.5, 0.01, "the cursor written with the batch, not a second later")
        assert moves() == before + 1
        with psycopg.connect(dsn, autocommit=True) as holder:
            for statement in hold:  # left open
                holder.execute(statement)
            wait_until(worker.horizon.held, 15, 0.02, "the relay seeing the held horizon")
            time.sleep(1.2)  # a quiet second: unheld, the next batch would write at once
            before = moves()
            one_by_one(5)
            time.sleep(1.5)  # past the unheld cadence
            assert moves() == before, "while it is open, the batches only checked their fence"
            assert undelivered(dsn) == 5
            holder.execute("COMMIT")
        wait_until(lambda: undelivered(dsn) == 0, 15, 0.02, "the owed cursor write once it ended")
        assert moves() == before + 1, "what was owed went in one write"
