"""Batched projection handlers (``@projection(..., batch=True)``) against a real PostgreSQL: one call
per batch with set-based writes, exactly-once (G7) across a crash mid-batch and a fenced-out batch
(G5), a poison event inside a batch charged alone (G9), per-key order (G6), rebuilds equal to live
processing (G12), async handlers, ``rebuild --key`` and the testing kit on the same walk.

The relay loop is the real SinkRunner, the sink the real ProjectionSink. Nothing is mocked.
"""

from __future__ import annotations

import asyncio
import threading
from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any

import psycopg
import pytest
from psycopg_pool import ConnectionPool

from outbox_relay import store
from outbox_relay.errors import ConfigurationError, NonRetriableDelivery
from outbox_relay.publish import Outbox
from outbox_relay.relay import SinkRunner
from projections import ProjectionEvent, projection
from projections.rebuild import Rebuild, rebuild_key
from projections.sink import ProjectionSink
from projections.testing import apply_projection
from tests.integration.order_totals import applied, expected_totals, orders, per_key, totals
from tests.integration.relay_helpers import (  # noqa: F401  (pool_fixture provides `pool`)
    ALL_BUCKETS,
    dead_letters,
    fetch_all,
    make_settings,
    parked_ids,
    pool_fixture,
    publish,
    run_until,
    undelivered,
)

pytestmark = pytest.mark.pg15  # the PostgreSQL 15 step runs it too (scripts/test.sh)

TABLES = """
CREATE TABLE order_totals (customer text PRIMARY KEY, orders int NOT NULL, paid_cents bigint NOT NULL);
CREATE TABLE applied_log (n bigserial PRIMARY KEY, event_id uuid NOT NULL, key text NOT NULL,
                          replay boolean NOT NULL);
"""

UPSERT = """
INSERT INTO order_totals (customer, orders, paid_cents)
SELECT * FROM unnest(%s::text[], %s::int[], %s::bigint[])
ON CONFLICT (customer) DO UPDATE SET orders = order_totals.orders + EXCLUDED.orders,
                                     paid_cents = order_totals.paid_cents + EXCLUDED.paid_cents
"""
LOG = """
INSERT INTO applied_log (event_id, key, replay)
SELECT * FROM unnest(%s::uuid[], %s::text[], %s::boolean[])
"""

Hook = Callable[[list[ProjectionEvent[Any]], Any], None]


def _rows(events: list[ProjectionEvent[Any]]) -> tuple[list[Any], list[Any]]:
    """The batch as set-based statements' arrays; a payload that is not an amount raises (a poison event)."""
    orders: Counter[str] = Counter()
    cents: Counter[str] = Counter()
    for e in events:
        customer = e.payload["customer"]
        if e.type == "OrderPlaced":
            orders[customer] += 1
        else:
            amount = int(e.payload["cents"])
            if amount < 0:
                raise ValueError("negative amount")
            cents[customer] += amount
    customers = sorted(set(orders) | set(cents))
    totals = [customers, [orders[c] for c in customers], [cents[c] for c in customers]]
    log = [[e.id for e in events], [e.key for e in events], [e.replay for e in events]]
    return totals, log


def batched(before: Hook | None = None, calls: list[int] | None = None) -> Any:
    @projection("order_totals", events=["OrderPlaced", "OrderPaid"], tables=["order_totals", "applied_log"],
                batch=True)
    def apply(events: list[ProjectionEvent[Any]], tx: Any) -> None:
        if calls is not None:
            calls.append(len(events))
        if before is not None:
            before(events, tx)
        totals, log = _rows(events)
        tx.execute(UPSERT, totals)
        tx.execute(LOG, log)

    @apply.key_reset
    def reset(key: str, tx: Any) -> None:
        tx.execute("DELETE FROM order_totals WHERE customer = %s", (key,))
        tx.execute("DELETE FROM applied_log WHERE key = %s", (key,))

    return apply


