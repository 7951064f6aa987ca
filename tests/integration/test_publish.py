"""Publishing with the caller's connection: G1 (atomic publish) and G2 (producer idempotency).

Every driver a producer may hold is covered: psycopg sync (connection and cursor), psycopg async,
SQLAlchemy Connection and Session, sync and async.

``pg15``: the tests whose SQL can behave differently on PostgreSQL 15, which scripts/test.sh runs there
too: one driver's (every driver runs the statements of one plan), the database's own checks, the
idempotency lookups and races, the producer's rights, the statements chosen. Input that Python refuses
before anything is sent, and the driver-specific refusals, are the same on every server.
"""

from __future__ import annotations

import asyncio
import math
import queue
import re
import threading
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import UTC, datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import psycopg
import pytest
from psycopg import Rollback, pq, sql
from psycopg.conninfo import make_conninfo
from psycopg.rows import dict_row
from psycopg.types.json import Jsonb
from sqlalchemy import create_engine, text
from sqlalchemy.orm import Session
from sqlalchemy.pool import NullPool

from outbox_relay import IdempotencyConflict, InvalidEvent, Outbox, Published, privileges
from outbox_relay.errors import NoTransaction
from outbox_relay.event import (
    MAX_HEADERS_BYTES,
    MAX_PAYLOAD_BYTES,
    MAX_PAYLOAD_DEPTH,
    RESERVED_HEADERS,
    make_event,
)
from outbox_relay.publish import _batch_json
from outbox_relay.sqlfiles import query
from tests.servers import sqlalchemy_url, wait_until

TOPIC = "orders"


@pytest.fixture
def outbox() -> Outbox:
    return Outbox(default_topic=TOPIC)


