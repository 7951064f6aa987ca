"""Hostile review of the rebuild's lanes and switch-over against a real PostgreSQL: a projection whose
live sink was never registered, events of types the projection does not take around the lanes'
snapshots, a process of a run restarted (--restart) under it while it holds a lane, a second process's
relay phase through the switch-over."""

# ruff: noqa: F811  (the `live` fixture, imported, is each test's parameter)
from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

import psycopg
import pytest

from outbox_relay.backoff import Backoff
from projections import ProjectionEvent, bulk, projection
from projections.rebuild import Rebuild, RebuildError
from tests.integration.relay_helpers import (  # noqa: F401  (pool_fixture provides `pool`)
    fetch_all,
    pool_fixture,
    publish,
    run_until,
)
from tests.integration.test_rebuild_bulk import (  # noqa: F401  (the `live` fixture)
    SLICE,
    counted,
    live,
    log_rows,
    model,
    outcome_of,
    settings,
    tally,
)


def test_a_projection_never_run_live_rebuilds_and_its_live_sink_goes_on_from_the_rebuild(
        dsn: str, live: Any) -> None:
    """No live sink registered yet: the switch-over registers it and hands it the rebuild's cursors,
    so live processing afterwards applies nothing twice."""
    ids = publish(dsn, counted(6, 20))
    result = Rebuild(tally(), settings(dsn), progress=None).run()
    assert result is not None and result.events == len(ids)
    assert fetch_all(dsn, "SELECT name FROM outbox.sinks ORDER BY name") == [("tally",)]
    runner = live(tally(), 0)
    later = publish(dsn, counted(6, 1, start=20))
    run_until(runner, lambda: len(log_rows(dsn)) >= len(ids) + len(later))
    runner.run_once()
    rows = log_rows(dsn)
    assert sorted(r[0] for r in rows) == sorted(ids + later), "each event once"


def test_events_the_projection_does_not_take_around_the_lanes_do_not_hold_up_the_switch_over(
        dsn: str, live: Any, caplog: pytest.LogCaptureFixture) -> None:
    """Events of a type the projection filters out, before and after the lanes' snapshots (live
    processing passed them): nothing to apply, so it switches over without a relay phase, same model."""
    ids = publish(dsn, [e for pair in zip(counted(6, 20), [(f"k{i % 6}", "Ignored", {"i": i}) for i in range(120)],
                                          strict=True) for e in pair])
    runner = live(tally(), 120)
    live_model = model(dsn)
    caplog.set_level(logging.INFO)
    result = Rebuild(tally(), settings(dsn), progress=None).run()
    assert result is not None and result.events == 120
    assert model(dsn) == live_model
    assert not [r for r in caplog.records if r.name.startswith("outbox_relay.worker")], "no relay phase started"
    runner.run_once()
    assert len(log_rows(dsn)) == 120 and len(ids) == 240


def test_a_process_of_a_restarted_run_holding_a_lane_changes_nothing_in_the_new_run(dsn: str, live: Any) -> None:
    """Process A holds a lane of run 1 (its handler waits in the second slice); `rebuild --restart` starts
    run 2 under it (its start waits for A's slice); A's later slices must not land in run 2's copies.
    A stops saying it was restarted; run 2 ends with each event once."""
    ids = publish(dsn, counted(20, 30))
    live(tally(), len(ids))
    live_model = model(dsn)
    entered, gate = threading.Event(), threading.Event()
    a_calls = [0]
    a = tally()
    a_original = a.handler

    def a_handler(event: ProjectionEvent[Any], tx: Any) -> None:
        a_calls[0] += 1
        if a_calls[0] == SLICE + 1:
            entered.set()
            gate.wait(30)
        a_original(event, tx)

    a.handler = a_handler
    outcome: list[Any] = []

    def run_a() -> None:
        outcome.append(outcome_of(a, dsn, "rebuilder-a"))

    thread = threading.Thread(target=run_a)
    thread.start()
    assert entered.wait(30)
    threading.Timer(1.0, gate.set).start()  # run 2's start waits for A's slice in flight (its schema's tables)
    result = Rebuild(tally(), settings(dsn, "rebuilder-b"), restart=True, progress=None).run()
    thread.join(60)
    assert result is not None
    assert outcome and isinstance(outcome[0], RebuildError) and "restarted" in str(outcome[0]), outcome
    assert model(dsn) == live_model, "G12: nothing of run 1 in run 2's model"
    rows = log_rows(dsn)
    assert sorted(r[0] for r in rows) == sorted(ids), "each event once"


