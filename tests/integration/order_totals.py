"""The order-totals read model the projection tests share: its events, its expected state, its rows."""

from __future__ import annotations

import uuid
from typing import Any

from tests.integration.relay_helpers import fetch_all


def orders(customers: int, per_customer: int) -> list[tuple[str, str, Any]]:
    """OrderPlaced then OrderPaid per order, keyed by customer (the partition key)."""
    out: list[tuple[str, str, Any]] = []
    for i in range(per_customer):
        for c in range(customers):
            out.append((f"cust-{c}", "OrderPlaced", {"customer": f"cust-{c}"}))
            out.append((f"cust-{c}", "OrderPaid", {"customer": f"cust-{c}", "cents": 100 * (i + 1)}))
    return out


def expected_totals(customers: int, per_customer: int) -> list[tuple[str, int, int]]:
    paid = sum(100 * (i + 1) for i in range(per_customer))
    return sorted((f"cust-{c}", per_customer, paid) for c in range(customers))


def totals(dsn: str) -> list[tuple[str, int, int]]:
    return [(c, o, int(p)) for c, o, p in fetch_all(dsn, "SELECT customer, orders, paid_cents FROM order_totals "
                                                         "ORDER BY customer")]


def applied(dsn: str) -> list[tuple[uuid.UUID, str]]:
    return [(r[0], r[1]) for r in fetch_all(dsn, "SELECT event_id, key FROM applied_log ORDER BY n")]


def per_key(pairs: list[tuple[uuid.UUID, str]]) -> dict[str, list[uuid.UUID]]:
    out: dict[str, list[uuid.UUID]] = {}
    for event_id, key in pairs:
        out.setdefault(key, []).append(event_id)
    return out
