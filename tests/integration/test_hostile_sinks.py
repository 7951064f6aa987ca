"""Hostile users' sinks (outbox_relay.sinks) under the real engine and real PostgreSQL: answers and
exceptions that break the usual rules must still be charged to their event, never loop forever
uncounted nor stop the sink for the events after them."""

from __future__ import annotations

import asyncio
import threading
import uuid
from typing import Any

import pytest
from psycopg_pool import ConnectionPool

from outbox_relay.sinks import GiveUp, Outcome, Retry, SinkEvent
from outbox_relay.sinks.adapter import EventSinkAdapter
from outbox_relay.sinks.engine import Failure
from outbox_relay.worker import Worker
from tests.integration.relay_helpers import (  # noqa: F401  (pool_fixture provides `pool`)
    dead_letters,
    fetch_all,
    make_settings,
    parked_ids,
    pool_fixture,
    publish,
    run_until,
    runner_for,
    undelivered,
    user_sink_runner,
)
from tests.servers import wait_until

NAME = "hostile"


class Unprintable:
    """An object whose str() raises (a reason or exception message built from a broken object)."""

    def __str__(self) -> str:
        raise RuntimeError("no str for you")


class BadMessage(Exception):
    def __str__(self) -> str:
        raise RuntimeError("no str for you")


class Sink:
    kind = "hostile"

    def __init__(self, deliver: Any, name: str = NAME) -> None:
        self.name = name
        self.deliver = deliver


def test_a_retry_whose_reason_can_not_be_shown_is_charged_and_dead_letters(dsn: str, pool: ConnectionPool[Any]) -> None:
    ids = publish(dsn, [("a", "t", {}), ("a", "t", {})])
    calls: list[uuid.UUID] = []

    def deliver(e: SinkEvent) -> Outcome:
        calls.append(e.id)
        return Retry(Unprintable()) if e.id == ids[0] else None  # type: ignore[arg-type]

    r, _ = user_sink_runner(Sink(deliver), pool, dsn, max_attempts=2)
    run_until(r, lambda: ids[1] in calls, timeout=15)
    [(attempts, error)] = dead_letters(dsn, NAME).values()
    assert attempts == 2 and "Unprintable" in error
    assert calls == [ids[0], ids[0], ids[1]]


def test_an_exception_whose_message_can_not_be_shown_is_charged(dsn: str, pool: ConnectionPool[Any]) -> None:
    ids = publish(dsn, [("a", "t", {}), ("a", "t", {})])
    calls: list[uuid.UUID] = []

    def deliver(e: SinkEvent) -> Outcome:
        calls.append(e.id)
        if e.id == ids[0]:
            raise BadMessage()
        return None

    r, _ = user_sink_runner(Sink(deliver), pool, dsn, max_attempts=2)
    run_until(r, lambda: ids[1] in calls, timeout=15)
    [(attempts, error)] = dead_letters(dsn, NAME).values()
    assert attempts == 2 and "BadMessage" in error


class ManySink:
    """A sink with ``deliver_many`` (waves): ``answer`` is what each call returns, given the call's events."""

    kind = "hostile"
    name = NAME
    concurrency = 8

    def __init__(self, answer: Any) -> None:
        self.answer = answer
        self.calls: list[list[uuid.UUID]] = []

    def deliver(self, event: SinkEvent) -> Outcome:
        raise AssertionError("not called: the sink has deliver_many")

    def deliver_many(self, events: list[SinkEvent]) -> Any:
        self.calls.append([e.id for e in events])
        return self.answer(events)


def _exit() -> None:
    raise SystemExit(3)


@pytest.mark.parametrize(("answer", "expected"), [
    (lambda events: [None] * (len(events) - 1), "returned 1 answers for 2 events"),
    (lambda events: None, "returned a NoneType for 2 events"),
    (lambda events: [GiveUp("no")] * len(events) + [None], "returned 3 answers for 2 events"),
    (lambda events: _exit(), "SystemExit"),
    (lambda events: [Failure("not an answer", retriable=False)] * len(events), "returned a Failure"),
])
def test_a_wave_answered_wrongly_charges_each_of_its_events(dsn: str, pool: ConnectionPool[Any], answer: Any,
                                                           expected: str) -> None:
    ids = publish(dsn, [("a", "t", {}), ("b", "t", {}), ("a", "t", {})])
    sink = ManySink(answer)
    r, _ = user_sink_runner(sink, pool, dsn, max_attempts=2)
    run_until(r, lambda: len(dead_letters(dsn, NAME)) == 2, timeout=15)
    dead = dead_letters(dsn, NAME)
    assert set(dead) == {ids[0], ids[1]}, "the heads of both keys, each charged twice"
    assert all(attempts == 2 and expected in error for attempts, error in dead.values()), dead
    run_until(r, lambda: undelivered(dsn, NAME) == 0 or len(sink.calls) > 2, timeout=15)
    assert [set(c) for c in sink.calls[:2]] == [{ids[0], ids[1]}] * 2, "one call per wave, one event per key"
    assert all(ids[2] not in c for c in sink.calls[:2]), "a key's next event waits for its head's answer"


