"""outbox_relay.contrib.sqlalchemy: events recorded on an ORM session, written by its flushes.

Against the real PostgreSQL: G1 (an event exists iff the transaction that recorded it committed,
through savepoints and failed flushes), G2 (one idempotency key, one event), one publish statement
per flush, sync and async sessions, and what ``record`` refuses.
"""

from __future__ import annotations

import asyncio
import gc
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from typing import Any

import psycopg
import pytest
from sqlalchemy import Engine, Identity, create_engine, event, text
from sqlalchemy.exc import IntegrityError
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker, create_async_engine
from sqlalchemy.orm import DeclarativeBase, Mapped, Session, mapped_column, object_session, scoped_session, sessionmaker
from sqlalchemy.pool import NullPool

from outbox_relay import ConfigurationError, IdempotencyConflict, InvalidEvent, Outbox, Published
from outbox_relay.contrib.sqlalchemy import Recorded, arecord, record, track
from outbox_relay.errors import NoTransaction
from tests.servers import sqlalchemy_url

TOPIC = "orders"


class Base(DeclarativeBase):
    pass


class Order(Base):
    __tablename__ = "orders"
    id: Mapped[int] = mapped_column(primary_key=True)
    total: Mapped[int]


class Customer(Base):
    __tablename__ = "customers"
    id: Mapped[int] = mapped_column(Identity(), primary_key=True)  # known only after the INSERT
    name: Mapped[str]


@pytest.fixture
def outbox() -> Outbox:
    return Outbox(default_topic=TOPIC)


@pytest.fixture
def shop(dsn: str) -> str:
    """The test database with the ORM's tables next to the outbox."""
    engine = create_engine(sqlalchemy_url(dsn), poolclass=NullPool)
    try:
        Base.metadata.create_all(engine)
    finally:
        engine.dispose()
    return dsn


@pytest.fixture
def engine(shop: str) -> Iterator[Engine]:
    engine = create_engine(sqlalchemy_url(shop), poolclass=NullPool)
    try:
        yield engine
    finally:
        engine.dispose()


@pytest.fixture
def maker(engine: Engine, outbox: Outbox) -> sessionmaker[Session]:
    """A sessionmaker of its own (a Session class of its own), tracked."""
    maker = sessionmaker(engine)
    track(maker, outbox)
    return maker


def stored(dsn: str) -> list[tuple[Any, ...]]:
    """(id, type, key, payload, topic) of the committed events, in position order."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        return conn.execute("SELECT id, type, partition_key, payload, topic FROM outbox.events "
                            "ORDER BY xid, seq").fetchall()


def keys(dsn: str) -> list[tuple[str, str]]:
    return [(row[1], row[2]) for row in stored(dsn)]


def orders(dsn: str) -> list[int]:
    with psycopg.connect(dsn, autocommit=True) as conn:
        return [row[0] for row in conn.execute("SELECT id FROM orders ORDER BY id")]


def writing_transactions(dsn: str) -> tuple[list[int], list[int]]:
    """The (32-bit) transaction ids that wrote the events, and those that wrote the orders."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        events = conn.execute("SELECT DISTINCT xid::text::bigint % 4294967296 FROM outbox.events").fetchall()
        rows = conn.execute("SELECT DISTINCT xmin::text::bigint FROM orders").fetchall()
    return sorted(r[0] for r in events), sorted(r[0] for r in rows)


@contextmanager
def publish_statements(engine: Engine) -> Iterator[list[str]]:
    """The INSERTs into outbox.events sent through ``engine`` while the block runs."""
    seen: list[str] = []

    def before(conn: Any, cursor: Any, statement: str, *args: Any) -> None:
        if "INSERT INTO outbox.events" in statement:
            seen.append(statement)

    event.listen(engine, "before_cursor_execute", before)
    try:
        yield seen
    finally:
        event.remove(engine, "before_cursor_execute", before)


def placed(session: Session, order_id: int, **fields: Any) -> Recorded:
    return record(session, type="OrderPlaced", key=f"order:{order_id}", payload={"order": order_id}, **fields)


# -- G1: the events share the fate of the objects ----------------------------------------------


