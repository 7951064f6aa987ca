"""The testing kit (outbox_relay.testing) against a real PostgreSQL: reading what a test's own
transaction published, the assertions (passing, and failing with a useful message), and
apply_projection, checked against what the real relay hands the same projection.

The example test of the order service (examples/test_order_service.py) runs here too, as a user
runs it: ``pytest examples/test_order_service.py`` with ``OUTBOX_DSN`` set.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import subprocess
import sys
import uuid
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any
from unittest.mock import ANY

import psycopg
import pytest
from psycopg_pool import ConnectionPool
from pydantic import BaseModel
from sqlalchemy import create_engine
from sqlalchemy.orm import Session
from sqlalchemy.pool import NullPool

from outbox_relay import Outbox, store
from outbox_relay.errors import EventDeadLettered, NonRetriableDelivery, OutboxError, UnknownEvent
from outbox_relay.relay import SinkRunner
from outbox_relay.testing import (
    FakeOutbox,
    PublishedEvent,
    apublished,
    assert_not_published,
    assert_published,
    published,
)
from projections import FenceToken, ProjectionEvent, projection
from projections.sink import ProjectionSink
from projections.testing import apply_projection
from projections.testing_async import aapply_projection
from tests.integration.relay_helpers import (  # noqa: F401  (pool_fixture provides `pool`)
    ALL_BUCKETS,
    dead_letters,
    fetch_all,
    make_settings,
    pool_fixture,
    run_until,
    undelivered,
)
from tests.servers import sqlalchemy_url

ROOT = Path(__file__).resolve().parents[2]
outbox = Outbox(default_topic="orders")

TABLES = """
CREATE TABLE totals (customer text PRIMARY KEY, orders int NOT NULL, cents bigint NOT NULL);
CREATE TABLE seen (n bigserial PRIMARY KEY, event_id uuid NOT NULL, key text NOT NULL)
"""


@pytest.fixture
def shop(dsn: str) -> str:
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(TABLES)
    return dsn


@pytest.fixture
def conn(shop: str) -> Iterator[psycopg.Connection[Any]]:
    """A test's connection: everything it does is one transaction, rolled back at the end."""
    with psycopg.connect(shop) as c:
        yield c
        c.rollback()


def seen(conn: psycopg.Connection[Any]) -> list[tuple[uuid.UUID, str]]:
    return [(r[0], r[1]) for r in conn.execute("SELECT event_id, key FROM seen ORDER BY n")]


def totals(conn: psycopg.Connection[Any]) -> list[tuple[str, int, int]]:
    return [(r[0], r[1], int(r[2])) for r in conn.execute("SELECT customer, orders, cents FROM totals ORDER BY 1")]


class Paid(BaseModel):
    customer: str
    cents: int


@projection("totals", events=["OrderPlaced", "OrderPaid"], tables=["totals", "seen"])
def totals_projection(event: ProjectionEvent[Any], tx: Any) -> None:
    p = event.payload
    if event.type == "OrderPlaced":
        tx.execute("INSERT INTO totals VALUES (%s, 1, 0) "
                   "ON CONFLICT (customer) DO UPDATE SET orders = totals.orders + 1", (p["customer"],))
    else:
        tx.execute("UPDATE totals SET cents = cents + %s WHERE customer = %s", (p["cents"], p["customer"]))
    tx.execute("INSERT INTO seen (event_id, key) VALUES (%s, %s)", (event.id, event.key))


# -- published -----------------------------------------------------------------------------------


