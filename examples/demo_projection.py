"""The demo's read model (examples/demo.py), run by its relays next to the Kafka delivery.

``customer_orders`` keeps the orders of the customers it knows: ``demo_customers`` is reference data
that another system loads. An order of a customer not loaded yet is rejected by the handler, retried
up to ``--max-attempts`` times, then dead-lettered with the handler's error; it blocks only its own
key. Once the customer is there, ``outbox-relay dead-letters retry`` applies it.

    outbox-relay run --projections demo_projection --projection customer_orders   # PYTHONPATH=examples
"""

from __future__ import annotations

from typing import Any

from projections import ProjectionEvent, projection

SCHEMA = """
CREATE TABLE IF NOT EXISTS demo_customers (
    name      text    PRIMARY KEY
);
CREATE TABLE IF NOT EXISTS customer_orders (
    order_id  bigint  PRIMARY KEY,
    customer  text    NOT NULL,
    amount    numeric NOT NULL
);
"""


class UnknownCustomer(LookupError):
    """The order names a customer the reference data does not have (yet)."""


@projection("customer_orders", events=["OrderPlaced"], tables=["customer_orders"])
def customer_orders(event: ProjectionEvent[Any], tx: Any) -> None:
    p = event.payload
    if tx.execute("SELECT 1 FROM demo_customers WHERE name = %s", (p["customer"],)).fetchone() is None:
        raise UnknownCustomer(f"unknown customer {p['customer']!r} (not in demo_customers yet)")
    tx.execute("INSERT INTO customer_orders (order_id, customer, amount) VALUES (%s, %s, %s)",
               (p["order_id"], p["customer"], p["amount"]))
