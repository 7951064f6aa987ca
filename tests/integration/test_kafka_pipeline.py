"""A Kafka batch's acknowledgements overlap the next read (issue 14, goal 5): while a batch is in flight, a
wake-up has the runner read the next batch over the buckets with nothing in flight and produce it
(``SinkRunner._pipeline``, the Kafka sink's ``start_batch`` / ``finish_batch``). Every guarantee holds:
a key's event is not produced before the batch with its earlier events is done (G6), a park that batch
makes holds the key's later events, a bucket lost meanwhile produces nothing more (G5), and a drain or a
database restart loses nothing read ahead (G3). Real PostgreSQL, real broker (Tansu), the real Kafka sink.

Each test starts the second batch deterministically: a wrapper of ``start_batch`` commits the next
events, names their buckets (as the listener's notifications would) and sets the runner's wake-up as
soon as the first batch is handed to the producer, before any of its acknowledgements is served.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import psycopg
import pytest
from psycopg_pool import ConnectionPool

from outbox_relay.kafka_sink import KafkaSink
from outbox_relay.relay import SinkRunner
from outbox_relay.store import StoredEvent
from outbox_relay.worker import _configure
from tests.integration.relay_helpers import (  # noqa: F401  (pool_fixture provides `pool`)
    cursor_row,
    keys_in_bucket,
    make_settings,
    parked_ids,
    pool_fixture,
    publish,
    run_until,
    runner_for,
)
from tests.integration.test_cursor_writes import durable_crashes  # noqa: F401  (a fixture)
from tests.integration.test_kafka_fence_fold import Checkpoints, counting_checkpoints
from tests.servers import PgServer, consume_all

KAFKA = "kafka"
BUCKET, OTHER = 41, 42
NO_AUTO_CREATE = {"allow.auto.create.topics": False, "topic.metadata.propagation.max.ms": 1000}


class Timeline(Checkpoints):
    """Checkpoints, and the order in which batches were started and their events acknowledged."""

    def __init__(self) -> None:
        super().__init__()
        self.log: list[tuple[str, uuid.UUID]] = []

    def acknowledged(self, sink: str, event_ids: Sequence[uuid.UUID]) -> None:
        self.log.extend(("ack", i) for i in event_ids)


def make_sink(bootstrap: str, topic: str, **config: Any) -> KafkaSink:
    return KafkaSink(KAFKA, {"bootstrap.servers": bootstrap, **config}, topic, "urn:outbox-relay:test")


@pytest.fixture
def kafka_sink(kafka_bootstrap: str, kafka_topic: str) -> Iterator[KafkaSink]:
    sink = make_sink(kafka_bootstrap, kafka_topic)
    try:
        yield sink
    finally:
        sink.close()


def pipelined_runner(dsn: str, pool: ConnectionPool[Any], sink: KafkaSink, buckets: set[int]) -> tuple[
        SinkRunner, Timeline]:
    runner = runner_for(sink, pool, make_settings(dsn, "relay-a", cursor_flush_seconds=60.0), buckets)
    seen = Timeline()
    runner.observer = sink.observer = seen
    runner.run_once()  # acquires the leases
    assert runner.leases.snapshot().keys() == buckets
    runner.listening = lambda: True  # notifications reach it: it reads the buckets they name ...
    runner._full_read_at = time.monotonic() + 600  # ... and no full read comes in this test
    return runner, seen


def while_in_flight(runner: SinkRunner, sink: KafkaSink, seen: Timeline,
                    then: Callable[[int], set[int] | None]) -> list[list[uuid.UUID]]:
    """Record each batch ``sink.start_batch`` is handed; after the n-th one is handed to the producer, call
    ``then(n)``: the buckets it returns are named and the runner woken (a read while it is in flight)."""
    started: list[list[uuid.UUID]] = []
    real = sink.start_batch

    def start(events: Sequence[StoredEvent], *args: Any, **kwargs: Any) -> Any:
        started.append([e.id for e in events])
        seen.log.extend(("start", e.id) for e in events)
        ticket = real(events, *args, **kwargs)
        named = then(len(started))
        if named:
            runner.hints.add(named)
            runner.wake.set()
        return ticket

    sink.start_batch = start  # type: ignore[method-assign]
    return started


def test_a_keys_next_event_waits_for_the_batch_in_flight_with_its_earlier_one(
        dsn: str, pool: ConnectionPool[Any], kafka_bootstrap: str, kafka_topic: str, kafka_sink: KafkaSink,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """G6: the read while a batch is in flight takes only buckets with nothing in flight. A key's second
    event, committed while its first is in flight, is not produced before the first is acknowledged and
    landed; another bucket's event committed at the same time goes out at once, in a second batch. The
    two batches' fence checks ride on the next read together, without a statement of their own."""
    runner, seen = pipelined_runner(dsn, pool, kafka_sink, {BUCKET, OTHER})
    [key] = keys_in_bucket(dsn, BUCKET, 1)
    [other_key] = keys_in_bucket(dsn, OTHER, 1)
    later: list[uuid.UUID] = []

    def commit_more(n: int) -> set[int] | None:
        if n > 1:
            return None
        later.extend(publish(dsn, [(key, "t", {"n": 2}), (other_key, "t", {"n": 3})], topic=kafka_topic))
        return {BUCKET, OTHER}

    started = while_in_flight(runner, kafka_sink, seen, commit_more)
    checkpoints = counting_checkpoints(monkeypatch)
    first = publish(dsn, [(key, "t", {"n": 1})], topic=kafka_topic)
    runner.hints.add({BUCKET})
    assert runner.run_once() == 2, "the first batch, and the other bucket's event read while it was in flight"
    assert started == [first, [later[1]]]
    assert seen.delivered == [], "both wait for the next read's fence check"
    assert runner.run_once() == 1, "the key's second event, read after the batch with its first landed"
    assert seen.delivered == [first[0], later[1]]
    assert checkpoints == [], "no batch ran a statement of its own"
    run_until(runner, lambda: later[0] in seen.delivered)
    assert started[2:] == [[later[0]]], "the key's second event, in a batch of its own after the first landed"
    assert seen.log.index(("ack", first[0])) < seen.log.index(("start", later[0]))
    messages = consume_all(kafka_bootstrap, kafka_topic, 3, timeout=20, settle=0.3)
    assert [m.headers["ce_id"] for m in messages if m.key == key] == [str(first[0]), str(later[0])]


