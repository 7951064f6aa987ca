"""Tests of the order service (order_service.py) and its read model (read_models.py), written with
the testing kit, ``outbox_relay.testing``. No relay runs: each test looks at the events its own
transaction published, and applies the projection in that transaction.

    pytest examples/test_order_service.py          # fixtures in examples/conftest.py
"""

from __future__ import annotations

import asyncio
import contextlib
from decimal import Decimal
from typing import Any

import psycopg
import pytest
from order_service import (
    SCHEMA,
    OrderError,
    apay_order,
    aplace_order,
    order_key,
    pay_order,
    place_order,
)
from read_models import OrderPlaced, order_totals

from outbox_relay.testing import (
    apublished,
    assert_not_published,
    assert_published,
    published,
)
from projections.testing import apply_projection


def test_placing_and_paying_an_order_publishes_both_events_in_order(conn: psycopg.Connection[Any]) -> None:
    place_order(conn, 7, "alice", Decimal("30.00"))
    pay_order(conn, 7, "pay-7")

    assert_published(conn, [
        ("OrderPlaced", {"order_id": 7, "customer": "alice", "amount": "30.00"}),
        ("OrderPaid", {"order_id": 7, "payment_id": "pay-7", "amount": "30.00"}),
    ], key=order_key(7))


def test_a_retried_request_publishes_its_event_once(conn: psycopg.Connection[Any]) -> None:
    first = place_order(conn, 7, "alice", Decimal("30.00"))
    again = place_order(conn, 7, "alice", Decimal("30.00"))  # the client timed out and retried
    pay_order(conn, 7, "pay-7")
    pay_order(conn, 7, "pay-7")

    assert again.id == first.id and not again.created
    assert_published(conn, ["OrderPlaced", "OrderPaid"], key=order_key(7))


def test_a_refused_request_publishes_nothing(conn: psycopg.Connection[Any]) -> None:
    place_order(conn, 7, "alice", Decimal("30.00"))
    pay_order(conn, 7, "pay-7")
    with pytest.raises(OrderError, match="already paid"):
        pay_order(conn, 7, "another-payment")
    with pytest.raises(OrderError, match="does not exist"):
        pay_order(conn, 8, "pay-8")

    assert_published(conn, [
        "OrderPlaced",
        {"type": "OrderPaid", "payload": {"order_id": 7, "payment_id": "pay-7", "amount": "30.00"},
         "idempotency_key": "payment:pay-7"},
    ], key=order_key(7))
    assert_not_published(conn, key=order_key(8))


def test_a_transaction_that_rolls_back_leaves_no_event(conn: psycopg.Connection[Any]) -> None:
    with contextlib.suppress(RuntimeError), conn.transaction():
        place_order(conn, 9, "carol", Decimal("5.00"))
        raise RuntimeError("payment provider said no")

    assert_not_published(conn, key=order_key(9))


def test_the_order_totals_read_model(conn: psycopg.Connection[Any]) -> None:
    place_order(conn, 1, "alice", Decimal("30.00"))
    place_order(conn, 2, "alice", Decimal("12.50"))
    pay_order(conn, 1, "pay-1")
    place_order(conn, 3, "bob", Decimal("5.00"))

    # The handler runs in this test's transaction, as the relay would run it: payloads validated
    # into the declared models, in publish order per key.
    applied = apply_projection(conn, order_totals, published(conn))

    assert [e.type for e in applied] == ["OrderPlaced", "OrderPlaced", "OrderPaid", "OrderPlaced"]
    assert applied[0].payload == OrderPlaced(order_id=1, customer="alice", amount=Decimal("30.00"))
    rows = conn.execute("SELECT customer, orders, placed, paid FROM order_totals ORDER BY customer").fetchall()
    assert rows == [("alice", 2, Decimal("42.50"), Decimal("30.00")), ("bob", 1, Decimal("5.00"), Decimal("0"))]


def test_the_async_service(database: str) -> None:
    async def scenario() -> list[Any]:
        async with await psycopg.AsyncConnection.connect(database) as aconn:
            await aconn.execute(SCHEMA)
            await aplace_order(aconn, 21, "dave", Decimal("8.00"))
            await apay_order(aconn, 21, "pay-21")
            events = await apublished(aconn, key=order_key(21))
            await aconn.rollback()
            return events

    assert_published(asyncio.run(scenario()), ["OrderPlaced", "OrderPaid"], key=order_key(21))
