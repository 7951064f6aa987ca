"""Rebuilds against a real PostgreSQL (G12): the same state as live processing, never a half-built
model for readers, while live events keep arriving; resumable; one key in place.

Live processing runs through the real SinkRunner + ProjectionSink; the rebuild is the real
``Rebuild`` (an ordinary Worker on its own sink, then the switch-over transaction).
"""

from __future__ import annotations

import contextlib
import io
import json
import logging
import threading
import time
import uuid
from collections.abc import Iterator
from datetime import datetime, timedelta
from typing import Any

import psycopg
import pytest
from psycopg_pool import ConnectionPool

from outbox_relay import store
from outbox_relay.errors import ConfigurationError
from outbox_relay.relay import SinkRunner
from projections import Projection, ProjectionEvent, projection
from projections.rebuild import Rebuild, RebuildError, rebuild_key
from projections.rebuild_switch import SwitchOver
from projections.sink import ProjectionSink
from tests.integration.relay_helpers import (  # noqa: F401  (pool_fixture provides `pool`)
    ALL_BUCKETS,
    close_history,
    dead_letters,
    fetch_all,
    make_settings,
    pool_fixture,
    publish,
    run_until,
)

pytestmark = pytest.mark.pg15  # the PostgreSQL 15 step runs it too (scripts/test.sh)

TABLES = """
CREATE TABLE order_totals (customer text PRIMARY KEY, orders int NOT NULL, paid_cents bigint NOT NULL);
CREATE TABLE applied_log (n bigserial PRIMARY KEY, event_id uuid NOT NULL UNIQUE, key text NOT NULL,
                          replay boolean NOT NULL);
"""


def totals_projection(factor: int = 1, qualified: bool = False) -> Any:
    """Order totals; ``factor`` changes the model's arithmetic (a new version of the read model)."""
    table = "public.order_totals" if qualified else "order_totals"

    @projection("order_totals", events=["OrderPlaced", "OrderPaid"], tables=["order_totals", "applied_log"])
    def apply(event: ProjectionEvent[Any], tx: Any) -> None:
        p = event.payload
        if event.type == "OrderPlaced":
            tx.execute(f"INSERT INTO {table} VALUES (%s, 1, 0) "
                       "ON CONFLICT (customer) DO UPDATE SET orders = order_totals.orders + 1", (p["customer"],))
        else:
            if p["cents"] < 0:
                raise ValueError("negative amount")
            tx.execute(f"UPDATE {table} SET paid_cents = paid_cents + %s WHERE customer = %s",
                       (p["cents"] * factor, p["customer"]))
        tx.execute("INSERT INTO applied_log (event_id, key, replay) VALUES (%s, %s, %s)",
                   (event.id, event.key, event.replay))

    @apply.key_reset
    def reset(key: str, tx: Any) -> None:
        tx.execute("DELETE FROM order_totals WHERE customer = %s", (key,))
        tx.execute("DELETE FROM applied_log WHERE key = %s", (key,))

    return apply


def orders(customers: int, per_customer: int, start: int = 0) -> list[tuple[str, str, Any]]:
    out: list[tuple[str, str, Any]] = []
    for i in range(start, start + per_customer):
        for c in range(customers):
            out.append((f"cust-{c}", "OrderPlaced", {"customer": f"cust-{c}"}))
            out.append((f"cust-{c}", "OrderPaid", {"customer": f"cust-{c}", "cents": 10 * (i + 1)}))
    return out


def state(dsn: str) -> list[tuple[Any, ...]]:
    return fetch_all(dsn, "SELECT customer, orders, paid_cents FROM order_totals ORDER BY customer")


def applied_ids(dsn: str) -> list[uuid.UUID]:
    return [r[0] for r in fetch_all(dsn, "SELECT event_id FROM applied_log ORDER BY n")]


def table_oid(dsn: str, name: str = "order_totals") -> int:
    return int(fetch_all(dsn, "SELECT %s::regclass::oid", (name,))[0][0])