@pytest.fixture
def shop(dsn: str) -> str:
    """The test database with a business table next to the outbox."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("CREATE TABLE orders (id int PRIMARY KEY, total int NOT NULL)")
    return dsn


def stored(dsn: str) -> list[dict[str, Any]]:
    """The events as another session sees them (committed only), in position order."""
    with psycopg.connect(dsn, autocommit=True) as conn, conn.cursor(row_factory=dict_row) as cur:
        # e.xid, not xid: the bare name would sort by the output column xid::text ('1000' < '999').
        cur.execute("SELECT id, xid::text, seq, partition_key, topic, type, payload, headers, idempotency_key "
                    "FROM outbox.events e ORDER BY e.xid, e.seq")
        return list(cur.fetchall())


def fetch_rows(dsn: str, sql_text: str) -> list[tuple[Any, ...]]:
    with psycopg.connect(dsn, autocommit=True) as conn:
        return conn.execute(sql_text).fetchall()  # type: ignore[arg-type]


def orders(dsn: str) -> list[int]:
    with psycopg.connect(dsn, autocommit=True) as conn:
        return [r[0] for r in conn.execute("SELECT id FROM orders ORDER BY id")]


class CountingCursor(psycopg.Cursor[Any]):
    """Records every statement sent through it (``statements`` is per connection)."""

    def execute(self, query: Any, params: Any = None, **kwargs: Any) -> Any:
        self.connection.statements.append(query)  # type: ignore[attr-defined]
        return super().execute(query, params, **kwargs)


@contextmanager
def counting_connection(dsn: str) -> Iterator[psycopg.Connection[Any]]:
    with psycopg.connect(dsn, cursor_factory=CountingCursor) as conn:
        conn.statements = []  # type: ignore[attr-defined]
        yield conn


@contextmanager
def sync_engine(dsn: str) -> Iterator[Any]:
    engine = create_engine(sqlalchemy_url(dsn), poolclass=NullPool)
    try:
        yield engine
    finally:
        engine.dispose()


# -- G1: an event exists iff the business transaction committed ------------------------------


@pytest.mark.parametrize("via", [pytest.param("connection", marks=pytest.mark.pg15), "cursor"])
def test_psycopg_rollback_discards_and_commit_keeps(shop: str, outbox: Outbox, via: str) -> None:
    with psycopg.connect(shop) as conn:
        target: Any = conn if via == "connection" else conn.cursor()
        conn.execute("INSERT INTO orders VALUES (1, 100)")
        outbox.publish(target, type="order.placed", key="order-1", payload={"total": 100})
        conn.rollback()
        assert stored(shop) == [] and orders(shop) == []

        conn.execute("INSERT INTO orders VALUES (2, 200)")
        p = outbox.publish(target, type="order.placed", key="order-2", payload={"total": 200},
                           headers={"trace": "abc"})
        assert stored(shop) == [], "an uncommitted event must not be visible to the relays"
        # A keyed retry is told apart by the insert's row count, on either kind of target.
        keyed = outbox.publish(target, type="order.paid", key="order-2", payload={}, idempotency_key="pay-2")
        assert outbox.publish(target, type="order.paid", key="order-2", payload={},
                              idempotency_key="pay-2") == Published(keyed.id, False)
        conn.commit()
        if via == "cursor":
            target.close()

    event, paid = stored(shop)
    assert orders(shop) == [2]
    assert p == Published(event["id"], True) and keyed == Published(paid["id"], True)
    assert (event["partition_key"], event["topic"], event["type"], event["payload"], event["headers"]) == (
        "order-2", TOPIC, "order.placed", {"total": 200}, {"trace": "abc"})


@pytest.mark.pg15
def test_exception_in_transaction_block_and_savepoint(shop: str, outbox: Outbox) -> None:
    with psycopg.connect(shop, autocommit=True) as conn:
        with pytest.raises(RuntimeError), conn.transaction():
            conn.execute("INSERT INTO orders VALUES (1, 100)")
            outbox.publish(conn, type="order.placed", key="order-1", payload={})
            raise RuntimeError("business rule failed after publishing")
        assert stored(shop) == []

        # An event belongs to the (sub)transaction it was published in.
        with conn.transaction():
            conn.execute("INSERT INTO orders VALUES (2, 200)")
            kept = outbox.publish(conn, type="order.placed", key="order-2", payload={})
            with pytest.raises(RuntimeError), conn.transaction():
                outbox.publish(conn, type="order.discounted", key="order-2", payload={})
                raise RuntimeError("roll back the savepoint only")
    assert [e["id"] for e in stored(shop)] == [kept.id]
    assert orders(shop) == [2]


@pytest.mark.pg15
def test_connection_lost_before_commit_leaves_nothing(shop: str, outbox: Outbox, pg_server: Any) -> None:
    with psycopg.connect(shop) as conn:
        conn.execute("INSERT INTO orders VALUES (1, 100)")
        outbox.publish(conn, type="order.placed", key="order-1", payload={})
        with pg_server.admin() as admin:
            admin.execute("SELECT pg_terminate_backend(%s)", (conn.info.backend_pid,))
        with pytest.raises(psycopg.OperationalError):
            conn.commit()
    assert stored(shop) == [] and orders(shop) == []


def test_psycopg_async(shop: str, outbox: Outbox) -> None:
    async def main() -> list[Published]:
        async with await psycopg.AsyncConnection.connect(shop) as conn:
            await conn.execute("INSERT INTO orders VALUES (1, 100)")
            await outbox.apublish(conn, type="order.placed", key="order-1", payload={})
            await conn.rollback()
            assert stored(shop) == []

            await conn.execute("INSERT INTO orders VALUES (2, 200)")
            one = await outbox.apublish(conn, type="order.placed", key="order-2", payload={}, idempotency_key="o2")
            async with conn.cursor() as cur:
                many = await outbox.apublish_many(cur, [
                    {"type": "order.paid", "key": "order-2", "payload": {}},
                    {"type": "order.placed", "key": "order-2", "payload": {}, "idempotency_key": "o2"},
                ])
                assert await outbox.apublish(cur, type="order.placed", key="order-2", payload={},
                                             idempotency_key="o2") == Published(one.id, False)
            with pytest.raises(InvalidEvent, match="key"):
                await outbox.apublish(conn, type="order.paid", key="", payload={})
            await conn.commit()
            return [one, *many]

    one, paid, again = asyncio.run(main())
    assert [e["id"] for e in stored(shop)] == [one.id, paid.id]
    assert orders(shop) == [2]
    assert again == Published(one.id, False)


def test_sqlalchemy_connection(shop: str, outbox: Outbox) -> None:
    with sync_engine(shop) as engine, engine.connect() as conn:
        with conn.begin():
            conn.execute(text("INSERT INTO orders VALUES (1, 100)"))
            outbox.publish(conn, type="order.placed", key="order-1", payload={})
            conn.rollback()
        assert stored(shop) == []

        with pytest.raises(RuntimeError), conn.begin():
            outbox.publish(conn, type="order.placed", key="order-1", payload={})
            raise RuntimeError("rolled back by the context manager")
        assert stored(shop) == []

        with conn.begin():
            conn.execute(text("INSERT INTO orders VALUES (2, 200)"))
            p = outbox.publish(conn, type="order.placed", key="order-2", payload={"n": 1}, idempotency_key="k")
            again = outbox.publish(conn, type="order.placed", key="order-2", payload={"n": 1}, idempotency_key="k")
    (event,) = stored(shop)
    assert p == Published(event["id"], True) and again == Published(event["id"], False)
    assert event["payload"] == {"n": 1}
    assert orders(shop) == [2]


def test_sqlalchemy_session(shop: str, outbox: Outbox) -> None:
    with sync_engine(shop) as engine, Session(engine) as session:
        session.execute(text("INSERT INTO orders VALUES (1, 100)"))
        outbox.publish(session, type="order.placed", key="order-1", payload={})
        session.rollback()
        assert stored(shop) == []

        with session.begin():
            session.execute(text("INSERT INTO orders VALUES (2, 200)"))
            (p,) = outbox.publish_many(session, [{"type": "order.placed", "key": "order-2", "payload": {}}])
    assert [e["id"] for e in stored(shop)] == [p.id]
    assert orders(shop) == [2]


def test_sqlalchemy_async(shop: str, outbox: Outbox) -> None:
    pytest.importorskip("greenlet", reason="SQLAlchemy's asyncio layer needs greenlet (sqlalchemy[asyncio])")
    from sqlalchemy.ext.asyncio import AsyncSession, create_async_engine

    async def main() -> tuple[Published, Published]:
        engine = create_async_engine(sqlalchemy_url(shop), poolclass=NullPool)
        try:
            async with engine.connect() as conn:
                await conn.execute(text("INSERT INTO orders VALUES (1, 100)"))
                await outbox.apublish(conn, type="order.placed", key="order-1", payload={})
                await conn.rollback()
                assert stored(shop) == []
                async with conn.begin():
                    await conn.execute(text("INSERT INTO orders VALUES (2, 200)"))
                    by_conn = await outbox.apublish(conn, type="order.placed", key="order-2", payload={},
                                                    idempotency_key="o2")
                    again = await outbox.apublish(conn, type="order.placed", key="order-2", payload={},
                                                  idempotency_key="o2")
                    assert again == Published(by_conn.id, False)
            async with AsyncSession(engine) as session:
                await outbox.apublish(session, type="order.placed", key="order-3", payload={})
                await session.rollback()
                async with session.begin():
                    await session.execute(text("INSERT INTO orders VALUES (4, 400)"))
                    by_session = await outbox.apublish(session, type="order.placed", key="order-4", payload={})
            return by_conn, by_session
        finally:
            await engine.dispose()

    by_conn, by_session = asyncio.run(main())
    assert [e["id"] for e in stored(shop)] == [by_conn.id, by_session.id]
    assert orders(shop) == [2, 4]


# -- G1: a connection that would commit the event on its own is refused ---------------------


def test_psycopg_autocommit_outside_a_transaction_is_refused(shop: str, outbox: Outbox) -> None:
    with psycopg.connect(shop, autocommit=True, cursor_factory=CountingCursor) as conn:
        conn.statements = []  # type: ignore[attr-defined]
        for target in (conn, conn.cursor()):
            with pytest.raises(NoTransaction, match="autocommit") as info:
                outbox.publish(target, type="order.placed", key="order-1", payload={})
            assert "Nothing was written" in str(info.value)
            with pytest.raises(NoTransaction):
                outbox.publish_many(target, [{"type": "order.placed", "key": "order-1", "payload": {}}])
        assert conn.statements == [], "nothing may reach the database"  # type: ignore[attr-defined]

        # Inside a transaction block the event joins it, and shares its fate.
        with pytest.raises(RuntimeError), conn.transaction():
            conn.execute("INSERT INTO orders VALUES (1, 100)")
            outbox.publish(conn, type="order.placed", key="order-1", payload={})
            outbox.publish(conn.cursor(), type="order.placed", key="order-1", payload={})
            raise RuntimeError("the business change fails")
        assert stored(shop) == []
        # What counts is the server's transaction status, not the flag: a BEGIN sent by hand opens one.
        conn.execute("BEGIN")
        conn.execute("INSERT INTO orders VALUES (2, 200)")
        kept = outbox.publish(conn, type="order.placed", key="order-2", payload={})
        conn.execute("COMMIT")
    assert [e["id"] for e in stored(shop)] == [kept.id]
    assert orders(shop) == [2]


def test_psycopg_async_autocommit_outside_a_transaction_is_refused(shop: str, outbox: Outbox) -> None:
    async def main() -> Published:
        async with await psycopg.AsyncConnection.connect(shop, autocommit=True) as conn:
            for target in (conn, conn.cursor()):
                with pytest.raises(NoTransaction, match="autocommit"):
                    await outbox.apublish(target, type="order.placed", key="order-1", payload={})
                with pytest.raises(NoTransaction):
                    await outbox.apublish_many(target, [{"type": "order.placed", "key": "order-1", "payload": {}}])
            assert stored(shop) == []
            with pytest.raises(RuntimeError):
                async with conn.transaction():
                    await outbox.apublish(conn, type="order.placed", key="order-1", payload={})
                    raise RuntimeError("the business change fails")
            async with conn.transaction():
                await conn.execute("INSERT INTO orders VALUES (2, 200)")
                async with conn.cursor() as cur:
                    return await outbox.apublish(cur, type="order.placed", key="order-2", payload={})

    kept = asyncio.run(main())
    assert [e["id"] for e in stored(shop)] == [kept.id]
    assert orders(shop) == [2]


@pytest.mark.parametrize("how", ["engine", "connection"])
def test_sqlalchemy_autocommit_is_refused(shop: str, outbox: Outbox, how: str) -> None:
    options = {"isolation_level": "AUTOCOMMIT"} if how == "engine" else {}
    engine = create_engine(sqlalchemy_url(shop), poolclass=NullPool, **options)
    try:
        with engine.connect() as conn:
            if how == "connection":
                conn.execution_options(isolation_level="AUTOCOMMIT")
            with pytest.raises(NoTransaction, match="AUTOCOMMIT") as info:
                outbox.publish(conn, type="order.placed", key="order-1", payload={})
            assert "Nothing was written" in str(info.value)
            with conn.begin():  # AUTOCOMMIT: begin() sends no BEGIN, every statement commits at once
                conn.execute(text("INSERT INTO orders VALUES (1, 100)"))
                with pytest.raises(NoTransaction):
                    outbox.publish_many(conn, [{"type": "order.placed", "key": "order-1", "payload": {}}])
            # A transaction the server knows of (BEGIN sent by hand) is one to join.
            conn.exec_driver_sql("BEGIN")
            kept = outbox.publish(conn, type="order.placed", key="order-2", payload={})
            conn.exec_driver_sql("COMMIT")
        if how == "engine":
            with Session(engine) as session:
                with pytest.raises(NoTransaction, match="AUTOCOMMIT"):
                    outbox.publish(session, type="order.placed", key="order-3", payload={})
                with pytest.raises(NoTransaction):
                    outbox.publish_many(session, [{"type": "order.placed", "key": "order-3", "payload": {}}])
                session.rollback()
    finally:
        engine.dispose()
    assert [e["id"] for e in stored(shop)] == [kept.id]


def test_sqlalchemy_async_autocommit_is_refused(shop: str, outbox: Outbox) -> None:
    pytest.importorskip("greenlet", reason="SQLAlchemy's asyncio layer needs greenlet (sqlalchemy[asyncio])")
    from sqlalchemy.ext.asyncio import AsyncSession, create_async_engine

    async def main() -> None:
        engine = create_async_engine(sqlalchemy_url(shop), poolclass=NullPool, isolation_level="AUTOCOMMIT")
        try:
            async with engine.connect() as conn:
                with pytest.raises(NoTransaction, match="AUTOCOMMIT"):
                    await outbox.apublish(conn, type="order.placed", key="order-1", payload={})
                async with conn.begin():
                    with pytest.raises(NoTransaction):
                        await outbox.apublish_many(conn, [{"type": "order.placed", "key": "order-1", "payload": {}}])
            async with AsyncSession(engine) as session:
                with pytest.raises(NoTransaction, match="AUTOCOMMIT"):
                    await outbox.apublish(session, type="order.placed", key="order-2", payload={})
                await session.rollback()  # the refused call began the session (autobegin)
                async with session.begin():
                    with pytest.raises(NoTransaction):
                        await outbox.apublish(session, type="order.placed", key="order-2", payload={})
        finally:
            await engine.dispose()

    asyncio.run(main())
    assert stored(shop) == []


# -- the database owns the time retention counts from ------------------------------------------


@pytest.mark.pg15
def test_time_is_when_the_event_happened_not_the_retention_clock(dsn: str, outbox: Outbox) -> None:
    epoch = datetime(1970, 1, 1, tzinfo=UTC)
    with psycopg.connect(dsn) as conn:
        stamped = outbox.publish(conn, type="t", key="k", payload={}, time=epoch)
        plain = outbox.publish(conn, type="t", key="k", payload={})
        row = conn.execute("SELECT now()").fetchone()
        assert row is not None
        conn.commit()
    with psycopg.connect(dsn) as conn:
        rows = dict((r[0], (r[1], r[2])) for r in conn.execute(
            "SELECT id, created_at, occurred_at FROM outbox.events"))
    # created_at (retention) is the database's clock at insert; time= is stored as occurred_at (ce_time).
    assert rows == {stamped.id: (row[0], epoch), plain.id: (row[0], None)}


@pytest.mark.pg15
@pytest.mark.parametrize("path", ["publish", "publish_many with headers"])
def test_a_time_in_any_utc_offset_python_allows_is_stored_as_that_instant(dsn: str, outbox: Outbox, path: str) -> None:
    """Python allows offsets up to 23:59 either way, PostgreSQL's timestamptz input only to 15:59: such a
    time failed the INSERT mid-statement and aborted the caller's transaction."""
    times = [datetime(2026, 1, 1, tzinfo=timezone(timedelta(hours=h, minutes=59 if h > 0 else -59)))
             for h in (23, 16, 15, -16, -23)]
    with psycopg.connect(dsn) as conn:
        if path == "publish":
            ids = [outbox.publish(conn, type="t", key="k", payload={}, time=t).id for t in times]
        else:
            ids = [p.id for p in outbox.publish_many(conn, [{"type": "t", "key": "k", "payload": {}, "time": t,
                                                             "headers": {"h": "v"}} for t in times])]
        conn.commit()
    with psycopg.connect(dsn) as conn:
        stored_times = dict(conn.execute("SELECT id, occurred_at FROM outbox.events").fetchall())
    assert [stored_times[i] for i in ids] == times