@pytest.fixture
def live(dsn: str, pool: ConnectionPool[Any]) -> Iterator[Callable[..., SinkRunner]]:
    """``live(projection, worker=..., **settings)``: a SinkRunner over every bucket; sinks closed afterwards."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(TABLES)
    sinks: list[ProjectionSink] = []

    def make(p: Any, worker: str = "w", **settings: Any) -> SinkRunner:
        sink = ProjectionSink(p, dsn)
        sinks.append(sink)
        with pool.connection() as conn:
            store.register_sink(conn, sink.name, sink.kind)
        r = SinkRunner(sink, pool, make_settings(dsn, worker, **settings))
        r.desired = set(ALL_BUCKETS)
        return r

    yield make
    for s in sinks:
        s.close()


def test_a_batched_handler_gets_the_batch_in_one_call_in_per_key_order_exactly_once(
        dsn: str, live: Callable[..., SinkRunner]) -> None:
    events = orders(customers=20, per_customer=5)
    ids = publish(dsn, events)
    calls: list[int] = []
    r = live(batched(calls=calls), batch_size=500)
    run_until(r, lambda: len(applied(dsn)) >= len(ids))
    r.run_once()  # nothing left: nothing applied twice
    assert totals(dsn) == expected_totals(20, 5)
    log = applied(dsn)
    assert sorted(e for e, _ in log) == sorted(ids), "each event applied exactly once"
    assert per_key(log) == per_key(list(zip(ids, [k for k, _, _ in events], strict=True))), "per key, in order"
    assert max(calls) > 1 and sum(calls) == len(ids), f"one call per batch, not per event: {calls}"
    assert undelivered(dsn, "order_totals") == 0


def test_a_crash_mid_batch_applies_nothing_and_the_retry_applies_once(
        dsn: str, live: Callable[..., SinkRunner]) -> None:
    """The set-based writes of half the batch are done when the database drops the session: none lands."""
    ids = publish(dsn, orders(customers=4, per_customer=3))
    killed = threading.Event()

    def write_half_then_die(events: list[ProjectionEvent[Any]], tx: Any) -> None:
        if killed.is_set():
            return
        totals_, log = _rows(events[: len(events) // 2])
        tx.execute(UPSERT, totals_)
        tx.execute(LOG, log)
        killed.set()
        with psycopg.connect(dsn, autocommit=True) as admin:
            admin.execute("SELECT pg_terminate_backend(%s)", (tx.info.backend_pid,))

    r = live(batched(before=write_half_then_die))
    with pytest.raises(psycopg.OperationalError):
        r.run_once()
    assert killed.is_set()
    assert totals(dsn) == [] and applied(dsn) == [], "a crashed batch left writes behind"
    run_until(r, lambda: len(applied(dsn)) >= len(ids))  # the sink reconnects
    assert totals(dsn) == expected_totals(4, 3)
    assert sorted(e for e, _ in applied(dsn)) == sorted(ids)


def test_a_fenced_out_batch_rolls_back_its_set_based_writes(dsn: str, live: Callable[..., SinkRunner]) -> None:
    ids = publish(dsn, orders(customers=3, per_customer=2))
    stolen = threading.Event()

    def steal_once(events: list[ProjectionEvent[Any]], tx: Any) -> None:
        if not stolen.is_set():
            stolen.set()
            with psycopg.connect(dsn, autocommit=True) as thief:  # another worker took every lease over
                thief.execute("UPDATE outbox.cursors SET owner = 'thief', fence = fence + 1 "
                              "WHERE sink = 'order_totals' AND owner IS NOT NULL")

    r = live(batched(before=steal_once))
    r.run_once()
    assert stolen.is_set()
    assert totals(dsn) == [] and applied(dsn) == [], "a fenced-out batch wrote to the read model"
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("UPDATE outbox.cursors SET owner = NULL WHERE owner = 'thief'")
    again = live(batched(), worker="next")
    run_until(again, lambda: len(applied(dsn)) >= len(ids))
    assert totals(dsn) == expected_totals(3, 2)
    assert sorted(e for e, _ in applied(dsn)) == sorted(ids)


def test_a_poison_event_inside_a_batch_is_charged_alone_and_only_its_key_waits(
        dsn: str, live: Callable[..., SinkRunner]) -> None:
    events = [*orders(customers=5, per_customer=2),
              ("cust-bad", "OrderPlaced", {"customer": "cust-bad"}),
              ("cust-bad", "OrderPaid", {"customer": "cust-bad", "cents": -1}),  # poison
              ("cust-bad", "OrderPaid", {"customer": "cust-bad", "cents": 7}),
              ("cust-late", "OrderPlaced", {"customer": "cust-late"})]
    ids = publish(dsn, events)
    poison, after = ids[-3], ids[-2]
    calls: list[int] = []
    r = live(batched(calls=calls), max_attempts=3, batch_size=500)
    r.run_once()
    # First attempt: the batch call failed, the careful walk applied every event but the poison one
    # and the one behind it on its key.
    assert sorted(e for e, _ in applied(dsn)) == sorted(set(ids) - {poison, after})
    assert poison in parked_ids(dsn, "order_totals")
    assert calls[0] == len(ids) and calls[1:] == [1] * (len(ids) - 1), calls
    run_until(r, lambda: poison in dead_letters(dsn, "order_totals") and len(applied(dsn)) == len(ids) - 1)
    count, error = dead_letters(dsn, "order_totals")[poison]
    assert count == 3 and error == "ValueError: negative amount"
    assert set(dead_letters(dsn, "order_totals")) == {poison}, "only the poison event was charged"
    assert sorted(e for e, _ in applied(dsn)) == sorted(set(ids) - {poison})
    assert ("cust-bad", 1, 7) in totals(dsn)
    assert parked_ids(dsn, "order_totals") == set()


def test_a_non_retriable_failure_in_a_batch_dead_letters_at_once(dsn: str, live: Callable[..., SinkRunner]) -> None:
    ids = publish(dsn, [("a", "OrderPlaced", {"customer": "a"}), ("a", "OrderPaid", {"customer": "a", "cents": 5}),
                        ("b", "OrderPlaced", {"customer": "b"})])

    def refuse(events: list[ProjectionEvent[Any]], tx: Any) -> None:
        if any(e.id == ids[0] for e in events):
            raise NonRetriableDelivery("never")

    r = live(batched(before=refuse))
    run_until(r, lambda: ids[0] in dead_letters(dsn, "order_totals") and len(applied(dsn)) == 2)
    assert dead_letters(dsn, "order_totals")[ids[0]][0] == 1
    assert totals(dsn) == [("a", 0, 5), ("b", 1, 0)]


def test_async_batched_handlers_get_the_same_walk(dsn: str, live: Callable[..., SinkRunner]) -> None:
    ids = publish(dsn, [*orders(customers=3, per_customer=2), ("x", "OrderPaid", {"customer": "x", "cents": -1})])
    calls: list[int] = []

    @projection("order_totals", events=["OrderPlaced", "OrderPaid"], tables=["order_totals", "applied_log"],
                batch=True)
    async def apply(events: list[ProjectionEvent[Any]], tx: Any) -> None:
        calls.append(len(events))
        await asyncio.sleep(0)
        totals_, log = _rows(events)
        await tx.execute(UPSERT, totals_)
        await tx.execute(LOG, log)

    r = live(apply, max_attempts=1)
    run_until(r, lambda: len(applied(dsn)) == len(ids) - 1 and dead_letters(dsn, "order_totals"))
    assert set(dead_letters(dsn, "order_totals")) == {ids[-1]}
    assert totals(dsn) == expected_totals(3, 2)
    assert calls[0] == len(ids), "the whole batch in one call first"


def test_a_batched_rebuild_ends_in_the_state_live_processing_reached(
        dsn: str, live: Callable[..., SinkRunner]) -> None:
    events = [*orders(30, 4), ("cust-0", "OrderPaid", {"customer": "cust-0", "cents": -5})]  # one dead letter
    ids = publish(dsn, events)
    r = live(batched(), max_attempts=2, batch_size=64)
    run_until(r, lambda: len(applied(dsn)) == len(ids) - 1 and dead_letters(dsn, "order_totals"))
    live_state, live_dead = totals(dsn), set(dead_letters(dsn, "order_totals"))
    calls: list[int] = []

    # The rebuild's retries back off for minutes: under load its switch used to come between the poison
    # event's first attempt and its second (the one that dead-letters it), and swapped in the parked retry
    # instead of the live dead letter (dead letters set() after the rebuild). The replay now follows the live
    # dead letter without calling the handler, so no retry of its own decides the outcome.
    result = Rebuild(batched(calls=calls), make_settings(dsn, "rebuilder", max_attempts=2, batch_size=200,
                                                         backoff_base_seconds=600.0, backoff_max_seconds=600.0),
                     progress=None).run()

    assert result is not None and result.events == len(ids) and result.clean
    assert totals(dsn) == live_state, "rebuild (G12) differs from live processing"
    assert set(dead_letters(dsn, "order_totals")) == live_dead
    assert sorted(e for e, _ in applied(dsn)) == sorted(set(ids) - live_dead)
    assert {r[0] for r in fetch_all(dsn, "SELECT replay FROM applied_log")} == {True}
    assert max(calls) > 1, "the rebuild called the batched handler with batches"


def test_rebuild_key_runs_a_batched_handler_over_the_keys_history(dsn: str, live: Callable[..., SinkRunner]) -> None:
    ids = publish(dsn, orders(customers=3, per_customer=3))
    r = live(batched())
    run_until(r, lambda: len(applied(dsn)) == len(ids))
    live_state = totals(dsn)
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("UPDATE order_totals SET orders = 99 WHERE customer = 'cust-1'")  # drifted
    calls: list[int] = []
    assert rebuild_key(batched(calls=calls), dsn, "cust-1") == 6
    assert calls == [6], "the key's history in one call"
    assert totals(dsn) == live_state


def test_the_testing_kit_applies_a_batched_projection_by_the_same_walk(dsn: str) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(TABLES)
    outbox = Outbox(default_topic="orders")
    calls: list[int] = []
    with psycopg.connect(dsn) as conn:
        good = [outbox.publish(conn, type="OrderPlaced", key=f"c{i}", payload={"customer": f"c{i}"}).id
                for i in range(3)]
        bad = outbox.publish(conn, type="OrderPaid", key="c1", payload={"customer": "c1", "cents": -1}).id
        with pytest.raises(ValueError, match="negative amount") as caught:
            apply_projection(conn, batched(calls=calls), events=[*good, bad])
        assert calls == [4, 1, 1, 1, 1], "one call for the batch, then one per event"
        assert "3 event(s) were applied" in "".join(caught.value.__notes__)
        assert conn.execute("SELECT customer, orders FROM order_totals ORDER BY 1").fetchall() == [
            ("c0", 1), ("c1", 1), ("c2", 1)]
        assert {r[0] for r in conn.execute("SELECT event_id FROM applied_log")} == set(good)
        conn.rollback()


def test_batch_must_be_a_bool() -> None:
    with pytest.raises(ConfigurationError, match="batch must be True or False"):
        projection("p", events=["A"], batch="yes")  # type: ignore[arg-type]