@pytest.fixture
def live(dsn: str, pool: ConnectionPool[Any]) -> Iterator[Any]:
    """``live(projection)``: a live SinkRunner for it (all buckets); sinks closed afterwards."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(TABLES)
    sinks: list[ProjectionSink] = []

    def make(p: Any, worker: str = "live") -> SinkRunner:
        sink = ProjectionSink(p, dsn)
        sinks.append(sink)
        with pool.connection() as conn:
            store.register_sink(conn, sink.name, sink.kind)
        r = SinkRunner(sink, pool, make_settings(dsn, worker, max_attempts=2))
        r.desired = set(ALL_BUCKETS)
        return r

    yield make
    for s in sinks:
        s.close()


def rebuild_settings(dsn: str) -> Any:
    return make_settings(dsn, "rebuilder", max_attempts=2, batch_size=200)


def test_rebuild_ends_in_the_state_live_processing_reached(dsn: str, live: Any) -> None:
    events = [*orders(30, 4), ("cust-0", "OrderPaid", {"customer": "cust-0", "cents": -5})]  # one dead letter
    ids = publish(dsn, events)
    runner = live(totals_projection())
    run_until(runner, lambda: len(applied_ids(dsn)) == len(ids) - 1 and dead_letters(dsn, "order_totals"))
    live_state, live_dead = state(dsn), set(dead_letters(dsn, "order_totals"))
    old_oid = table_oid(dsn)
    out = io.StringIO()

    result = Rebuild(totals_projection(), rebuild_settings(dsn), progress=out).run()

    assert result is not None and result.events == len(ids) and not result.resumed
    assert table_oid(dsn) != old_oid, "the rebuilt table was swapped in"
    assert state(dsn) == live_state
    # The poison event is the last one: the bulk phase hands its slice to the relay phase, which may
    # switch over while the event waits for its second attempt; the live projection adopts the retry
    # (adopt_parked) and dead-letters it, with the same reason.
    if set(dead_letters(dsn, "order_totals")) != live_dead:
        assert {r[0] for r in fetch_all(dsn, "SELECT event_id FROM outbox.parked WHERE sink = 'order_totals'")
                } == live_dead
        run_until(runner, lambda: set(dead_letters(dsn, "order_totals")) == live_dead)
    assert sorted(applied_ids(dsn)) == sorted(set(ids) - live_dead)
    assert {r[0] for r in fetch_all(dsn, "SELECT replay FROM applied_log")} == {True}, "handlers saw a replay"
    assert "switched over" in out.getvalue() and "ev/s" in out.getvalue()
    leftovers = fetch_all(dsn, "SELECT nspname FROM pg_namespace WHERE nspname LIKE 'outbox_re%%'")
    assert leftovers == [] and fetch_all(dsn, "SELECT count(*) FROM outbox.rebuilds") == [(0,)]
    assert fetch_all(dsn, "SELECT name FROM outbox.sinks ORDER BY name") == [("order_totals",)]
    # The live projection carries on from the rebuild's positions: new events, applied once.
    more = publish(dsn, orders(30, 1, start=4))
    run_until(runner, lambda: len(applied_ids(dsn)) == len(ids) - 1 + len(more))
    assert len(set(applied_ids(dsn))) == len(applied_ids(dsn))


def test_readers_see_the_old_model_or_the_new_one_never_a_half_built_one(dsn: str, live: Any) -> None:
    ids = publish(dsn, orders(50, 4))
    runner = live(totals_projection(factor=1))
    run_until(runner, lambda: len(applied_ids(dsn)) == len(ids))
    old_total = fetch_all(dsn, "SELECT sum(paid_cents), count(*) FROM order_totals")[0]
    new_total = (old_total[0] * 3, old_total[1])  # version 2 of the model triples amounts
    seen: set[tuple[Any, ...]] = set()
    done = threading.Event()

    def read() -> None:
        with psycopg.connect(dsn, autocommit=True) as conn:
            while not done.is_set():
                seen.add(tuple(conn.execute("SELECT sum(paid_cents), count(*) FROM order_totals").fetchone() or ()))

    reader = threading.Thread(target=read)
    reader.start()
    try:
        Rebuild(totals_projection(factor=3), rebuild_settings(dsn), progress=None).run()
    finally:
        done.set()
        reader.join()
    assert seen <= {old_total, new_total}, f"a reader saw a half-built model: {seen - {old_total, new_total}}"
    assert new_total in seen or fetch_all(dsn, "SELECT sum(paid_cents), count(*) FROM order_totals")[0] == new_total


def test_rebuild_while_live_events_keep_arriving(dsn: str, live: Any, pool: ConnectionPool[Any]) -> None:
    first = publish(dsn, orders(40, 3))
    runner = live(totals_projection())
    run_until(runner, lambda: len(applied_ids(dsn)) == len(first))
    published = list(first)
    stop = threading.Event()
    errors: list[BaseException] = []

    def keep_publishing() -> None:
        i, pause = 3, 0.1
        while not stop.is_set():
            published.extend(publish(dsn, orders(40, 1, start=i)))
            i += 1
            # 80 events, then a pause that grows (0.1 s, 0.15 s, ... at most 1 s): live events keep
            # arriving through the whole rebuild, and it catches up with its moving target in bounded
            # time even where it replays slower than 800/s (at a fixed 0.1 s it chased it for 2.5
            # minutes on a busy machine's PostgreSQL 15).
            stop.wait(pause)
            pause = min(1.0, pause * 1.5)

    def keep_applying() -> None:
        renewed = time.monotonic()
        try:
            while not stop.is_set():
                runner.run_once()
                if time.monotonic() - renewed > 1.0:  # as the membership thread does: no lease runs out
                    runner.renew()
                    renewed = time.monotonic()
                time.sleep(0.005)
        except BaseException as exc:  # surfaced below
            errors.append(exc)

    threads = [threading.Thread(target=keep_publishing), threading.Thread(target=keep_applying)]
    for t in threads:
        t.start()
    try:
        time.sleep(0.3)
        result = Rebuild(totals_projection(), rebuild_settings(dsn), progress=None).run()
        time.sleep(0.3)
    finally:
        stop.set()
        for t in threads:
            t.join()
    assert result is not None and not errors
    run_until(runner, lambda: len(applied_ids(dsn)) >= len(published), timeout=30)
    log = applied_ids(dsn)
    assert sorted(log) == sorted(published), "after the switch every event is applied exactly once"
    per_customer = len(published) // 80
    assert state(dsn) == [(f"cust-{c}", per_customer, sum(10 * (i + 1) for i in range(per_customer)))
                          for c in sorted(range(40), key=lambda c: f"cust-{c}")]


def test_an_interrupted_rebuild_resumes_and_options_must_match(dsn: str, live: Any) -> None:
    ids = publish(dsn, orders(40, 10))
    runner = live(totals_projection())
    run_until(runner, lambda: len(applied_ids(dsn)) == len(ids))
    live_state = state(dsn)
    slow = totals_projection()
    original = slow.handler

    def slow_handler(event: ProjectionEvent[Any], tx: Any) -> None:
        time.sleep(0.001)
        original(event, tx)

    slow.handler = slow_handler
    first = Rebuild(slow, rebuild_settings(dsn), progress=None)
    timer = threading.Timer(0.6, first.stop)
    timer.start()
    assert first.run() is None, "a stopped rebuild does not switch"
    timer.cancel()
    partial = fetch_all(dsn, "SELECT count(*) FROM outbox_rebuild_order_totals.applied_log")[0][0]
    assert 0 < partial < len(ids), f"expected a partial rebuild, got {partial} of {len(ids)}"
    assert state(dsn) == live_state, "the live model is untouched while rebuilding"

    with pytest.raises(RebuildError, match="with the same options"):
        Rebuild(totals_projection(), rebuild_settings(dsn), from_position=(1, 1), progress=None).run()
    result = Rebuild(totals_projection(), rebuild_settings(dsn), progress=None).run()
    assert result is not None and result.resumed and result.events == len(ids)
    assert state(dsn) == live_state
    assert sorted(applied_ids(dsn)) == sorted(ids), "resumed without replaying anything twice"


def test_restart_and_cancel(dsn: str, live: Any) -> None:
    ids = publish(dsn, orders(10, 2))
    run_until(live(totals_projection()), lambda: len(applied_ids(dsn)) == len(ids))
    r = Rebuild(totals_projection(), rebuild_settings(dsn), progress=None)
    r.stop()  # stopped before it replays anything: started, resumable
    assert r.run() is None
    assert fetch_all(dsn, "SELECT projection, sink FROM outbox.rebuilds") == [("order_totals", "order_totals.rebuild")]
    assert r.cancel() is True and r.cancel() is False
    assert fetch_all(dsn, "SELECT count(*) FROM pg_namespace WHERE nspname = 'outbox_rebuild_order_totals'") == [(0,)]
    assert fetch_all(dsn, "SELECT name FROM outbox.sinks") == [("order_totals",)]
    result = Rebuild(totals_projection(), rebuild_settings(dsn), restart=True, progress=None).run()
    assert result is not None and not result.resumed and sorted(applied_ids(dsn)) == sorted(ids)


def test_rebuild_from_a_position_or_time_replays_only_what_follows(dsn: str, live: Any) -> None:
    early = publish(dsn, orders(5, 2))
    cut = datetime.now().astimezone()
    late = publish(dsn, orders(5, 1, start=2))
    run_until(live(totals_projection()), lambda: len(applied_ids(dsn)) == len(early) + len(late))
    result = Rebuild(totals_projection(), rebuild_settings(dsn), from_time=cut, progress=None).run()
    assert result is not None and result.events == len(late)
    assert sorted(applied_ids(dsn)) == sorted(late)

    first_late = fetch_all(dsn, "SELECT xid::text::bigint, seq FROM outbox.events WHERE id = %s", (late[0],))[0]
    result = Rebuild(totals_projection(), rebuild_settings(dsn), from_position=(first_late[0], first_late[1]),
                     progress=None).run()
    assert result is not None and sorted(applied_ids(dsn)) == sorted(late)


def test_rebuild_carries_grants_owner_sequences_and_foreign_keys(dsn: str, live: Any) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("DO $$ BEGIN CREATE ROLE outbox_test_reader; EXCEPTION WHEN duplicate_object THEN NULL; END $$")
        conn.execute("GRANT SELECT ON order_totals, applied_log TO outbox_test_reader")
        conn.execute("CREATE TABLE customers (name text PRIMARY KEY)")
        conn.execute("INSERT INTO customers SELECT 'cust-' || i FROM generate_series(0, 9) i")
        conn.execute("ALTER TABLE order_totals ADD CONSTRAINT known_customer FOREIGN KEY (customer) "
                     "REFERENCES customers (name)")
    ids = publish(dsn, orders(10, 2))
    run_until(live(totals_projection()), lambda: len(applied_ids(dsn)) == len(ids))
    Rebuild(totals_projection(), rebuild_settings(dsn), progress=None).run()
    grants = fetch_all(dsn, "SELECT table_name, privilege_type FROM information_schema.role_table_grants "
                            "WHERE grantee = 'outbox_test_reader' ORDER BY 1")
    assert grants == [("applied_log", "SELECT"), ("order_totals", "SELECT")]
    fks = fetch_all(dsn, "SELECT conname FROM pg_constraint WHERE conrelid = 'order_totals'::regclass AND contype='f'")
    assert fks == [("known_customer",)]
    seq = fetch_all(dsn, "SELECT pg_get_serial_sequence('applied_log', 'n')")[0][0]
    assert seq == "public.applied_log_n_seq"
    with psycopg.connect(dsn, autocommit=True) as conn:  # the new table's serial works on its own sequence
        conn.execute("INSERT INTO applied_log (event_id, key, replay) VALUES (gen_random_uuid(), 'x', false)")


def test_a_view_on_the_table_blocks_a_swap_with_a_clear_error(dsn: str, live: Any) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("CREATE VIEW big_spenders AS SELECT customer FROM order_totals WHERE paid_cents > 100")
    with pytest.raises(RebuildError, match=r"public.order_totals: view big_spenders"):
        Rebuild(totals_projection(), rebuild_settings(dsn), progress=None).run()
    assert fetch_all(dsn, "SELECT count(*) FROM outbox.rebuilds") == [(0,)], "nothing was started"


def test_a_handler_that_names_the_live_table_is_refused_during_a_rebuild(dsn: str, live: Any) -> None:
    ids = publish(dsn, orders(5, 1))
    run_until(live(totals_projection()), lambda: len(applied_ids(dsn)) == len(ids))
    before = state(dsn)
    with pytest.raises(RebuildError, match=r"wrote public\.order_totals during its rebuild, outside"):
        Rebuild(totals_projection(qualified=True), rebuild_settings(dsn), progress=None).run()
    assert state(dsn) == before


def test_rebuild_needs_declared_tables() -> None:
    @projection("no_tables")
    def apply(event: Any, tx: Any) -> None: ...

    with pytest.raises(ConfigurationError, match="declares no tables"):
        Rebuild(apply, make_settings("postgresql:///x", "w"), progress=None)


def test_rebuild_key_restores_one_key_in_place(dsn: str, live: Any) -> None:
    ids = publish(dsn, orders(6, 3))
    run_until(live(totals_projection()), lambda: len(applied_ids(dsn)) == len(ids))
    good = state(dsn)
    with psycopg.connect(dsn, autocommit=True) as conn:  # someone damaged one customer's row
        conn.execute("UPDATE order_totals SET paid_cents = -1 WHERE customer = 'cust-2'")
        conn.execute("DELETE FROM applied_log WHERE key = 'cust-2'")
    assert rebuild_key(totals_projection(), dsn, "cust-2") == 6
    assert state(dsn) == good
    assert len(applied_ids(dsn)) == len(ids)
    assert rebuild_key(totals_projection(), dsn, "cust-unknown") == 0
    with pytest.raises(ConfigurationError, match="has no key_reset"):
        rebuild_key(projection("order_totals", tables=["order_totals"])(lambda e, tx: None), dsn, "cust-2")


# -- where a rebuild may start -----------------------------------------------------------------


def rebuild_footprint(dsn: str) -> tuple[Any, ...]:
    """What a rebuild start creates or changes: its row, schema and sink, and the live cursors."""
    return (fetch_all(dsn, "SELECT count(*) FROM outbox.rebuilds"),
            fetch_all(dsn, "SELECT nspname FROM pg_namespace WHERE nspname LIKE 'outbox_re%%'"),
            fetch_all(dsn, "SELECT name FROM outbox.sinks ORDER BY name"),
            fetch_all(dsn, "SELECT bucket, snapshot::text, target::text, after_xid::text, after_seq, fence "
                           "FROM outbox.cursors WHERE sink = 'order_totals' ORDER BY bucket"))


def history(dsn: str) -> tuple[int, tuple[int, int]]:
    """The next transaction id and the last stored position."""
    horizon = int(fetch_all(dsn, "SELECT pg_snapshot_xmax(pg_current_snapshot())::text::bigint")[0][0])
    last = fetch_all(dsn, "SELECT xid::text::bigint, seq FROM outbox.events ORDER BY xid DESC, seq DESC LIMIT 1")[0]
    return horizon, (int(last[0]), int(last[1]))


@pytest.mark.parametrize("start", ["past the horizon", "past the history", "beyond xid8", "negative", "future",
                                   "after the newest event"])
def test_a_start_outside_stored_history_is_refused_before_anything_changes(dsn: str, live: Any, start: str) -> None:
    """Item 3: a mistyped --from-position / --from-time swapped in an empty model and parked the live
    projection's cursors past every transaction id. Refused with the position, the next transaction id and
    the stored range named; nothing is created, no sink registered, the live cursors untouched."""
    ids = publish(dsn, orders(5, 2))
    run_until(live(totals_projection()), lambda: len(applied_ids(dsn)) == len(ids))
    horizon, last = history(dsn)
    newest = fetch_all(dsn, "SELECT max(created_at) FROM outbox.events")[0][0]
    options: dict[str, Any] = {
        "past the horizon": {"from_position": (horizon + 1_000_000, 1)},
        "past the history": {"from_position": (last[0], last[1] + 1)},
        "beyond xid8": {"from_position": (2**64 + 5, 1)},
        "negative": {"from_position": (-1, 5)},
        "future": {"from_time": datetime.now().astimezone() + timedelta(days=1)},
        "after the newest event": {"from_time": newest + timedelta(microseconds=1)},
    }[start]
    before = rebuild_footprint(dsn)
    live_state = state(dsn)
    with pytest.raises(RebuildError) as refused:
        Rebuild(totals_projection(), rebuild_settings(dsn), progress=None, **options).run()
    message = str(refused.value)
    if "from_position" in options:
        assert ":".join(map(str, options["from_position"])) in message, message
    if start in ("past the horizon", "past the history"):
        assert "the next transaction id is" in message, message
        assert f"to {last[0]}:{last[1]}" in message, message
    if start == "future":
        assert "in the future" in message, message
    assert rebuild_footprint(dsn) == before, "the refused rebuild changed something"
    assert state(dsn) == live_state


def test_a_start_inside_stored_history_is_accepted(dsn: str, live: Any) -> None:
    """The check refuses only what lies past the history: its last event is a valid start."""
    ids = publish(dsn, orders(5, 2))
    run_until(live(totals_projection()), lambda: len(applied_ids(dsn)) == len(ids))
    _, last = history(dsn)
    result = Rebuild(totals_projection(), rebuild_settings(dsn), from_position=last, progress=None).run()
    assert result is not None and result.events == 1


# -- what a rebuild may write, and which tables it may swap ------------------------------------


@pytest.mark.parametrize("write", ["insert", "truncate"])
def test_a_handler_writing_an_undeclared_table_stops_the_rebuild(dsn: str, live: Any, write: str) -> None:
    """Item 9: a table the handler writes but tables= does not list has no shadow copy, so during a
    rebuild its unqualified name is the live table: it would get the rebuild's writes on top of live
    processing. The batch rolls back and the rebuild stops, naming the table."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("CREATE TABLE audit (event_id uuid NOT NULL, replay boolean NOT NULL)")
    base = totals_projection()

    @projection("order_totals", events=["OrderPlaced", "OrderPaid"], tables=["order_totals", "applied_log"])
    def apply(event: ProjectionEvent[Any], tx: Any) -> None:
        base.handler(event, tx)
        if write == "insert":
            tx.execute("INSERT INTO audit VALUES (%s, %s)", (event.id, event.replay))
        elif event.replay:
            tx.execute("TRUNCATE audit")

    ids = publish(dsn, orders(5, 2))
    run_until(live(apply), lambda: len(applied_ids(dsn)) == len(ids))
    audit_before = fetch_all(dsn, "SELECT count(*) FROM audit")
    live_state = state(dsn)
    with pytest.raises(RebuildError, match=r"wrote public\.audit during its rebuild, outside the rebuild's schema"):
        Rebuild(apply, rebuild_settings(dsn), progress=None).run()
    assert fetch_all(dsn, "SELECT count(*) FROM audit") == audit_before, "the rebuild's writes landed on audit"
    assert state(dsn) == live_state


