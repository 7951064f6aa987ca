"""Projections against a real PostgreSQL: exactly-once effects (G7), retries and dead letters,
event-type filtering, payload models, async handlers, per-key order across a hand-over (G6).

The relay loop is the real SinkRunner; the sink is the real ProjectionSink. Nothing is mocked.

``pg15``: what PostgreSQL 15 runs too (scripts/test.sh): the exactly-once writes, fences, retries, dead
letters, retention and hand-overs, with the sync handlers; an async handler sends the same statements,
and the declarations and registries are Python.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import uuid
from collections.abc import Callable
from typing import Any

import psycopg
import pytest
from psycopg_pool import ConnectionPool
from pydantic import BaseModel

from outbox_relay import store
from outbox_relay.errors import ConfigurationError, NonRetriableDelivery
from outbox_relay.housekeeping import Housekeeping
from outbox_relay.relay import SinkRunner
from projections import ProjectionEvent, Registry, fenced_upsert, load_registry, projection
from projections.event import FenceToken
from projections.sink import ProjectionSink
from tests.integration.order_totals import applied, expected_totals, orders, per_key, totals
from tests.integration.relay_helpers import (  # noqa: F401  (pool_fixture provides `pool`)
    ALL_BUCKETS,
    close_history,
    dead_letters,
    fetch_all,
    keys_in_bucket,
    make_settings,
    parked_ids,
    pool_fixture,
    publish,
    run_until,
    undelivered,
)
from tests.servers import wait_until


def on_pg15(*values: Any) -> list[Any]:
    """Parameters that the PostgreSQL 15 step runs too."""
    return [pytest.param(v, marks=pytest.mark.pg15) for v in values]


TOTALS = """
CREATE TABLE order_totals (customer text PRIMARY KEY, orders int NOT NULL, paid_cents bigint NOT NULL);
CREATE TABLE applied_log (n bigserial PRIMARY KEY, event_id uuid NOT NULL, key text NOT NULL,
                          worker text NOT NULL, replay boolean NOT NULL);