def test_commit_writes_the_events_in_the_transaction_of_the_objects(shop: str, maker: sessionmaker[Session]) -> None:
    with maker.begin() as session:
        session.add(Order(id=1, total=10))
        first = placed(session, 1)
        session.add(Order(id=2, total=20))
        second = placed(session, 2)
        lines = [{"sku": "a"}]
        paid = record(session, type="OrderPaid", key="order:1", payload={"order": 1, "lines": lines})
        lines.append({"sku": "b"})  # after record: not part of the event
        assert first.published is None, "nothing was flushed yet"
    # commit() flushed the orders, then the events, in the order recorded.
    assert keys(shop) == [("OrderPlaced", "order:1"), ("OrderPlaced", "order:2"), ("OrderPaid", "order:1")]
    assert [row[0] for row in stored(shop)] == [r.published.id for r in (first, second, paid) if r.published]
    assert stored(shop)[2][3] == {"order": 1, "lines": [{"sku": "a"}]}
    assert all(r.published and r.published.created for r in (first, second, paid))
    events, rows = writing_transactions(shop)
    assert events == rows and len(rows) == 1, "one transaction wrote the orders and the events"
    assert orders(shop) == [1, 2]


@pytest.mark.parametrize("flushed", [False, True])
@pytest.mark.parametrize("ending", ["rollback", "exception", "close"])
def test_a_transaction_that_does_not_commit_leaves_no_event(
        shop: str, maker: sessionmaker[Session], ending: str, flushed: bool) -> None:
    session = maker()
    try:
        with pytest.raises(RuntimeError) if ending == "exception" else nullcontext(), session.begin():
            session.add(Order(id=1, total=10))
            gone = placed(session, 1)
            if flushed:
                session.flush()
                assert gone.published is not None
            if ending == "exception":
                raise RuntimeError("the business change fails")
            if ending == "rollback":
                session.rollback()
            else:
                session.close()
        assert gone.published is None
        # The session goes on: its next transaction does not carry the dropped event.
        with session.begin():
            session.add(Order(id=2, total=20))
            placed(session, 2)
    finally:
        session.close()
    assert keys(shop) == [("OrderPlaced", "order:2")]
    assert orders(shop) == [2]


def test_commit_writes_events_when_no_object_changed(shop: str, maker: sessionmaker[Session]) -> None:
    # Nothing to flush, so no flush event: the commit itself writes them.
    with maker.begin() as session:
        record(session, type="CustomerNotified", key="customer:9", payload={})
        session.flush()
    assert keys(shop) == [("CustomerNotified", "customer:9")]


def test_one_publish_statement_per_flush(shop: str, engine: Engine, maker: sessionmaker[Session]) -> None:
    with publish_statements(engine) as seen:
        with maker.begin() as session:
            for i in (1, 2, 3):
                session.add(Order(id=i, total=i))
                placed(session, i)
            session.flush()
            assert len(seen) == 1
            session.add(Order(id=4, total=4))
            session.flush()  # no event waiting: no statement
            assert len(seen) == 1
            session.add(Order(id=5, total=5))
            placed(session, 5)
            record(session, type="OrderPaid", key="order:5", payload={})
            assert session.get(Order, 5) is not None  # autoflush: the order, then the two events
            assert len(seen) == 2
        assert len(seen) == 2, "the commit found nothing left to write"
    assert [k for _, k in keys(shop)] == ["order:1", "order:2", "order:3", "order:5", "order:5"]


def test_events_recorded_during_the_flush_are_written_by_it(
        shop: str, engine: Engine, maker: sessionmaker[Session]) -> None:
    # An id the database assigns is known after the INSERT: record in a mapper event, inside the flush.
    def customer_created(mapper: Any, connection: Any, customer: Customer) -> None:
        session = object_session(customer)
        assert session is not None
        record(session, type="CustomerCreated", key=f"customer:{customer.id}", payload={"name": customer.name})

    event.listen(Customer, "after_insert", customer_created)
    try:
        with publish_statements(engine) as seen, maker.begin() as session:
            session.add_all([Customer(name="ada"), Customer(name="bob")])
            session.flush()
            ids = [c.id for c in session.query(Customer).order_by(Customer.id)]
            assert len(seen) == 1
    finally:
        event.remove(Customer, "after_insert", customer_created)
    assert keys(shop) == [("CustomerCreated", f"customer:{i}") for i in ids]


def test_event_recorded_by_a_later_before_commit_listener_is_written(
        shop: str, maker: sessionmaker[Session]) -> None:
    # This listener runs after the outbox's (track() came first): no flush follows it in the commit.
    def audit(session: Session) -> None:
        if session.get_nested_transaction() is None:
            record(session, type="Audited", key="audit", payload={})

    event.listen(maker, "before_commit", audit)
    with maker.begin() as session:
        session.add(Order(id=1, total=10))
        placed(session, 1)
    assert keys(shop) == [("OrderPlaced", "order:1"), ("Audited", "audit")]