@pytest.mark.pg15
@pytest.mark.parametrize(("column", "value"), [("created_at", "1970-01-01T00:00:00Z"), ("xid", "1")])
def test_sql_producers_can_not_set_what_the_database_owns(dsn: str, column: str, value: str) -> None:
    insert = sql.SQL("INSERT INTO outbox.events (topic, partition_key, type, payload, {}) "
                     "VALUES ('orders', 'k', 't', '{{}}', %s)").format(sql.Identifier(column))
    with psycopg.connect(dsn) as conn:
        with pytest.raises(psycopg.errors.CheckViolation, match=rf"outbox\.events\.{column} is set by the database"):
            conn.execute(insert, (value,))
        conn.rollback()
    assert stored(dsn) == []


@pytest.mark.pg15
@pytest.mark.parametrize(("topic", "headers", "error"), [
    ("orders", '["a"]', r"headers must be a JSON object of strings, not a JSON array"),
    ("orders", '"a"', r"headers must be a JSON object of strings, not a JSON string"),
    ("orders", '{"retry": 1}', r"headers: the value of 'retry' is a JSON number, not a string"),
    ("orders", '{"trace": {"id": "x"}}', r"headers: the value of 'trace' is a JSON object, not a string"),
    ("orders", '{"ce_id": "forged"}', r"headers: 'ce_id' is reserved for the relay"),
    ("..", "{}", r"topic '\.\.' is not a Kafka topic name"),
    ("orders/eu", "{}", r"topic 'orders/eu' is not a Kafka topic name"),
    ("x" * 250, "{}", r"is not a Kafka topic name"),
])
def test_sql_producers_can_not_store_what_no_relay_could_deliver(dsn: str, topic: str, headers: str,
                                                                  error: str) -> None:
    """The database refuses, at INSERT, an event whose headers or topic Kafka could not take: it would
    otherwise be stored, and fail (or be dead-lettered) only at delivery time."""
    with psycopg.connect(dsn) as conn:
        with pytest.raises(psycopg.errors.CheckViolation, match=error):
            conn.execute("INSERT INTO outbox.events (topic, partition_key, type, payload, headers) "
                         "VALUES (%s, 'k', 't', '{}', %s::jsonb)", (topic, headers))
        conn.rollback()
        conn.execute("INSERT INTO outbox.events (topic, partition_key, type, payload, headers) "
                     "VALUES ('orders.eu-1_a', 'k', 't', '{}', '{\"trace\": \"x\"}')")  # and what is fine is fine
        conn.commit()
    assert [e["topic"] for e in stored(dsn)] == ["orders.eu-1_a"]


# -- G2: one idempotency key, one event, and the caller learns which -------------------------


@pytest.mark.pg15
def test_same_key_in_separate_transactions(dsn: str, outbox: Outbox) -> None:
    with psycopg.connect(dsn) as conn:
        first = outbox.publish(conn, type="payment.captured", key="pay-1", payload={"a": 1, "b": 2},
                               idempotency_key="cap-1", headers={"try": "1"})
        conn.commit()
        # A retry: the same event (type, key, payload; jsonb equality, so key order does not matter).
        retry = outbox.publish(conn, type="payment.captured", key="pay-1", payload={"b": 2, "a": 1},
                               idempotency_key="cap-1", headers={"try": "2"})
        conn.commit()
    (event,) = stored(dsn)
    assert first == Published(event["id"], True)
    assert retry == Published(event["id"], False)
    assert event["headers"] == {"try": "1"}, "the first event stands; a retry changes nothing"


@pytest.mark.pg15
def test_same_key_twice_in_one_batch(dsn: str, outbox: Outbox) -> None:
    with psycopg.connect(dsn) as conn:
        before = outbox.publish(conn, type="t", key="a", payload=0, idempotency_key="old")
        results = outbox.publish_many(conn, [
            {"type": "t", "key": "a", "payload": 1, "idempotency_key": "dup"},
            {"type": "t", "key": "b", "payload": 2},
            {"type": "t", "key": "a", "payload": 1, "idempotency_key": "dup"},
            {"type": "t", "key": "a", "payload": 0, "idempotency_key": "old"},
            {"type": "t", "key": "c", "payload": 5, "idempotency_key": "new"},
        ])
        conn.commit()
    events = stored(dsn)
    by_id = {e["id"]: e for e in events}
    assert [e["payload"] for e in events] == [0, 1, 2, 5]
    assert [r.created for r in results] == [True, True, False, False, True]
    assert results[2].id == results[0].id and by_id[results[0].id]["payload"] == 1
    assert results[3].id == before.id
    assert by_id[results[4].id]["idempotency_key"] == "new"


