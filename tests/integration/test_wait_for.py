"""Read-your-writes (``wait_for`` / ``wait_for_async``) against a real PostgreSQL and the real relay loop.

The relay runs ``SinkRunner.run_once()`` in a background thread with a ``RecordingSink``, so the waiter
really waits while delivery happens concurrently. The sink's gate (or a failure switched off later by a
timer) decides when an event gets applied; the tests check the waiter returns after that, not before.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from itertools import islice
from typing import Any

import psycopg
import pytest
from psycopg import pq
from psycopg_pool import ConnectionPool

from outbox_relay import ConfigurationError, Outbox, wait_for, wait_for_async
from outbox_relay.errors import EventDeadLettered, OpenTransaction, OutboxError, UnknownEvent, WaitTimeout
from outbox_relay.progress import Poll
from outbox_relay.relay import SinkRunner
from outbox_relay.sinks.engine import Aborted, Failure
from outbox_relay.store import StoredEvent
from tests.integration.relay_helpers import (  # noqa: F401  (pool_fixture provides `pool`)
    SINK,
    TOPIC,
    RecordingSink,
    dead_letters,
    fetch_all,
    make_settings,
    parked_ids,
    pool_fixture,
    publish,
    register,
    run_until,
    runner_for,
)
from tests.servers import wait_until

pytestmark = pytest.mark.pg15  # the PostgreSQL 15 step runs it too (scripts/test.sh)

# Far longer than any of these tests needs: a waiter that raises "at once" must beat it by a wide margin.
LONG = 30.0
AT_ONCE = 5.0


@contextlib.contextmanager
def relaying(runner: SinkRunner) -> Iterator[None]:
    """The relay loop in a background thread for the duration of the block; its errors fail the test."""
    stop = threading.Event()
    errors: list[BaseException] = []

    def loop() -> None:
        try:
            while not stop.is_set():
                if runner.run_once() == 0:
                    stop.wait(0.005)
        except Aborted:
            pass  # stopped while a batch was held at the sink's gate
        except BaseException as exc:
            errors.append(exc)

    thread = threading.Thread(target=loop, name="relay", daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        runner.abort.set()  # releases a batch held at a closed gate
        thread.join(10)
    assert not thread.is_alive(), "the relay thread did not stop"
    assert not errors, errors


@contextlib.contextmanager
def later(seconds: float, action: Callable[[], Any]) -> Iterator[None]:
    """Run ``action`` after ``seconds`` in a timer thread (cancelled and joined when the block ends)."""
    timer = threading.Timer(seconds, action)
    timer.start()
    try:
        yield
    finally:
        timer.cancel()
        timer.join()


def test_poll_intervals_start_short_and_double_up_to_the_cap() -> None:
    assert list(islice(Poll(first=0.005, most=0.1).intervals(), 7)) == pytest.approx(
        [0.005, 0.01, 0.02, 0.04, 0.08, 0.1, 0.1])


def test_returns_once_applied_and_not_before(dsn: str, pool: ConnectionPool[Any]) -> None:
    gate = threading.Event()
    sink = RecordingSink(gate=gate)
    runner = runner_for(sink, pool, make_settings(dsn, "w"))
    [event] = publish(dsn, [("k1", "t", {"n": 1})])

    with relaying(runner), psycopg.connect(dsn, autocommit=True) as conn:
        assert sink.entered.wait(10), "the relay never picked the event up"
        # The batch is in flight, held at the gate: not applied yet, so the waiter must not return.
        with pytest.raises(WaitTimeout) as timed_out:
            wait_for(conn, event, sink=SINK, timeout=0.3)
        assert timed_out.value.pending == (event,)
        assert timed_out.value.retrying == ()
        assert "no live relay" not in str(timed_out.value), "the relay holds the bucket: no such hint"

        with later(0.2, gate.set):
            wait_for(conn, event, sink=SINK, timeout=LONG)
            assert gate.is_set(), "returned before the sink was allowed to deliver"
        assert event in sink.delivered_ids()


def test_times_out_when_nothing_delivers(dsn: str) -> None:
    register(dsn)  # the sink exists, but no relay runs it
    [event] = publish(dsn, [("k1", "t", {})])

    with psycopg.connect(dsn, autocommit=True) as conn:
        start = time.monotonic()
        with pytest.raises(TimeoutError) as timed_out:
            wait_for(conn, event, sink=SINK, timeout=0.25)
        elapsed = time.monotonic() - start

    error = timed_out.value
    assert isinstance(error, WaitTimeout) and isinstance(error, OutboxError)
    assert 0.25 <= elapsed < AT_ONCE
    assert (error.sink, error.pending, error.retrying, error.last_error) == (SINK, (event,), (), None)
    assert "1 pending, 0 retrying" in str(error)
    assert f"is a relay running sink {SINK!r}" in str(error)


def test_an_older_open_transaction_does_not_delay_delivery(dsn: str, pool: ConnectionPool[Any]) -> None:
    """Relays read what has committed, in the order it became visible: a writing transaction that began
    earlier and stays open (idle in transaction, a long batch job) holds nothing back, and its own events
    are delivered when it commits."""
    runner = runner_for(RecordingSink(), pool, make_settings(dsn, "w"))
    with psycopg.connect(dsn) as blocker:
        Outbox(default_topic="t").publish(blocker, type="t", key="k1", payload={"late": True})  # older, still open
        [event] = publish(dsn, [("k1", "t", {})])
        with relaying(runner), psycopg.connect(dsn, autocommit=True) as conn:
            wait_for(conn, event, sink=SINK, timeout=LONG)
            [late] = [r[0] for r in conn.execute("SELECT id FROM outbox.events WHERE payload ? 'late'")] or [None]
            assert late is None, "the open transaction's event is invisible until it commits"
            blocker.commit()
            [late_id] = [r[0] for r in conn.execute("SELECT id FROM outbox.events WHERE payload ? 'late'")]
            wait_for(conn, late_id, sink=SINK, timeout=LONG)


def test_dead_lettered_event_raises_at_once_with_its_error(dsn: str, pool: ConnectionPool[Any]) -> None:
    reason = "message too large (2 MB > 1 MB)"

    def fail(e: StoredEvent, n: int) -> Failure | None:
        return Failure(reason, retriable=False) if e.key == "poison" else None

    sink = RecordingSink(fail=fail)
    runner = runner_for(sink, pool, make_settings(dsn, "w"))
    fine, poison = publish(dsn, [("k1", "t", {}), ("poison", "t", {})])

    with psycopg.connect(dsn, autocommit=True) as conn:
        with relaying(runner):
            start = time.monotonic()
            with pytest.raises(EventDeadLettered) as dead:
                wait_for(conn, [fine, poison], sink=SINK, timeout=LONG)
            assert time.monotonic() - start < AT_ONCE, "a dead letter must not wait for the timeout"
        assert (dead.value.sink, dead.value.event_id, dead.value.last_error) == (SINK, poison, reason)
        assert reason in str(dead.value)
        assert dead_letters(dsn) == {poison: (1, reason)}

        # Already dead before the call (no relay running any more): the first poll says so.
        start = time.monotonic()
        with pytest.raises(EventDeadLettered):
            wait_for(conn, poison, sink=SINK, timeout=LONG)
        assert time.monotonic() - start < AT_ONCE
        wait_for(conn, fine, sink=SINK, timeout=0)  # the other key was applied


def test_waits_through_retries_until_delivered(dsn: str, pool: ConnectionPool[Any]) -> None:
    healed = threading.Event()
    head, behind = publish(dsn, [("k1", "t", {"n": 1}), ("k1", "t", {"n": 2})])

    def fail(e: StoredEvent, n: int) -> Failure | None:
        return Failure("broker unavailable") if e.id == head and not healed.is_set() else None

    sink = RecordingSink(fail=fail)
    runner = runner_for(sink, pool, make_settings(dsn, "w", max_attempts=1000))

    with relaying(runner), psycopg.connect(dsn, autocommit=True) as conn:
        wait_until(lambda: parked_ids(dsn) == {head, behind}, message="the key to be parked")
        with pytest.raises(WaitTimeout) as timed_out:
            wait_for(conn, [head, behind], sink=SINK, timeout=0.3)
        assert (timed_out.value.pending, timed_out.value.retrying) == ((), (head, behind))
        assert timed_out.value.last_error == "broker unavailable"
        # The event queued behind the failing head has no error of its own: the head's is reported.
        with pytest.raises(WaitTimeout) as timed_out:
            wait_for(conn, behind, sink=SINK, timeout=0)
        assert timed_out.value.last_error == "broker unavailable"

        with later(0.2, healed.set):
            wait_for(conn, behind, sink=SINK, timeout=LONG)
            assert healed.is_set(), "returned while the key was still failing"
    attempts = [a for a in sink.attempts if a.key == "k1"]
    assert not attempts[0].ok and attempts[-1].ok
    assert [a.event_id for a in attempts if a.ok] == [head, behind]


def test_several_events_at_once(dsn: str, pool: ConnectionPool[Any]) -> None:
    healed = threading.Event()

    def fail(e: StoredEvent, n: int) -> Failure | None:
        return Failure("handler failed") if e.key == "slow" and not healed.is_set() else None

    sink = RecordingSink(fail=fail)
    runner = runner_for(sink, pool, make_settings(dsn, "w", max_attempts=1000))
    with psycopg.connect(dsn) as tx:
        published = Outbox(default_topic=TOPIC).publish_many(tx, [
            {"key": "a", "type": "t", "payload": {}},
            {"key": "b", "type": "t", "payload": {}},
            {"key": "slow", "type": "t", "payload": {}},
        ])
    a, b, slow = published

    with relaying(runner), psycopg.connect(dsn, autocommit=True) as conn:
        # Published values and bare ids, a duplicate too; the two fast ones are applied meanwhile.
        wait_for(conn, [a, b.id, a.id], sink=SINK, timeout=LONG)
        with pytest.raises(WaitTimeout) as timed_out:
            wait_for(conn, published, sink=SINK, timeout=0.3)
        assert (timed_out.value.pending, timed_out.value.retrying) == ((), (slow.id,))
        assert "did not apply 1 event(s)" in str(timed_out.value)

        with later(0.2, healed.set):
            wait_for(conn, iter(published), sink=SINK, timeout=LONG)
            assert healed.is_set()
    assert {a.id, b.id, slow.id} <= sink.delivered_ids()


def test_a_sink_not_registered_yet_is_waited_for_then_named(dsn: str, pool: ConnectionPool[Any]) -> None:
    """A relay may still be starting when the API waits: an unregistered sink is "not yet", and
    the timeout names it (a typo ends the same way, with the name in the message)."""
    register(dsn)
    [event] = publish(dsn, [("k1", "t", {})])
    with psycopg.connect(dsn, autocommit=True) as conn:
        start = time.monotonic()
        with pytest.raises(ConfigurationError, match="no sink named 'projection-typo' was registered within"):
            wait_for(conn, event, sink="projection-typo", timeout=0.3)
        assert time.monotonic() - start >= 0.3
        with pytest.raises(ConfigurationError):
            wait_for(conn, [], sink="projection-typo", timeout=0.05)
        wait_for(conn, [], sink=SINK, timeout=0)  # nothing to wait for on a known sink

        # The sink appears while we wait (its relay starts late) and delivers.
        sink = RecordingSink("late", name="late-sink")

        def late_relay() -> None:
            time.sleep(0.2)
            run_until(runner_for(sink, pool, make_settings(dsn, "late")), lambda: event in sink.delivered_ids())

        relay = threading.Thread(target=late_relay)
        relay.start()
        try:
            wait_for(conn, event, sink="late-sink", timeout=LONG)
        finally:
            relay.join(20)
        assert event in sink.delivered_ids()


def test_unknown_event_ids(dsn: str) -> None:
    register(dsn)
    [known] = publish(dsn, [("k1", "t", {})])
    with psycopg.connect(dsn) as tx:
        rolled_back = Outbox(default_topic=TOPIC).publish(tx, key="k2", type="t", payload={}).id
        tx.rollback()
    never = uuid.uuid4()

    with psycopg.connect(dsn, autocommit=True) as conn:
        start = time.monotonic()
        with pytest.raises(UnknownEvent) as unknown:
            wait_for(conn, [known, rolled_back, never], sink=SINK, timeout=LONG)
        assert time.monotonic() - start < AT_ONCE
        assert unknown.value.event_ids == (rolled_back, never)
        assert str(rolled_back) in str(unknown.value)
        with pytest.raises(TypeError, match="not str"):
            wait_for(conn, str(known), sink=SINK)  # type: ignore[arg-type]


def test_refuses_to_wait_inside_the_publishing_transaction(dsn: str, pool: ConnectionPool[Any]) -> None:
    runner = runner_for(RecordingSink(), pool, make_settings(dsn, "w"))
    with psycopg.connect(dsn) as conn:
        event = Outbox(default_topic=TOPIC).publish(conn, key="k1", type="t", payload={})
        start = time.monotonic()
        with pytest.raises(OpenTransaction, match="Commit first"):
            wait_for(conn, event, sink=SINK, timeout=LONG)
        assert time.monotonic() - start < AT_ONCE
        # The caller's transaction is left as it was: still open, and it commits.
        assert conn.info.transaction_status == pq.TransactionStatus.INTRANS
        conn.commit()

        with relaying(runner):
            wait_for(conn, event, sink=SINK, timeout=LONG)
        # Each poll was committed: the connection is back outside any transaction.
        assert conn.info.transaction_status == pq.TransactionStatus.IDLE


def test_polls_hold_no_transaction_open(dsn: str, pool: ConnectionPool[Any]) -> None:
    gate = threading.Event()
    runner = runner_for(RecordingSink(gate=gate), pool, make_settings(dsn, "w"))
    [event] = publish(dsn, [("k1", "t", {})])
    outcome: list[BaseException | None] = []

    # Not autocommit, and REPEATABLE READ: polls sharing one transaction would never see the cursor move.
    with relaying(runner), psycopg.connect(dsn) as conn:
        conn.isolation_level = psycopg.IsolationLevel.REPEATABLE_READ
        pid = conn.info.backend_pid

        def waiter() -> None:
            try:
                wait_for(conn, event, sink=SINK, timeout=10, poll=Poll(first=0.005, most=0.02))
                outcome.append(None)
            except BaseException as exc:
                outcome.append(exc)

        thread = threading.Thread(target=waiter)
        thread.start()
        ages = []  # seconds the waiter's current transaction has been open, sampled while it waits
        with psycopg.connect(dsn, autocommit=True) as probe:
            for _ in range(40):
                row = probe.execute("SELECT extract(epoch FROM clock_timestamp() - xact_start)::float8 "
                                    "FROM pg_stat_activity WHERE pid = %s", (pid,)).fetchone()
                assert row is not None
                ages.append(row[0] or 0.0)
                time.sleep(0.01)
        gate.set()
        thread.join(LONG)
    assert outcome == [None]
    # A transaction held across polls would be as old as the wait (about 0.5 s by the last samples).
    assert max(ages) < 0.1, ages


def test_async_twin(dsn: str, pool: ConnectionPool[Any]) -> None:
    gate = threading.Event()

    def fail(e: StoredEvent, n: int) -> Failure | None:
        return Failure("no such topic", retriable=False) if e.key == "poison" else None

    runner = runner_for(RecordingSink(gate=gate, fail=fail), pool, make_settings(dsn, "w"))
    outbox = Outbox(default_topic=TOPIC)

    async def main() -> None:
        async with await psycopg.AsyncConnection.connect(dsn) as conn:
            event = await outbox.apublish(conn, key="k1", type="t", payload={})
            with pytest.raises(OpenTransaction):
                await wait_for_async(conn, event, sink=SINK, timeout=LONG)
            await conn.commit()

            with pytest.raises(WaitTimeout):  # held at the gate
                await wait_for_async(conn, event, sink=SINK, timeout=0.3)
            asyncio.get_running_loop().call_later(0.2, gate.set)
            await wait_for_async(conn, event, sink=SINK, timeout=LONG)
            assert gate.is_set()
            assert conn.info.transaction_status == pq.TransactionStatus.IDLE

        async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as conn:
            async with conn.transaction():
                poison = await outbox.apublish(conn, key="poison", type="t", payload={})
            with pytest.raises(EventDeadLettered, match="no such topic"):
                await wait_for_async(conn, poison, sink=SINK, timeout=LONG)
            with pytest.raises(ConfigurationError, match="no sink named 'projection-typo'"):
                await wait_for_async(conn, poison, sink="projection-typo", timeout=0.2)

    with relaying(runner):
        asyncio.run(main())
    assert fetch_all(dsn, "SELECT count(*) FROM outbox.dead_letters")[0][0] == 1