@pytest.mark.parametrize("table", ["outbox.cursors", "OUTBOX.sinks", "pg_catalog.pg_class", '"outbox".parked',
                                   "outbox_rebuild_other.t", "outbox_retired_other.t"])
def test_tables_in_the_relays_or_the_systems_schemas_are_refused_when_declared(table: str) -> None:
    """Item 9: tables=["outbox.cursors"] made a rebuild swap out (and wipe) every cursor."""
    with pytest.raises(ConfigurationError, match=r"is in schema .* a projection keeps its read model"):
        projection("bad", tables=[table])


def test_a_declared_table_that_resolves_to_a_reserved_schema_is_refused_at_rebuild_start(dsn: str) -> None:
    """Names without a schema resolve on the search path (pg_catalog is always on it), and a Projection
    can be built without the decorator: the rebuild checks where each table really is."""
    cursors = fetch_all(dsn, "SELECT count(*) FROM outbox.cursors")
    for tables in (("pg_class",), ("outbox.cursors",)):
        p = Projection(name="bad", handler=lambda e, tx: None, events=None, tables=tables)
        with pytest.raises(RebuildError, match=r"in a schema a rebuild must never swap tables of"):
            Rebuild(p, rebuild_settings(dsn), progress=None).run()
    assert fetch_all(dsn, "SELECT count(*) FROM outbox.rebuilds") == [(0,)]
    assert fetch_all(dsn, "SELECT count(*) FROM pg_namespace WHERE nspname LIKE 'outbox_re%%'") == [(0,)]
    assert fetch_all(dsn, "SELECT count(*) FROM outbox.cursors") == cursors