def test_published_sees_the_tests_own_open_transaction_in_position_order(shop: str) -> None:
    when = datetime(2026, 11, 1, 12, 0, tzinfo=UTC)
    with psycopg.connect(shop, autocommit=True) as earlier:
        with earlier.transaction():
            first = outbox.publish(earlier, type="OrderPlaced", key="order:1", payload={"n": 1})
        with psycopg.connect(shop) as other:  # another transaction, never committed: invisible
            outbox.publish(other, type="OrderPlaced", key="order:1", payload={"n": "other"})
            with psycopg.connect(shop) as conn:
                b = outbox.publish(conn, type="OrderPlaced", key="order:2", payload={"n": 2}, topic="billing")
                c = outbox.publish_many(conn, [
                    {"type": "OrderPaid", "key": "order:1", "payload": {"n": 3}, "headers": {"trace": "t1"},
                     "idempotency_key": "paid-1", "time": when},
                    {"type": "OrderShipped", "key": "order:1", "payload": [1, "x"]},
                ])
                everything = published(conn)
                assert [e.id for e in everything] == [first.id, b.id, c[0].id, c[1].id]
                assert [e.type for e in published(conn, key="order:1")] == ["OrderPlaced", "OrderPaid",
                                                                             "OrderShipped"]
                assert [e.id for e in published(conn, topic="billing")] == [b.id]
                assert [e.id for e in published(conn, type="OrderPaid", key="order:1")] == [c[0].id]
                assert published(conn, key="order:3") == []
                paid = everything[2]
                assert paid == PublishedEvent(
                    id=c[0].id, type="OrderPaid", key="order:1", topic="orders", payload={"n": 3},
                    headers={"trace": "t1"}, idempotency_key="paid-1", time=when, position=paid.position)
                assert everything[0].time is None and everything[3].payload == [1, "x"]
                positions = [e.position for e in everything]
                assert positions == sorted(positions) and len(set(positions)) == 4
                conn.rollback()
            other.rollback()
        # An autocommit connection with no transaction open reads too (publish would refuse it).
        assert [e.id for e in published(earlier)] == [first.id]


def test_published_reads_through_every_connection_a_producer_holds(shop: str) -> None:
    with psycopg.connect(shop) as conn:
        one = outbox.publish(conn, type="A", key="k", payload=1)
        with conn.cursor() as cur:
            assert [e.id for e in published(cur, key="k")] == [one.id]
        conn.commit()
    engine = create_engine(sqlalchemy_url(shop), poolclass=NullPool)
    try:
        with engine.connect() as sa:
            two = outbox.publish(sa, type="B", key="k", payload=2)
            assert [e.id for e in published(sa, key="k")] == [one.id, two.id]
            sa.rollback()
        with Session(engine) as session:
            three = outbox.publish(session, type="C", key="k", payload=3)
            assert [e.type for e in published(session, key="k")] == ["A", "C"]
            assert published(session, key="k")[1].id == three.id
            session.rollback()
    finally:
        engine.dispose()

    async def main() -> None:
        from sqlalchemy.ext.asyncio import AsyncSession, create_async_engine

        async with await psycopg.AsyncConnection.connect(shop) as aconn:
            four = await outbox.apublish(aconn, type="D", key="k", payload=4)
            assert [e.id for e in await apublished(aconn, key="k")] == [one.id, four.id]
            async with aconn.cursor() as acur:
                assert len(await apublished(acur)) == 2
            with pytest.raises(TypeError, match=r"await apublished"):
                published(aconn)
            with psycopg.connect(shop, autocommit=True) as sync, \
                    pytest.raises(TypeError, match=r"not async: use published"):
                await apublished(sync)
            await aconn.rollback()
        aengine = create_async_engine(sqlalchemy_url(shop), poolclass=NullPool)
        try:
            async with aengine.connect() as asa:
                await outbox.apublish(asa, type="E", key="k", payload=5)
                assert [e.type for e in await apublished(asa, key="k")] == ["A", "E"]
                await asa.rollback()
            async with AsyncSession(aengine) as asession:
                await outbox.apublish(asession, type="F", key="k", payload=6)
                assert [e.type for e in await apublished(asession, key="k")] == ["A", "F"]
                await asession.rollback()
        finally:
            await aengine.dispose()

    asyncio.run(main())
    with pytest.raises(TypeError, match=r"cannot read events from a str"):
        published("postgresql://nowhere")


# -- assertions ----------------------------------------------------------------------------------