# -- G1 with savepoints and failed flushes -----------------------------------------------------


@pytest.mark.parametrize("flushed_inside", [False, True])
def test_savepoint_rollback_drops_only_its_own_events(
        shop: str, maker: sessionmaker[Session], flushed_inside: bool) -> None:
    with maker.begin() as session:
        session.add(Order(id=1, total=10))
        outer = placed(session, 1)
        with pytest.raises(RuntimeError), session.begin_nested():  # flushes order 1 and its event first
            session.add(Order(id=2, total=20))
            inner = placed(session, 2)
            if flushed_inside:
                session.flush()
                assert inner.published is not None
            raise RuntimeError("this part of the change fails")
        assert outer.published is not None and inner.published is None
        record(session, type="OrderPaid", key="order:1", payload={})
    assert keys(shop) == [("OrderPlaced", "order:1"), ("OrderPaid", "order:1")]
    assert orders(shop) == [1]


@pytest.mark.parametrize("then", ["commit", "rollback", "rollback the enclosing savepoint"])
def test_a_released_savepoint_s_events_share_the_fate_of_what_encloses_it(
        shop: str, maker: sessionmaker[Session], then: str) -> None:
    with maker() as session, session.begin():
        placed(session, 1)
        with session.begin_nested() as enclosing:
            with session.begin_nested():  # released: its events now belong to the savepoint around it
                session.add(Order(id=2, total=20))
                inner = placed(session, 2)
            if then == "rollback the enclosing savepoint":
                enclosing.rollback()
        if then == "rollback":
            session.rollback()
    assert inner.published is None if then != "commit" else inner.published is not None
    expected = {"commit": ["order:1", "order:2"], "rollback": [], "rollback the enclosing savepoint": ["order:1"]}
    assert [k for _, k in keys(shop)] == expected[then]


def test_an_earlier_event_written_inside_a_savepoint_that_rolls_back_is_written_again(
        shop: str, engine: Engine, maker: sessionmaker[Session]) -> None:
    with publish_statements(engine) as seen, maker.begin() as session:
        early = placed(session, 1)  # no object changed: begin_nested() below has nothing to flush
        with pytest.raises(RuntimeError), session.begin_nested():
            session.add(Order(id=2, total=20))
            session.flush()  # order 2, then the waiting event: inside the savepoint
            assert early.published is not None
            raise RuntimeError("the savepoint rolls back, and the event's row with it")
        assert early.published is None, "it waits again"
    assert keys(shop) == [("OrderPlaced", "order:1")]
    assert early.published is not None and [row[0] for row in stored(shop)] == [early.published.id]
    assert orders(shop) == [] and len(seen) == 2


@pytest.mark.parametrize("fails", ["writing an object", "after writing the events"])
def test_a_flush_that_fails_in_a_savepoint_keeps_earlier_events_waiting(
        shop: str, maker: sessionmaker[Session], fails: str) -> None:
    with maker.begin() as session:
        session.execute(text("INSERT INTO orders VALUES (100, 1)"))  # unknown to the identity map
        early = placed(session, 1)
        if fails == "after writing the events":
            @event.listens_for(session, "after_flush_postexec", once=True)
            def broken(session: Session, context: Any) -> None:
                raise RuntimeError("a listener fails after the outbox wrote its events")

        expected = IntegrityError if fails == "writing an object" else RuntimeError
        with pytest.raises(expected), session.begin_nested():  # the flush at its release fails
            inner = placed(session, 2)
            session.add(Order(id=100 if fails == "writing an object" else 2, total=2))
        assert early.published is None and inner.published is None
        session.add(Order(id=3, total=30))
        late = placed(session, 3)  # the retried flush (the commit's) writes early and late, once each
    assert [k for _, k in keys(shop)] == ["order:1", "order:3"]
    assert [row[0] for row in stored(shop)] == [r.published.id for r in (early, late) if r.published]
    assert orders(shop) == [3, 100]


