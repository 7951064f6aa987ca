"""Orders with the SQLAlchemy ORM: events recorded on the session are written by its flushes.

    OUTBOX_DSN=postgresql://app@db/app python examples/sqlalchemy_orders.py   # against your database
    python examples/sqlalchemy_orders.py                                      # against an embedded PostgreSQL

Needs ``pip install 'outbox-relay[sqlalchemy]'`` (the async part: ``sqlalchemy[asyncio]``). Only the
producer side runs here: the events wait in ``outbox.events`` for an ``outbox-relay run`` process.

Patterns shown (docs/integrations.md explains the rules):
- ``track(Session, outbox)`` once; then ``record(session, ...)`` next to the changes, and the
  commit writes the orders and their events in one transaction;
- an id the database assigns: flush first, then record with it;
- an optional step in a savepoint (a coupon): when it fails, its event goes with it, the order's stays;
- an idempotency key: a retried payment request gets the stored event, ``created=False``;
- a unit of work that fails leaves no order and no event; ``AsyncSession`` with ``arecord``.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import sys
from collections.abc import Iterator
from decimal import Decimal

import psycopg
from sqlalchemy import ForeignKey, Identity, Numeric, create_engine
from sqlalchemy.exc import IntegrityError
from sqlalchemy.ext.asyncio import async_sessionmaker, create_async_engine
from sqlalchemy.orm import DeclarativeBase, Mapped, Session, mapped_column, sessionmaker

from outbox_relay import Outbox, migrate
from outbox_relay.contrib.sqlalchemy import Recorded, arecord, record, track

outbox = Outbox(default_topic="orders")


class Base(DeclarativeBase):
    pass


class Order(Base):
    __tablename__ = "sa_orders"
    id: Mapped[int] = mapped_column(Identity(), primary_key=True)
    customer: Mapped[str]
    amount: Mapped[Decimal] = mapped_column(Numeric)
    status: Mapped[str] = mapped_column(default="placed")
    payment_id: Mapped[str | None]


class CouponUse(Base):
    __tablename__ = "sa_coupon_uses"
    code: Mapped[str] = mapped_column(primary_key=True)  # each coupon once
    order_id: Mapped[int] = mapped_column(ForeignKey("sa_orders.id"))


class OrderError(Exception):
    """The request can not be applied to the order as it stands."""


def order_key(order_id: int) -> str:
    return f"order:{order_id}"  # the partition key: one order's events stay in order


def place_order(session: Session, customer: str, amount: Decimal, coupon: str | None = None) -> Order:
    order = Order(customer=customer, amount=amount)
    session.add(order)
    session.flush()  # the database assigns order.id; the event needs it
    record(session, type="OrderPlaced", key=order_key(order.id),
           payload={"order_id": order.id, "customer": customer, "amount": str(amount)})
    if coupon is not None:
        try:
            with session.begin_nested():  # the coupon is optional: a savepoint of its own
                session.add(CouponUse(code=coupon, order_id=order.id))
                record(session, type="CouponApplied", key=order_key(order.id),
                       payload={"order_id": order.id, "coupon": coupon})
        except IntegrityError:
            print(f"  coupon {coupon!r} was used before: order {order.id} goes on without it")
    return order


def pay_order(session: Session, order_id: int, payment_id: str) -> Recorded:
    order = session.get(Order, order_id, with_for_update=True)  # serialises requests for one order
    if order is None:
        raise OrderError(f"order {order_id} does not exist")
    if order.status == "paid" and order.payment_id != payment_id:
        raise OrderError(f"order {order_id} is already paid (payment {order.payment_id})")
    order.status, order.payment_id = "paid", payment_id
    # A retried request for the same payment: the idempotency key finds the first OrderPaid.
    return record(session, type="OrderPaid", key=order_key(order_id),
                  payload={"order_id": order_id, "payment_id": payment_id, "amount": str(order.amount)},
                  idempotency_key=f"payment:{payment_id}")


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


async def async_part(dsn: str) -> int:
    engine = create_async_engine("postgresql+psycopg://",
                                 async_creator=lambda: psycopg.AsyncConnection.connect(dsn))
    try:
        AsyncSession = async_sessionmaker(engine)
        track(AsyncSession, outbox)
        async with AsyncSession.begin() as session:
            order = Order(customer="dave", amount=Decimal("7.00"))
            session.add(order)
            await session.flush()
            order_id = order.id
            await arecord(session, type="OrderPlaced", key=order_key(order_id),
                          payload={"order_id": order_id, "customer": "dave", "amount": "7.00"})
        print(f"  order {order_id} placed")
        return order_id
    finally:
        await engine.dispose()


def main() -> int:
    with database() as dsn:
        migrate(dsn)  # idempotent; in production run `outbox-relay migrate` at deploy time
        # psycopg connects with the DSN as given (URL or key=value), so no SQLAlchemy URL is needed.
        engine = create_engine("postgresql+psycopg://", creator=lambda: psycopg.connect(dsn))
        Base.metadata.create_all(engine)
        SessionLocal = sessionmaker(engine)
        track(SessionLocal, outbox)
        coupon = f"WELCOME-{os.getpid()}"

        print("place two orders (the second tries the coupon the first used):")
        with SessionLocal.begin() as session:
            first = place_order(session, "alice", Decimal("30.00"), coupon=coupon).id
        with SessionLocal.begin() as session:
            second = place_order(session, "bob", Decimal("12.50"), coupon=coupon).id

        print("pay the first, then retry the same request:")
        for attempt in ("first", "retried"):
            with SessionLocal.begin() as session:
                paid = pay_order(session, first, f"pay-{first}")
            assert paid.published is not None
            print(f"  {attempt:<8} OrderPaid {paid.published.id} created={paid.published.created}")

        print("a unit of work that fails leaves nothing:")
        with contextlib.suppress(OrderError), SessionLocal.begin() as session:
            third = place_order(session, "carol", Decimal("5.00")).id
            pay_order(session, second, "pay-x")
            pay_order(session, second, "pay-y")  # raises: the whole transaction rolls back
        print(f"  order {third} and its events were rolled back, and so was the payment of order {second}")

        print("async (AsyncSession):")
        fourth = asyncio.run(async_part(dsn))

        with psycopg.connect(dsn) as conn:
            print("outbox.events holds (the relay delivers them in this order per key):")
            rows = conn.execute(
                "SELECT partition_key, type, payload->>'customer' FROM outbox.events "
                "WHERE partition_key = ANY(%s) ORDER BY partition_key, xid, seq",
                ([order_key(i) for i in (first, second, third, fourth)],)).fetchall()
            for key, type_, customer in rows:
                print(f"  {key:<10} {type_:<14} {customer or ''}")
        engine.dispose()
    return 0


if __name__ == "__main__":
    sys.exit(main())