def test_assert_published_passes_on_exactly_the_expected_events_in_order(conn: psycopg.Connection[Any]) -> None:
    placed = outbox.publish(conn, type="OrderPlaced", key="order:1", payload={"order_id": 1, "customer": "ann"})
    outbox.publish(conn, type="OrderPlaced", key="order:2", payload={"order_id": 2, "customer": "bob"})
    outbox.publish(conn, type="OrderPaid", key="order:1", payload={"order_id": 1, "paid_at": "2026-11-01"},
                   headers={"trace": "x"}, idempotency_key="pay-1")
    got = assert_published(conn, [
        ("OrderPlaced", {"order_id": 1, "customer": "ann"}),
        {"type": "OrderPaid", "payload": {"order_id": 1, "paid_at": ANY}, "headers": {"trace": "x"},
         "idempotency_key": "pay-1", "topic": "orders", "id": ANY},
    ], key="order:1")
    assert got[0].id == placed.id
    assert_published(conn, ["OrderPlaced", "OrderPlaced", "OrderPaid"])
    assert_published(conn, [{"key": "order:1", "id": placed}, {"key": "order:2"}], type="OrderPlaced")
    assert_published(conn, [], key="order:3")
    assert_not_published(conn, key="order:3")
    assert_not_published(conn, type="OrderCancelled", key="order:1")
    assert_not_published(conn, topic="billing")


def failure(call: Any, *args: Any, **kwargs: Any) -> str:
    with pytest.raises(AssertionError) as caught:
        call(*args, **kwargs)
    return str(caught.value)


def test_assert_published_fails_with_the_difference_event_by_event(conn: psycopg.Connection[Any]) -> None:
    outbox.publish(conn, type="OrderPlaced", key="order:1", payload={"order_id": 1})
    outbox.publish(conn, type="OrderPaid", key="order:1", payload={"order_id": 1, "cents": 3000})
    outbox.publish(conn, type="OrderShipped", key="order:1", payload={"order_id": 1})

    message = failure(assert_published, conn, [("OrderPlaced", {"order_id": 1}),
                                               ("OrderPaid", {"order_id": 1, "cents": 2999})], key="order:1")
    assert message.splitlines() == [
        "assert_published: the events with key='order:1' are not the expected ones (2 expected, 3 published), "
        "in position order:",
        '  1 ok         OrderPlaced {"order_id": 1}',
        '  2 DIFFERS    expected:  OrderPaid {"cents": 2999, "order_id": 1}',
        '               published: OrderPaid {"cents": 3000, "order_id": 1}   (payload differs)',
        '  3 UNEXPECTED published: OrderShipped {"order_id": 1} key="order:1" topic="orders" id="'
        + str(published(conn, type="OrderShipped")[0].id) + '"',
    ]

    # The same events in another order: said so.
    message = failure(assert_published, conn, ["OrderPaid", "OrderPlaced", "OrderShipped"], key="order:1")
    assert "  1 DIFFERS    expected:  OrderPaid" in message
    assert "(type differs)" in message
    assert message.endswith("The same events were published, in another order.")

    # Fewer published than expected.
    message = failure(assert_published, conn, ["OrderPlaced", "OrderPaid", "OrderShipped", "OrderClosed"],
                      key="order:1")
    assert "  4 MISSING    expected:  OrderClosed" in message

    # Nothing under the key asked for (a typo, say): what is there is listed.
    message = failure(assert_published, conn, ["OrderPlaced"], key="order:01")
    assert "(1 expected, 0 published)" in message
    assert "Nothing was published with key='order:01'; the 3 event(s) visible are:" in message
    assert "  1 x key='order:1' type='OrderPaid' topic='orders'" in message

    message = failure(assert_not_published, conn, key="order:1", type="OrderPaid")
    assert message.splitlines()[0] == "assert_not_published: 1 event(s) with key='order:1', type='OrderPaid' were " \
                                      "published:"
    assert message.splitlines()[1].startswith('  OrderPaid {"cents": 3000, "order_id": 1} key="order:1" '
                                              'topic="orders" id="')
    assert failure(assert_not_published, conn).startswith("assert_not_published: 3 event(s) in the outbox were")