@pytest.mark.pg15
def test_a_large_batch_with_keys_published_again_creates_nothing(dsn: str, outbox: Outbox) -> None:
    """publish_many of plain dicts with idempotency keys (its quick path): a retry of the whole batch,
    with new events among it, learns which were stored and creates only the new ones."""
    batch = [{"type": "t", "key": f"k{i % 7}", "payload": {"n": i}, "idempotency_key": f"i{i}"} for i in range(300)]
    with psycopg.connect(dsn) as conn:
        first = outbox.publish_many(conn, batch)
        conn.commit()
        retry = outbox.publish_many(conn, [*batch[:150], {"type": "t", "key": "k", "payload": 1,
                                                          "idempotency_key": "new"}, *batch[150:]])
        conn.commit()
    assert all(r.created for r in first)
    assert [r.created for r in retry] == [False] * 150 + [True] + [False] * 150
    assert [r.id for r in retry[:150] + retry[151:]] == [r.id for r in first]
    events = stored(dsn)
    assert [e["id"] for e in events] == [r.id for r in first] + [retry[150].id]
    assert [e["payload"] for e in events[:300]] == [{"n": i} for i in range(300)]


@pytest.mark.parametrize("path", ["plain dicts", "dicts with headers", "events"])
@pytest.mark.parametrize("keys", [False, True])
def test_a_bad_event_in_the_middle_of_a_batch_writes_nothing(dsn: str, outbox: Outbox, path: str,
                                                             keys: bool) -> None:
    """Every path of publish_many checks the whole batch before it sends anything: a bad event at
    position 50 of 100 raises InvalidEvent naming it, nothing is written and the transaction goes on."""
    def event(i: int) -> Any:
        fields: dict[str, Any] = {"type": "t", "key": f"k{i}", "payload": {"n": i}}
        if keys:
            fields["idempotency_key"] = f"i{i}"
        if path == "dicts with headers":
            fields["headers"] = {"h": "1"}
        return outbox.event(**fields) if path == "events" else fields

    batch = [event(i) for i in range(100)]
    # A NUL in the key: PostgreSQL would refuse it mid-statement and abort the caller's transaction.
    batch[50] = outbox.event(type="t", key="a\x00b", payload={}) if path == "events" else {
        "type": "t", "key": "a\x00b", "payload": {}}
    with counting_connection(dsn) as conn:
        accepted = outbox.publish(conn, type="t", key="k", payload="accepted")
        sent = len(conn.statements)  # type: ignore[attr-defined]
        with pytest.raises(InvalidEvent, match="key: contains a NUL"):
            outbox.publish_many(conn, batch)
        assert len(conn.statements) == sent, "nothing may reach the database"  # type: ignore[attr-defined]
        assert conn.info.transaction_status == pq.TransactionStatus.INTRANS
        after = outbox.publish(conn, type="t", key="k", payload="after")
        conn.commit()
    assert [e["id"] for e in stored(dsn)] == [accepted.id, after.id]


CONFLICTS: dict[str, dict[str, Any]] = {
    "payload": {"payload": {"n": 2}},
    "type": {"type": "order.cancelled"},
    "key": {"key": "order-2"},
}


@pytest.mark.pg15
@pytest.mark.parametrize("differs", list(CONFLICTS))
def test_a_key_reused_for_another_event_is_a_conflict(dsn: str, outbox: Outbox, differs: str) -> None:
    original: dict[str, Any] = {"type": "order.placed", "key": "order-1", "payload": {"n": 1},
                                "idempotency_key": "place-1"}
    other = {**original, **CONFLICTS[differs]}
    with counting_connection(dsn) as conn:
        first = outbox.publish(conn, **original)
        conn.commit()
        with pytest.raises(IdempotencyConflict) as info:
            outbox.publish(conn, **other)
        assert isinstance(info.value, InvalidEvent)
        assert (info.value.idempotency_key, info.value.topic) == ("place-1", TOPIC)
        assert "'place-1' of topic 'orders'" in str(info.value) and "nothing of this call" in str(info.value)
        sent = len(conn.statements)  # type: ignore[attr-defined]
        with pytest.raises(IdempotencyConflict, match="'place-1'"):
            outbox.publish_many(conn, [{"type": "t", "key": "x", "payload": "new"}, other])
        assert len(conn.statements) == sent + 1, "found by the one INSERT statement"  # type: ignore[attr-defined]
        # Nothing of either call was written, and the transaction goes on.
        assert conn.info.transaction_status == pq.TransactionStatus.INTRANS
        elsewhere = outbox.publish(conn, **other, topic="audit")  # keys are scoped per topic
        retry = outbox.publish(conn, **original)
        conn.commit()
    assert [e["id"] for e in stored(dsn)] == [first.id, elsewhere.id]
    assert elsewhere.created and retry == Published(first.id, False)


@pytest.mark.pg15
def test_fingerprints_tell_apart_type_and_key_that_run_together(dsn: str, outbox: Outbox) -> None:
    """Type "a\\nb" with key "c" is not type "a" with key "b\\nc" (found in review: a separator alone
    made them one fingerprint)."""
    with psycopg.connect(dsn) as conn:
        outbox.publish(conn, type="a\nb", key="c", payload={}, idempotency_key="joined")
        with pytest.raises(IdempotencyConflict):
            outbox.publish(conn, type="a", key="b\nc", payload={}, idempotency_key="joined")


@pytest.mark.pg15
def test_a_key_used_twice_in_one_batch_for_different_events_is_a_conflict(dsn: str, outbox: Outbox) -> None:
    with counting_connection(dsn) as conn:
        with pytest.raises(IdempotencyConflict, match="'dup' of topic 'orders'"):
            outbox.publish_many(conn, [
                {"type": "t", "key": "a", "payload": 1, "idempotency_key": "dup"},
                {"type": "t", "key": "b", "payload": 2},
                {"type": "t", "key": "a", "payload": 3, "idempotency_key": "dup"},
            ])
        assert len(conn.statements) == 1  # type: ignore[attr-defined]
        assert conn.info.transaction_status == pq.TransactionStatus.INTRANS
        after = outbox.publish(conn, type="t", key="a", payload=3, idempotency_key="dup")
        conn.commit()
    assert [e["id"] for e in stored(dsn)] == [after.id]


@pytest.mark.pg15
def test_events_stored_without_a_fingerprint_count_as_the_same(dsn: str, outbox: Outbox) -> None:
    # Events stored before migration 0005 have no fingerprint: a reuse of their key is taken as a retry.
    with psycopg.connect(dsn) as conn:
        first = outbox.publish(conn, type="t", key="k", payload=1, idempotency_key="old")
        conn.execute("UPDATE outbox.events SET idempotency_fingerprint = NULL")
        # 0014: the key's fingerprint is looked up in outbox.idempotency_keys (copied from the events).
        conn.execute("UPDATE outbox.idempotency_keys SET fingerprint = NULL")
        conn.commit()
        assert outbox.publish(conn, type="t", key="k", payload=2, idempotency_key="old") == Published(first.id, False)
        conn.commit()
    assert [e["payload"] for e in stored(dsn)] == [1]


@pytest.mark.pg15
@pytest.mark.parametrize("idempotency_key", ["same-object", None])
def test_same_event_object_twice_in_one_batch(dsn: str, outbox: Outbox, idempotency_key: str | None) -> None:
    event = make_event(type="t", key="k", topic=TOPIC, payload={}, idempotency_key=idempotency_key)
    with psycopg.connect(dsn) as conn:
        results = outbox.publish_many(conn, [event, event])
        conn.commit()
    assert [e["id"] for e in stored(dsn)] == [event.id]
    assert results == [Published(event.id, True), Published(event.id, False)]


