"""A rebuild keeps what live processing decided (G12): an operator's skip stays a dead letter, its event's
effect is never replayed, the keys behind it stay applied, and a rebuild whose replayed key still fails
says so instead of reporting a clean switch. Batched and per-event handlers, real PostgreSQL, the real
relay loop, bulk phase and relay phase.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Callable
from typing import Any

import psycopg
import pytest

from outbox_relay.admin import SKIPPED_ERROR, key_state, pause_key, resume_key, skip_key
from outbox_relay.relay import SinkRunner
from projections import ProjectionEvent, projection
from projections.rebuild import Rebuild
from tests.integration.order_totals import applied, totals
from tests.integration.relay_helpers import (  # noqa: F401  (pool_fixture provides `pool`)
    dead_letters,
    fetch_all,
    make_settings,
    parked_ids,
    parked_rows,
    pool_fixture,
    publish,
    run_until,
)
from tests.integration.test_batched_projections import batched, live  # noqa: F401  (the `live` fixture)

LIVE = "order_totals"


def until(condition: Callable[[], Any], timeout: float = 60.0) -> None:
    """Poll a condition of the database (nothing else signals it) until it holds."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        threading.Event().wait(0.05)


def per_event(before: Callable[[ProjectionEvent[Any]], None] | None = None) -> Any:
    writes = batched().handler  # the batched test projection's writes, one event at a time

    @projection(LIVE, events=["OrderPlaced", "OrderPaid"], tables=["order_totals", "applied_log"])
    def apply(event: ProjectionEvent[Any], tx: Any) -> None:
        if before is not None:
            before(event)
        writes([event], tx)

    return apply


def async_per_event(before: Callable[[ProjectionEvent[Any]], None] | None = None) -> Any:
    """The same model from an ``async def`` handler (the relay phase's async driver; no bulk phase)."""

    @projection(LIVE, events=["OrderPlaced", "OrderPaid"], tables=["order_totals", "applied_log"])
    async def apply(event: ProjectionEvent[Any], tx: Any) -> None:
        if before is not None:
            before(event)
        cents = 0 if event.type == "OrderPlaced" else int(event.payload["cents"])
        if cents < 0:
            raise ValueError("negative amount")
        await tx.execute("INSERT INTO order_totals (customer, orders, paid_cents) VALUES (%s, %s, %s) "
                         "ON CONFLICT (customer) DO UPDATE SET orders = order_totals.orders + EXCLUDED.orders, "
                         "paid_cents = order_totals.paid_cents + EXCLUDED.paid_cents",
                         (event.payload["customer"], int(event.type == "OrderPlaced"), cents))
        await tx.execute("INSERT INTO applied_log (event_id, key, replay) VALUES (%s, %s, %s)",
                         (event.id, event.key, event.replay))

    return apply


def kinds(*names: str) -> list[Any]:
    """The handler kinds a test runs with; PostgreSQL 15 runs the per-event one (scripts/test.sh): the
    decisions' SQL is the same whichever way a handler applies events (test_batched_projections.py runs
    the batched path's own writes there)."""
    return [pytest.param(n, marks=pytest.mark.pg15) if n == "per-event" else n for n in names]


def make(kind: str, before: Callable[[ProjectionEvent[Any]], None] | None = None) -> Any:
    if kind == "per-event":
        return per_event(before)
    if kind == "async":
        return async_per_event(before)
    return batched(None if before is None else lambda events, tx: [before(e) for e in events])


def poisoned_key(dsn: str) -> tuple[list[uuid.UUID], uuid.UUID]:
    """Orders of 5 customers, and a poison head (a negative amount) of cust-0 with 2 events queued behind it."""
    events = [(f"cust-{c}", "OrderPlaced", {"customer": f"cust-{c}"}) for c in range(5)]
    events += [("cust-0", "OrderPaid", {"customer": "cust-0", "cents": -5})]
    events += [("cust-0", "OrderPaid", {"customer": "cust-0", "cents": 7}) for _ in range(2)]
    ids = publish(dsn, events)
    return ids, ids[5]


