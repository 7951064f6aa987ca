"""A Kafka batch's fence check rides on the runner's next read (issue 14, goal 5): the cycle after a
batch starts as soon as the broker acknowledged it, and the read that starts it is fenced like a
checkpoint (owner, fence, lease not expired), so a relay that lost a bucket produces nothing more of
it (G5) and the batch whose check failed is discarded (its read cursor with it: the next owner sends
it again, in order, G6). Real PostgreSQL, real broker (Tansu), the real Kafka sink.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator, Sequence
from typing import Any

import psycopg
import pytest
from psycopg_pool import ConnectionPool

from outbox_relay import store
from outbox_relay.observer import Observer
from outbox_relay.relay import SinkRunner
from outbox_relay.services.pool import configure_connection as configure
from outbox_relay.sinks.kafka import KafkaSink
from tests.integration.relay_helpers import (  # noqa: F401  (pool_fixture provides `pool`)
    cursor_row,
    keys_in_bucket,
    make_settings,
    pool_fixture,
    publish,
    run_until,
    runner_for,
)
from tests.integration.test_cursor_writes import durable_crashes  # noqa: F401  (a fixture)
from tests.servers import PgServer, consume_all

pytestmark = pytest.mark.pg15  # the PostgreSQL 15 step runs it too (scripts/test.sh)

KAFKA = "kafka"
BUCKET, OTHER = 41, 42


class Checkpoints(Observer):
    """The events ``Observer.checkpointed`` was told of, in order."""

    def __init__(self) -> None:
        self.delivered: list[uuid.UUID] = []

    def checkpointed(self, sink: str, *, delivered: Sequence[uuid.UUID], dead: Sequence[uuid.UUID]) -> None:
        self.delivered.extend(delivered)

    def leases(self, sink: str, *, acquired: int = 0, lost: int = 0, released: int = 0) -> None:
        self.lost = getattr(self, "lost", 0) + lost


@pytest.fixture
def kafka_sink(kafka_bootstrap: str, kafka_topic: str) -> Iterator[KafkaSink]:
    sink = KafkaSink(KAFKA, {"bootstrap.servers": kafka_bootstrap}, kafka_topic, "urn:outbox-relay:test")
    try:
        yield sink
    finally:
        sink.close()


def kafka_runner(dsn: str, pool: ConnectionPool[Any], sink: KafkaSink, buckets: set[int]) -> tuple[
        SinkRunner, Checkpoints]:
    # Deferred cursor writes (the default is 5 s; the tests' helper writes every batch unless told).
    runner = runner_for(sink, pool, make_settings(dsn, "relay-a", cursor_flush_seconds=60.0), buckets)
    seen = Checkpoints()
    runner.observer = seen
    runner.run_once()  # acquires the leases
    assert runner.leases.snapshot().keys() == buckets
    return runner, seen


def counting_reads(monkeypatch: pytest.MonkeyPatch) -> list[set[int]]:
    """The buckets of every read the runner runs (``store.fetch_events``), recorded as it goes to the database."""
    reads: list[set[int]] = []
    real = store.fetch_events

    def fetch(conn: Any, sink: str, worker: str, wanted: dict[int, Any], *args: Any, **kwargs: Any) -> Any:
        reads.append(set(wanted))
        return real(conn, sink, worker, wanted, *args, **kwargs)

    monkeypatch.setattr(store, "fetch_events", fetch)
    return reads


def counting_checkpoints(monkeypatch: pytest.MonkeyPatch) -> list[store.Checkpoint]:
    """Every checkpoint statement the runner runs (``store.checkpoint``: the fence check of a batch of
    its own, cursor writes), recorded as it goes to the real database."""
    calls: list[store.Checkpoint] = []
    real = store.checkpoint

    def recording(conn: Any, sink: str, worker: str, cp: store.Checkpoint) -> set[int]:
        calls.append(cp)
        return real(conn, sink, worker, cp)

    monkeypatch.setattr(store, "checkpoint", recording)
    return calls


def test_a_batch_lands_with_the_next_read_without_a_statement_of_its_own(
        dsn: str, pool: ConnectionPool[Any], kafka_bootstrap: str, kafka_topic: str, kafka_sink: KafkaSink,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Each batch is checked by the read that starts the next cycle, also when that read is for other
    buckets (a notification named only those): the batch's buckets are read with it."""
    runner, seen = kafka_runner(dsn, pool, kafka_sink, {BUCKET, OTHER})
    checkpoints = counting_checkpoints(monkeypatch)
    reads = counting_reads(monkeypatch)
    runner.listening = lambda: True  # notifications reach it: it reads the buckets they name ...
    runner.reads.full_read_at = time.monotonic() + 600  # ... and no full read comes in this test
    [key] = keys_in_bucket(dsn, BUCKET, 1)
    [other_key] = keys_in_bucket(dsn, OTHER, 1)

    first = publish(dsn, [(key, "t", {"n": 1})], topic=kafka_topic)
    runner.hints.add({BUCKET})
    assert runner.run_once() == 1
    assert seen.delivered == [], "not landed yet: its fence check waits for the next read"

    second = publish(dsn, [(other_key, "t", {"n": 2})], topic=kafka_topic)
    runner.hints.add({OTHER})
    reads.clear()
    assert runner.run_once() == 1
    assert reads and BUCKET in reads[0] and OTHER in reads[0], "the waiting check's bucket is read too"
    assert seen.delivered == first, "the first batch landed with that read"

    assert runner.run_once() == 0  # nothing new: the read finds nothing, and lands the second batch
    assert seen.delivered == [*first, *second]
    assert checkpoints == [], "no batch ran a statement of its own"
    got = consume_all(kafka_bootstrap, kafka_topic, 2, timeout=20, settle=0.3)
    assert sorted(m.headers["ce_id"] for m in got) == sorted(str(i) for i in [*first, *second])