def test_a_failed_flush_rolls_back_and_a_retried_unit_of_work_publishes_once(
        shop: str, maker: sessionmaker[Session]) -> None:
    with maker() as session:
        session.execute(text("INSERT INTO orders VALUES (100, 1)"))
        session.commit()
        session.add(Order(id=100, total=5))
        first = placed(session, 100)  # no idempotency key: only the bookkeeping keeps it single
        with pytest.raises(IntegrityError):
            session.commit()
        session.rollback()  # SQLAlchemy drops the added order; the event goes with it
        assert first.published is None
        session.add(Order(id=101, total=5))
        again = placed(session, 100)
        session.commit()
    assert again.published is not None and [row[0] for row in stored(shop)] == [again.published.id]
    assert orders(shop) == [100, 101]


# -- G2: one idempotency key, one event ---------------------------------------------------------


def test_an_idempotency_key_recorded_again_is_one_event(shop: str, maker: sessionmaker[Session]) -> None:
    with maker.begin() as session:
        session.add(Order(id=1, total=10))
        first = placed(session, 1, idempotency_key="placed-1")
        repeat = placed(session, 1, idempotency_key="placed-1")  # a handler that ran twice
    assert first.published is not None and first.published.created
    assert repeat.published == Published(first.published.id, False)
    with maker.begin() as session:
        later = placed(session, 1, idempotency_key="placed-1")  # a retried request
    assert later.published == Published(first.published.id, False)
    # The key for another event: the flush fails and the transaction rolls back, the order with it.
    with pytest.raises(IdempotencyConflict, match="placed-1"), maker.begin() as session:
        session.add(Order(id=2, total=20))
        record(session, type="OrderPlaced", key="order:2", payload={}, idempotency_key="placed-1")
    assert [row[0] for row in stored(shop)] == [first.published.id]
    assert orders(shop) == [1]


# -- what record refuses ------------------------------------------------------------------------


def test_record_refuses_what_could_not_be_written(shop: str, engine: Engine, maker: sessionmaker[Session]) -> None:
    with sessionmaker(engine)() as untracked, pytest.raises(ConfigurationError, match="not tracked"):
        record(untracked, type="OrderPlaced", key="order:1", payload={})
    with pytest.raises(TypeError, match="arecord"):
        record(AsyncSession(), type="OrderPlaced", key="order:1", payload={})  # type: ignore[arg-type]
    with maker.begin() as session:
        with pytest.raises(InvalidEvent, match="key"):
            record(session, type="OrderPlaced", key="", payload={})
        with pytest.raises(InvalidEvent, match="not JSON"):
            record(session, type="OrderPlaced", key="order:1", payload={"items": {1, 2}})
        session.add(Order(id=1, total=10))
        kept = placed(session, 1)  # the session and its transaction go on
    assert kept.published is not None and [row[0] for row in stored(shop)] == [kept.published.id]


def test_autocommit_session_is_refused_at_record(shop: str, outbox: Outbox) -> None:
    engine = create_engine(sqlalchemy_url(shop), poolclass=NullPool, isolation_level="AUTOCOMMIT")
    try:
        maker = sessionmaker(engine)
        track(maker, outbox)
        with maker() as session:
            session.add(Order(id=1, total=10))
            with pytest.raises(NoTransaction, match="autocommit") as info:
                placed(session, 1)
            assert "Nothing was recorded" in str(info.value)
            session.commit()  # autocommit: the order is stored whatever happens; no event was accepted
    finally:
        engine.dispose()
    assert stored(shop) == [] and orders(shop) == [1]


# -- what track hooks ---------------------------------------------------------------------------


def test_track_targets(shop: str, engine: Engine, outbox: Outbox) -> None:
    maker = sessionmaker(engine)
    opened_before = maker()  # a session made before track() is hooked too
    track(maker, outbox)
    track(maker, outbox)  # again: nothing changes, events are written once
    track(scoped_session(maker), outbox)  # the same sessions
    with pytest.raises(ConfigurationError, match="another Outbox"):
        track(maker, Outbox(default_topic="billing"))
    with pytest.raises(TypeError, match="sessionmaker"):
        track(engine, outbox)
    with opened_before as session, session.begin():
        placed(session, 1)
    # One session tracked with another outbox: the most specific target wins.
    with maker() as session, session.begin():
        track(session, Outbox(default_topic="billing"))
        record(session, type="InvoiceDue", key="order:1", payload={})
    assert [(row[1], row[4]) for row in stored(shop)] == [("OrderPlaced", TOPIC), ("InvoiceDue", "billing")]
    # Tracking a sessionmaker hooks its sessions only.
    with sessionmaker(engine)() as other, pytest.raises(ConfigurationError, match="not tracked"):
        placed(other, 2)
    # An async_sessionmaker whose sync sessions come from a sessionmaker: that one's sessions.
    sync_maker = sessionmaker(engine)
    async_maker = async_sessionmaker(sync_session_class=sync_maker)
    track(async_maker, outbox)
    assert isinstance(async_maker().sync_session, sync_maker.class_)
    with sync_maker.begin() as session:
        placed(session, 3)
    assert [row[2] for row in stored(shop)] == ["order:1", "order:1", "order:3"]


