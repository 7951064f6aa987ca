"""Projections as a service would declare them, for tests that load them by module name."""

from __future__ import annotations

import os
import time
from typing import Any

from projections import ProjectionEvent, Registry, projection

registry = Registry()

# Seconds order_totals spends per event: tests that need a rebuild still running when they act.
APPLY_SECONDS = float(os.environ.get("OUTBOX_TEST_APPLY_SECONDS", "0"))


@projection("order_totals", events=["OrderPlaced", "OrderPaid"], tables=["order_totals"])
def order_totals(event: ProjectionEvent[Any], tx: Any) -> None:
    if APPLY_SECONDS:
        time.sleep(APPLY_SECONDS)
    p = event.payload
    if event.type == "OrderPlaced":
        tx.execute("INSERT INTO order_totals (customer, orders, paid_cents) VALUES (%s, 1, 0) "
                   "ON CONFLICT (customer) DO UPDATE SET orders = order_totals.orders + 1", (p["customer"],))
    else:
        tx.execute("UPDATE order_totals SET paid_cents = paid_cents + %s WHERE customer = %s",
                   (p["cents"], p["customer"]))


@registry.projection("customer_orders", events=["OrderPlaced"], tables=["customer_orders"])
def customer_orders(event: ProjectionEvent[Any], tx: Any) -> None:
    tx.execute("INSERT INTO customer_orders (customer, event_id) VALUES (%s, %s)",
               (event.payload["customer"], event.id))
