"""The bench's read model: per customer, orders paid and cents, one upsert per event.

    outbox-relay run --no-kafka --projections bench_projection --projection bench_totals   # PYTHONPATH=bench
    outbox-relay rebuild bench_totals --projections bench_projection

The payload is the bench's own (``Bench.payload``: customer, amount_cents, ...), read as a plain
dict: no pydantic model, so the figure is the relay's and the upsert's, not validation's.
The table name is unqualified, so that a rebuild writes its shadow copy.
"""

from __future__ import annotations

from typing import Any

from projections import ProjectionEvent, projection

SCHEMA = """
CREATE TABLE bench_totals (
    customer text   PRIMARY KEY,
    orders   int    NOT NULL,
    cents    bigint NOT NULL
)
"""

UPSERT = ("INSERT INTO bench_totals (customer, orders, cents) VALUES (%s, 1, %s) "
          "ON CONFLICT (customer) DO UPDATE SET orders = bench_totals.orders + 1, "
          "cents = bench_totals.cents + EXCLUDED.cents")


@projection("bench_totals", events=["bench.order_paid"], tables=["bench_totals"])
def bench_totals(event: ProjectionEvent[Any], tx: Any) -> None:
    p = event.payload
    tx.execute(UPSERT, (p["customer"], p["amount_cents"]))


BATCH_UPSERT = ("INSERT INTO bench_totals (customer, orders, cents) "
                "SELECT * FROM unnest(%s::text[], %s::int[], %s::bigint[]) "
                "ON CONFLICT (customer) DO UPDATE SET orders = bench_totals.orders + EXCLUDED.orders, "
                "cents = bench_totals.cents + EXCLUDED.cents")


@projection("bench_totals_batched", events=["bench.order_paid"], tables=["bench_totals"], batch=True)
def bench_totals_batched(events: list[ProjectionEvent[Any]], tx: Any) -> None:
    """The same read model, set-based: one upsert per batch (a customer once per statement)."""
    orders: dict[str, int] = {}
    cents: dict[str, int] = {}
    for event in events:
        p = event.payload
        c = p["customer"]
        orders[c] = orders.get(c, 0) + 1
        cents[c] = cents.get(c, 0) + p["amount_cents"]
    customers = list(orders)
    tx.execute(BATCH_UPSERT, (customers, [orders[c] for c in customers], [cents[c] for c in customers]))