def test_a_batch_that_parks_a_key_holds_what_was_committed_behind_it_meanwhile(
        dsn: str, pool: ConnectionPool[Any], kafka_bootstrap: str, kafka_topic: str) -> None:
    """G6 with a park: the batch in flight parks a key (its topic does not exist; held, no attempt
    counted). The key's next event, committed while that batch was in flight, is not read ahead with the
    other bucket's: it is read after the batch landed, finds its key parked, and waits behind it."""
    sink = make_sink(kafka_bootstrap, kafka_topic, **NO_AUTO_CREATE)
    try:
        runner, seen = pipelined_runner(dsn, pool, sink, {BUCKET, OTHER})
        key, neighbour = keys_in_bucket(dsn, BUCKET, 2)
        [other_key] = keys_in_bucket(dsn, OTHER, 1)
        later: list[uuid.UUID] = []

        def commit_more(n: int) -> set[int] | None:
            if n > 1:
                return None
            later.extend(publish(dsn, [(key, "t", {"n": 3}), (other_key, "t", {"n": 4})], topic=kafka_topic))
            return {BUCKET, OTHER}

        started = while_in_flight(runner, sink, seen, commit_more)
        missing = f"missing-{uuid.uuid4().hex[:8]}"
        [parked] = publish(dsn, [(key, "t", {"n": 1})], topic=missing)
        [sent] = publish(dsn, [(neighbour, "t", {"n": 2})], topic=kafka_topic)
        runner.hints.add({BUCKET})
        assert runner.run_once() == 3
        assert started == [[parked, sent], [later[1]]], "nothing of the parking batch's bucket was read ahead"
        assert parked_ids(dsn, KAFKA) == {parked}
        for _ in range(5):  # the bucket is read again: the key's next event waits behind its parked head
            runner.hints.add({BUCKET})
            runner.run_once()
        assert parked_ids(dsn, KAFKA) == {parked, later[0]}
        messages = consume_all(kafka_bootstrap, kafka_topic, 2, timeout=20, settle=1.0)
        assert sorted(m.headers["ce_id"] for m in messages) == sorted([str(sent), str(later[1])])
    finally:
        sink.close()


def test_a_drain_with_a_batch_in_flight_and_one_read_ahead_lands_both_once(
        dsn: str, pool: ConnectionPool[Any], kafka_bootstrap: str, kafka_topic: str, kafka_sink: KafkaSink) -> None:
    """G3/G10: SIGTERM's drain arrives after the second batch was read and produced while the first was in
    flight: both are waited for and land, and their cursors are written when the leases are handed back,
    so the next owner sends neither again."""
    runner, seen = pipelined_runner(dsn, pool, kafka_sink, {BUCKET, OTHER})
    [key] = keys_in_bucket(dsn, BUCKET, 1)
    [other_key] = keys_in_bucket(dsn, OTHER, 1)
    later: list[uuid.UUID] = []

    def commit_more(n: int) -> set[int] | None:
        if n == 1:
            later.extend(publish(dsn, [(other_key, "t", {"n": 2})], topic=kafka_topic))
            return {OTHER}
        runner.draining.set()  # the second batch is in flight with the first
        return None

    started = while_in_flight(runner, kafka_sink, seen, commit_more)
    first = publish(dsn, [(key, "t", {"n": 1})], topic=kafka_topic)
    runner.hints.add({BUCKET})
    assert runner.run_once() == 2
    assert started == [first, later]
    runner._release_all()  # what the drain does next
    assert sorted(seen.delivered) == sorted([*first, *later]), "each landed once"
    assert len(seen.delivered) == 2
    with psycopg.connect(dsn) as conn:
        for bucket, event in ((BUCKET, first[0]), (OTHER, later[0])):
            row = cursor_row(dsn, bucket, KAFKA)
            position = conn.execute("SELECT xid::text::bigint, seq FROM outbox.events WHERE id = %s",
                                    (event,)).fetchone()
            assert row["owner"] is None, "handed back"
            assert position is not None and row["cursor"].delivered(*position), "its cursor was written past it"
    messages = consume_all(kafka_bootstrap, kafka_topic, 2, timeout=20, settle=0.5)
    assert sorted(m.headers["ce_id"] for m in messages) == sorted(str(i) for i in [*first, *later])