@pytest.mark.pg15
def test_two_different_events_with_one_id_are_refused(dsn: str, outbox: Outbox) -> None:
    a = make_event(type="t", key="k", topic=TOPIC, payload=1)
    b = make_event(type="t", key="k", topic=TOPIC, payload=2, id=a.id)
    with psycopg.connect(dsn) as conn:
        with pytest.raises(InvalidEvent, match=str(a.id)):
            outbox.publish_many(conn, [a, b])
        assert conn.info.transaction_status != pq.TransactionStatus.INERROR
        conn.commit()
    assert stored(dsn) == []


def _second_psycopg(dsn: str, outbox: Outbox, pids: queue.Queue[int], events: list[dict[str, Any]]) -> Any:
    with psycopg.connect(dsn) as conn:
        pids.put(conn.info.backend_pid)
        try:
            result: Any = outbox.publish_many(conn, events)
        except IdempotencyConflict as exc:
            result = exc
            if conn.info.transaction_status == pq.TransactionStatus.INERROR:
                conn.rollback()
                return result
        # The caller's transaction is still usable: it commits an event after the conflict.
        outbox.publish(conn, type="t", key="k", payload="after", idempotency_key="after")
        conn.commit()
        return result


def _second_psycopg_async(dsn: str, outbox: Outbox, pids: queue.Queue[int], events: list[dict[str, Any]]) -> Any:
    async def main() -> Any:
        async with await psycopg.AsyncConnection.connect(dsn) as conn:
            pids.put(conn.info.backend_pid)
            try:
                result: Any = await outbox.apublish_many(conn, events)
            except IdempotencyConflict as exc:
                result = exc
                if conn.info.transaction_status == pq.TransactionStatus.INERROR:
                    await conn.rollback()
                    return result
            await outbox.apublish(conn, type="t", key="k", payload="after", idempotency_key="after")
            await conn.commit()
            return result

    return asyncio.run(main())


def _second_sqlalchemy(dsn: str, outbox: Outbox, pids: queue.Queue[int], events: list[dict[str, Any]]) -> Any:
    with sync_engine(dsn) as engine, engine.connect() as conn:
        conn.begin()
        pids.put(int(conn.exec_driver_sql("SELECT pg_backend_pid()").scalar_one()))
        try:
            result: Any = outbox.publish_many(conn, events)
        except IdempotencyConflict as exc:
            result = exc
            if conn.connection.driver_connection.info.transaction_status == pq.TransactionStatus.INERROR:
                conn.rollback()
                return result
        outbox.publish(conn, type="t", key="k", payload="after", idempotency_key="after")
        conn.commit()
        return result


SECOND_PRODUCERS: dict[str, Callable[[str, Outbox, queue.Queue[int], list[dict[str, Any]]], Any]] = {
    "psycopg": _second_psycopg,
    "psycopg-async": _second_psycopg_async,
    "sqlalchemy": _second_sqlalchemy,
}

# What the second producer publishes while the first holds idempotency key "K" uncommitted.
SECOND_BATCHES: dict[str, list[dict[str, Any]]] = {
    "retry": [{"type": "t", "key": "k", "payload": "first", "idempotency_key": "K"}],
    "other-event": [{"type": "t", "key": "k", "payload": "second", "idempotency_key": "K"}],
    "batch-retry": [{"type": "t", "key": "b", "payload": "mine"},
                    {"type": "t", "key": "k", "payload": "first", "idempotency_key": "K"}],
    "batch-other-event": [{"type": "t", "key": "b", "payload": "mine"},
                          {"type": "t", "key": "k", "payload": "second", "idempotency_key": "K"}],
}


def race(dsn: str, outbox: Outbox, pg_server: Any, second: str, batch: str, first_outcome: str,
         second_dsn: str | None = None) -> Any:
    """The first producer publishes key "K" and holds it uncommitted while the second publishes
    ``batch`` (on ``second_dsn``, default ``dsn``) and waits for it; returns what the second got."""
    pids: queue.Queue[int] = queue.Queue()
    result: list[Any] = []
    errors: list[BaseException] = []

    def run_second() -> None:
        try:
            result.append(SECOND_PRODUCERS[second](second_dsn or dsn, outbox, pids, SECOND_BATCHES[batch]))
        except BaseException as exc:
            errors.append(exc)

    with psycopg.connect(dsn) as first_conn:
        outbox.publish(first_conn, type="t", key="k", payload="first", idempotency_key="K")
        thread = threading.Thread(target=run_second)
        thread.start()
        try:
            pid = pids.get(timeout=10)

            def second_waits_for_first() -> bool:
                with pg_server.admin() as admin:
                    row = admin.execute("SELECT wait_event_type FROM pg_stat_activity WHERE pid = %s",
                                        (pid,)).fetchone()
                return row is not None and row[0] == "Lock"

            wait_until(second_waits_for_first, 10, message="the second producer to wait on the first")
            assert thread.is_alive() and not result
        finally:
            if first_outcome == "commit":
                first_conn.commit()
            else:
                first_conn.rollback()
            thread.join(30)
    assert not errors, errors
    (outcome,) = result
    return outcome


# On PostgreSQL 15 the race runs with one driver: the others send the same statements (publish_drivers.py).
@pytest.mark.parametrize("second", [pytest.param(s, marks=pytest.mark.pg15) if s == "psycopg" else s
                                    for s in SECOND_PRODUCERS])
@pytest.mark.parametrize("first_outcome", ["commit", "rollback"])
@pytest.mark.parametrize("batch", list(SECOND_BATCHES))
def test_concurrent_producers_with_one_key(dsn: str, outbox: Outbox, pg_server: Any, second: str,
                                           first_outcome: str, batch: str) -> None:
    outcome = race(dsn, outbox, pg_server, second, batch, first_outcome)
    by_payload = {e["payload"]: e for e in stored(dsn)}
    first = by_payload.get("first")
    if first_outcome == "rollback":
        # The key is free again: the second producer's events are all created.
        assert [p.created for p in outcome] == [True] * len(SECOND_BATCHES[batch])
        assert outcome[-1].id == by_payload[SECOND_BATCHES[batch][-1]["payload"]]["id"]
        assert set(by_payload) == {e["payload"] for e in SECOND_BATCHES[batch]} | {"after"}
    elif batch.endswith("retry"):
        # The same event: the first one stands for both, the rest of the batch is created.
        assert first is not None and outcome[-1] == Published(first["id"], False)
        assert all(p.created for p in outcome[:-1])
        assert set(by_payload) == {e["payload"] for e in SECOND_BATCHES[batch]} | {"after"}
    else:
        # Another event under a key the first producer just committed: refused, and nothing of the
        # second call is stored. A single event left nothing behind, so the transaction went on
        # (and committed "after"); a batch had written its first event, so its transaction was
        # failed and rolled back.
        assert isinstance(outcome, IdempotencyConflict), outcome
        assert (outcome.idempotency_key, outcome.topic) == ("K", TOPIC)
        assert "'K'" in str(outcome) and repr(TOPIC) in str(outcome)
        if batch == "other-event":
            assert "nothing of this call was written" in str(outcome)
            assert set(by_payload) == {"first", "after"}
        else:
            assert "must be rolled back" in str(outcome)
            assert set(by_payload) == {"first"}


