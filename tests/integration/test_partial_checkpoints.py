"""A batch's settled prefix is checkpointed while the rest is still in flight (``Commit.partial``),
so a relay that loses its lease before the batch's checkpoint hands over only the rest: the next
owner re-sends the tail, not the whole batch. Real PostgreSQL; the sink is a test sink that settles
the first part of its batch, then stalls until the lease has been taken over.
"""

from __future__ import annotations

import threading
import uuid
from collections.abc import Sequence
from typing import Any

import psycopg
import pytest
from psycopg_pool import ConnectionPool

from outbox_relay.sinks.engine import Commit, Outcomes
from outbox_relay.store import StoredEvent
from tests.integration.relay_helpers import (  # noqa: F401  (pool_fixture provides `pool`)
    SINK,
    RecordingSink,
    cursor_row,
    dead_letters,
    fetch_all,
    keys_in_bucket,
    make_settings,
    parked_ids,
    pool_fixture,
    publish,
    run_until,
    runner_for,
)
from tests.servers import wait_until

pytestmark = pytest.mark.pg15  # the PostgreSQL 15 step runs it too (scripts/test.sh)

BUCKET = 77


class StallingSink:
    """Delivers its batch's first ``settle`` events, checkpoints them with ``commit.partial``, then waits
    for ``go`` before it delivers the rest and commits."""

    name = SINK
    kind = "projection"
    event_filter = None

    def __init__(self, settle: int) -> None:
        self.settle = settle
        self.halfway = threading.Event()
        self.go = threading.Event()
        self.partial_result: set[int] | None = None
        self.final_result: set[int] | None = None

    def deliver(self, events: Sequence[StoredEvent], fences: dict[int, int], commit: Commit,
                abort: threading.Event) -> set[int]:
        outcomes: Outcomes = {e.id: None for e in events[:self.settle]}
        self.partial_result = commit.partial(outcomes)
        self.halfway.set()
        assert self.go.wait(20)
        outcomes.update({e.id: None for e in events[self.settle:]})
        self.final_result = commit(outcomes, None)
        return self.final_result

    def close(self) -> None:
        pass


def lease_expired(dsn: str) -> bool:
    rows = fetch_all(dsn, "SELECT lease_expires_at < clock_timestamp() FROM outbox.cursors "
                          "WHERE sink = %s AND bucket = %s", (SINK, BUCKET))
    return bool(rows[0][0])


def test_a_relay_fenced_out_mid_batch_hands_over_only_the_unsettled_tail(dsn: str, pool: ConnectionPool[Any]) -> None:
    keys = keys_in_bucket(dsn, BUCKET, 4)
    ids: list[uuid.UUID] = publish(dsn, [(k, "t", {"n": n}) for n in range(5) for k in keys])
    sink_a = StallingSink(settle=12)
    runner_a = runner_for(sink_a, pool, make_settings(dsn, "worker-a", lease_seconds=0.3), {BUCKET})
    thread = threading.Thread(target=runner_a.run_once)
    thread.start()
    try:
        assert sink_a.halfway.wait(10)
        assert sink_a.partial_result == {BUCKET}
        wait_until(lambda: lease_expired(dsn), 5.0)  # A stalls past its lease
        sink_b = RecordingSink("worker-b")
        runner_b = runner_for(sink_b, pool, make_settings(dsn, "worker-b"), {BUCKET})
        run_until(runner_b, lambda: sink_b.delivered_ids() == set(ids[12:]))
    finally:
        sink_a.go.set()
        thread.join(10)
    assert sink_a.final_result == set(), "A's checkpoint of the whole batch is fenced out"
    assert [a.event_id for a in sink_b.delivered()] == ids[12:], "B re-sends the tail only, in order"
    row = cursor_row(dsn, BUCKET)
    assert (row["owner"], row["fence"]) == ("worker-b", 2)
    assert parked_ids(dsn) == set() and dead_letters(dsn) == {}


def test_the_prefix_stops_at_the_first_unsettled_event_of_each_bucket(dsn: str, pool: ConnectionPool[Any]) -> None:
    """An event without an outcome yet (or failed) ends the prefix of its bucket: nothing after it is
    checkpointed early, whatever its outcome, so no event is passed over without being delivered."""
    keys = keys_in_bucket(dsn, BUCKET, 2)
    ids = publish(dsn, [(k, "t", {"n": n}) for n in range(3) for k in keys])

    class GapSink(StallingSink):
        def deliver(self, events: Sequence[StoredEvent], fences: dict[int, int], commit: Commit,
                    abort: threading.Event) -> set[int]:
            outcomes: Outcomes = {e.id: None for e in events}
            del outcomes[events[2].id]  # still in flight
            self.partial_result = commit.partial(outcomes)
            self.halfway.set()
            assert self.go.wait(20)
            return set()  # the relay dies before its checkpoint

    sink_a = GapSink(settle=0)
    runner_a = runner_for(sink_a, pool, make_settings(dsn, "worker-a", lease_seconds=0.3), {BUCKET})
    thread = threading.Thread(target=runner_a.run_once)
    thread.start()
    try:
        assert sink_a.halfway.wait(10)
        wait_until(lambda: lease_expired(dsn), 5.0)
        sink_b = RecordingSink("worker-b")
        runner_b = runner_for(sink_b, pool, make_settings(dsn, "worker-b"), {BUCKET})
        run_until(runner_b, lambda: sink_b.delivered_ids() == set(ids[2:]))
    finally:
        sink_a.go.set()
        thread.join(10)
    assert [a.event_id for a in sink_b.delivered()] == ids[2:]


def test_a_checkpoint_whose_connection_broke_is_written_again_instead_of_the_batch_sent_again(
        dsn: str, pool: ConnectionPool[Any]) -> None:
    """The batch was delivered; then the database ended the relay's connections (a failover, an
    operator's pg_terminate_backend) before its checkpoint. The checkpoint, which only moves cursors and
    so can be written twice, is written again on a new connection while the lease holds: the batch is
    not delivered a second time."""
    keys = keys_in_bucket(dsn, BUCKET, 3)
    ids = publish(dsn, [(k, "t", {"n": n}) for n in range(2) for k in keys])

    class CuttingSink(RecordingSink):
        def deliver(self, events: Sequence[StoredEvent], fences: dict[int, int], commit: Commit,
                    abort: threading.Event) -> set[int]:
            with psycopg.connect(dsn, autocommit=True) as conn:  # every other session of this database
                conn.execute("SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                             "WHERE datname = current_database() AND pid <> pg_backend_pid()")
            return super().deliver(events, fences, commit, abort)

    sink = CuttingSink("worker-a")
    runner = runner_for(sink, pool, make_settings(dsn, "worker-a"), {BUCKET})
    assert runner.run_once() == len(ids)
    assert [a.event_id for a in sink.delivered()] == ids, "delivered once each"
    row = cursor_row(dsn, BUCKET)
    assert row["owner"] == "worker-a" and row["fence"] == 1
    runner.run_once()
    assert len(sink.delivered()) == len(ids), "nothing sent again"