# -- a rebuild that disappears while it runs ---------------------------------------------------


def slow_projection(entered: threading.Event) -> Any:
    p = totals_projection()
    original = p.handler

    def handler(event: ProjectionEvent[Any], tx: Any) -> None:
        entered.set()
        time.sleep(0.002)
        original(event, tx)

    p.handler = handler
    return p


@pytest.mark.parametrize("how", ["cancel", "sink dropped"])
def test_a_rebuild_cancelled_while_it_runs_fails_and_says_so(dsn: str, live: Any, how: str) -> None:
    """Item 9: `rebuild --cancel` (or `sinks drop` of its sink) from another terminal while a rebuild
    runs: it must not report success (it said "another rebuild process switched over already").
    Told apart from a peer's switch by the oids of its copies."""
    ids = publish(dsn, orders(40, 10))
    run_until(live(totals_projection()), lambda: len(applied_ids(dsn)) == len(ids))
    live_state, live_oid = state(dsn), table_oid(dsn)
    entered = threading.Event()
    running = Rebuild(slow_projection(entered), rebuild_settings(dsn), progress=None)
    outcome: list[Any] = []

    def run() -> None:
        try:
            outcome.append(running.run())
        except BaseException as exc:  # checked below
            outcome.append(exc)

    thread = threading.Thread(target=run)
    thread.start()
    try:
        assert entered.wait(30), "the rebuild never started replaying"
        if how == "cancel":
            assert Rebuild(totals_projection(), rebuild_settings(dsn), progress=None).cancel()
        else:
            with psycopg.connect(dsn, autocommit=True) as conn:
                conn.execute("DELETE FROM outbox.sinks WHERE name = 'order_totals.rebuild'")
    finally:
        thread.join(60)
    assert len(outcome) == 1 and isinstance(outcome[0], RebuildError), outcome
    assert "was cancelled while it ran" in str(outcome[0]) and "nothing was switched" in str(outcome[0])
    assert table_oid(dsn) == live_oid and state(dsn) == live_state, "the live model changed"


