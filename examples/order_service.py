"""A small order service: every state change and its event commit together, or neither does.

    OUTBOX_DSN=postgresql://app@db/app python examples/order_service.py   # against your database
    python examples/order_service.py                                      # against an embedded PostgreSQL

Only the producer side runs here (no relay, no Kafka): the events wait in ``outbox.events``
until an ``outbox-relay run`` process delivers them (examples/demo.py shows both sides).

Patterns shown:
- the business write and ``outbox.publish`` share one transaction (psycopg sync and async);
- idempotency keys: a client that retries a request (after a timeout, say) gets the event
  stored the first time, with ``created=False``, and the business write is written to be
  repeatable too;
- a transaction that rolls back leaves no event behind.

The functions take a psycopg connection; ``conn.transaction()`` is a transaction of its own on an
autocommit connection and a savepoint inside a transaction the caller already opened, so they
also compose into bigger units of work. A SQLAlchemy Connection or Session works with
``outbox.publish`` the same way.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import sys
from collections.abc import Iterator
from decimal import Decimal
from typing import Any

import psycopg

from outbox_relay import Outbox, Published, migrate

TOPIC = "orders"
outbox = Outbox(default_topic=TOPIC)

SCHEMA = """
CREATE TABLE IF NOT EXISTS orders (
    id         bigint      PRIMARY KEY,
    customer   text        NOT NULL,
    amount     numeric     NOT NULL CHECK (amount > 0),
    status     text        NOT NULL DEFAULT 'placed' CHECK (status IN ('placed', 'paid')),
    payment_id text,
    updated_at timestamptz NOT NULL DEFAULT now()
)
"""


class OrderError(Exception):
    """The request can not be applied to the order as it stands (nothing was written)."""


def order_key(order_id: int) -> str:
    # The partition key: every event of one order reaches Kafka in publish order.
    return f"order:{order_id}"


def create_schema(conn: psycopg.Connection[Any]) -> None:
    with conn.transaction():
        conn.execute(SCHEMA)


# -- sync (psycopg.Connection) ----------------------------------------------------------------


def place_order(conn: psycopg.Connection[Any], order_id: int, customer: str, amount: Decimal) -> Published:
    """Create the order and publish OrderPlaced in one transaction. Safe to retry."""
    with conn.transaction():
        # Repeatable business write: a retried request finds the row and changes nothing.
        conn.execute("INSERT INTO orders (id, customer, amount) VALUES (%s, %s, %s) ON CONFLICT (id) DO NOTHING",
                     (order_id, customer, amount))
        return outbox.publish(
            conn,
            type="OrderPlaced",
            key=order_key(order_id),
            payload={"order_id": order_id, "customer": customer, "amount": str(amount)},
            idempotency_key=f"order:{order_id}:placed",
        )


def pay_order(conn: psycopg.Connection[Any], order_id: int, payment_id: str) -> Published:
    """Mark the order paid and publish OrderPaid in one transaction. Retrying one payment is safe."""
    with conn.transaction():
        # FOR UPDATE serialises concurrent requests for one order, so their events keep commit order.
        row = conn.execute("SELECT status, payment_id, amount FROM orders WHERE id = %s FOR UPDATE",
                           (order_id,)).fetchone()
        if row is None:
            raise OrderError(f"order {order_id} does not exist")
        status, paid_with, amount = row
        if status == "paid" and paid_with != payment_id:
            raise OrderError(f"order {order_id} is already paid (payment {paid_with})")
        if status == "placed":
            conn.execute("UPDATE orders SET status = 'paid', payment_id = %s, updated_at = now() WHERE id = %s",
                         (payment_id, order_id))
        # Same payment again: the idempotency key finds the first OrderPaid, created=False.
        return outbox.publish(
            conn,
            type="OrderPaid",
            key=order_key(order_id),
            payload={"order_id": order_id, "payment_id": payment_id, "amount": str(amount)},
            idempotency_key=f"payment:{payment_id}",
        )


# -- async (psycopg.AsyncConnection) ----------------------------------------------------------


async def aplace_order(conn: psycopg.AsyncConnection[Any], order_id: int, customer: str,
                       amount: Decimal) -> Published:
    async with conn.transaction():
        await conn.execute("INSERT INTO orders (id, customer, amount) VALUES (%s, %s, %s) "
                           "ON CONFLICT (id) DO NOTHING", (order_id, customer, amount))
        return await outbox.apublish(
            conn,
            type="OrderPlaced",
            key=order_key(order_id),
            payload={"order_id": order_id, "customer": customer, "amount": str(amount)},
            idempotency_key=f"order:{order_id}:placed",
        )


async def apay_order(conn: psycopg.AsyncConnection[Any], order_id: int, payment_id: str) -> Published:
    async with conn.transaction():
        cur = await conn.execute("SELECT status, payment_id, amount FROM orders WHERE id = %s FOR UPDATE",
                                 (order_id,))
        row = await cur.fetchone()
        if row is None:
            raise OrderError(f"order {order_id} does not exist")
        status, paid_with, amount = row
        if status == "paid" and paid_with != payment_id:
            raise OrderError(f"order {order_id} is already paid (payment {paid_with})")
        if status == "placed":
            await conn.execute("UPDATE orders SET status = 'paid', payment_id = %s, updated_at = now() "
                               "WHERE id = %s", (payment_id, order_id))
        return await outbox.apublish(
            conn,
            type="OrderPaid",
            key=order_key(order_id),
            payload={"order_id": order_id, "payment_id": payment_id, "amount": str(amount)},
            idempotency_key=f"payment:{payment_id}",
        )


# -- running it -------------------------------------------------------------------------------


@contextlib.contextmanager
def database() -> Iterator[str]:
    """OUTBOX_DSN if set, else a private PostgreSQL (needs the outbox-relay[embedded] extra)."""
    dsn = os.environ.get("OUTBOX_DSN")
    if dsn:
        yield dsn
        return
    from outbox_relay.private_servers import EmbeddedPostgres

    with EmbeddedPostgres() as pg:
        yield pg.dsn


def show(label: str, result: Published) -> None:
    print(f"  {label:<42} event {result.id}  created={result.created}")


async def async_part(dsn: str, first_id: int) -> None:
    async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as conn:
        show(f"aplace_order({first_id})", await aplace_order(conn, first_id, "bob", Decimal("12.50")))
        show(f"apay_order({first_id}, 'pay-{first_id}')", await apay_order(conn, first_id, f"pay-{first_id}"))


def main() -> int:
    with database() as dsn:
        applied = migrate(dsn)  # idempotent; in production run `outbox-relay migrate` at deploy time
        print(f"outbox schema: {len(applied)} migrations applied")
        # autocommit: each `with conn.transaction()` below is a real BEGIN ... COMMIT of its own.
        with psycopg.connect(dsn, autocommit=True) as conn:
            create_schema(conn)
            base = int(conn.execute("SELECT coalesce(max(id), 0) FROM orders").fetchone()[0])  # type: ignore[index]
            a, b, c = base + 1, base + 2, base + 3

            print("sync, one transaction per call:")
            first = place_order(conn, a, "alice", Decimal("30.00"))
            show(f"place_order({a})", first)
            again = place_order(conn, a, "alice", Decimal("30.00"))
            show(f"place_order({a}) retried", again)
            assert again.id == first.id and not again.created
            show(f"pay_order({a}, 'pay-{a}')", pay_order(conn, a, f"pay-{a}"))
            show(f"pay_order({a}, 'pay-{a}') retried", pay_order(conn, a, f"pay-{a}"))
            try:
                pay_order(conn, a, "another-payment")
            except OrderError as exc:
                print(f"  pay_order({a}, 'another-payment')            refused: {exc}")

            print("a transaction that rolls back publishes nothing:")
            with contextlib.suppress(RuntimeError), conn.transaction():
                # place_order's own transaction becomes a savepoint of this one and shares its fate.
                place_order(conn, c, "carol", Decimal("5.00"))
                raise RuntimeError("payment provider said no")
            gone = conn.execute("SELECT count(*) FROM outbox.events WHERE partition_key = %s",
                                (order_key(c),)).fetchone()
            print(f"  events for {order_key(c)} after the rollback: {gone[0] if gone else '?'}")

        print("async (psycopg.AsyncConnection):")
        asyncio.run(async_part(dsn, b))

        with psycopg.connect(dsn, autocommit=True) as conn:
            print("outbox.events now holds (the relay delivers them in this order per key):")
            rows = conn.execute(
                "SELECT partition_key, type, xid::text, seq, idempotency_key FROM outbox.events "
                "WHERE partition_key = ANY(%s) ORDER BY partition_key, xid, seq",
                ([order_key(a), order_key(b), order_key(c)],)).fetchall()
            for key, type_, xid, seq, idem in rows:
                print(f"  {key:<10} {type_:<12} position ({xid}, {seq})  idempotency_key={idem}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