def skipped_live(dsn: str, run: Callable[..., SinkRunner], p: Any) -> tuple[list[uuid.UUID], uuid.UUID]:
    """Live processing parks the poison head (retrying), the operator skips it, the 2 behind it land."""
    ids, head = poisoned_key(dsn)
    r = run(p, max_attempts=10)
    run_until(r, lambda: head in parked_ids(dsn, LIVE) and len(applied(dsn)) == 5)
    with psycopg.connect(dsn, autocommit=True) as conn:
        skip_key(conn, "cust-0", LIVE)
    run_until(r, lambda: len(applied(dsn)) == len(ids) - 1)
    return ids, head


@pytest.mark.parametrize("kind", kinds("batched", "per-event", "async"))
def test_a_skip_made_before_the_rebuild_stays_a_skip(
        dsn: str, live: Callable[..., SinkRunner], kind: str) -> None:  # noqa: F811
    ids, head = skipped_live(dsn, live, make(kind))
    live_state, live_dead = totals(dsn), dead_letters(dsn, LIVE)
    assert set(live_dead) == {head} and live_dead[head][1] == SKIPPED_ERROR
    seen: list[uuid.UUID] = []

    result = Rebuild(make(kind, lambda e: seen.append(e.id)), make_settings(dsn, "rebuilder", max_attempts=10),
                     progress=None).run()

    assert result is not None and result.clean, (result.waiting, result.dropped) if result else None
    assert head not in seen, "the replay applied (or retried) the event the operator skipped"
    assert dead_letters(dsn, LIVE) == live_dead, "the operator's skip was lost or rewritten by the rebuild"
    assert parked_ids(dsn, LIVE) == set(), "the skipped key is retrying again after the rebuild"
    assert totals(dsn) == live_state
    assert sorted(e for e, _ in applied(dsn)) == sorted(set(ids) - {head})


@pytest.mark.parametrize("kind", kinds("batched", "per-event"))
def test_a_skip_made_while_the_rebuild_waits_to_switch_is_followed(
        dsn: str, live: Callable[..., SinkRunner], kind: str) -> None:  # noqa: F811
    """The rebuild parks the poison head itself (it fails there too); the operator skips it live while the
    switch waits for the live tables (a reader holds them): the rebuild follows the skip before it swaps."""
    ids, head = poisoned_key(dsn)
    r = live(make(kind), max_attempts=10)
    run_until(r, lambda: head in parked_ids(dsn, LIVE) and len(applied(dsn)) == 5)
    rebuild = Rebuild(make(kind), make_settings(dsn, "rebuilder", max_attempts=10), progress=None)
    results: list[Any] = []
    with psycopg.connect(dsn) as reader:
        reader.execute("SELECT count(*) FROM order_totals").fetchone()  # holds the table: the switch waits
        t = threading.Thread(target=lambda: results.append(rebuild.run()))
        t.start()
        try:
            until(lambda: head in parked_ids(dsn, LIVE + ".rebuild") and fetch_all(
                dsn, "SELECT 1 FROM pg_locks l JOIN pg_class c ON c.oid = l.relation "
                     "WHERE c.relname = 'order_totals' AND NOT l.granted"))  # the live relay is not running
            with psycopg.connect(dsn, autocommit=True) as conn:
                skip_key(conn, "cust-0", LIVE)
            run_until(r, lambda: len(applied(dsn)) == len(ids) - 1)  # live applies the 2 behind it
        finally:
            reader.rollback()
            t.join(120)
    result = results[0]
    assert result is not None and result.clean, (result.waiting, result.dropped)
    assert set(dead_letters(dsn, LIVE)) == {head}
    assert dead_letters(dsn, LIVE)[head][1] == SKIPPED_ERROR
    assert parked_ids(dsn, LIVE) == set()
    assert sorted(e for e, _ in applied(dsn)) == sorted(set(ids) - {head})