def test_two_rebuild_processes_share_the_work_and_both_succeed(dsn: str, live: Any) -> None:
    """The peer case the cancel check must not break: whichever process switches, the other one
    finds its copies live and succeeds too."""
    ids = publish(dsn, orders(40, 5))
    run_until(live(totals_projection()), lambda: len(applied_ids(dsn)) == len(ids))
    live_state = state(dsn)
    results: list[Any] = []

    def run(worker: str) -> None:
        try:
            results.append(Rebuild(totals_projection(), make_settings(dsn, worker, batch_size=50),
                                   progress=None).run())
        except BaseException as exc:  # checked below
            results.append(exc)

    threads = [threading.Thread(target=run, args=(w,)) for w in ("rebuilder-a", "rebuilder-b")]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert len(results) == 2 and all(r is not None and not isinstance(r, BaseException) for r in results), results
    assert state(dsn) == live_state
    assert fetch_all(dsn, "SELECT count(*) FROM outbox.rebuilds") == [(0,)]


@pytest.mark.parametrize("statement", ["COMMIT", "ROLLBACK"])
def test_rebuild_key_whose_handler_ends_the_transaction_changes_nothing(dsn: str, live: Any, statement: str) -> None:
    """The in-place key rebuild runs under the same commit guard as a batch: its key_reset's delete
    and a part of the replay must not commit on their own."""
    ids = publish(dsn, orders(3, 3))
    run_until(live(totals_projection()), lambda: len(applied_ids(dsn)) == len(ids))
    good, log = state(dsn), applied_ids(dsn)
    p = totals_projection()
    original = p.handler

    def handler(event: ProjectionEvent[Any], tx: Any) -> None:
        original(event, tx)
        with contextlib.suppress(psycopg.Error):
            tx.execute(statement)

    p.handler = handler
    with pytest.raises(RebuildError, match="ended the transaction"):
        rebuild_key(p, dsn, "cust-1")
    assert state(dsn) == good and applied_ids(dsn) == log