"""


def setup_tables(dsn: str, ddl: str = TOTALS) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(ddl)


def totals_projection(name: str = "order_totals", worker: str = "w",
                      before: Callable[[ProjectionEvent[Any], Any], None] | None = None) -> Any:
    @projection(name, events=["OrderPlaced", "OrderPaid"], tables=["order_totals", "applied_log"])
    def apply(event: ProjectionEvent[Any], tx: Any) -> None:
        if before is not None:
            before(event, tx)
        p = event.payload
        if event.type == "OrderPlaced":
            tx.execute("INSERT INTO order_totals VALUES (%s, 1, 0) "
                       "ON CONFLICT (customer) DO UPDATE SET orders = order_totals.orders + 1", (p["customer"],))
        else:
            tx.execute("UPDATE order_totals SET paid_cents = paid_cents + %s WHERE customer = %s",
                       (p["cents"], p["customer"]))
        tx.execute("INSERT INTO applied_log (event_id, key, worker, replay) VALUES (%s, %s, %s, %s)",
                   (event.id, event.key, worker, event.replay))
    return apply


_open_sinks: list[ProjectionSink] = []


@pytest.fixture(autouse=True)
def _close_sinks() -> Any:
    yield
    while _open_sinks:
        _open_sinks.pop().close()


def runner(projection_: Any, dsn: str, pool: ConnectionPool[Any], worker: str = "w",
           buckets: Any = ALL_BUCKETS, **settings: Any) -> SinkRunner:
    sink = ProjectionSink(projection_, dsn, lease_seconds=settings.get("lease_seconds", 30.0))
    _open_sinks.append(sink)
    with pool.connection() as conn:
        store.register_sink(conn, sink.name, sink.kind)
    r = SinkRunner(sink, pool, make_settings(dsn, worker, **settings))
    r.desired = set(buckets)
    return r


# -- declaring ---------------------------------------------------------------------------------


def test_registries_are_independent_and_refuse_duplicate_names() -> None:
    a, b = Registry(), Registry()

    @a.projection("same_name")
    def one(event: Any, tx: Any) -> None: ...

    @b.projection("same_name")
    def two(event: Any, tx: Any) -> None: ...

    assert a.get("same_name").handler is not b.get("same_name").handler
    with pytest.raises(ConfigurationError, match="two projections are named 'same_name'"):
        a.add(b.get("same_name"))
    with pytest.raises(ConfigurationError, match="unknown projection 'nope'"):
        a.get("nope")


@pytest.mark.parametrize(("name", "kwargs", "message"), [
    ("Bad-Name", {}, "must be 1-48 characters"),
    ("ok", {"events": "OrderPlaced"}, "not the string"),
    ("ok", {"events": []}, "non-empty"),
    ("ok", {"on_unknown": "reject"}, "needs the list of events"),
    ("ok", {"on_unknown": "explode", "events": ["A"]}, "on_unknown must be"),
    ("ok", {"events": {"A": dict}}, "not a pydantic model"),
])
def test_bad_declarations_name_the_problem(name: str, kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigurationError, match=message):
        projection(name, **kwargs)(lambda e, tx: None)


def test_load_registry_gathers_a_module_and_rejects_what_is_not_there() -> None:
    registry = load_registry("tests.integration.projection_app")
    assert registry.names() == ["customer_orders", "order_totals"]
    assert load_registry("tests.integration.projection_app:order_totals").names() == ["order_totals"]
    with pytest.raises(ConfigurationError, match="no module named"):
        load_registry("tests.integration.no_such_module")
    with pytest.raises(ConfigurationError, match="no attribute 'nope'"):
        load_registry("tests.integration.projection_app:nope")


# -- G7: exactly-once effects ------------------------------------------------------------------


@pytest.mark.pg15
def test_events_are_applied_once_in_order_with_the_checkpoint(dsn: str, pool: ConnectionPool[Any]) -> None:
    setup_tables(dsn)
    events = orders(customers=20, per_customer=5)
    ids = publish(dsn, events)
    r = runner(totals_projection(), dsn, pool, batch_size=50)
    run_until(r, lambda: len(applied(dsn)) >= len(ids))
    r.run_once()  # nothing left: nothing applied twice
    assert totals(dsn) == expected_totals(20, 5)
    log = applied(dsn)
    assert len(log) == len(ids) and {e for e, _ in log} == set(ids), "each event applied exactly once"
    want = per_key(list(zip(ids, [k for k, _, _ in events], strict=True)))
    assert per_key(log) == want, "per key, applied in publish order"
    assert undelivered(dsn, "order_totals") == 0, "the cursors moved past every applied event"


@pytest.mark.pg15
def test_a_fenced_out_batch_rolls_back_the_handlers_writes(dsn: str, pool: ConnectionPool[Any]) -> None:
    """The lease is taken over while the batch is being applied: its writes must not land (G5/G7)."""
    setup_tables(dsn)
    ids = publish(dsn, orders(customers=3, per_customer=2))
    stolen = threading.Event()

    def steal_once(event: ProjectionEvent[Any], tx: Any) -> None:
        if not stolen.is_set():
            stolen.set()
            with psycopg.connect(dsn, autocommit=True) as thief:  # another worker took every lease over
                thief.execute("UPDATE outbox.cursors SET owner = 'thief', fence = fence + 1 "
                              "WHERE sink = 'order_totals' AND owner IS NOT NULL")

    r = runner(totals_projection(before=steal_once), dsn, pool)
    r.run_once()
    assert stolen.is_set()
    assert totals(dsn) == [] and applied(dsn) == [], "a fenced-out batch wrote to the read model"
    batch_buckets = {b for (b,) in fetch_all(dsn, "SELECT DISTINCT bucket FROM outbox.events")}
    assert not batch_buckets & r.leases.snapshot().keys(), "the runner forgot the buckets it lost"
    # The thief's lease ends; the next owner applies everything exactly once.
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("UPDATE outbox.cursors SET owner = NULL WHERE owner = 'thief'")
    again = runner(totals_projection(worker="next"), dsn, pool, worker="next")
    run_until(again, lambda: len(applied(dsn)) >= len(ids))
    assert totals(dsn) == expected_totals(3, 2)
    assert sorted(e for e, _ in applied(dsn)) == sorted(ids)


@pytest.mark.pg15
def test_a_connection_lost_before_commit_applies_nothing_and_the_retry_applies_once(
        dsn: str, pool: ConnectionPool[Any]) -> None:
    setup_tables(dsn)
    ids = publish(dsn, orders(customers=4, per_customer=2))
    killed = threading.Event()

    def die_once(event: ProjectionEvent[Any], tx: Any) -> None:
        if not killed.is_set():
            killed.set()
            pid = tx.info.backend_pid
            with psycopg.connect(dsn, autocommit=True) as admin:  # the database drops our session
                admin.execute("SELECT pg_terminate_backend(%s)", (pid,))

    r = runner(totals_projection(before=die_once), dsn, pool)
    with pytest.raises(psycopg.OperationalError):
        r.run_once()
    assert totals(dsn) == [] and applied(dsn) == []
    run_until(r, lambda: len(applied(dsn)) >= len(ids))  # the sink reconnects
    assert totals(dsn) == expected_totals(4, 2)
    assert len(applied(dsn)) == len(ids)


def test_async_handlers_get_the_same_guarantees(dsn: str, pool: ConnectionPool[Any]) -> None:
    setup_tables(dsn)
    ids = publish(dsn, orders(customers=5, per_customer=3))
    calls = 0

    @projection("order_totals", events=["OrderPlaced", "OrderPaid"])
    async def apply(event: ProjectionEvent[Any], tx: psycopg.AsyncConnection[Any]) -> None:
        nonlocal calls
        calls += 1
        await asyncio.sleep(0)
        p = event.payload
        if event.type == "OrderPlaced":
            await tx.execute("INSERT INTO order_totals VALUES (%s, 1, 0) ON CONFLICT (customer) "
                             "DO UPDATE SET orders = order_totals.orders + 1", (p["customer"],))
        else:
            if event.key == "cust-1" and event.attempt == 1:
                raise RuntimeError("first attempt fails")
            await tx.execute("UPDATE order_totals SET paid_cents = paid_cents + %s WHERE customer = %s",
                             (p["cents"], p["customer"]))
        await tx.execute("INSERT INTO applied_log (event_id, key, worker, replay) VALUES (%s, %s, 'w', false)",
                         (event.id, event.key))

    assert apply.is_async
    r = runner(apply, dsn, pool)
    run_until(r, lambda: len(applied(dsn)) >= len(ids))
    assert totals(dsn) == expected_totals(5, 3)
    assert sorted(e for e, _ in applied(dsn)) == sorted(ids), "each event exactly once despite the retry"


# -- failures ----------------------------------------------------------------------------------


@pytest.mark.pg15
def test_a_raising_handler_is_retried_then_dead_lettered_and_its_key_moves_on(
        dsn: str, pool: ConnectionPool[Any]) -> None:
    setup_tables(dsn)
    events = [("cust-bad", "OrderPlaced", {"customer": "cust-bad"}),
              ("cust-bad", "OrderPaid", {"customer": "cust-bad", "cents": -1}),  # poison
              ("cust-bad", "OrderPaid", {"customer": "cust-bad", "cents": 7}),
              ("cust-ok", "OrderPlaced", {"customer": "cust-ok"})]
    placed, poison, after, ok = publish(dsn, events)
    attempts: list[int] = []

    def refuse_negative(event: ProjectionEvent[Any], tx: Any) -> None:
        if event.payload.get("cents", 0) < 0:
            attempts.append(event.attempt)
            raise ValueError("negative amount")

    r = runner(totals_projection(before=refuse_negative), dsn, pool, max_attempts=3)
    run_until(r, lambda: poison in dead_letters(dsn, "order_totals") and len(applied(dsn)) == 3)
    assert attempts == [1, 2, 3]
    count, error = dead_letters(dsn, "order_totals")[poison]
    assert count == 3 and error == "ValueError: negative amount"
    assert [e for e, _ in applied(dsn)] in ([placed, ok, after], [ok, placed, after], [placed, after, ok])
    assert totals(dsn) == [("cust-bad", 1, 7), ("cust-ok", 1, 0)]
    assert parked_ids(dsn, "order_totals") == set()


@pytest.mark.pg15
def test_non_retriable_delivery_and_invalid_payloads_are_dead_lettered_at_once(
        dsn: str, pool: ConnectionPool[Any]) -> None:
    setup_tables(dsn)

    class Paid(BaseModel):
        customer: str
        cents: int

    @projection("order_totals", events={"OrderPaid": Paid})
    def apply(event: ProjectionEvent[Paid], tx: Any) -> None:
        assert isinstance(event.payload, Paid)
        if event.payload.cents == 13:
            raise NonRetriableDelivery("unlucky amount")
        tx.execute("INSERT INTO order_totals VALUES (%s, 0, %s) ON CONFLICT (customer) "
                   "DO UPDATE SET paid_cents = order_totals.paid_cents + EXCLUDED.paid_cents",
                   (event.payload.customer, event.payload.cents))

    bad_shape, unlucky, good = publish(dsn, [
        ("c", "OrderPaid", {"customer": "c", "cents": "lots"}),
        ("c", "OrderPaid", {"customer": "c", "cents": 13}),
        ("c", "OrderPaid", {"customer": "c", "cents": 5}),
    ])
    r = runner(apply, dsn, pool)
    run_until(r, lambda: totals(dsn) == [("c", 0, 5)])
    letters = dead_letters(dsn, "order_totals")
    assert set(letters) == {bad_shape, unlucky}
    attempts, error = letters[bad_shape]
    assert attempts == 1 and "ValidationError" in error and "cents" in error
    assert letters[unlucky] == (1, "NonRetriableDelivery: unlucky amount")
    assert good not in letters


@pytest.mark.pg15
def test_unknown_event_types_are_ignored_or_rejected_as_declared(dsn: str, pool: ConnectionPool[Any]) -> None:
    setup_tables(dsn)
    seen: dict[str, list[str]] = {"lenient": [], "strict": []}

    def make(name: str, on_unknown: Any) -> Any:
        @projection(name, events=["OrderPlaced"], on_unknown=on_unknown)
        def apply(event: ProjectionEvent[Any], tx: Any) -> None:
            seen[name].append(event.type)
        return apply

    _, refunded = publish(dsn, [("c", "OrderPlaced", {}), ("c", "OrderRefunded", {})])
    lenient = runner(make("lenient", "ignore"), dsn, pool)
    strict = runner(make("strict", "reject"), dsn, pool)
    run_until(lenient, lambda: seen["lenient"] == ["OrderPlaced"])
    run_until(strict, lambda: refunded in dead_letters(dsn, "strict"))
    assert seen == {"lenient": ["OrderPlaced"], "strict": ["OrderPlaced"]}
    assert dead_letters(dsn, "lenient") == {}
    assert dead_letters(dsn, "strict")[refunded] == (
        1, "projection 'strict' does not handle event type 'OrderRefunded'")


@pytest.mark.pg15
def test_a_projection_moves_past_events_it_does_not_want_so_retention_can_delete_them(
        dsn: str, pool: ConnectionPool[Any]) -> None:
    """Buckets that hold only other types: the cursor still moves (else every read walks past
    them again and retention waits for them forever)."""
    seen: list[str] = []

    @projection("rare", events=["Rare"])
    def apply(event: ProjectionEvent[Any], tx: Any) -> None:
        seen.append(event.type)

    publish(dsn, [(f"k{i}", "Common", {}) for i in range(600)])
    r = runner(apply, dsn, pool)

    def behind() -> int:
        return undelivered(dsn, "rare")

    run_until(r, lambda: behind() == 0)
    assert seen == []
    publish(dsn, [("k1", "Rare", {})])
    run_until(r, lambda: seen == ["Rare"])
    close_history(dsn)
    deleted = Housekeeping(pool, make_settings(dsn, "hk", retention_seconds=0.0)).run_once().deleted_events
    assert deleted == 601, "every event is behind the only sink: retention deletes all of them"


# -- G6 across a hand-over ---------------------------------------------------------------------


@pytest.mark.pg15
def test_per_key_order_and_exactly_once_hold_while_buckets_move_between_workers(
        dsn: str, pool: ConnectionPool[Any]) -> None:
    setup_tables(dsn)
    events = orders(customers=40, per_customer=6)
    ids = publish(dsn, events)
    a = runner(totals_projection(worker="a"), dsn, pool, worker="a", batch_size=16)
    b = runner(totals_projection(worker="b"), dsn, pool, worker="b", batch_size=16)
    half = set(range(0, 256, 2))
    a.desired, b.desired = set(ALL_BUCKETS), set()
    for step in range(400):
        if step % 3 == 0:  # the assignment changes: buckets move back and forth
            a.desired, b.desired = (half, ALL_BUCKETS - half) if step % 6 == 0 else (ALL_BUCKETS - half, half)
        a.run_once()
        b.run_once()
        if len(applied(dsn)) >= len(ids):
            break
    log = applied(dsn)
    assert len(log) == len(ids) and len({e for e, _ in log}) == len(ids), "an event was applied twice or lost"
    assert per_key(log) == per_key(list(zip(ids, [k for k, _, _ in events], strict=True)))
    assert totals(dsn) == expected_totals(40, 6)
    workers = {w for (w,) in fetch_all(dsn, "SELECT DISTINCT worker FROM applied_log")}
    assert workers == {"a", "b"}, "both workers took part"


# -- fencing helper ----------------------------------------------------------------------------


@pytest.mark.pg15
def test_fenced_upsert_writes_only_over_an_older_token(dsn: str) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("CREATE TABLE remote_view (id text PRIMARY KEY, status text, fence_token text NOT NULL)")
        # A new owner (larger fence) wins whatever its read and position; then later reads, then positions.
        old, new = FenceToken(3, 7, 900, 2), FenceToken(4, 1, 800, 1)
        assert fenced_upsert(conn, "public.remote_view", {"id": "o1"}, {"status": "paid"}, new)
        assert not fenced_upsert(conn, "remote_view", {"id": "o1"}, {"status": "stale"}, old)
        assert not fenced_upsert(conn, "remote_view", {"id": "o1"}, {"status": "again"}, new), "same token: no-op"
        assert fenced_upsert(conn, "remote_view", {"id": "o1"}, {"status": "packed"}, FenceToken(4, 2, 700, 1))
        assert not fenced_upsert(conn, "remote_view", {"id": "o1"}, {"status": "late"}, FenceToken(4, 1, 900, 9))
        assert fenced_upsert(conn, "remote_view", {"id": "o1"}, {"status": "shipped"}, FenceToken(4, 2, 700, 2))
        rows = conn.execute("SELECT id, status, fence_token FROM remote_view").fetchall()
        assert rows == [("o1", "shipped", str(FenceToken(4, 2, 700, 2)))]
        # A row written before reads were numbered (FENCE-XID-SEQ) is overwritten by the next owner's
        # token, compared in the database's own collation, and refuses nothing it should not.
        conn.execute("INSERT INTO remote_view VALUES ('o2', 'old relay', %s)",
                     (f"{5:020d}-{99999:020d}-{9:020d}",))
        assert not fenced_upsert(conn, "remote_view", {"id": "o2"}, {"status": "stale"}, FenceToken(4, 9, 99999, 9))
        assert fenced_upsert(conn, "remote_view", {"id": "o2"}, {"status": "upgraded"}, FenceToken(6, 1, 3, 1))
        assert conn.execute("SELECT status FROM remote_view WHERE id = 'o2'").fetchone() == ("upgraded",)


# -- events the relay can not turn into a handler call -------------------------------------------


def insert_raw(dsn: str, rows: list[tuple[str, str, str, str]]) -> list[uuid.UUID]:
    """Insert (key, type, payload JSON, headers JSON) rows as a superuser bypassing the events_check
    trigger (as rows from before migration 0005 would be); returns their ids in order."""
    with psycopg.connect(dsn, autocommit=True) as conn, conn.transaction():
        conn.execute("SET LOCAL session_replication_role = replica")
        return [conn.execute("INSERT INTO outbox.events (partition_key, topic, type, payload, headers) "
                             "VALUES (%s, 'relay-test', %s, %s::jsonb, %s::jsonb) RETURNING id",
                             (key, type_, payload, headers)).fetchone()[0]  # type: ignore[index]
                for key, type_, payload, headers in rows]


@pytest.mark.pg15
def test_events_that_can_not_be_prepared_are_dead_lettered_at_once_and_the_rest_lands(
        dsn: str, pool: ConnectionPool[Any]) -> None:
    """Item 5: a payload too deep for json.loads, headers that are not a JSON object of strings, and
    any exception from prepare are charged to their event (dead letter at once, the reason named);
    never an exception that fails the whole batch, so the other events land."""
    setup_tables(dsn)

    class Placed(BaseModel):
        customer: str

        @classmethod
        def model_validate(cls, obj: Any, **kwargs: Any) -> Any:  # type: ignore[override]
            if obj.get("customer") == "explodes":
                raise RuntimeError("validator crashed")  # not a ValidationError
            return super().model_validate(obj, **kwargs)

    @projection("order_totals", events={"OrderPlaced": Placed})
    def apply(event: ProjectionEvent[Placed], tx: Any) -> None:
        tx.execute("INSERT INTO order_totals VALUES (%s, 1, 0) ON CONFLICT (customer) "
                   "DO UPDATE SET orders = order_totals.orders + 1", (event.payload.customer,))
        tx.execute("INSERT INTO applied_log (event_id, key, worker, replay) VALUES (%s, %s, 'w', false)",
                   (event.id, event.key))

    deep = "[" * 990 + "]" * 990
    ok = '{"customer": "ok"}'
    rows = [("k1", "OrderPlaced", deep, "{}"), ("k1", "OrderPlaced", ok, "{}"),
            ("k2", "OrderPlaced", ok, '["not", "an", "object"]'), ("k2", "OrderPlaced", ok, "{}"),
            ("k3", "OrderPlaced", ok, '{"retries": 3}'), ("k3", "OrderPlaced", ok, "{}"),
            ("k4", "OrderPlaced", '{"customer": "explodes"}', "{}"), ("k4", "OrderPlaced", ok, "{}")]
    ids = insert_raw(dsn, rows)
    bad = {ids[0], ids[2], ids[4], ids[6]}
    r = runner(apply, dsn, pool)
    run_until(r, lambda: len(dead_letters(dsn, "order_totals")) == 4 and len(applied(dsn)) == 4)
    assert {e for e, _ in applied(dsn)} == set(ids) - bad
    letters = dead_letters(dsn, "order_totals")
    assert set(letters) == bad and {a for a, _ in letters.values()} == {1}, letters
    assert "payload" in letters[ids[0]][1] and "RecursionError" in letters[ids[0]][1]
    assert "headers" in letters[ids[2]][1] and "JSON object" in letters[ids[2]][1]
    assert "headers" in letters[ids[4]][1] and "'retries'" in letters[ids[4]][1]
    assert "RuntimeError: validator crashed" in letters[ids[6]][1]
    assert parked_ids(dsn, "order_totals") == set()


# -- a handler that ends the relay's transaction -----------------------------------------------

ESCAPES = {"commit": ["COMMIT"], "end": ["END"], "rollback": ["ROLLBACK"], "commit_begin": ["COMMIT", "BEGIN"],
           "rollback_begin": ["ROLLBACK", "BEGIN READ WRITE"]}


@pytest.mark.parametrize("escape", list(ESCAPES))
@pytest.mark.parametrize("path", [*on_pg15("pipelined", "savepoint"), "async", "async_savepoint"])
def test_a_handler_that_ends_the_transaction_is_charged_with_it_and_nothing_lands_twice(
        dsn: str, pool: ConnectionPool[Any], escape: str, path: str) -> None:
    """Item 7: ``tx.execute("COMMIT")`` (or END, ROLLBACK, then BEGIN) in a handler must not
    commit anything of the batch early, nor let writes after it autocommit; the batch fails, the
    event is dead-lettered with the reason, and every other event lands exactly once.

    One bucket holds, in this order, a key whose first event raises once (in the *savepoint paths:
    the fast attempt stops there, so the escaping event is first called with a savepoint), the
    escaping key, and an innocent key; other buckets hold more keys of the same batch."""
    setup_tables(dsn)
    raiser, escaper, innocent = keys_in_bucket(dsn, 7, 3, prefix="k")
    events = [(raiser, "OrderPlaced", {"customer": raiser, "fail_once": path.endswith("savepoint")}),
              (escaper, "OrderPlaced", {"customer": escaper, "escape": True}),
              (escaper, "OrderPlaced", {"customer": escaper}),
              (innocent, "OrderPlaced", {"customer": innocent}),
              (raiser, "OrderPlaced", {"customer": raiser})]
    events += [(f"other-{i}", "OrderPlaced", {"customer": f"other-{i}"}) for i in range(20)]
    ids = publish(dsn, events)
    escaping = ids[1]
    log_sql = "INSERT INTO applied_log (event_id, key, worker, replay) VALUES (%s, %s, %s, false)"

    def sync_handler(event: ProjectionEvent[Any], tx: Any) -> None:
        if event.payload.get("fail_once") and event.attempt == 1:
            raise RuntimeError("fails once")
        if event.payload.get("escape"):
            tx.execute(log_sql, (event.id, event.key, "before the escape"))
            for statement in ESCAPES[escape]:
                with contextlib.suppress(psycopg.Error):  # a careless handler: errors ignored, too
                    tx.execute(statement)
            tx.execute(log_sql, (event.id, event.key, "after the escape"))
            return
        tx.execute(log_sql, (event.id, event.key, "w"))

    async def async_handler(event: ProjectionEvent[Any], tx: psycopg.AsyncConnection[Any]) -> None:
        if event.payload.get("fail_once") and event.attempt == 1:
            raise RuntimeError("fails once")
        if event.payload.get("escape"):
            await tx.execute(log_sql, (event.id, event.key, "before the escape"))
            for statement in ESCAPES[escape]:
                with contextlib.suppress(psycopg.Error):
                    await tx.execute(statement)
            await tx.execute(log_sql, (event.id, event.key, "after the escape"))
            return
        await tx.execute(log_sql, (event.id, event.key, "w"))

    handler = async_handler if path.startswith("async") else sync_handler
    p = projection("order_totals", events=["OrderPlaced"])(handler)
    r = runner(p, dsn, pool, max_attempts=5)
    run_until(r, lambda: len(applied(dsn)) >= len(ids) - 1 and escaping in dead_letters(dsn, "order_totals"))
    for _ in range(3):
        r.run_once()  # nothing left to do: nothing more lands
    log = applied(dsn)
    assert all(e != escaping for e, _ in log), "a write of the escaping handler landed"
    assert len(log) == len({e for e, _ in log}), "an event's effect landed twice"
    assert {e for e, _ in log} == set(ids) - {escaping}
    attempts, error = dead_letters(dsn, "order_totals")[escaping]
    assert attempts == 1 and "ended the relay's transaction" in error, error
    assert set(dead_letters(dsn, "order_totals")) == {escaping}
    assert parked_ids(dsn, "order_totals") == set()


@pytest.mark.parametrize("is_async", [*on_pg15(False), True])
def test_a_handler_that_swallows_a_failed_statement_is_charged_with_it(
        dsn: str, pool: ConnectionPool[Any], is_async: bool) -> None:
    """A handler that catches a failed statement's error and goes on: its transaction can not go on,
    so the failure is that event's (retried, then dead-lettered), never an error that fails every
    batch (in the pipelined path psycopg then reports only "pipeline aborted" at the end)."""
    setup_tables(dsn)
    ids = publish(dsn, [("bad", "OrderPlaced", {"customer": "bad"}), ("bad", "OrderPlaced", {"customer": "bad"}),
                        *[(f"ok-{i}", "OrderPlaced", {"customer": f"ok-{i}"}) for i in range(10)]])
    log_sql = "INSERT INTO applied_log (event_id, key, worker, replay) VALUES (%s, %s, 'w', false)"

    def sync_handler(event: ProjectionEvent[Any], tx: Any) -> None:
        if event.id == ids[0]:
            with contextlib.suppress(psycopg.Error):
                tx.execute("SELECT 1 / 0")
                tx.execute("SELECT 1")
        with contextlib.suppress(psycopg.Error):
            tx.execute(log_sql, (event.id, event.key))

    async def async_handler(event: ProjectionEvent[Any], tx: psycopg.AsyncConnection[Any]) -> None:
        if event.id == ids[0]:
            with contextlib.suppress(psycopg.Error):
                await tx.execute("SELECT 1 / 0")
        with contextlib.suppress(psycopg.Error):
            await tx.execute(log_sql, (event.id, event.key))

    p = projection("order_totals", events=["OrderPlaced"])(async_handler if is_async else sync_handler)
    r = runner(p, dsn, pool, max_attempts=2)
    run_until(r, lambda: len(applied(dsn)) == len(ids) - 1 and ids[0] in dead_letters(dsn, "order_totals"))
    log = applied(dsn)
    assert sorted(e for e, _ in log) == sorted(ids[1:]), "every other event exactly once"
    attempts, error = dead_letters(dsn, "order_totals")[ids[0]]
    assert attempts == 2 and "went on" in error, error


@pytest.mark.parametrize("is_async", [*on_pg15(False), True], ids=["sync-savepoint-walk", "async"])
def test_a_handler_slower_than_the_lease_is_charged_with_it_and_its_key_moves_on(
        dsn: str, pool: ConnectionPool[Any], is_async: bool) -> None:
    """Issue 7, item 5: where every statement is synced (async handlers; the event-by-event walk with a
    savepoint per event that redoes a batch after a failure), a handler that keeps the relay's
    transaction idle longer than the lease is cut off by the server: idle_in_transaction_session_timeout
    ends the connection. That failure is the event's: it is retried alone, each attempt counted, while
    the rest of the batch and its key's next event land, and the sink never wedges.

    The async handler is slow on every attempt: dead-lettered after max attempts. The sync handler is cut
    off only in the walk: retried alone, in one pipelined transaction (nothing is synced until it ends, so
    the server's idle timer does not run and a slow handler is only slow, its lease renewed by the
    membership thread; a relay stopped there is ended by housekeeping, test_cli_projections.py), it lands."""
    setup_tables(dsn)
    ids = publish(dsn, [("slow", "OrderPlaced", {"customer": "slow"}), ("slow", "OrderPlaced", {"customer": "slow"}),
                        *[(f"ok-{i}", "OrderPlaced", {"customer": f"ok-{i}"}) for i in range(10)]])
    log_sql = "INSERT INTO applied_log (event_id, key, worker, replay) VALUES (%s, %s, 'w', false)"
    calls: list[int] = []

    def sync_handler(event: ProjectionEvent[Any], tx: Any) -> None:
        if event.id == ids[-1] and event.attempt == 1:
            raise RuntimeError("fails once, so the batch is redone event by event")
        if event.id == ids[0]:
            calls.append(event.attempt)
            tx.execute("SELECT 1")
            threading.Event().wait(1.5)  # three times the server's idle cut-off
        tx.execute(log_sql, (event.id, event.key))

    async def async_handler(event: ProjectionEvent[Any], tx: psycopg.AsyncConnection[Any]) -> None:
        if event.id == ids[0]:
            calls.append(event.attempt)
            await asyncio.sleep(1.5)
        await tx.execute(log_sql, (event.id, event.key))

    p = projection("order_totals", events=["OrderPlaced"])(async_handler if is_async else sync_handler)
    # The idle cut-off is the sink's lease (0.5 s); the relay's lease (30 s) stands in for one its
    # membership thread keeps renewing, as it does while a handler runs.
    sink = ProjectionSink(p, dsn, lease_seconds=0.5)
    _open_sinks.append(sink)
    with pool.connection() as conn:
        store.register_sink(conn, sink.name, sink.kind)
    r = SinkRunner(sink, pool, make_settings(dsn, "w", max_attempts=2))
    r.desired = set(ALL_BUCKETS)
    expected = ids[1:] if is_async else ids
    loop = threading.Thread(target=r.run)  # the runner's own loop: a failed cycle backs off and goes on
    loop.start()
    try:
        wait_until(lambda: len(applied(dsn)) == len(expected) and (not is_async or dead_letters(dsn, "order_totals")),
                   30, 0.05, "every event applied or dead-lettered")
    finally:
        r.draining.set()
        loop.join(30)
    assert sorted(e for e, _ in applied(dsn)) == sorted(expected), "each event once; the slow key moved on"
    assert parked_ids(dsn, "order_totals") == set()
    if is_async:
        attempts, error = dead_letters(dsn, "order_totals")[ids[0]]
        assert attempts == 2 and "idle-in-transaction timeout" in error, error
        # One call per counted attempt, and maybe one more in the batch that failed as a whole.
        assert calls[-1] == 2 and len(calls) <= 3, calls
    else:
        assert dead_letters(dsn, "order_totals") == {}
        # The pipelined batch; the walk, cut off (a failure of the whole batch, charged to no event);
        # then alone, its attempt counted before it is made, where it lands.
        assert calls[-1] == 1 and len(calls) <= 3, calls
        assert fetch_all(dsn, "SELECT count(*) FROM applied_log WHERE event_id = %s", (ids[0],)) == [(1,)]


# -- an operator's skip racing an attempt ---------------------------------------------------------


def done(dsn: str) -> list[uuid.UUID]:
    return [event_id for event_id, _key in applied(dsn)]


@pytest.mark.pg15
def test_a_skip_while_the_heads_attempt_is_in_flight_wins_and_that_attempt_lands_nothing(
        dsn: str, pool: ConnectionPool[Any]) -> None:
    """The documented outcome (docs/keys-and-dead-letters.md, keys skip), made deterministic: the head's retry is
    inside its handler when the operator skips it, and then succeeds. The skip's new fence rolls the
    attempt back: the head is dead-lettered and NOT applied, the key's next events are, and
    `dead-letters retry` applies the head once."""
    from outbox_relay import admin

    setup_tables(dsn)
    ids = publish(dsn, [("c1", "OrderPlaced", {"customer": "c1"}), ("c1", "OrderPaid", {"customer": "c1", "cents": 5}),
                        ("c1", "OrderPaid", {"customer": "c1", "cents": 7})])
    armed, entered, go = threading.Event(), threading.Event(), threading.Event()

    def before(event: ProjectionEvent[Any], _tx: Any) -> None:
        if event.id != ids[0] or entered.is_set():
            return
        if not armed.is_set():
            raise RuntimeError("first attempt fails")  # the head is parked, its key queues behind it
        entered.set()  # the attempt the skip races: it succeeds once the test lets it go on
        assert go.wait(30), "the test never let the attempt finish"

    r = runner(totals_projection(before=before), dsn, pool, backoff_base_seconds=0.01, backoff_max_seconds=0.01)
    run_until(r, lambda: parked_ids(dsn, "order_totals") >= set(ids))
    armed.set()
    in_flight = threading.Thread(target=lambda: run_until(r, entered.is_set, timeout=20))
    in_flight.start()
    try:
        assert entered.wait(20), "the retry did not start"
        with psycopg.connect(dsn, autocommit=True) as conn:
            skipped = admin.skip_key(conn, "c1", "order_totals")
        assert skipped.event_id == ids[0]
    finally:
        go.set()  # the attempt's handler returns: a success, and its transaction checks the fence
        in_flight.join(30)
    assert dead_letters(dsn, "order_totals") == {ids[0]: (1, admin.SKIPPED_ERROR)}
    run_until(r, lambda: done(dsn) == [ids[1], ids[2]] or len(done(dsn)) > 2)
    assert done(dsn) == [ids[1], ids[2]], "the attempt in flight landed nothing; the key moved on"
    with psycopg.connect(dsn, autocommit=True) as conn:
        admin.retry_dead_letters(conn, "order_totals", event_ids=[ids[0]])
    run_until(r, lambda: ids[0] in done(dsn))
    assert sorted(map(str, done(dsn))) == sorted(map(str, ids)), "the head's effect, once"
    assert dead_letters(dsn, "order_totals") == {}


@pytest.mark.pg15
def test_a_skip_after_the_heads_attempt_landed_skips_nothing_and_says_so(
        dsn: str, pool: ConnectionPool[Any]) -> None:
    """The other order: the retry succeeded and committed before the operator's skip. The head and the events
    queued behind it were applied in that transaction; the skip finds nothing parked and says so."""
    from outbox_relay import admin
    from outbox_relay.errors import OutboxError

    setup_tables(dsn)
    ids = publish(dsn, [("c1", "OrderPlaced", {"customer": "c1"}), ("c1", "OrderPaid", {"customer": "c1", "cents": 5})])
    failing = threading.Event()
    failing.set()

    def before(event: ProjectionEvent[Any], _tx: Any) -> None:
        if event.id == ids[0] and failing.is_set():
            raise RuntimeError("first attempt fails")

    r = runner(totals_projection(before=before), dsn, pool, backoff_base_seconds=0.01, backoff_max_seconds=0.01)
    run_until(r, lambda: parked_ids(dsn, "order_totals") == set(ids))
    failing.clear()
    run_until(r, lambda: done(dsn) == ids)
    with psycopg.connect(dsn, autocommit=True) as conn, pytest.raises(
            OutboxError, match="nothing to skip: no event of key 'c1' is parked for sink 'order_totals'"):
        admin.skip_key(conn, "c1", "order_totals")
    assert dead_letters(dsn, "order_totals") == {} and done(dsn) == ids