@pytest.fixture
def producer_dsn(dsn: str, pg_server: Any) -> Iterator[str]:
    """A login with only the producer's rights of docs/roles.md
    (outbox_relay/privileges.py; tests/integration/test_roles.py runs that page as written)."""
    name = f"outbox_test_producer_{uuid.uuid4().hex[:8]}"
    role = sql.Identifier(name)
    with pg_server.admin() as admin:
        admin.execute(sql.SQL("CREATE ROLE {} LOGIN").format(role))
    try:
        with psycopg.connect(dsn, autocommit=True) as conn:
            for grant in privileges.grant_statements(privileges.PRODUCER, role.as_string(conn)):
                conn.execute(grant)
        yield make_conninfo(dsn, user=name, password=None)
    finally:
        with psycopg.connect(dsn, autocommit=True) as conn:
            conn.execute(sql.SQL("DROP OWNED BY {}").format(role))
        with pg_server.admin() as admin:
            admin.execute(sql.SQL("DROP ROLE {}").format(role))


@pytest.mark.pg15
def test_conflicts_are_found_with_a_producers_rights(dsn: str, producer_dsn: str, outbox: Outbox,
                                                     pg_server: Any) -> None:
    with psycopg.connect(producer_dsn) as conn:
        first = outbox.publish(conn, type="t", key="k", payload=1, idempotency_key="P")
        conn.commit()
        with pytest.raises(IdempotencyConflict, match="'P'"):
            outbox.publish(conn, type="t", key="k", payload=2, idempotency_key="P")
        with pytest.raises(IdempotencyConflict, match="'Q'"):
            outbox.publish_many(conn, [{"type": "t", "key": "k", "payload": 1, "idempotency_key": "Q"},
                                       {"type": "t", "key": "k", "payload": 2, "idempotency_key": "Q"}])
        assert outbox.publish(conn, type="t", key="k", payload=1, idempotency_key="P") == Published(first.id, False)
        conn.commit()
    # The concurrent path too: the lookup after the insert, and failing the transaction.
    outcome = race(dsn, outbox, pg_server, "psycopg", "batch-other-event", "commit", second_dsn=producer_dsn)
    assert isinstance(outcome, IdempotencyConflict) and "must be rolled back" in str(outcome)
    assert {e["payload"] for e in stored(dsn)} == {1, "first"}


# -- batches ------------------------------------------------------------------------------


@pytest.mark.pg15
def test_publish_many_is_one_statement_in_input_order(dsn: str, outbox: Outbox) -> None:
    # Every tenth event repeats the event 7 before it (a retry inside the batch).
    events = [make_event(type="t", key=f"key-{j % 37}", topic=TOPIC, payload={"i": j}, idempotency_key=f"idem-{j}")
              for j in (i - 7 if i % 10 == 7 else i for i in range(1000))]
    with counting_connection(dsn) as conn:
        results = outbox.publish_many(conn, events)
        assert len(conn.statements) == 1  # type: ignore[attr-defined]
        conn.commit()
    rows = stored(dsn)
    # The repeats are one row each, reported as not created.
    created = [e for e, r in zip(events, results, strict=True) if r.created]
    assert len(created) == 900 == len(rows)
    assert [r["id"] for r in rows] == [e.id for e in created], "seq must follow the input order"
    assert len({r["xid"] for r in rows}) == 1
    assert [r.id for r in results[7::10]] == [e.id for e in events[0::10]]


@pytest.mark.pg15
def test_publish_statement_cost_grows_linearly(dsn: str, outbox: Outbox) -> None:
    # The planner knows nothing of a CTE's columns, so joins between CTEs multiply its row estimates
    # (n * n / 200): a batch of a few thousand events was costed past jit_above_cost (100,000 by
    # default), and JIT compiling then took longer than the insert (0.3 s at 1,000 events, 7 s at
    # 10,000 on PostgreSQL 15). Costs are estimates, not timings: this holds on any machine.
    def cost(n: int) -> float:
        events = [outbox.event(type="t", key=f"k{i % 50}", payload={"i": i}, idempotency_key=f"idem-{i}")
                  for i in range(n)]
        with psycopg.connect(dsn) as conn:
            conn.prepare_threshold = None  # the custom plan, as for the first executions of any client
            (plan,) = conn.execute("EXPLAIN (FORMAT JSON) " + query("publish", "publish"),
                                   {"rows": _batch_json(Outbox._rows(events), keys=True),
                                    "ids_new": False}).fetchone()  # type: ignore[misc]  (every probe)
        return float(plan[0]["Plan"]["Total Cost"])

    small, large = cost(1000), cost(4000)
    assert large < 100_000, f"4,000 events cost {large:,.0f}"
    assert large / small < 5, f"cost {small:,.0f} for 1,000 events, {large:,.0f} for 4,000"


# -- bad input: a clear error naming the problem, before anything is written ------------------

def nested(depth: int) -> Any:
    """A payload of ``depth`` nested arrays (and objects every other level)."""
    payload: Any = "leaf"
    for level in range(depth):
        payload = [payload] if level % 2 else {"n": payload}
    return payload


def contains_itself() -> Any:
    payload: dict[str, Any] = {"a": []}
    payload["a"].append(payload)
    return payload