def test_assert_published_names_a_malformed_expectation(conn: psycopg.Connection[Any]) -> None:
    with pytest.raises(TypeError, match=r"expected must be a list of events, not a str \(write \['OrderPlaced'\]\)"):
        assert_published(conn, "OrderPlaced")
    with pytest.raises(TypeError, match=r"expected event #2 \{'type': 'A', 'paylod': 1\}: unknown field\(s\) paylod"):
        assert_published(conn, ["A", {"type": "A", "paylod": 1}])
    with pytest.raises(TypeError, match=r"expected event #1 is 42: give a type name, a \(type, payload\) pair"):
        assert_published(conn, [42])
    with pytest.raises(TypeError, match=r"expected event #1 \{\}: no fields"):
        assert_published(conn, [{}])


def test_the_assertions_take_a_fake_outbox_or_a_list_of_events(conn: psycopg.Connection[Any]) -> None:
    fake = FakeOutbox(default_topic="orders")
    fake.publish(None, type="OrderPlaced", key="order:1", payload={"order_id": 1})
    fake.publish(None, type="OrderPaid", key="order:1", payload={"order_id": 1})
    assert_published(fake, ["OrderPlaced", "OrderPaid"], key="order:1")
    assert "2 DIFFERS" in failure(assert_published, fake, ["OrderPlaced", "OrderShipped"], key="order:1")
    assert_not_published(fake, key="order:2")

    async def read() -> list[PublishedEvent]:
        async with await psycopg.AsyncConnection.connect(conn.info.dsn) as aconn:
            await outbox.apublish(aconn, type="OrderPlaced", key="order:9", payload={})
            return await apublished(aconn)

    events = asyncio.run(read())  # the async way: read with apublished, then assert on the list
    assert_published(events, ["OrderPlaced"], key="order:9")
    assert "UNEXPECTED" in failure(assert_published, events, [], key="order:9")


# -- apply_projection ----------------------------------------------------------------------------


def test_apply_projection_runs_the_handler_in_the_tests_transaction(shop: str) -> None:
    with psycopg.connect(shop) as conn:
        a = outbox.publish(conn, type="OrderPlaced", key="cust-1", payload={"customer": "cust-1"})
        b = outbox.publish(conn, type="OrderPaid", key="cust-1", payload={"customer": "cust-1", "cents": 250})
        outbox.publish(conn, type="CustomerRenamed", key="cust-1", payload={})  # a type it does not take
        c = outbox.publish(conn, type="OrderPlaced", key="cust-2", payload={"customer": "cust-2"})
        applied = apply_projection(conn, totals_projection)
        assert [e.id for e in applied] == [a.id, b.id, c.id]
        assert totals(conn) == [("cust-1", 1, 250), ("cust-2", 1, 0)]
        # Not committed: the handler's writes are the test's, and roll back with it.
        assert fetch_all(shop, "SELECT count(*) FROM totals") == [(0,)]
        conn.rollback()
    assert fetch_all(shop, "SELECT count(*) FROM totals") == [(0,)]


def test_apply_projection_applies_given_events_in_position_order_once(conn: psycopg.Connection[Any]) -> None:
    one = outbox.publish(conn, type="OrderPlaced", key="cust-1", payload={"customer": "cust-1"})
    two = outbox.publish(conn, type="OrderPaid", key="cust-1", payload={"customer": "cust-1", "cents": 1})
    other = outbox.publish(conn, type="OrderPlaced", key="cust-2", payload={"customer": "cust-2"})
    got = apply_projection(conn, totals_projection, [two, one.id, published(conn, key="cust-1")[1]])
    assert [e.id for e in got] == [one.id, two.id]  # position order, each once
    assert seen(conn) == [(one.id, "cust-1"), (two.id, "cust-1")]
    assert apply_projection(conn, totals_projection, other, key="cust-1") == []  # key narrows
    assert [e.id for e in apply_projection(conn, totals_projection, key="cust-2")] == [other.id]
    missing = uuid.uuid4()
    with pytest.raises(UnknownEvent, match=str(missing)):
        apply_projection(conn, totals_projection, [other.id, missing])
    with pytest.raises(TypeError, match=r"events: 'x' is not a published event"):
        apply_projection(conn, totals_projection, ["x"])  # type: ignore[list-item]