def test_sessionmakers_made_one_after_another_are_all_hooked(shop: str, engine: Engine, outbox: Outbox) -> None:
    # Each sessionmaker makes a Session class, and a new class may get the id() of a collected one:
    # SQLAlchemy's event.contains() then answers for the old class (track must not rely on it).
    for i in range(20):
        maker = sessionmaker(engine)
        track(maker, outbox)
        with maker.begin() as session:
            placed(session, i)
        del maker, session
        gc.collect()
    assert len(stored(shop)) == 20


def test_sync_sessions_need_no_greenlet() -> None:
    # SQLAlchemy 2.1 no longer installs greenlet, and its asyncio module refuses to import without it.
    code = ("import sys; sys.modules['greenlet'] = None\n"
            "from outbox_relay.contrib.sqlalchemy import record, track\n"
            "from sqlalchemy.orm import sessionmaker\n"
            "track(sessionmaker(), __import__('outbox_relay').Outbox())\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr


# -- asyncio ------------------------------------------------------------------------------------


def test_async_session(shop: str, outbox: Outbox) -> None:
    async def main() -> tuple[int, list[Recorded]]:
        engine = create_async_engine(sqlalchemy_url(shop), poolclass=NullPool)
        try:
            maker = async_sessionmaker(engine)
            track(maker, outbox)
            with publish_statements(engine.sync_engine) as seen:
                async with maker() as session:
                    session.add(Order(id=1, total=10))
                    gone = await arecord(session, type="OrderPlaced", key="order:1", payload={})
                    await session.flush()
                    await session.rollback()
                    assert gone.published is None
                async with maker.begin() as session:
                    session.add(Order(id=2, total=20))
                    kept = [await arecord(session, type="OrderPlaced", key="order:2", payload={})]
                    with pytest.raises(RuntimeError):
                        async with session.begin_nested():
                            session.add(Order(id=3, total=30))
                            await arecord(session, type="OrderPlaced", key="order:3", payload={})
                            raise RuntimeError("the savepoint rolls back")
                    kept.append(await arecord(session, type="OrderPaid", key="order:2", payload={},
                                              idempotency_key="paid-2"))
                    kept.append(await arecord(session, type="OrderPaid", key="order:2", payload={},
                                              idempotency_key="paid-2"))
                async with maker.begin() as session:  # no object changed
                    kept.append(await arecord(session, type="OrderShipped", key="order:2", payload={}))
            # An async_sessionmaker is given a sync session class of its own: plain sessions stay untracked.
            with Session(engine.sync_engine) as plain, pytest.raises(ConfigurationError, match="not tracked"):
                record(plain, type="OrderPlaced", key="order:4", payload={})
            return len(seen), kept
        finally:
            await engine.dispose()

    statements, kept = asyncio.run(main())
    assert keys(shop) == [("OrderPlaced", "order:2"), ("OrderPaid", "order:2"), ("OrderShipped", "order:2")]
    assert [r.published.created for r in kept if r.published] == [True, True, False, True]
    assert orders(shop) == [2]
    # The flush rolled back, begin_nested()'s flush, the commit's flush, the commit with no object.
    assert statements == 4


def test_async_autocommit_session_is_refused_at_record(shop: str, outbox: Outbox) -> None:
    async def main() -> None:
        engine = create_async_engine(sqlalchemy_url(shop), poolclass=NullPool, isolation_level="AUTOCOMMIT")
        try:
            maker = async_sessionmaker(engine)
            track(maker, outbox)
            async with maker() as session:
                with pytest.raises(NoTransaction, match="autocommit"):
                    await arecord(session, type="OrderPlaced", key="order:1", payload={})
                session.add(Order(id=1, total=10))
                await session.commit()
        finally:
            await engine.dispose()

    asyncio.run(main())
    assert stored(shop) == [] and orders(shop) == [1]