def _history(dsn: str, capsys: pytest.CaptureFixture[str]) -> dict[str, Any]:
    """`status --json`'s history row of order_totals, without its times."""
    from outbox_relay import cli

    capsys.readouterr()
    assert cli.main(["status", "--json", "--dsn", dsn]) == cli.EXIT_OK
    [row] = json.loads(capsys.readouterr().out)["history"]
    return {k: v for k, v in row.items() if k in ("projection", "removed_events", "full_rebuild_complete")}


def test_a_rebuild_after_retention_removed_applied_events_refuses_unless_partial_is_accepted(
        dsn: str, live: Any, pool: ConnectionPool[Any], capsys: pytest.CaptureFixture[str]) -> None:
    """A full rebuild replays what is stored; once retention has removed events the projection applied,
    that is less than live processing saw. The rebuild (and `rebuild --key`) refuses, naming what is
    missing, unless a partial model is accepted; after that, the next rebuild is complete again."""
    from outbox_relay.housekeeping import Housekeeping

    first = publish(dsn, orders(3, 2))
    runner = live(totals_projection())
    run_until(runner, lambda: len(applied_ids(dsn)) == len(first))
    close_history(dsn)
    removed = Housekeeping(pool, make_settings(dsn, "hk", retention_seconds=0.0))._apply_retention()
    assert removed == len(first)
    later = publish(dsn, orders(3, 1, start=2))
    run_until(runner, lambda: len(applied_ids(dsn)) == len(first) + len(later))
    live_state = state(dsn)

    assert _history(dsn, capsys) == {"projection": "order_totals", "removed_events": len(first),
                                     "full_rebuild_complete": False}
    with pytest.raises(RebuildError, match=rf"would be partial: retention has removed {len(first)} events .* "
                                           r"--accept-partial") as refused:
        Rebuild(totals_projection(), rebuild_settings(dsn), progress=None).run()
    assert "history now exists from" in str(refused.value)
    with pytest.raises(RebuildError, match="would be partial"):
        rebuild_key(totals_projection(), dsn, "cust-0")
    assert state(dsn) == live_state, "a refused rebuild changes nothing"
    assert fetch_all(dsn, "SELECT count(*) FROM outbox.rebuilds") == [(0,)]

    result = Rebuild(totals_projection(), rebuild_settings(dsn), accept_partial=True, progress=None).run()
    assert result is not None and result.events == len(later)
    assert state(dsn) == [(f"cust-{c}", 1, 30) for c in range(3)], "the model holds what is still stored"
    assert _history(dsn, capsys)["full_rebuild_complete"] is True
    # Nothing removed since the partial model began: the next rebuild is complete and needs no flag.
    again = Rebuild(totals_projection(), rebuild_settings(dsn), progress=None).run()
    assert again is not None and state(dsn) == [(f"cust-{c}", 1, 30) for c in range(3)]
    assert rebuild_key(totals_projection(), dsn, "cust-0") == 2