def test_unheld_a_burst_writes_its_first_batch_and_the_rest_lands_with_one_write_a_second_later(
        dsn: str, pool: ConnectionPool[Any], kafka_bootstrap: str, kafka_topic: str, kafka_sink: KafkaSink,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 27: while nothing holds vacuum back a batch after a quiet second writes its cursor at once;
    the batches right after it fold their fence check into the next read, and the last one, with nothing
    more to read, waits for no read of its own: it lands with the write of the cursors, a second after
    the first, in one statement that is its fence check (G5: fenced like any checkpoint)."""
    runner, seen = kafka_runner(dsn, pool, kafka_sink, {BUCKET})
    runner.defer_writes = lambda: False  # nothing holds vacuum back
    runner.listening = lambda: True
    runner.reads.full_read_at = time.monotonic() + 600
    checkpoints = counting_checkpoints(monkeypatch)
    reads = counting_reads(monkeypatch)
    [key] = keys_in_bucket(dsn, BUCKET, 1)
    ids = []
    for n in range(3):
        ids += publish(dsn, [(key, "t", {"n": n})], topic=kafka_topic)
        runner.hints.add({BUCKET})
        assert runner.run_once() == 1
    assert len(checkpoints) == 1 and checkpoints[0].defer == set(), "the first batch wrote its cursor at once"
    assert seen.delivered == ids[:2], "the second landed with the third's read; the third waits"
    reads.clear()
    assert runner.run_once() == 0
    assert reads == [], "nothing to read: no read only to check the waiting batch's fence"
    until = runner.writer.until_flush(time.monotonic())
    assert 0 < until <= 1.0
    time.sleep(until + 0.01)
    assert runner.run_once() == 0
    assert seen.delivered == ids, "landed with the write"
    assert len(checkpoints) == 2 and checkpoints[1].defer == set()
    assert runner.writer.pending is None and not runner.book.owed
    row = cursor_row(dsn, BUCKET, KAFKA)
    assert row["cursor"].delivered(*_position(dsn, ids[-1])), "the cursor written past the last event"
    got = consume_all(kafka_bootstrap, kafka_topic, 3, timeout=20, settle=0.3)
    assert [m.headers["ce_id"] for m in got] == [str(i) for i in ids]


def _position(dsn: str, event_id: uuid.UUID) -> tuple[int, int]:
    with psycopg.connect(dsn) as conn:
        row = conn.execute("SELECT xid::text::bigint, seq FROM outbox.events WHERE id = %s", (event_id,)).fetchone()
    assert row is not None
    return int(row[0]), int(row[1])


def _lose(dsn: str, how: str) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        if how == "taken over":  # another relay acquired it (a new fence, its lease)
            conn.execute("UPDATE outbox.cursors SET owner = 'relay-b', fence = fence + 1, "
                         "lease_expires_at = clock_timestamp() + interval '60 s' WHERE sink = %s AND bucket = %s",
                         (KAFKA, BUCKET))
        elif how == "fence bumped":  # e.g. an operator's keys skip, or this relay's own re-acquisition
            conn.execute("UPDATE outbox.cursors SET fence = fence + 1 WHERE sink = %s AND bucket = %s",
                         (KAFKA, BUCKET))
        else:  # the lease ran out (a stalled relay); nobody took it yet
            conn.execute("UPDATE outbox.cursors SET lease_expires_at = clock_timestamp() - interval '1 ms' "
                         "WHERE sink = %s AND bucket = %s", (KAFKA, BUCKET))


@pytest.mark.parametrize("how", ["taken over", "fence bumped", "lease expired"])
def test_a_relay_that_lost_a_bucket_after_a_batch_produces_nothing_more_of_it(
        dsn: str, pool: ConnectionPool[Any], kafka_bootstrap: str, kafka_topic: str, kafka_sink: KafkaSink,
        how: str) -> None:
    """G5 with the folded check: the bucket is lost between a batch's acks and the next read. That read
    returns nothing of the bucket, the relay lets it go, and the batch does not land (its check failed):
    nothing more of the bucket goes out under the lost fence, and nothing of it counts as done."""
    runner, seen = kafka_runner(dsn, pool, kafka_sink, {BUCKET})
    fence = cursor_row(dsn, BUCKET, KAFKA)["fence"]
    before = cursor_row(dsn, BUCKET, KAFKA)["cursor"]
    [key] = keys_in_bucket(dsn, BUCKET, 1)
    first = publish(dsn, [(key, "t", {"n": 1})], topic=kafka_topic)
    assert runner.run_once() == 1  # produced and acknowledged; its fence check waits
    _lose(dsn, how)
    later = publish(dsn, [(key, "t", {"n": 2})], topic=kafka_topic)
    assert runner.run_once() == 0, "the read returned nothing of the lost bucket"
    assert BUCKET not in runner.leases.snapshot(), "the relay let the bucket go"
    assert seen.delivered == [], "the batch whose check failed did not land"
    assert runner.writer.pending is None and BUCKET not in runner.book.owed
    messages = consume_all(kafka_bootstrap, kafka_topic, 1, timeout=20, settle=1.0)
    assert [m.headers["ce_id"] for m in messages] == [str(first[0])], "nothing of the bucket after the loss"
    assert messages[0].headers["outbox_fence"] == str(fence)
    assert str(later[0]) not in {m.headers["ce_id"] for m in messages}
    row = cursor_row(dsn, BUCKET, KAFKA)
    assert row["cursor"] == before, "the lost bucket's cursor was not written"
    if how != "taken over":  # it may take the bucket back, under a new fence: from the stored cursor, in order
        run_until(runner, lambda: seen.delivered == [*first, *later])
        again = consume_all(kafka_bootstrap, kafka_topic, 3, timeout=20, settle=0.5)
        newer = [m for m in again if m.headers["outbox_fence"] != str(fence)]
        assert [m.headers["ce_id"] for m in newer] == [str(first[0]), str(later[0])]
        assert {int(m.headers["outbox_fence"]) for m in newer} == {row["fence"] + 1}


def test_a_bucket_only_checked_keeps_its_cursor_for_the_read_that_finds_its_events(
        dsn: str, pool: ConnectionPool[Any], kafka_bootstrap: str, kafka_topic: str, kafka_sink: KafkaSink) -> None:
    """G3: the read that checks a waiting batch's bucket nothing named since (limit 0) does not read its
    delta, so it must not move its read cursor past it: an event there whose wake-up went missing is
    delivered by the next full read, after the events before it."""
    runner, seen = kafka_runner(dsn, pool, kafka_sink, {BUCKET, OTHER})
    runner.listening = lambda: True
    runner.reads.full_read_at = time.monotonic() + 600
    [key] = keys_in_bucket(dsn, BUCKET, 1)
    [other_key] = keys_in_bucket(dsn, OTHER, 1)
    first = publish(dsn, [(key, "t", {"n": 1})], topic=kafka_topic)
    runner.hints.add({BUCKET})
    assert runner.run_once() == 1
    unnamed = publish(dsn, [(key, "t", {"n": 2})], topic=kafka_topic)  # its wake-up is lost
    other = publish(dsn, [(other_key, "t", {"n": 3})], topic=kafka_topic)
    runner.hints.add({OTHER})
    assert runner.run_once() == 1, "OTHER's event; BUCKET only checked"
    assert seen.delivered == first
    runner.reads.full_read_at = 0.0  # the safety net: every held bucket is read
    run_until(runner, lambda: set(seen.delivered) == {*first, *other, *unnamed})
    messages = consume_all(kafka_bootstrap, kafka_topic, 3, timeout=20, settle=0.3)
    assert [m.headers["ce_id"] for m in messages if m.key == key] == [str(first[0]), str(unnamed[0])]


def test_a_batch_waiting_for_its_check_is_read_again_after_a_database_crash_restart(
        dsn: str, durable_crashes: PgServer,  # noqa: F811  (the fixture imported above)
        kafka_bootstrap: str, kafka_topic: str, kafka_sink: KafkaSink) -> None:
    """G3/G6: a crash restart can hand out again transaction ids a snapshot had counted as seen, so the
    waiting batch's cursor (held in memory only) is dropped with the others when the next read finds a
    new server: that batch does not land, and its bucket is read again from the written cursor (its
    events sent again, in order: duplicates, never a gap)."""
    [key] = keys_in_bucket(dsn, BUCKET, 1)
    with ConnectionPool(dsn, min_size=1, max_size=4, configure=configure, kwargs={"autocommit": True}) as pool:
        runner, seen = kafka_runner(dsn, pool, kafka_sink, {BUCKET})
        first = publish(dsn, [(key, "t", {"n": 1})], topic=kafka_topic)
        assert runner.run_once() == 1
        assert runner.writer.pending is not None, "its fence check waits for the next read"
        durable_crashes.stop("immediate")  # type: ignore[call-arg]  (EmbeddedPg: a crash)
        durable_crashes.start()
        pool.check()  # the pool drops the connections the restart closed
        later = publish(dsn, [(key, "t", {"n": 2})], topic=kafka_topic)
        run_until(runner, lambda: later[0] in seen.delivered, timeout=20)
        assert seen.delivered == [*first, *later], "told once, with the read again; the batch that waited never landed"
        messages = consume_all(kafka_bootstrap, kafka_topic, 3, timeout=20, settle=0.3)
        assert [m.headers["ce_id"] for m in messages] == [str(first[0]), str(first[0]), str(later[0])]


def _park_again(dsn: str, event_id: uuid.UUID) -> None:
    """A retry of ``event_id`` that is due now (a parked row, as a failed attempt leaves it)."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("INSERT INTO outbox.parked (sink, bucket, xid, seq, partition_key, event_id, attempts, "
                     "available_at, last_error) SELECT %s, bucket, xid, seq, partition_key, id, 1, "
                     "clock_timestamp() - interval '1 s', 'broker said no' FROM outbox.events WHERE id = %s",
                     (KAFKA, event_id))


def test_a_relay_that_lost_a_bucket_after_a_batch_retries_no_parked_event_of_it(
        dsn: str, pool: ConnectionPool[Any], kafka_bootstrap: str, kafka_topic: str, kafka_sink: KafkaSink) -> None:
    """G5 with the folded check, parked path: the cycle after a batch retries due parked keys before its
    read checks the batch's fence, and ``fetch_parked`` is not fenced. A bucket lost between the batch's
    acks and the next cycle must not have a parked event produced under the lost fence."""
    runner, seen = kafka_runner(dsn, pool, kafka_sink, {BUCKET})
    fence = cursor_row(dsn, BUCKET, KAFKA)["fence"]
    key, other = keys_in_bucket(dsn, BUCKET, 2)
    first = publish(dsn, [(key, "t", {"n": 1}), (other, "t", {"n": 2})], topic=kafka_topic)
    assert runner.run_once() == 2  # produced and acknowledged; its fence check waits
    assert runner.writer.pending is not None
    _park_again(dsn, first[1])  # a retry of ``other``'s event is due
    runner.park.now()
    _lose(dsn, "taken over")
    runner.run_once()
    assert BUCKET not in runner.leases.snapshot(), "the relay let the bucket go"
    assert seen.delivered == []
    assert seen.lost == 1, "the loss is told once"
    messages = consume_all(kafka_bootstrap, kafka_topic, 2, timeout=20, settle=1.0)
    stale = sorted(m.headers["ce_id"] for m in messages if m.headers["outbox_fence"] == str(fence))
    assert stale == sorted(str(i) for i in first), "nothing of the bucket after the loss, parked retries included"


def test_a_probe_of_a_lost_bucket_produces_no_parked_event_of_it(
        dsn: str, pool: ConnectionPool[Any], kafka_bootstrap: str, kafka_topic: str, kafka_sink: KafkaSink) -> None:
    """G5, crash-loop isolation: a probe reads the suspect bucket's parked events (not fenced) and its new
    ones (fenced). When that read says the bucket is no longer held, the parked ones are not produced."""
    runner, seen = kafka_runner(dsn, pool, kafka_sink, {BUCKET})
    fence = cursor_row(dsn, BUCKET, KAFKA)["fence"]
    key, other = keys_in_bucket(dsn, BUCKET, 2)
    first = publish(dsn, [(key, "t", {"n": 1}), (other, "t", {"n": 2})], topic=kafka_topic)
    assert runner.run_once() == 2
    _park_again(dsn, first[1])
    runner.ramp.grow(BUCKET, 2)  # a crash-loop suspect, probed two events at a time
    _lose(dsn, "taken over")
    runner.run_once()
    assert BUCKET not in runner.leases.snapshot(), "the relay let the bucket go"
    assert seen.lost == 1, "the loss is told once"
    messages = consume_all(kafka_bootstrap, kafka_topic, 2, timeout=20, settle=1.0)
    stale = sorted(m.headers["ce_id"] for m in messages if m.headers["outbox_fence"] == str(fence))
    assert stale == sorted(str(i) for i in first), "nothing of the bucket after the loss"


@pytest.mark.parametrize("how", ["drain", "hand-over"])
def test_a_waiting_batch_lands_and_its_cursor_is_written_when_its_bucket_is_let_go(
        dsn: str, pool: ConnectionPool[Any], kafka_bootstrap: str, kafka_topic: str, kafka_sink: KafkaSink,
        how: str) -> None:
    """G3/G6: a batch whose fence check waits is checked and its cursor written before the lease is handed
    back (SIGTERM's drain, or a rebalance), so the next owner does not send it again, and it is told once."""
    runner, seen = kafka_runner(dsn, pool, kafka_sink, {BUCKET, OTHER})
    [key] = keys_in_bucket(dsn, BUCKET, 1)
    first = publish(dsn, [(key, "t", {"n": 1})], topic=kafka_topic)
    assert runner.run_once() == 1
    assert runner.writer.pending is not None and seen.delivered == []
    if how == "drain":
        runner.draining.set()
        runner.release_all()
    else:
        runner.desired = {OTHER}
        runner.run_once()
    assert seen.delivered == first, "landed once, before the bucket went"
    row = cursor_row(dsn, BUCKET, KAFKA)
    assert row["owner"] is None, "handed back"
    with psycopg.connect(dsn) as conn:
        position = conn.execute("SELECT xid::text::bigint, seq FROM outbox.events WHERE id = %s",
                                (first[0],)).fetchone()
    assert position is not None and row["cursor"].delivered(*position), "its cursor was written past it"


def test_a_read_that_fails_after_taking_the_waiting_batch_puts_it_back(
        dsn: str, pool: ConnectionPool[Any], kafka_bootstrap: str, kafka_topic: str, kafka_sink: KafkaSink,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """G3: the read that checks a waiting batch fails (a broken connection): the batch waits for the next
    read, which lands it once; nothing is lost or sent twice."""
    runner, seen = kafka_runner(dsn, pool, kafka_sink, {BUCKET})
    [key] = keys_in_bucket(dsn, BUCKET, 1)
    first = publish(dsn, [(key, "t", {"n": 1})], topic=kafka_topic)
    assert runner.run_once() == 1
    later = publish(dsn, [(key, "t", {"n": 2})], topic=kafka_topic)
    real_fetch = store.fetch_events
    failures = [1]

    def fetch(*args: Any, **kwargs: Any) -> Any:
        if failures:
            failures.pop()
            raise psycopg.OperationalError("server closed the connection unexpectedly")
        return real_fetch(*args, **kwargs)

    monkeypatch.setattr(store, "fetch_events", fetch)
    with pytest.raises(psycopg.OperationalError):
        runner.run_once()
    assert runner.writer.pending is not None, "put back"
    run_until(runner, lambda: seen.delivered == [*first, *later])
    runner.run_once()
    assert seen.delivered == [*first, *later], "each told once"
    messages = consume_all(kafka_bootstrap, kafka_topic, 2, timeout=20, settle=0.5)
    assert [m.headers["ce_id"] for m in messages] == [str(first[0]), str(later[0])]


def test_a_relay_that_lost_a_bucket_with_no_batch_waiting_retries_no_parked_event_of_it(
        dsn: str, pool: ConnectionPool[Any], kafka_bootstrap: str, kafka_topic: str, kafka_sink: KafkaSink) -> None:
    runner, seen = kafka_runner(dsn, pool, kafka_sink, {BUCKET})
    fence = cursor_row(dsn, BUCKET, KAFKA)["fence"]
    key, other = keys_in_bucket(dsn, BUCKET, 2)
    first = publish(dsn, [(key, "t", {"n": 1}), (other, "t", {"n": 2})], topic=kafka_topic)
    assert runner.run_once() == 2
    assert runner.run_once() == 0  # the read that lands it: nothing waits now
    assert runner.writer.pending is None and seen.delivered == first
    _park_again(dsn, first[1])
    runner.park.now()
    _lose(dsn, "taken over")
    runner.run_once()
    assert BUCKET not in runner.leases.snapshot()
    messages = consume_all(kafka_bootstrap, kafka_topic, 2, timeout=20, settle=1.0)
    stale = sorted(m.headers["ce_id"] for m in messages if m.headers["outbox_fence"] == str(fence))
    assert stale == sorted(str(i) for i in first), "nothing of the bucket after the loss"
