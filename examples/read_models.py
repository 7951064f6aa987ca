"""Read models of the order service (examples/order_service.py), kept by the relay.

    outbox-relay run --no-kafka --projections read_models --projection order_totals   # PYTHONPATH=examples
    outbox-relay rebuild order_totals --projections read_models

``order_totals``: per customer, orders placed, amount placed and amount paid. OrderPaid does not
name the customer, so the projection keeps which customer each order belongs to as well; both
tables belong to it (``tables=``), so a rebuild builds both afresh and swaps them in together.
Table names are unqualified: during a rebuild they resolve to the fresh copies.
"""

from __future__ import annotations

from decimal import Decimal
from typing import Any

from pydantic import BaseModel

from projections import ProjectionEvent, projection

SCHEMA = """
CREATE TABLE IF NOT EXISTS order_totals (
    customer     text    PRIMARY KEY,
    orders       int     NOT NULL,
    placed       numeric NOT NULL,
    paid         numeric NOT NULL
);
CREATE TABLE IF NOT EXISTS order_customers (
    order_id     bigint  PRIMARY KEY,
    customer     text    NOT NULL
);
"""


class OrderPlaced(BaseModel):
    order_id: int
    customer: str
    amount: Decimal


class OrderPaid(BaseModel):
    order_id: int
    payment_id: str
    amount: Decimal


@projection("order_totals", events={"OrderPlaced": OrderPlaced, "OrderPaid": OrderPaid},
            tables=["order_totals", "order_customers"])
def order_totals(event: ProjectionEvent[Any], tx: Any) -> None:
    """Runs in the relay's transaction: these writes and the relay's checkpoint commit together."""
    p = event.payload
    if isinstance(p, OrderPlaced):
        tx.execute("INSERT INTO order_customers (order_id, customer) VALUES (%s, %s) ON CONFLICT DO NOTHING",
                   (p.order_id, p.customer))
        tx.execute("INSERT INTO order_totals (customer, orders, placed, paid) VALUES (%s, 1, %s, 0) "
                   "ON CONFLICT (customer) DO UPDATE SET orders = order_totals.orders + 1, "
                   "placed = order_totals.placed + EXCLUDED.placed", (p.customer, p.amount))
    else:
        tx.execute("UPDATE order_totals t SET paid = t.paid + %s FROM order_customers c "
                   "WHERE c.order_id = %s AND t.customer = c.customer", (p.amount, p.order_id))