def test_two_processes_with_live_traffic_through_the_switch_over_apply_each_event_once(
        dsn: str, live: Any) -> None:
    """Two rebuild processes (lanes, then relay phases) while events keep arriving and live processing
    applies them: whichever switches, the other's relay phase lands nothing in the new model; live
    processing then ends with the same model and each event once."""
    ids = publish(dsn, counted(20, 20))
    runner = live(tally(), len(ids))
    stop = threading.Event()
    published: list[Any] = []

    def produce() -> None:
        n = 100
        while not stop.is_set():
            published.extend(publish(dsn, counted(20, 1, start=n)))
            n += 1
            time.sleep(0.05)

    def live_loop() -> None:
        while not stop.is_set():
            runner.run_once()
            time.sleep(0.01)

    results: dict[str, Any] = {}

    def run(worker: str) -> None:
        results[worker] = outcome_of(tally(), dsn, worker)

    side = [threading.Thread(target=produce), threading.Thread(target=live_loop)]
    for t in side:
        t.start()
    threads = [threading.Thread(target=run, args=(w,)) for w in ("rebuilder-a", "rebuilder-b")]
    for t in threads:
        t.start()
    for t in threads:
        t.join(180)
    stop.set()
    for t in side:
        t.join(30)
    assert all(r is not None and not isinstance(r, BaseException) for r in results.values()), results
    every = ids + published
    run_until(runner, lambda: len(log_rows(dsn)) >= len(every), timeout=60)
    runner.run_once()
    rows = log_rows(dsn)
    assert sorted(r[0] for r in rows) == sorted(every), "each event once"
    per: dict[str, tuple[int, int]] = {}
    for _, key, i, _ in rows:
        n, total = per.get(key, (0, 0))
        per[key] = (n + 1, total + i)
    assert model(dsn) == sorted((k, n, t) for k, (n, t) in per.items()), "G12"