BAD_INPUT: dict[str, tuple[dict[str, Any], str]] = {
    "payload with a set": ({"payload": {"tags": {"a", "b"}}}, "payload"),
    "payload with NaN": ({"payload": {"amount": math.nan}}, "payload"),
    "payload with a NUL": ({"payload": {"note": "a\x00b"}}, "payload"),
    "payload with a lone surrogate": ({"payload": "\ud800"}, "payload"),
    "payload nested one level too deep": ({"payload": nested(MAX_PAYLOAD_DEPTH + 1)}, "payload"),
    "payload nested 10,000 deep": ({"payload": nested(10_000)}, "payload"),
    "payload that contains itself": ({"payload": contains_itself()}, "payload"),
    "payload over MAX_PAYLOAD_BYTES": ({"payload": "x" * MAX_PAYLOAD_BYTES}, "MAX_PAYLOAD_BYTES"),
    "payload over MAX_PAYLOAD_BYTES in UTF-8": ({"payload": "é" * (MAX_PAYLOAD_BYTES // 2)}, "MAX_PAYLOAD_BYTES"),
    "empty key": ({"key": ""}, "key"),
    "key over 1024 bytes": ({"key": "é" * 513}, "key"),
    "key with a NUL": ({"key": "a\x00b"}, "key"),
    "missing topic": ({"topic": None, "_no_default": True}, "topic"),
    "invalid topic": ({"topic": "orders and more!"}, "topic"),
    "topic .": ({"topic": "."}, "topic"),
    "topic ..": ({"topic": ".."}, "topic"),
    "topic with a trailing newline": ({"topic": "orders\n"}, "topic"),
    "empty type": ({"type": ""}, "type"),
    "type with a NUL": ({"type": "a\x00"}, "type"),
    "header that is not text": ({"headers": {"n": 1}}, "headers"),
    "header that is bytes": ({"headers": {"n": b"1"}}, "headers"),
    "header name that is not text": ({"headers": {1: "n"}}, "headers"),
    "header with a NUL": ({"headers": {"n": "\x00"}}, "headers"),
    # Past PostgreSQL's jsonb limit (256 MB) the INSERT failed mid-statement and aborted the transaction.
    "headers over MAX_HEADERS_BYTES": ({"headers": {"a": "x" * (MAX_HEADERS_BYTES // 2),
                                                    "b": "é" * (MAX_HEADERS_BYTES // 4)}}, "MAX_HEADERS_BYTES"),
    "header ce_id": ({"headers": {"ce_id": "mine"}}, "'ce_id' is reserved"),
    "header CE_Type": ({"headers": {"CE_Type": "mine"}}, "'CE_Type' is reserved"),
    "header Content-Type": ({"headers": {"Content-Type": "text/plain"}}, "'Content-Type' is reserved"),
    "header outbox_fence": ({"headers": {"outbox_fence": "99"}}, "'outbox_fence' is reserved"),
    "header Outbox_Replay": ({"headers": {"Outbox_Replay": "1"}}, "'Outbox_Replay' is reserved"),
    "empty idempotency key": ({"idempotency_key": ""}, "idempotency_key"),
    "time without a time zone": ({"time": datetime(2026, 1, 1)}, "time"),
    # Stored, then unreadable by every relay: PostgreSQL keeps 1 BC and year 10000, Python's datetime
    # (psycopg loads times into it) does not, and the read of the event's whole bucket failed.
    "time before year 1 in UTC": ({"time": datetime(1, 1, 1, tzinfo=timezone(timedelta(hours=1)))}, "time"),
    "time after year 9999 in UTC": ({"time": datetime(9999, 12, 31, 23, tzinfo=timezone(timedelta(hours=-5)))},
                                    "time"),
    # datetime.min/max as "no time": read back in a session time zone west (east) of UTC, they are too.
    "datetime.min as a time": ({"time": datetime.min.replace(tzinfo=UTC)}, "time"),
    "datetime.max as a time": ({"time": datetime.max.replace(tzinfo=UTC)}, "time"),
}


@pytest.mark.parametrize("case", list(BAD_INPUT))
def test_bad_input_is_refused_before_anything_is_written(dsn: str, case: str) -> None:
    change, named = BAD_INPUT[case]
    change = dict(change)
    outbox = Outbox(default_topic=None if change.pop("_no_default", False) else TOPIC)
    bad = {"type": "t", "key": "k", "payload": {}, **change}
    with counting_connection(dsn) as conn:
        accepted = outbox.publish(conn, type="t", key="k", topic=TOPIC, payload="accepted")
        sent = len(conn.statements)  # type: ignore[attr-defined]
        with pytest.raises(InvalidEvent) as info:
            outbox.publish(conn, **bad)
        assert named in str(info.value)
        with pytest.raises(InvalidEvent) as info:
            outbox.publish_many(conn, [{"type": "t", "key": "k", "topic": TOPIC, "payload": "in the batch"}, bad])
        assert named in str(info.value)
        assert len(conn.statements) == sent, "nothing may reach the database"  # type: ignore[attr-defined]
        assert conn.info.transaction_status == pq.TransactionStatus.INTRANS
        after = outbox.publish(conn, type="t", key="k", topic=TOPIC, payload="after")
        conn.commit()
    assert [e["id"] for e in stored(dsn)] == [accepted.id, after.id]


def test_unknown_fields(dsn: str, outbox: Outbox) -> None:
    # publish has typed keyword parameters (editors and mypy see them): Python itself names an unknown
    # one; a dict in publish_many is validated like the rest of the event.
    with psycopg.connect(dsn) as conn:
        with pytest.raises(TypeError, match="colour"):
            outbox.publish(conn, type="t", key="k", payload={}, colour="red")  # type: ignore[call-arg]
        with pytest.raises(InvalidEvent, match="colour"):
            outbox.publish_many(conn, [{"type": "t", "key": "k", "payload": {}, "colour": "red"}])
        conn.commit()
    assert stored(dsn) == []


@pytest.mark.pg15
def test_limits_agree_with_the_database(dsn: str, outbox: Outbox) -> None:
    # The largest key Python accepts is one the CHECK constraint accepts (bytes, not characters),
    # and the deepest payload is stored and read back.
    key = "é" * 512
    with psycopg.connect(dsn) as conn:
        outbox.publish(conn, type="t", key=key, payload="\\u0000 is text here, not a NUL")
        deep = outbox.publish(conn, type="t", key="k", payload=nested(MAX_PAYLOAD_DEPTH))
        conn.commit()
    first, second = stored(dsn)
    assert first["partition_key"] == key
    assert first["payload"] == "\\u0000 is text here, not a NUL"
    assert second["id"] == deep.id and second["payload"] == nested(MAX_PAYLOAD_DEPTH)


def test_the_largest_payload_is_stored_in_its_most_expanding_shape(dsn: str, outbox: Outbox) -> None:
    """MAX_PAYLOAD_BYTES keeps jsonb below its 256 MB limit even for a payload whose binary form is
    the largest for its text (an array of small numbers): publish must never let a payload through
    that PostgreSQL then refuses mid-statement (ProgramLimitExceeded, an aborted transaction)."""
    zeros = [0] * ((MAX_PAYLOAD_BYTES - 2) // 2)  # "[0,0,...,0]" is 2 bytes a number
    with psycopg.connect(dsn) as conn:
        published = outbox.publish(conn, type="t", key="k", payload=zeros)
        row = conn.execute("SELECT pg_column_size(payload) FROM outbox.events WHERE id = %s",
                           (published.id,)).fetchone()
        conn.commit()
    assert row is not None and row[0] < 256 * 1024 * 1024 // 2, f"jsonb took {row}: the margin is too thin"


# Names a consumer's screen shows as one of the relay's own: a space, another case and '-', a zero-width
# space or soft hyphen inside, fullwidth letters, a word joiner, a fullwidth hyphen, a byte-order mark.
LOOKALIKES = ["ce_id ", " ce_id", "CE-ID", "ce_\u200bid", "c\u00ade_id", "\uff43\uff45\uff3f\uff49\uff44",
              "ce\u2060_type", "content\uff0dtype", "outbox\u200b_fence", "\ufeffce_time"]
HEADER_NAMES = [*sorted(RESERVED_HEADERS), "CE_ID", "Ce_SpecVersion", "Content-Type", "outbox_fence", "OUTBOX_REPLAY",
                "outbox_", "Outbox_x", "ce_\u0130d", "ce_other", "ce-id", "content_type", "outbox-fence", "x_outbox_y",
                "trace", *LOOKALIKES]


@pytest.mark.pg15
def test_reserved_header_names_agree_with_the_database(dsn: str) -> None:
    # Every name the trigger refuses, Python refuses first (a refusal mid-statement would abort the
    # caller's transaction); for ASCII names the two lists are the same.
    insert = ("INSERT INTO outbox.events (topic, partition_key, type, payload, headers) "
              "VALUES ('orders', 'k', 't', '{}', %s)")
    with psycopg.connect(dsn) as conn:
        for name in HEADER_NAMES:
            try:
                make_event(type="t", key="k", payload={}, headers={name: "v"})
                python_refuses = False
            except InvalidEvent:
                python_refuses = True
            try:
                with conn.transaction():
                    conn.execute(insert, (Jsonb({name: "v"}),))
                    raise Rollback()
            except psycopg.errors.CheckViolation as exc:
                assert "is reserved for the relay" in str(exc)
                database_refuses = True
            else:
                database_refuses = False
            assert python_refuses >= database_refuses, name
            if name.isascii() or name in LOOKALIKES:
                assert python_refuses == database_refuses, name
            if name in LOOKALIKES:  # what a consumer's screen shows as one of the relay's own names
                assert database_refuses, name



# -- producers in other languages (docs/sql-producers.md, run as written there) -----------------------


@pytest.mark.pg15
def test_the_documented_sql_producer(dsn: str, outbox: Outbox) -> None:
    text = (Path(__file__).resolve().parents[2] / "docs" / "sql-producers.md").read_text()
    insert, check = re.findall(r"```sql\n(.*?)```", text, re.S)
    with psycopg.connect(dsn) as conn:
        conn.execute(insert)
        conn.execute(insert)  # a retry
        conn.commit()
        assert conn.execute(check).fetchall() == [(stored(dsn)[0]["id"], True)]
        conn.execute(insert.replace("9182}", "9183}"))  # the key reused for another event: DO NOTHING ...
        conn.commit()
        (event,) = stored(dsn)
        assert conn.execute(check.replace("9182}", "9183}")).fetchall() == [(event["id"], False)]  # ... told apart
        # The Python API sees it as the same event.
        retry = outbox.publish(conn, type="OrderPaid", key="order:9182", payload={"order_id": 9182},
                               idempotency_key="paid-9182")
        with pytest.raises(IdempotencyConflict):
            outbox.publish(conn, type="OrderPaid", key="order:9182", payload={"order_id": 9183},
                           idempotency_key="paid-9182")
        when = conn.execute("SELECT occurred_at FROM outbox.events").fetchone()
    assert retry == Published(event["id"], False)
    assert when == (datetime(2026, 11, 2, 10, 15, tzinfo=UTC),)


@pytest.mark.pg15
def test_the_schema_version_is_stored_and_checked(dsn: str, outbox: Outbox) -> None:
    with psycopg.connect(dsn) as conn:
        outbox.publish(conn, type="t", key="k", payload={})
        outbox.publish(conn, type="t", key="k", payload={}, version=3)
        outbox.publish_many(conn, [{"type": "t", "key": "k", "payload": {}, "version": 2},
                                   outbox.event(type="t", key="k", payload={}, version=4)])
        outbox.publish(conn, type="t", key="k", payload={}, version=5, idempotency_key="i")
        with pytest.raises(InvalidEvent, match="version"):
            outbox.publish(conn, type="t", key="k", payload={}, version=0)
        conn.commit()
    versions = [r[0] for r in fetch_rows(dsn, "SELECT schema_version FROM outbox.events ORDER BY xid, seq")]
    assert versions == [1, 3, 2, 4, 5]
    with psycopg.connect(dsn) as conn, pytest.raises(psycopg.errors.CheckViolation, match="schema_version"):
        conn.execute("INSERT INTO outbox.events (topic, partition_key, type, payload, schema_version) "
                     "VALUES ('t', 'k', 't', '{}', 0)")


@pytest.mark.pg15
def test_each_call_sends_the_cheapest_statement_that_keeps_its_promises(dsn: str, outbox: Outbox) -> None:
    """One event is a plain INSERT of the fields that differ from the defaults (insert_plain), with or
    without an idempotency key (its row count says whether the key was free: a look-up only when it was
    not); headers, a time or a version send every field (insert_one). Several events without keys are
    one JSON document; ids the caller chose are checked in the insert; batches with keys use the
    idempotency statement.
    A regression here is invisible to the other tests and costs every producer its commit rate."""
    def sent(call: Callable[[Any], Any]) -> list[str]:
        with counting_connection(dsn) as conn:
            call(conn)
            conn.rollback()
            return [name for statement in conn.statements  # type: ignore[attr-defined]
                    for name in ("insert_plain", "insert_one", "insert_many", "insert_checked",
                                 "find_by_idempotency_keys", "publish")
                    if statement == query("publish", name)]

    assert sent(lambda c: outbox.publish(c, type="t", key="k", payload={})) == ["insert_plain"]
    assert sent(lambda c: outbox.publish_many(c, [{"type": "t", "key": "k", "payload": {}}])) == ["insert_plain"]
    assert sent(lambda c: outbox.publish(c, type="t", key="k", payload={}, headers={"h": "1"})) == ["insert_one"]
    assert sent(lambda c: outbox.publish(c, type="t", key="k", payload={}, version=2)) == ["insert_one"]
    assert sent(lambda c: outbox.publish(c, type="t", key="k", payload={}, time=datetime.now(UTC),
                                         idempotency_key="i")) == ["insert_one"]
    assert sent(lambda c: outbox.publish_many(c, [{"type": "t", "key": k, "payload": {}} for k in "ab"])) == [
        "insert_many"]
    assert sent(lambda c: outbox.publish(c, type="t", key="k", payload={}, id=uuid.uuid4())) == ["insert_checked"]
    assert sent(lambda c: outbox.publish_many(c, [outbox.event(type="t", key="k", payload={})])) == [
        "insert_checked"]
    assert sent(lambda c: outbox.publish(c, type="t", key="k", payload={}, idempotency_key="i")) == ["insert_plain"]

    def twice(c: Any) -> None:
        outbox.publish(c, type="t", key="k", payload={}, idempotency_key="i")
        assert not outbox.publish(c, type="t", key="k", payload={}, idempotency_key="i").created
    assert sent(twice) == ["insert_plain", "insert_plain", "find_by_idempotency_keys"]
    keyed = [{"type": "t", "key": k, "payload": {}, "idempotency_key": k} for k in "ab"]
    assert sent(lambda c: outbox.publish_many(c, keyed)) == ["publish"]


@pytest.mark.pg15
def test_a_batch_round_trips_every_field_as_given(dsn: str, outbox: Outbox) -> None:
    """publish_many sends a batch as one JSON document: every field must come back as given, whatever
    the characters (quotes, backslashes, non-ASCII, JSON null, nested payloads, headers, times)."""
    when = datetime(2026, 1, 2, 3, 4, 5, 678901, tzinfo=UTC)
    events = [
        {"type": 'od"d\\type', "key": 'k"ey\\1 ü €', "payload": None},
        {"type": "t", "key": "k2", "payload": {"q": 'say "hi" \\ there', "n": 1.50, "nested": [1, {"é": None}]},
         "headers": {"h-1": 'v"1\\'}, "time": when, "version": 3},
        {"type": "t", "key": "k3", "payload": "just a string with \u2028 inside"},
        {"type": "t", "key": "k4", "payload": [True, False, 10**30]},
    ]
    with psycopg.connect(dsn) as conn:
        published = outbox.publish_many(conn, events)
        conn.commit()
    rows = fetch_rows(dsn, "SELECT id, type, partition_key, payload, headers, occurred_at, schema_version "
                           "FROM outbox.events ORDER BY xid, seq")
    assert [r[0] for r in rows] == [p.id for p in published]
    assert [(r[1], r[2]) for r in rows] == [(e["type"], e["key"]) for e in events]
    assert [r[3] for r in rows] == [None, {"q": 'say "hi" \\ there', "n": 1.5, "nested": [1, {"é": None}]},
                                    "just a string with \u2028 inside", [True, False, 10**30]]
    assert rows[1][4] == {"h-1": 'v"1\\'} and rows[1][5] == when and [r[6] for r in rows] == [1, 3, 1, 1]
    assert fetch_rows(dsn, "SELECT count(*) FROM outbox.events WHERE payload = 'null'::jsonb") == [(1,)]


@pytest.mark.pg15
def test_plain_dicts_round_trip_as_the_general_path_stores_them(dsn: str, outbox: Outbox) -> None:
    """publish_many builds rows from plain dicts without an Event (its quick path): the stored rows are
    the ones the general path (an Event per dict) stores, field by field."""
    when = datetime(2026, 1, 2, 3, 4, 5, 678901, tzinfo=UTC)
    events: list[dict[str, Any]] = [
        {"type": 'od"d\\type', "key": 'k"ey\\1 ü €', "payload": None, "idempotency_key": 'i"1\\ é'},
        {"type": "t", "key": "k2", "payload": {"q": 'say "hi"', "n": 1.50, "nested": [1, {"é": None}]},
         "time": when, "version": 3, "topic": "audit"},
        {"type": "t", "key": "k3", "payload": "a \u2028 string", "topic": None},
        {"type": "t", "key": "k4", "payload": [True, False, 10**30], "idempotency_key": "i4"},
    ]
    columns = "topic, type, partition_key, payload, headers, idempotency_key, occurred_at, schema_version"
    with psycopg.connect(dsn) as conn:
        quick = outbox.publish_many(conn, events)
        # The general path: the same events, each built as an Event first.
        general = outbox.publish_many(conn, [outbox.event(**{k: v for k, v in e.items()
                                                              if k != "idempotency_key"}) for e in events])
        conn.commit()
    rows = fetch_rows(dsn, f"SELECT id, {columns} FROM outbox.events ORDER BY xid, seq")
    assert [r[0] for r in rows] == [p.id for p in quick + general]
    assert all(p.created for p in quick + general)
    assert [r[1:6] + r[7:] for r in rows[:4]] == [r[1:6] + r[7:] for r in rows[4:]]
    assert [r[6] for r in rows[:4]] == [e.get("idempotency_key") for e in events]
    assert rows[0][1:4] == (TOPIC, 'od"d\\type', 'k"ey\\1 ü €') and rows[1][7:] == (when, 3)