@pytest.mark.parametrize("kind", kinds("batched", "per-event"))
def test_a_rebuild_whose_replayed_key_still_fails_is_not_clean(
        dsn: str, live: Callable[..., SinkRunner], kind: str) -> None:  # noqa: F811
    """Live processing applied every event; the rebuild's handler now fails on one: it switches over but
    names the key and is not clean (the CLI exits 1), never a plain success."""
    ids, head = poisoned_key(dsn)
    with psycopg.connect(dsn, autocommit=True) as conn:  # live processing had no poison: an older payload
        conn.execute("UPDATE outbox.events SET payload = '{\"customer\": \"cust-0\", \"cents\": 5}' WHERE id = %s",
                     (head,))
    r = live(make(kind), max_attempts=10)
    run_until(r, lambda: len(applied(dsn)) == len(ids))
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("UPDATE outbox.events SET payload = '{\"customer\": \"cust-0\", \"cents\": -5}' WHERE id = %s",
                     (head,))

    result = Rebuild(make(kind), make_settings(dsn, "rebuilder", max_attempts=10), progress=None).run()

    assert result is not None and not result.clean
    assert [(w.key, w.head, w.paused) for w in result.failing] == [("cust-0", head, False)]
    assert "negative amount" in (result.failing[0].last_error or "")


@pytest.mark.parametrize("kind", kinds("batched", "per-event", "async"))
def test_a_paused_keys_held_events_stay_held_and_the_pause_stays(
        dsn: str, live: Callable[..., SinkRunner], kind: str) -> None:  # noqa: F811
    """The operator paused cust-0 after its first event: live holds the rest, unapplied. The rebuild holds
    them too (never applies them), the pause and the live park rows stay, and resuming lets them go once."""
    first = publish(dsn, [("cust-0", "OrderPlaced", {"customer": "cust-0"})])
    r = live(make(kind), max_attempts=10)
    run_until(r, lambda: len(applied(dsn)) == 1)
    with psycopg.connect(dsn, autocommit=True) as conn:
        pause_key(conn, "cust-0", LIVE, reason="checking a refund")
    held = publish(dsn, [("cust-0", "OrderPaid", {"customer": "cust-0", "cents": 7}) for _ in range(3)])
    others = publish(dsn, [("cust-1", "OrderPlaced", {"customer": "cust-1"})])
    run_until(r, lambda: parked_ids(dsn, LIVE) == set(held) and len(applied(dsn)) == 2)
    live_state, live_park = totals(dsn), parked_rows(dsn, "cust-0", LIVE)
    seen: list[uuid.UUID] = []

    result = Rebuild(make(kind, lambda e: seen.append(e.id)), make_settings(dsn, "rebuilder", max_attempts=10),
                     progress=None).run()

    assert result is not None and result.clean, (result.waiting, result.dropped) if result else None
    assert not set(held) & set(seen), "the replay applied events the live projection holds for the pause"
    assert totals(dsn) == live_state
    assert parked_rows(dsn, "cust-0", LIVE) == live_park, "the held events' park rows changed"
    assert [(w.key, w.paused, w.parked) for w in result.waiting] == [("cust-0", True, 3)]
    with psycopg.connect(dsn, autocommit=True) as conn:
        assert key_state(conn, "cust-0", sink=LIVE).sinks[0].state == "paused", "the pause was lost"
        resume_key(conn, "cust-0", LIVE)
    run_until(r, lambda: len(applied(dsn)) == len(first) + len(held) + len(others))
    assert sorted(e for e, _ in applied(dsn)) == sorted(first + held + others), "each held event once"