def end_rebuild_sessions(conn: psycopg.Connection[Any]) -> int:
    """End every session of the rebuild process (what a crash restart of the server does to it)."""
    return len(conn.execute("SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                            "WHERE application_name LIKE 'outbox-relay rebuilder%%'").fetchall())


def rebuild_through(dsn: str, live: Any, outage: Callable[[], None]) -> tuple[Rebuild, list[Any], Any]:
    """A rebuild of the tally (its events applied live first) that calls ``outage`` as a lane's second
    slice begins, not started yet; the events and the live model."""
    ids = publish(dsn, counted(20, 30))
    live(tally(), len(ids))
    live_model = model(dsn)
    p = tally()
    original = p.handler
    calls = [0]

    def handler(event: ProjectionEvent[Any], tx: Any) -> None:
        calls[0] += 1
        if calls[0] == SLICE + 1:
            outage()
        original(event, tx)

    p.handler = handler
    return Rebuild(p, settings(dsn), progress=None), ids, live_model


def test_the_server_ending_every_rebuild_session_mid_lane_resumes_with_each_event_once(dsn: str, live: Any) -> None:
    """What a PostgreSQL crash restart does to the lanes: every session of the rebuild process ends in
    a lane's second slice (its lock, its slice in flight and its read ahead go). The phase reconnects
    and resumes the lane from its last slice: each event once, the same model."""
    ended = [0]

    def crash() -> None:
        with psycopg.connect(dsn, autocommit=True) as other:
            ended[0] += end_rebuild_sessions(other)

    rebuild, ids, live_model = rebuild_through(dsn, live, crash)
    result = rebuild.run()
    assert ended[0] >= 2, "the slice's session and the reader's ended"
    assert result is not None
    assert model(dsn) == live_model
    rows = log_rows(dsn)
    assert sorted(r[0] for r in rows) == sorted(ids), "each event once"
    assert {r[3] for r in rows} == {0}, "all of it by the bulk phase: resumed after reconnecting"


@pytest.mark.parametrize("window", [bulk.RECONNECT_SECONDS, 0.3])
def test_a_server_away_for_seconds_mid_lane_is_waited_out_by_the_bulk_phase(
        dsn: str, live: Any, monkeypatch: pytest.MonkeyPatch, window: float) -> None:
    """A restart that keeps the server away for a few seconds (here: every session of the rebuild ended
    as soon as it appears, for 3 s). The bulk phase tried three times in about a second, then left the
    rest of history to the relay phase, several times slower; it now waits out such an outage (up to
    bulk.RECONNECT_SECONDS) and finishes the lanes itself: each event once, all of it under the bulk
    phase's fence 0. An outage longer than the window still hands the rest over safely."""
    monkeypatch.setattr(bulk, "RECONNECT_SECONDS", window)
    ended = [0]
    threads: list[threading.Thread] = []

    def keep_ending(until: float) -> None:
        with psycopg.connect(dsn, autocommit=True) as other:
            while time.monotonic() < until:
                ended[0] += end_rebuild_sessions(other)
                time.sleep(0.01)

    def away() -> None:
        threads.append(threading.Thread(target=keep_ending, args=(time.monotonic() + 3.0,)))
        threads[0].start()
        time.sleep(0.05)  # this slice's session is among the first to go

    rebuild, ids, live_model = rebuild_through(dsn, live, away)
    result = rebuild.run()
    threads[0].join()
    assert ended[0] >= 3, "the outage ended the phase's sessions again and again"
    assert result is not None
    assert model(dsn) == live_model
    rows = log_rows(dsn)
    assert sorted(r[0] for r in rows) == sorted(ids), "each event once"
    fences = {r[3] for r in rows}
    if window > 3.0:
        assert fences == {0}, "all of it by the bulk phase, after the outage"
    else:
        assert 0 in fences and len(fences) > 1, "the window ran out: the relay phase applied the rest"


def test_a_stop_while_the_bulk_phase_waits_for_the_server_ends_the_wait_and_resumes(
        dsn: str, live: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """A stop (SIGTERM) that comes while the bulk phase waits to reconnect ends the wait at once, as a
    resumable stop; the rerun finishes with each event once."""
    monkeypatch.setattr(bulk, "RECONNECT", Backoff(30.0, 30.0))  # a wait the test would notice
    stop: list[Callable[[], None]] = []

    def crash_then_stop() -> None:
        with psycopg.connect(dsn, autocommit=True) as other:
            end_rebuild_sessions(other)
        threading.Timer(1.0, stop[0]).start()

    first, ids, live_model = rebuild_through(dsn, live, crash_then_stop)
    stop.append(first.stop)
    started = time.monotonic()
    assert first.run() is None, "a stop is resumable"
    assert time.monotonic() - started < 20, "the stop ended the 30 s wait"
    result = Rebuild(tally(), settings(dsn), progress=None).run()
    assert result is not None and result.resumed and model(dsn) == live_model
    assert sorted(r[0] for r in log_rows(dsn)) == sorted(ids), "each event once"


def reading_tally() -> Any:
    """Counters whose handler reads the model before it writes it (a read, then an update): its batch
    holds a read lock on the table while its write waits."""

    @projection("tally", events=["Counted"], tables=["counters", "tally_log"])
    def apply(event: ProjectionEvent[Any], tx: Any) -> None:
        i = int(event.payload["i"])
        row = tx.execute("SELECT n FROM counters WHERE key = %s", (event.key,)).fetchone()
        if row is None:
            tx.execute("INSERT INTO counters VALUES (%s, 1, %s)", (event.key, i))
        else:
            tx.execute("UPDATE counters SET n = n + 1, total = total + %s WHERE key = %s", (i, event.key))
        tx.execute("INSERT INTO tally_log (event_id, key, i, fence) VALUES (%s, %s, %s, %s)",
                   (event.id, event.key, i, event.token.fence))
    return apply


def test_a_switch_over_under_live_traffic_of_a_handler_that_reads_before_it_writes_succeeds(
        dsn: str, live: Any, caplog: pytest.LogCaptureFixture) -> None:
    """Liveness: with the switch-over holding the live tables in a lock that let reads through, a live
    projection batch read them (a read lock) and waited to write; raising the switch's lock to ACCESS
    EXCLUSIVE then waited for that read lock: a deadlock, and the switch-over was the one aborted (its
    relay phase started again), attempt after attempt while live events kept arriving. The switch now
    takes ACCESS EXCLUSIVE first: such a batch lands before it, or waits for it."""
    caplog.set_level(logging.INFO)
    ids = publish(dsn, counted(8, 10))
    runner = live(reading_tally(), len(ids))
    stop = threading.Event()
    published: list[Any] = []

    def produce() -> None:
        n, pause, started = 100, 0.005, time.monotonic()
        while not stop.is_set():
            published.extend(publish(dsn, [(f"k{n % 8}", "Counted", {"i": n})]))
            n += 1
            # An event every 5 ms for the first second (a switch-over on an idle machine comes within
            # it), then ever fewer (at most one per 0.1 s): still live traffic through the switch, and a
            # rebuild that replays slower than the events come still catches up (it timed out at 300 s
            # on a busy machine's PostgreSQL 15 chasing 200 events/s).
            stop.wait(pause)
            if time.monotonic() - started > 1.0:
                pause = min(0.1, pause * 1.1)

    def live_loop() -> None:
        while not stop.is_set():
            with contextlib.suppress(Exception):
                runner.run_once()

    side = [threading.Thread(target=produce), threading.Thread(target=live_loop)]
    for t in side:
        t.start()
    try:
        result = Rebuild(reading_tally(), settings(dsn), progress=None).run()
    finally:
        stop.set()
        for t in side:
            t.join(30)
    assert result is not None
    victims = [r.getMessage() for r in caplog.records
               if r.name == "outbox_relay.rebuild" and "DeadlockDetected" in r.getMessage()]
    assert not victims, victims
    every = ids + published
    run_until(runner, lambda: len(log_rows(dsn)) >= len(every), timeout=60)
    runner.run_once()
    assert sorted(r[0] for r in log_rows(dsn)) == sorted(every), "each event once"