def test_apply_projection_hands_over_what_the_relay_hands_over(shop: str, pool: ConnectionPool[Any]) -> None:
    """The same events, once through the real relay (ProjectionSink under a SinkRunner) and once
    through apply_projection: each handler call gets an equal ProjectionEvent, and both end in the
    same dead letter for a payload the model refuses."""

    class Placed(BaseModel):
        customer: str

    got: dict[str, list[ProjectionEvent[Any]]] = {"relay": [], "kit": []}
    into = ["relay"]

    @projection("recorder", events={"OrderPlaced": Placed, "OrderPaid": Paid}, topics=["orders", "billing"])
    def recorder(event: ProjectionEvent[Any], tx: Any) -> None:
        got[into[0]].append(event)

    when = datetime(2026, 1, 2, 3, 4, 5, tzinfo=UTC)
    with psycopg.connect(shop) as conn:
        outbox.publish_many(conn, [
            {"type": "OrderPlaced", "key": "c1", "payload": {"customer": "c1"}, "headers": {"h": "v"}, "time": when},
            {"type": "OrderPaid", "key": "c1", "payload": {"customer": "c1", "cents": 5}},
            {"type": "OrderPaid", "key": "c2", "payload": {"customer": "c2", "cents": "lots"}},  # refused by Paid
            {"type": "OrderPlaced", "key": "c2", "payload": {"customer": "c2"}, "topic": "billing"},
            {"type": "OrderPlaced", "key": "c3", "payload": {"customer": "c3"}, "topic": "elsewhere"},
            {"type": "Other", "key": "c1", "payload": {}},
        ])
        outbox.publish(conn, type="OrderPaid", key="c1", payload={"customer": "c1", "cents": 7})
    sink = ProjectionSink(recorder, shop)
    try:
        with pool.connection() as c:
            store.register_sink(c, sink.name, sink.kind)
        runner = SinkRunner(sink, pool, make_settings(shop, "w"))
        runner.desired = set(ALL_BUCKETS)
        run_until(runner, lambda: undelivered(shop, "recorder") == 0)
        runner.release_all()
    finally:
        sink.close()
    relay_dead = dead_letters(shop, "recorder")
    fence = fetch_all(shop, "SELECT DISTINCT fence FROM outbox.cursors WHERE sink = 'recorder' AND fence > 0")
    assert len(fence) == 1

    into[0] = "kit"
    with psycopg.connect(shop) as conn:
        with pytest.raises(EventDeadLettered) as caught:
            apply_projection(conn, recorder, fence=fence[0][0])
        conn.rollback()
    assert {caught.value.event_id: (caught.value.attempts, caught.value.last_error)} == relay_dead
    assert "4 event(s) were applied" in caught.value.__notes__[0]
    relay_order = sorted(got["relay"], key=lambda e: e.position)  # the relay's order across keys is its own
    assert got["kit"] == relay_order
    assert [e.type for e in got["kit"]] == ["OrderPlaced", "OrderPaid", "OrderPlaced", "OrderPaid"]
    first = got["kit"][0]
    assert first.payload == Placed(customer="c1") and first.headers == {"h": "v"} and first.time == when
    assert first.token == FenceToken(fence[0][0], 1, *first.position) and not first.replay and first.attempt == 1


def test_a_failing_handler_fails_alone_as_in_the_relays_first_attempt(conn: psycopg.Connection[Any]) -> None:
    @projection("picky", events=["OrderPlaced"], tables=["seen"])
    def picky(event: ProjectionEvent[Any], tx: Any) -> None:
        tx.execute("INSERT INTO seen (event_id, key) VALUES (%s, %s)", (event.id, event.key))
        if event.payload.get("boom"):
            raise ValueError(f"no good: {event.payload['boom']}")
        if event.payload.get("never"):
            raise NonRetriableDelivery("never")

    ids = [p.id for p in outbox.publish_many(conn, [
        {"type": "OrderPlaced", "key": "a", "payload": {}},
        {"type": "OrderPlaced", "key": "b", "payload": {"boom": 1}},
        {"type": "OrderPlaced", "key": "c", "payload": {"never": True}},
        {"type": "OrderPlaced", "key": "b", "payload": {}},  # waits behind b's failure
        {"type": "OrderPlaced", "key": "c", "payload": {}},  # c's failure is for good: c moves on
        {"type": "OrderPlaced", "key": "b", "payload": {"boom": 2}},
    ])]
    with pytest.raises(ValueError, match="no good: 1") as caught:
        apply_projection(conn, picky)
    assert seen(conn) == [(ids[0], "a"), (ids[4], "c")]  # the failing handlers' writes are undone
    assert caught.value.__notes__ == [
        f"apply_projection('picky'): event {ids[1]} ('OrderPlaced', key 'b') failed; 2 event(s) were applied, 2 wait "
        "behind a failed event of their key (not attempted)",
        f"also failed: event {ids[2]} ('OrderPlaced', key 'c'): NonRetriableDelivery: never",
    ]
    conn.execute("SELECT 1")  # the transaction goes on