@pytest.mark.parametrize("kind", kinds("batched", "per-event"))
def test_a_live_retrying_head_keeps_its_attempts_and_its_queue(
        dsn: str, live: Callable[..., SinkRunner], kind: str) -> None:  # noqa: F811
    """Live processing retries cust-0's poison head (3 attempts so far), 2 events queued behind it. The
    rebuild holds the key as live does: the head's attempts go on from 3, not from scratch, nothing behind it
    is applied, and the rebuild is not clean (the key still fails)."""
    ids, head = poisoned_key(dsn)
    r = live(make(kind), max_attempts=10)
    run_until(r, lambda: any(a >= 3 for e, a, _ in parked_rows(dsn, "cust-0", LIVE) if e == head))
    # The live relay stops here (run_until drives it), its head parked and retrying.
    [attempts] = [a for e, a, _ in parked_rows(dsn, "cust-0", LIVE) if e == head]
    live_state = totals(dsn)
    seen: list[uuid.UUID] = []

    result = Rebuild(make(kind, lambda e: seen.append(e.id)), make_settings(dsn, "rebuilder", max_attempts=10),
                     progress=None).run()

    assert result is not None and not result.clean
    assert head not in seen and not set(ids[6:]) & set(seen), "the replay retried the key from scratch"
    assert totals(dsn) == live_state
    [failing] = result.failing
    assert (failing.key, failing.head, failing.attempts, failing.parked) == ("cust-0", head, attempts, 3)
    assert "negative amount" in (failing.last_error or "")


@pytest.mark.parametrize("kind", kinds("batched", "per-event"))
def test_a_resume_made_while_the_rebuild_waits_to_switch_is_followed(
        dsn: str, live: Callable[..., SinkRunner], kind: str) -> None:  # noqa: F811
    """cust-0 is paused with 2 events held in both; the operator resumes it while the switch waits for the
    live tables, and live processing applies them. The rebuild applies them too before it swaps: the new
    model holds them once, nothing is left parked."""
    publish(dsn, [("cust-0", "OrderPlaced", {"customer": "cust-0"})])
    r = live(make(kind), max_attempts=10)
    run_until(r, lambda: len(applied(dsn)) == 1)
    with psycopg.connect(dsn, autocommit=True) as conn:
        pause_key(conn, "cust-0", LIVE)
    held = publish(dsn, [("cust-0", "OrderPaid", {"customer": "cust-0", "cents": 7}) for _ in range(2)])
    run_until(r, lambda: parked_ids(dsn, LIVE) == set(held))
    rebuild = Rebuild(make(kind), make_settings(dsn, "rebuilder", max_attempts=10), progress=None)
    results: list[Any] = []
    with psycopg.connect(dsn) as reader:
        reader.execute("SELECT count(*) FROM order_totals").fetchone()  # holds the table: the switch waits
        t = threading.Thread(target=lambda: results.append(rebuild.run()))
        t.start()
        try:
            until(lambda: parked_ids(dsn, LIVE + ".rebuild") == set(held) and fetch_all(
                dsn, "SELECT 1 FROM pg_locks l JOIN pg_class c ON c.oid = l.relation "
                     "WHERE c.relname = 'order_totals' AND NOT l.granted"))
            with psycopg.connect(dsn, autocommit=True) as conn:
                resume_key(conn, "cust-0", LIVE)
            run_until(r, lambda: len(applied(dsn)) == 3)  # live applies the held events
            live_state = totals(dsn)
        finally:
            reader.rollback()
            t.join(120)
    result = results[0]
    assert result is not None and result.clean, (result.waiting, result.dropped)
    assert totals(dsn) == live_state
    assert parked_ids(dsn, LIVE) == set()
    assert sorted(e for e, _ in applied(dsn)) == sorted(e for e, _ in fetch_all(
        dsn, "SELECT id, 1 FROM outbox.events"))