def test_an_async_sink_that_raises_system_exit_keeps_its_event_loop(dsn: str, pool: ConnectionPool[Any]) -> None:
    ids = publish(dsn, [("a", "t", {}), ("b", "t", {}), ("c", "t", {})])
    got: list[uuid.UUID] = []

    async def deliver(e: SinkEvent) -> Outcome:
        await asyncio.sleep(0)
        if e.id == ids[0] and e.attempt == 1:
            raise SystemExit(3)
        if e.id == ids[1] and e.attempt == 1:
            raise KeyboardInterrupt()
        got.append(e.id)
        return None

    r, adapter = user_sink_runner(Sink(deliver), pool, dsn, handler_timeout_seconds=3.0)
    try:
        run_until(r, lambda: undelivered(dsn, NAME) == 0 and not parked_ids(dsn, NAME), timeout=20)
    finally:
        adapter.close()
    assert not dead_letters(dsn, NAME)
    assert sorted(got) == sorted(ids)


def test_an_async_sink_that_stops_its_event_loop_gets_a_new_one(dsn: str, pool: ConnectionPool[Any]) -> None:
    ids = publish(dsn, [("a", "t", {}), ("b", "t", {}), ("c", "t", {}), ("d", "t", {})])
    got: list[uuid.UUID] = []

    async def deliver(e: SinkEvent) -> Outcome:
        if e.id == ids[0] and e.attempt == 1:
            asyncio.get_running_loop().stop()
        got.append(e.id)
        return None

    r, adapter = user_sink_runner(Sink(deliver), pool, dsn, handler_timeout_seconds=1.0, max_attempts=2)
    try:
        run_until(r, lambda: undelivered(dsn, NAME) == 0 and not parked_ids(dsn, NAME), timeout=20)
    finally:
        adapter.close()
    assert not dead_letters(dsn, NAME), "events after the one that stopped the loop are not charged for it"
    assert set(got) == set(ids)


# ESC (colour, window title), BEL, CR, a C1 CSI, DEL, a right-to-left override: what a receiver or a
# producer can put in an error or a type, and what a terminal would act on.
HOSTILE = "\x1b[31mred\x1b]0;pwned\x07\rX\x9b2J\x7f\u202eevil"
RAW = ("\x1b", "\x07", "\r", "\x9b", "\x7f", "\u202e")


def test_the_relays_log_lines_show_hostile_strings_escaped(dsn: str, pool: ConnectionPool[Any],
                                                           capsys: Any) -> None:
    import psycopg

    from outbox_relay.cli.logs import setup_logging

    with psycopg.connect(dsn, autocommit=True) as conn:  # a plain SQL producer: no validation of the type
        conn.execute("INSERT INTO outbox.events (partition_key, type, topic, payload) VALUES ('k', %s, 't', '{}')",
                     (f"order{HOSTILE}",))
    setup_logging("info", False, "w")
    r, _ = user_sink_runner(Sink(lambda e: GiveUp(f"receiver said {HOSTILE}")), pool, dsn)
    run_until(r, lambda: bool(dead_letters(dsn, NAME)))
    err = capsys.readouterr().err
    assert "dead-lettered" in err and "\\x1b[31mred" in err, err
    assert not any(c in err for c in RAW), repr(err)


class Exits:
    """A sink whose idle() or close() raises SystemExit (its own code calling sys.exit)."""

    name = NAME
    kind = "hostile"

    def __init__(self, where: str) -> None:
        self.where = where
        self.got: list[uuid.UUID] = []
        self.idles = 0

    def deliver(self, event: SinkEvent) -> Outcome:
        self.got.append(event.id)
        return None

    def idle(self) -> None:
        self.idles += 1
        if self.where == "idle" and self.idles == 1:
            raise SystemExit("idle says bye")

    def close(self) -> None:
        if self.where == "close":
            raise SystemExit("close says bye")