def test_a_handler_that_swallows_a_failed_statement_or_ends_the_transaction_is_reported(
        conn: psycopg.Connection[Any]) -> None:
    @projection("swallow", events=["A"])
    def swallow(event: ProjectionEvent[Any], tx: Any) -> None:
        with contextlib.suppress(psycopg.errors.DivisionByZero):
            tx.execute("SELECT 1/0")

    @projection("commits", events=["A"])
    def commits(event: ProjectionEvent[Any], tx: Any) -> None:
        tx.execute("COMMIT")

    one = outbox.publish(conn, type="A", key="k", payload={})
    with pytest.raises(OutboxError, match=r"a statement of the handler failed and the handler went on"):
        apply_projection(conn, swallow)
    conn.execute("SELECT 1")
    with pytest.raises(EventDeadLettered, match=r"the handler ended the transaction it was given .* what was "
                                                r"committed stays committed") as caught:
        apply_projection(conn, commits)
    assert caught.value.event_id == one.id


def test_apply_projection_on_an_autocommit_connection_commits_like_a_batch(shop: str) -> None:
    with psycopg.connect(shop, autocommit=True) as conn:
        with conn.transaction():
            outbox.publish(conn, type="OrderPlaced", key="cust-1", payload={"customer": "cust-1"})
            outbox.publish(conn, type="OrderPaid", key="cust-1", payload={"customer": "cust-1", "cents": "x"})
            outbox.publish(conn, type="OrderPlaced", key="cust-2", payload={"customer": "cust-2"})
        with pytest.raises(psycopg.errors.InvalidTextRepresentation):
            apply_projection(conn, totals_projection)
        assert conn.info.transaction_status == psycopg.pq.TransactionStatus.IDLE
    # Committed, except the failing event's writes.
    assert fetch_all(shop, "SELECT customer, orders, cents FROM totals ORDER BY 1") == [("cust-1", 1, 0),
                                                                                        ("cust-2", 1, 0)]


def test_async_handlers_and_sqlalchemy_connections(shop: str) -> None:
    @projection("atotals", events=["OrderPlaced"], tables=["seen"])
    async def atotals(event: ProjectionEvent[Any], tx: psycopg.AsyncConnection[Any]) -> None:
        await tx.execute("INSERT INTO seen (event_id, key) VALUES (%s, %s)", (event.id, event.key))

    with psycopg.connect(shop) as conn:
        with pytest.raises(TypeError, match=r"'atotals' has an async handler: use await aapply_projection"):
            apply_projection(conn, atotals)
        with pytest.raises(TypeError, match=r"not a projection"):
            apply_projection(conn, lambda e, tx: None)  # type: ignore[arg-type]
        with pytest.raises(TypeError, match=r"'totals' is applied on a database connection .* not on a FakeOutbox"):
            apply_projection(FakeOutbox(), totals_projection)

    engine = create_engine(sqlalchemy_url(shop), poolclass=NullPool)
    try:
        with engine.connect() as sa:
            one = outbox.publish(sa, type="OrderPlaced", key="s", payload={"customer": "s"})
            assert [e.id for e in apply_projection(sa, totals_projection)] == [one.id]
            assert sa.exec_driver_sql("SELECT key FROM seen").fetchall() == [("s",)]
            sa.rollback()
        with Session(engine) as session:
            outbox.publish(session, type="OrderPlaced", key="s", payload={"customer": "s"})
            assert len(apply_projection(session, totals_projection)) == 1
            session.rollback()
    finally:
        engine.dispose()

    async def main() -> None:
        from sqlalchemy.ext.asyncio import AsyncSession, create_async_engine

        async with await psycopg.AsyncConnection.connect(shop) as aconn:
            one = await outbox.apublish(aconn, type="OrderPlaced", key="a", payload={})
            assert [e.id for e in await aapply_projection(aconn, atotals)] == [one.id]
            assert await (await aconn.execute("SELECT event_id FROM seen")).fetchall() == [(one.id,)]
            with pytest.raises(TypeError, match=r"'totals' has a sync handler: use apply_projection"):
                await aapply_projection(aconn, totals_projection)
            await aconn.rollback()
        aengine = create_async_engine(sqlalchemy_url(shop), poolclass=NullPool)
        try:
            async with AsyncSession(aengine) as asession:
                await outbox.apublish(asession, type="OrderPlaced", key="b", payload={})
                assert len(await aapply_projection(asession, atotals)) == 1
                await asession.rollback()
        finally:
            await aengine.dispose()

    asyncio.run(main())
    assert fetch_all(shop, "SELECT count(*) FROM seen") == [(0,)]