@pytest.mark.pg15
def test_the_command_exits_1_naming_the_key_that_still_fails(
        dsn: str, live: Callable[..., SinkRunner], capsys: pytest.CaptureFixture[str]) -> None:  # noqa: F811
    """`outbox-relay rebuild` after a switch with a failing key: exit 1 and the key, never "rebuilt" alone."""
    from outbox_relay import cli
    from tests.integration import projection_app

    [_, paid] = publish(dsn, [("cust-0", "OrderPlaced", {"customer": "cust-0"}),
                              ("cust-0", "OrderPaid", {"customer": "cust-0", "cents": 5})])
    r = live(projection_app.order_totals)
    run_until(r, lambda: totals(dsn) == [("cust-0", 1, 5)])
    with psycopg.connect(dsn, autocommit=True) as conn:  # a payload the handler can no longer apply
        conn.execute("""UPDATE outbox.events SET payload = '{"customer": "cust-0", "cents": "five"}' WHERE id = %s""",
                     (paid,))
    capsys.readouterr()

    code = cli.main(["rebuild", "order_totals", "--projections", "tests.integration.projection_app", "--dsn", dsn,
                     "--max-attempts", "10"])

    err = capsys.readouterr().err
    assert code == cli.EXIT_FAILED, err
    assert f"still failing: key 'cust-0': 1 events wait behind {paid}" in err
    assert "not clean" in err


@pytest.mark.parametrize("kind", kinds("batched", "per-event"))
def test_the_bulk_phase_hand_over_names_the_handlers_error(
        dsn: str, live: Callable[..., SinkRunner], kind: str, caplog: pytest.LogCaptureFixture) -> None:  # noqa: F811
    """The log line of a failed slice says what the handler raised (``KeyError: 'customer'``), not ``Redo``."""
    [placed] = publish(dsn, [("cust-0", "OrderPlaced", {"customer": "cust-0"})])
    r = live(make(kind), max_attempts=10)
    run_until(r, lambda: len(applied(dsn)) == 1)
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("""UPDATE outbox.events SET payload = '{"client": "cust-0"}' WHERE id = %s""", (placed,))
    caplog.set_level("INFO", logger="outbox_relay.rebuild")

    Rebuild(make(kind), make_settings(dsn, "rebuilder", max_attempts=10), progress=None).run()

    [line] = [r.getMessage() for r in caplog.records if "relay phase takes over" in r.getMessage()]
    assert "(KeyError: 'customer')" in line and "Redo" not in line, line


@pytest.mark.parametrize("kind", kinds("batched", "per-event"))
def test_events_of_a_paused_key_live_has_not_read_yet_are_held_too(
        dsn: str, live: Callable[..., SinkRunner], kind: str) -> None:  # noqa: F811
    """cust-0 is paused; its next events were published but no live relay has read them (it is down while the
    rebuild runs): live processing will hold them, so the rebuild holds them too, and after the switch they
    wait for the resume like any held event, applied once then."""
    first = publish(dsn, [("cust-0", "OrderPlaced", {"customer": "cust-0"})])
    r = live(make(kind), max_attempts=10)
    run_until(r, lambda: len(applied(dsn)) == 1)
    with psycopg.connect(dsn, autocommit=True) as conn:
        pause_key(conn, "cust-0", LIVE)
    unread = publish(dsn, [("cust-0", "OrderPaid", {"customer": "cust-0", "cents": 7}) for _ in range(2)])
    others = publish(dsn, [("cust-1", "OrderPlaced", {"customer": "cust-1"})])
    seen: list[uuid.UUID] = []

    result = Rebuild(make(kind, lambda e: seen.append(e.id)), make_settings(dsn, "rebuilder", max_attempts=10),
                     progress=None).run()

    assert result is not None and result.clean, (result.waiting, result.dropped)
    assert not set(unread) & set(seen), "the replay applied events of a paused key"
    assert [(w.key, w.paused, w.parked) for w in result.waiting] == [("cust-0", True, 2)]
    assert sorted(e for e, _ in applied(dsn)) == sorted(first + others)
    with psycopg.connect(dsn, autocommit=True) as conn:
        resume_key(conn, "cust-0", LIVE)
    run_until(r, lambda: len(applied(dsn)) == 4)
    assert sorted(e for e, _ in applied(dsn)) == sorted(first + unread + others), "each once, after the resume"