def test_a_projection_that_began_after_retention_removed_events_rebuilds_without_a_word(
        dsn: str, live: Any, pool: ConnectionPool[Any]) -> None:
    """It never applied the removed events (a new sink starts from the oldest stored event), so its
    rebuild is complete."""
    from outbox_relay.housekeeping import Housekeeping

    publish(dsn, orders(2, 1))
    with psycopg.connect(dsn, autocommit=True) as conn:  # another sink delivered them, then they went
        conn.execute("INSERT INTO outbox.sinks (name, kind) VALUES ('kafka', 'kafka')")
        conn.execute("INSERT INTO outbox.cursors (sink, bucket, snapshot) "
                     "SELECT 'kafka', b, pg_current_snapshot() FROM generate_series(0, 255) AS b")
    close_history(dsn)
    assert Housekeeping(pool, make_settings(dsn, "hk", retention_seconds=0.0))._apply_retention() == 4
    ids = publish(dsn, orders(2, 1, start=1))
    runner = live(totals_projection())
    run_until(runner, lambda: len(applied_ids(dsn)) == len(ids))
    result = Rebuild(totals_projection(), rebuild_settings(dsn), progress=None).run()
    assert result is not None and result.events == len(ids)


def test_a_rebuild_across_a_change_of_payload_shape_ends_where_live_processing_did(
        dsn: str, live: Any, pool: ConnectionPool[Any]) -> None:
    """OrderPaid version 1 had "euros"; version 2 has "cents". The projection, given an upcaster, sees
    every event at version 2, live and in the rebuild, so the rebuilt model equals the live one."""
    from outbox_relay import Outbox
    from projections import Upcasters

    upcasters = Upcasters()

    @upcasters.register("OrderPaid", version=1)
    def euros_to_cents(payload: dict[str, Any]) -> dict[str, Any]:
        return {"customer": payload["customer"], "cents": round(payload["euros"] * 100)}

    seen_versions: set[int] = set()

    def make() -> Any:
        @projection("order_totals", events=["OrderPlaced", "OrderPaid"], tables=["order_totals", "applied_log"],
                    upcasters=upcasters)
        def apply(event: ProjectionEvent[Any], tx: Any) -> None:
            p = event.payload
            if event.type == "OrderPlaced":
                tx.execute("INSERT INTO order_totals VALUES (%s, 1, 0) "
                           "ON CONFLICT (customer) DO UPDATE SET orders = order_totals.orders + 1", (p["customer"],))
            else:
                seen_versions.add(event.version)
                tx.execute("UPDATE order_totals SET paid_cents = paid_cents + %s WHERE customer = %s",
                           (p["cents"], p["customer"]))
            tx.execute("INSERT INTO applied_log (event_id, key, replay) VALUES (%s, %s, %s)",
                       (event.id, event.key, event.replay))

        @apply.key_reset
        def reset(key: str, tx: Any) -> None:
            tx.execute("DELETE FROM order_totals WHERE customer = %s", (key,))
            tx.execute("DELETE FROM applied_log WHERE key = %s", (key,))

        return apply

    outbox = Outbox(default_topic="orders")
    with psycopg.connect(dsn) as conn:
        for c in ("a", "b"):
            outbox.publish(conn, type="OrderPlaced", key=c, payload={"customer": c})
            outbox.publish(conn, type="OrderPaid", key=c, payload={"customer": c, "euros": 1.5})  # version 1
    with psycopg.connect(dsn) as conn:  # the producers' new code
        for c in ("a", "b"):
            outbox.publish(conn, type="OrderPaid", key=c, payload={"customer": c, "cents": 20}, version=2)
    assert fetch_all(dsn, "SELECT schema_version, count(*) FROM outbox.events GROUP BY 1 ORDER BY 1") == [(1, 4),
                                                                                                        (2, 2)]
    runner = live(make())
    run_until(runner, lambda: len(applied_ids(dsn)) == 6)
    live_state = state(dsn)
    assert live_state == [("a", 1, 170), ("b", 1, 170)] and seen_versions == {2}

    result = Rebuild(make(), rebuild_settings(dsn), progress=None).run()
    assert result is not None and result.events == 6
    assert state(dsn) == live_state and seen_versions == {2}
    assert rebuild_key(make(), dsn, "a") == 3 and state(dsn) == live_state