# -- the example ---------------------------------------------------------------------------------


def test_the_example_test_of_the_order_service_passes(dsn: str) -> None:
    """examples/test_order_service.py, run as a user runs it (its own conftest, OUTBOX_DSN)."""
    env = {**os.environ, "OUTBOX_DSN": dsn, "PYTHONDONTWRITEBYTECODE": "1"}
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "examples/test_order_service.py"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    assert result.returncode == 0, result.stdout + result.stderr
    assert re.search(r"\b[1-9]\d* passed\b", result.stdout), result.stdout


# -- RecordingSink: a real relay, no Kafka ------------------------------------------------------------


def test_a_recording_sink_gets_what_a_real_relay_delivers_in_order_with_retries_and_dead_letters(dsn: str) -> None:
    """A Worker delivers to a RecordingSink as to Kafka: per key in order, a failed attempt retried (the
    key waits behind it), a non-retriable one dead-lettered, each attempt counted as the relay counts it."""
    from outbox_relay.sinks.engine import Failure as SinkFailure
    from outbox_relay.testing import RecordingSink
    from outbox_relay.worker import Worker

    def fail(event: Any, attempt: int) -> Any:
        if event.type == "Flaky" and attempt == 1:
            return "the broker said no"
        if event.type == "Poison":
            return SinkFailure("can never be sent", retriable=False)
        return None

    sink = RecordingSink("kafka", fail=fail)
    worker = Worker(make_settings(dsn, "kit-relay"), sinks=[sink])
    assert worker.start()
    try:
        outbox = Outbox(default_topic="orders")
        with psycopg.connect(dsn) as conn:
            outbox.publish_many(conn, [{"type": t, "key": "order:7", "payload": {}}
                                       for t in ("Placed", "Flaky", "Paid")]
                                + [{"type": "Poison", "key": "order:8", "payload": {}},
                                   {"type": "Placed", "key": "order:8", "payload": {}}])
        sink.wait_for(4)
    finally:
        worker.drain()
        worker.wait()
    assert [e.type for e in sink.delivered(key="order:7")] == ["Placed", "Flaky", "Paid"]
    assert [e.type for e in sink.delivered(key="order:8")] == ["Placed"]
    flaky = [(d.attempt, d.error) for d in sink.deliveries if d.event.type == "Flaky"]
    assert flaky == [(1, "the broker said no"), (2, None)]
    assert [(d.attempt, d.error) for d in sink.deliveries if d.event.type == "Poison"] == [(1, "can never be sent")]
    assert fetch_all(dsn, "SELECT count(*) FROM outbox.dead_letters WHERE sink = 'kafka'") == [(1,)]
    with pytest.raises(AssertionError, match=r"4 of 5 events delivered within 0.1s; failed attempts: .*Flaky"):
        sink.wait_for(5, timeout=0.1)


def test_a_recording_sink_refuses_a_kind_the_database_does_not_know() -> None:
    from outbox_relay.testing import RecordingSink

    with pytest.raises(ValueError, match="kind must be 'kafka' or 'projection'"):
        RecordingSink("x", kind="webhook")