@pytest.mark.parametrize("where", ["idle", "close"])
def test_a_sink_whose_idle_or_close_exits_neither_kills_its_runner_nor_skips_the_drain(dsn: str, where: str) -> None:
    sink = Exits(where)
    worker = Worker(make_settings(dsn, "w"), sinks=[EventSinkAdapter(sink)])
    assert worker.start()
    waiter = threading.Thread(target=worker.wait)
    waiter.start()
    try:
        wait_until(lambda: sink.idles >= 2, timeout=20, message="the runner idles on")
        ids = publish(dsn, [("k", "t", {"n": n}) for n in range(3)])
        wait_until(lambda: set(ids) <= set(sink.got), timeout=20, message="delivered after the idle() that exited")
    finally:
        worker.drain()
        waiter.join(20)
    assert not waiter.is_alive(), "the worker stopped"
    held = fetch_all(dsn, "SELECT count(*) FROM outbox.cursors WHERE sink = %s AND owner IS NOT NULL", (NAME,))
    assert held == [(0,)], "its leases were released"
    assert fetch_all(dsn, "SELECT count(*) FROM outbox.workers WHERE id = 'w'") == [(0,)], "left the registry"


# -- projections: a handler is a sink's code too


@pytest.mark.parametrize("raised", [SystemExit("handler exits"), KeyboardInterrupt()], ids=["SystemExit",
                                                                                           "KeyboardInterrupt"])
def test_a_projection_handler_that_exits_is_charged_to_its_event(dsn: str, pool: ConnectionPool[Any],
                                                                 raised: BaseException) -> None:
    from tests.integration.test_projections import runner as projection_runner
    from tests.integration.test_projections import setup_tables, totals, totals_projection

    setup_tables(dsn)

    def before(event: Any, tx: Any) -> None:
        if event.payload["customer"] == "bad":
            raise raised

    publish(dsn, [("bad", "OrderPlaced", {"customer": "bad"}), ("good", "OrderPlaced", {"customer": "good"})])
    r = projection_runner(totals_projection(before=before), dsn, pool, max_attempts=2)
    try:
        run_until(r, lambda: undelivered(dsn, "order_totals") == 0 and not parked_ids(dsn, "order_totals"),
                  timeout=20)
    finally:
        r.sink.close()
    [(attempts, error)] = dead_letters(dsn, "order_totals").values()
    assert attempts == 2 and type(raised).__name__ in error
    assert totals(dsn) == [("good", 1, 0)]


def test_a_runner_thread_that_gets_a_base_exception_stops_the_relay_instead_of_dying_quietly(dsn: str) -> None:
    class Escapes(Exception.__base__):  # type: ignore[misc,name-defined]  # a BaseException no sink code catches
        pass

    sink = Exits("")
    adapter = EventSinkAdapter(sink)

    def idle() -> None:
        raise Escapes("an engine bug")

    adapter.idle = idle  # type: ignore[method-assign]
    worker = Worker(make_settings(dsn, "w"), sinks=[adapter])
    assert worker.start()
    waiter = threading.Thread(target=worker.wait)
    waiter.start()
    waiter.join(30)
    assert not waiter.is_alive(), "the relay stopped by itself"
    assert worker.fatal is not None and "Escapes: an engine bug" in str(worker.fatal)
    held = fetch_all(dsn, "SELECT count(*) FROM outbox.cursors WHERE sink = %s AND owner IS NOT NULL", (NAME,))
    assert held == [(0,)], "its leases were released"


# -- embedding


def test_two_relays_of_one_worker_id_in_one_process_are_refused_at_start(dsn: str) -> None:
    """Two ``Relay`` objects left with the same worker_id (the default one is per process) looked like one
    relay restarted in the same process: the second silently took the registration over and the first
    stopped later with "in use by another relay" naming its own pid."""
    from outbox_relay import Relay
    from outbox_relay.errors import ConfigurationError

    first, second = Exits(""), Exits("")
    relay = Relay(make_settings(dsn, "same"), sinks=[first])
    relay.start()
    try:
        other = Relay(make_settings(dsn, "same"), sinks=[second])
        with pytest.raises(ConfigurationError, match="worker id 'same' is used by another Relay in this process"):
            other.start()
        assert not other.running
        ids = publish(dsn, [("k", "t", {"n": n}) for n in range(3)])
        wait_until(lambda: set(ids) <= set(first.got), timeout=20, message="the first relay delivers on")
        assert relay.running and relay.fatal is None
    finally:
        assert relay.drain(20)
    again = Relay(make_settings(dsn, "same"), sinks=[second])  # the id is free once the first one stopped
    again.start()
    assert again.drain(20) and again.fatal is None