def test_an_event_wait_for_reported_applied_stays_applied_across_the_switch_over(
        dsn: str, live: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """Read-your-writes across a rebuild: a caller whose wait_for returned reads its write in the model,
    before the switch-over and after it."""
    from outbox_relay.progress import wait_for

    runner = live(totals_projection())
    ids = publish(dsn, orders(2, 1))
    run_until(runner, lambda: len(applied_ids(dsn)) == len(ids))
    late: list[uuid.UUID] = []
    switch = SwitchOver.switch

    def publish_then_switch(self: SwitchOver, worker: Any) -> bool:
        # Between the rebuild's last batch and its switch-over, a producer publishes and waits for the
        # live projection (its relay keeps running through a rebuild).
        [event_id] = publish(dsn, [("cust-9", "OrderPlaced", {"customer": "cust-9"})])
        run_until(runner, lambda: event_id in applied_ids(dsn))
        with psycopg.connect(dsn, autocommit=True) as conn:
            wait_for(conn, [event_id], sink="order_totals", timeout=0)
        late.append(event_id)
        return switch(self, worker)

    monkeypatch.setattr(SwitchOver, "switch", publish_then_switch)
    assert Rebuild(totals_projection(), rebuild_settings(dsn), progress=None).run() is not None
    assert late, "the switch-over ran"
    assert set(late) <= set(applied_ids(dsn)), "the switched-in model lacks an event wait_for reported applied"
    with psycopg.connect(dsn, autocommit=True) as conn:
        wait_for(conn, late, sink="order_totals", timeout=0)


def test_rebuild_key_in_place_while_the_live_relay_applies_that_key(dsn: str, live: Any) -> None:
    """`rebuild --key K` while a producer keeps publishing K and the live relay keeps applying it: each
    rebuild is all or nothing (a deadlock with a live batch is retried, and may fail the rebuild, never
    half-apply it), and in the end every event of K is applied exactly once and the model is what the
    events say."""
    runner = live(totals_projection())
    published = publish(dsn, orders(3, 2))
    run_until(runner, lambda: len(applied_ids(dsn)) == len(published))
    stop = threading.Event()
    relay_errors: list[str] = []

    def produce() -> None:
        cents = 1
        while not stop.is_set():
            published.extend(publish(dsn, [("cust-0", "OrderPlaced", {"customer": "cust-0"}),
                                           ("cust-0", "OrderPaid", {"customer": "cust-0", "cents": cents})]))
            cents += 1
            stop.wait(0.005)

    def relay() -> None:
        while not stop.is_set():
            try:
                runner.run_once()
            except Exception as exc:  # a checkpoint that lost a deadlock to the rebuild: the real loop retries
                relay_errors.append(type(exc).__name__)

    threads = [threading.Thread(target=produce), threading.Thread(target=relay)]
    for t in threads:
        t.start()
    replayed: list[int] = []
    try:
        for _ in range(8):
            with contextlib.suppress(psycopg.errors.DeadlockDetected):
                replayed.append(rebuild_key(totals_projection(), dsn, "cust-0"))
    finally:
        stop.set()
        for t in threads:
            t.join(30)
    assert replayed, "no key rebuild got through"
    assert set(relay_errors) <= {"CheckpointFailed"}, relay_errors
    run_until(runner, lambda: len(applied_ids(dsn)) >= len(published), timeout=30)
    assert sorted(map(str, applied_ids(dsn))) == sorted(map(str, published)), "each event applied exactly once"
    expected = fetch_all(dsn, "SELECT partition_key, count(*) FILTER (WHERE type = 'OrderPlaced'), "
                              "coalesce(sum((payload->>'cents')::int), 0) FROM outbox.events "
                              "GROUP BY 1 ORDER BY 1")
    assert state(dsn) == expected


def test_a_rebuilds_switch_over_is_logged_by_the_live_relay_as_an_operators_action(
        dsn: str, live: Any, caplog: pytest.LogCaptureFixture) -> None:
    """The switch-over re-fences every bucket of the live projection while its relay keeps the leases: the
    relay says so at INFO, naming the action, and logs no "fenced out" WARNING (issue 25, finding 7)."""
    caplog.set_level(logging.INFO, logger="outbox_relay.relay")
    ids = publish(dsn, orders(5, 2))
    runner = live(totals_projection())
    run_until(runner, lambda: len(applied_ids(dsn)) == len(ids))
    Rebuild(totals_projection(), rebuild_settings(dsn), progress=None).run()
    more = publish(dsn, orders(5, 1, start=2))
    run_until(runner, lambda: len(applied_ids(dsn)) == len(ids) + len(more))
    said = [(r.levelno, r.getMessage()) for r in caplog.records if r.name == "outbox_relay.relay"]
    assert not [m for level, m in said
                if level >= logging.WARNING and ("fenced out" in m or "lost the lease" in m)], said
    assert any(level == logging.INFO and "a rebuild's switch-over (an operator's action) re-fenced" in m
               for level, m in said), said