@pytest.mark.parametrize("how", ["taken over", "fence bumped"])
def test_a_bucket_lost_while_a_batch_is_in_flight_produces_nothing_more(
        dsn: str, pool: ConnectionPool[Any], kafka_bootstrap: str, kafka_topic: str, kafka_sink: KafkaSink,
        how: str) -> None:
    """G5: a bucket is lost (another relay takes it, or its fence moves on) while this relay has a batch of
    another bucket in flight. The read made meanwhile is fenced: it returns nothing of the lost bucket,
    which the relay lets go, and nothing of it is produced under the lost fence."""
    runner, seen = pipelined_runner(dsn, pool, kafka_sink, {BUCKET, OTHER})
    fence = cursor_row(dsn, OTHER, KAFKA)["fence"]
    [key] = keys_in_bucket(dsn, BUCKET, 1)
    [other_key] = keys_in_bucket(dsn, OTHER, 1)
    later: list[uuid.UUID] = []

    def lose_other(n: int) -> set[int] | None:
        if n > 1:
            return None
        later.extend(publish(dsn, [(other_key, "t", {"n": 2})], topic=kafka_topic))
        owner = "relay-b" if how == "taken over" else None  # a new owner and fence, or a new fence only
        with psycopg.connect(dsn, autocommit=True) as conn:
            conn.execute("UPDATE outbox.cursors SET owner = coalesce(%s, owner), fence = fence + 1, "
                         "lease_expires_at = clock_timestamp() + interval '60 s' WHERE sink = %s AND bucket = %s",
                         (owner, KAFKA, OTHER))
        return {OTHER}

    started = while_in_flight(runner, kafka_sink, seen, lose_other)
    first = publish(dsn, [(key, "t", {"n": 1})], topic=kafka_topic)
    runner.hints.add({BUCKET})
    assert runner.run_once() == 1, "the read while the batch was in flight returned nothing of the lost bucket"
    assert OTHER not in runner.leases.snapshot(), "the relay let it go"
    assert seen.lost == 1
    assert started == [first]
    messages = consume_all(kafka_bootstrap, kafka_topic, 1, timeout=20, settle=1.0)
    assert [m.headers["ce_id"] for m in messages] == [str(first[0])], "nothing of the lost bucket"
    assert str(fence) not in {m.headers["outbox_fence"] for m in messages if m.key == other_key}


def test_a_batch_in_flight_when_a_read_finds_the_database_restarted_does_not_land(
        dsn: str, durable_crashes: PgServer,  # noqa: F811  (the fixture imported above)
        kafka_bootstrap: str, kafka_topic: str, kafka_sink: KafkaSink) -> None:
    """G3/G6: the read made while a batch is in flight finds a crash-restarted server. The batch's cursor
    comes from a snapshot taken before the restart (which may count a reused transaction id as seen), so
    it must not land, also though that read, not the batch's own check, found the restart: its bucket is
    read again from the written cursor (its event sent again: a duplicate, never a gap)."""
    [key] = keys_in_bucket(dsn, BUCKET, 1)
    [other_key] = keys_in_bucket(dsn, OTHER, 1)
    with ConnectionPool(dsn, min_size=1, max_size=4, configure=_configure, kwargs={"autocommit": True}) as pool:
        runner, seen = pipelined_runner(dsn, pool, kafka_sink, {BUCKET, OTHER})
        later: list[uuid.UUID] = []

        def restart(n: int) -> set[int] | None:
            if n > 1:
                return None
            durable_crashes.stop("immediate")  # type: ignore[call-arg]  (EmbeddedPg: a crash)
            durable_crashes.start()
            pool.check()  # the pool drops the connections the restart closed
            later.extend(publish(dsn, [(other_key, "t", {"n": 2})], topic=kafka_topic))
            return {OTHER}

        while_in_flight(runner, kafka_sink, seen, restart)
        first = publish(dsn, [(key, "t", {"n": 1})], topic=kafka_topic)
        runner.hints.add({BUCKET})
        with pytest.raises(Exception, match="restarted"):
            runner.run_once()
        assert seen.delivered == [], "the batch read before the restart did not land"
        runner._full_read_at = 0.0  # the cycle after a failed one: as the runner's loop goes on
        run_until(runner, lambda: {*first, *later} <= set(seen.delivered), timeout=20)
        assert sorted(seen.delivered) == sorted([*first, *later])
        messages = consume_all(kafka_bootstrap, kafka_topic, 4, timeout=20, settle=0.5)
        ids = [m.headers["ce_id"] for m in messages]
        assert ids.count(str(first[0])) == 2, "sent again after the restart: a duplicate, never a gap"
