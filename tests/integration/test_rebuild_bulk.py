"""The bulk phase of a rebuild (projections/bulk.py) against a real PostgreSQL: the same model as live
processing (G12) in slices across xid partitions, per-key order, resume after a crash mid-slice with
no double effect, a failure handed over to the relay phase, two rebuild processes, events committed
during the phase, a transaction open at its snapshot, upcasters.

The read model's effect is not idempotent (counters), and every handler call records the fence of
its token: the bulk phase applies under fence 0, the relay phase under the fences its leases get
(>= 2), so a test can tell which phase applied an event.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest
from psycopg_pool import ConnectionPool

from outbox_relay import Outbox, store
from outbox_relay.relay import SinkRunner
from projections import ProjectionEvent, Upcasters, projection
from projections.rebuild import Rebuild
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

TABLES = """
CREATE TABLE counters (key text PRIMARY KEY, n int NOT NULL, total bigint NOT NULL);
CREATE TABLE tally_log (n bigserial PRIMARY KEY, event_id uuid NOT NULL, key text NOT NULL, i int NOT NULL,
                        fence bigint NOT NULL);
"""
SLICE = 50  # --batch-size: the bulk phase's slice


class Crash(BaseException):
    """A process dying mid-slice (what SIGKILL does to it: nothing after this line runs)."""


def tally(batch: bool = False, fail_i: int | None = None, crash_after: int | None = None,
          upcasters: Upcasters | None = None, entered: threading.Event | None = None,
          gate: threading.Event | None = None) -> Any:
    """Counters per key (an increment: applied twice, it shows) and a log of every application."""
    calls = [0]

    def one(event: ProjectionEvent[Any], tx: Any) -> None:
        calls[0] += 1
        if entered is not None:
            entered.set()
        if gate is not None:
            gate.wait(30)
        if crash_after is not None and calls[0] > crash_after:
            raise Crash()
        i = int(event.payload["i"])
        if fail_i is not None and i == fail_i:
            raise ValueError(f"event {i} fails")
        tx.execute("INSERT INTO counters VALUES (%s, 1, %s) "
                   "ON CONFLICT (key) DO UPDATE SET n = counters.n + 1, total = counters.total + excluded.total",
                   (event.key, i))
        tx.execute("INSERT INTO tally_log (event_id, key, i, fence) VALUES (%s, %s, %s, %s)",
                   (event.id, event.key, i, event.token.fence))

    if batch:
        @projection("tally", events=["Counted"], tables=["counters", "tally_log"], batch=True, upcasters=upcasters)
        def apply_batch(events: list[ProjectionEvent[Any]], tx: Any) -> None:
            for e in events:
                one(e, tx)
        return apply_batch

    @projection("tally", events=["Counted"], tables=["counters", "tally_log"], upcasters=upcasters)
    def apply(event: ProjectionEvent[Any], tx: Any) -> None:
        one(event, tx)
    return apply


def counted(keys: int, per_key: int, start: int = 0) -> list[tuple[str, str, Any]]:
    return [(f"k{k}", "Counted", {"i": i}) for i in range(start, start + per_key) for k in range(keys)]


def model(dsn: str) -> list[tuple[Any, ...]]:
    return fetch_all(dsn, "SELECT key, n, total FROM counters ORDER BY key")


def log_rows(dsn: str) -> list[tuple[Any, ...]]:
    return fetch_all(dsn, "SELECT event_id, key, i, fence FROM tally_log ORDER BY n")


def per_key(rows: list[tuple[Any, ...]]) -> dict[str, list[int]]:
    out: dict[str, list[int]] = {}
    for _, key, i, _ in rows:
        out.setdefault(key, []).append(i)
    return out


def settings(dsn: str, worker: str = "rebuilder") -> Any:
    return make_settings(dsn, worker, max_attempts=2, batch_size=SLICE)


@pytest.fixture
def live(dsn: str, pool: ConnectionPool[Any]) -> Iterator[Any]:
    """``live(projection, n)``: live processing applies the n published events, the reference model."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(TABLES)
    sinks: list[ProjectionSink] = []

    def make(p: Any, n: int) -> SinkRunner:
        sink = ProjectionSink(p, dsn)
        sinks.append(sink)
        with pool.connection() as conn:
            store.register_sink(conn, sink.name, sink.kind)
        r = SinkRunner(sink, pool, make_settings(dsn, "live", max_attempts=2))
        r.desired = set(ALL_BUCKETS)
        run_until(r, lambda: len(log_rows(dsn)) >= n, timeout=60)
        return r

    yield make
    for s in sinks:
        s.close()


def publish_across_partitions(dsn: str, keys: int, per_key: int, parts: int) -> list[uuid.UUID]:
    ids: list[uuid.UUID] = []
    step = per_key // parts
    for p in range(parts):
        for j in range(step):  # one transaction per round: many xids per partition
            ids += publish(dsn, counted(keys, 1, start=p * step + j))
        close_history(dsn)  # a new xid partition from here
    return ids


@pytest.mark.parametrize("batch", [False, True], ids=["per-event", "batched"])
def test_the_bulk_phase_builds_the_live_model_in_slices_across_partitions(dsn: str, live: Any, batch: bool) -> None:
    ids = publish_across_partitions(dsn, keys=12, per_key=30, parts=3)
    assert len(fetch_all(dsn, "SELECT DISTINCT tableoid FROM outbox.events")) >= 3, "events span partitions"
    live(tally(batch), len(ids))
    live_model, live_order = model(dsn), per_key(log_rows(dsn))

    result = Rebuild(tally(batch), settings(dsn), progress=None).run()

    assert result is not None and result.events == len(ids)
    rows = log_rows(dsn)
    assert model(dsn) == live_model, "G12: the rebuilt model is the live one"
    assert per_key(rows) == live_order, "per-key order kept across slices and partitions"
    assert sorted(r[0] for r in rows) == sorted(ids), "each event applied once"
    assert {r[3] for r in rows} == {0}, "all of it by the bulk phase (fence 0)"


def test_with_nothing_committed_after_the_bulk_phase_it_switches_over_without_a_relay_phase(
        dsn: str, live: Any, caplog: pytest.LogCaptureFixture) -> None:
    ids = publish(dsn, counted(6, 20))
    live(tally(True), len(ids))
    live_model = model(dsn)
    caplog.set_level(logging.INFO)

    result = Rebuild(tally(True), settings(dsn), progress=None).run()

    assert result is not None and result.events == len(ids)
    assert model(dsn) == live_model
    assert not [r for r in caplog.records if r.name.startswith("outbox_relay.worker")], "no relay phase started"
    assert fetch_all(dsn, "SELECT name FROM outbox.sinks ORDER BY name") == [("tally",)], "switched over"


def test_a_crash_mid_slice_resumes_at_the_last_slice_with_no_double_effect(dsn: str, live: Any) -> None:
    ids = publish(dsn, counted(10, 40))
    live(tally(), len(ids))
    live_model = model(dsn)

    with pytest.raises(Crash):
        Rebuild(tally(crash_after=3 * SLICE + 17), settings(dsn), progress=None).run()
    landed = fetch_all(dsn, "SELECT count(*) FROM outbox_rebuild_tally.tally_log")[0][0]
    assert landed == 3 * SLICE, "the three slices before the crash landed, the fourth rolled back"

    result = Rebuild(tally(), settings(dsn), progress=None).run()
    assert result is not None and result.resumed
    assert model(dsn) == live_model, "no event counted twice, none missed"
    rows = log_rows(dsn)
    assert sorted(r[0] for r in rows) == sorted(ids) and {r[3] for r in rows} == {0}


def test_a_handler_failure_hands_over_to_the_relay_phase(dsn: str, live: Any) -> None:
    """The failing event is retried and dead-lettered by the relay phase exactly as before; everything
    before its slice was applied by the bulk phase, the rest by the relay phase."""
    ids = publish(dsn, counted(10, 30))
    poison = ids[10 * 12 + 3]  # key k3, i == 12: in the third slice
    live(tally(fail_i=12), len(ids) - 10)
    live_model = model(dsn)

    result = Rebuild(tally(fail_i=12), settings(dsn), progress=None).run()

    assert result is not None
    assert model(dsn) == live_model
    rows = log_rows(dsn)
    assert poison not in {r[0] for r in rows}
    fences = {r[3] for r in rows}
    assert 0 in fences and any(f > 0 for f in fences), "the bulk phase, then the relay phase"
    assert sum(1 for r in rows if r[3] == 0) == 2 * SLICE, "the bulk phase ended at the last slice that landed"
    dead = dead_letters(dsn, "tally")
    assert set(dead) == set(ids[120:130]), "i == 12 of every key: dead letters"
    assert all(attempts == 2 and "fails" in error for attempts, error in dead.values()), dead


def test_two_rebuild_processes_at_once_apply_each_event_once(dsn: str, live: Any) -> None:
    ids = publish(dsn, counted(20, 30))
    live(tally(), len(ids))
    live_model = model(dsn)
    results: list[Any] = []

    def run(worker: str) -> None:
        try:
            results.append(Rebuild(tally(), settings(dsn, worker), progress=None).run())
        except BaseException as exc:  # checked below
            results.append(exc)

    threads = [threading.Thread(target=run, args=(w,)) for w in ("rebuilder-a", "rebuilder-b")]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert len(results) == 2 and all(r is not None and not isinstance(r, BaseException) for r in results), results
    assert model(dsn) == live_model
    assert sorted(r[0] for r in log_rows(dsn)) == sorted(ids)


def test_events_committed_during_the_bulk_phase_are_applied_once_by_the_relay_phase(dsn: str, live: Any) -> None:
    first = publish(dsn, counted(10, 20))
    live_runner = live(tally(), len(first))
    entered, gate = threading.Event(), threading.Event()
    rebuild = Rebuild(tally(entered=entered, gate=gate), settings(dsn), progress=None)
    outcome: list[Any] = []
    thread = threading.Thread(target=lambda: outcome.append(rebuild.run()))
    thread.start()
    try:
        assert entered.wait(30), "the bulk phase never called the handler"
        later = publish(dsn, counted(10, 5, start=20))  # after the phase pinned its snapshot
    finally:
        gate.set()
        thread.join(120)
    assert outcome and outcome[0] is not None
    run_until(live_runner, lambda: len(log_rows(dsn)) >= len(first) + len(later))
    rows = log_rows(dsn)
    assert sorted(r[0] for r in rows) == sorted(first + later), "each event once"
    assert {r[3] for r in rows if r[0] in set(first)} == {0}
    assert all(r[3] > 0 for r in rows if r[0] in set(later)), "the later ones by the relay phase (or live)"
    assert model(dsn) == [(f"k{k}", 25, sum(range(25))) for k in sorted(range(10), key=lambda k: f"k{k}")]


def test_a_transaction_open_at_the_bulk_snapshot_that_commits_later_is_not_skipped(dsn: str, live: Any) -> None:
    first = publish(dsn, counted(5, 20))
    live(tally(), len(first))
    outbox = Outbox(default_topic="orders")
    entered, gate = threading.Event(), threading.Event()
    with psycopg.connect(dsn) as open_tx:  # open before the rebuild starts, commits during its bulk phase
        late = outbox.publish(open_tx, type="Counted", key="k0", payload={"i": 100}).id
        rebuild = Rebuild(tally(entered=entered, gate=gate), settings(dsn), progress=None)
        outcome: list[Any] = []
        thread = threading.Thread(target=lambda: outcome.append(rebuild.run()))
        thread.start()
        try:
            assert entered.wait(30)
            open_tx.commit()
        finally:
            gate.set()
    thread.join(120)
    assert outcome and outcome[0] is not None
    rows = log_rows(dsn)
    applied = [r for r in rows if r[0] == late]
    assert len(applied) == 1 and applied[0][3] > 0, "applied once, by the relay phase"
    assert sorted(r[0] for r in rows) == sorted([*first, late])


def test_the_bulk_phase_applies_upcasters(dsn: str, live: Any) -> None:
    upcasters = Upcasters()

    @upcasters.register("Counted", version=1)
    def n_to_i(payload: dict[str, Any]) -> dict[str, Any]:
        return {"i": payload["n"]}

    outbox = Outbox(default_topic="orders")
    with psycopg.connect(dsn) as conn:
        for i in range(60):
            outbox.publish(conn, type="Counted", key=f"k{i % 3}", payload={"n": i})  # version 1
            outbox.publish(conn, type="Counted", key=f"k{i % 3}", payload={"i": i}, version=2)
    live(tally(upcasters=upcasters), 120)
    live_model = model(dsn)
    result = Rebuild(tally(upcasters=upcasters), settings(dsn), progress=None).run()
    assert result is not None and model(dsn) == live_model
    assert {r[3] for r in log_rows(dsn)} == {0}


def test_a_stop_between_slices_resumes(dsn: str, live: Any) -> None:
    ids = publish(dsn, counted(10, 30))
    live(tally(), len(ids))
    live_model = model(dsn)
    entered = threading.Event()
    first = Rebuild(tally(entered=entered), settings(dsn), progress=None)
    slow = threading.Event()

    def stop_soon() -> None:
        entered.wait(30)
        time.sleep(0.05)
        first.stop()

    stopper = threading.Thread(target=stop_soon)
    stopper.start()
    original = first.projection.handler

    def handler(event: Any, tx: Any) -> None:
        slow.wait(0.001)
        original(event, tx)

    first.projection.handler = handler
    assert first.run() is None
    stopper.join()
    partial = fetch_all(dsn, "SELECT count(*) FROM outbox_rebuild_tally.tally_log")[0][0]
    assert 0 < partial < len(ids) and partial % SLICE == 0, partial
    result = Rebuild(tally(), settings(dsn), progress=None).run()
    assert result is not None and result.resumed and model(dsn) == live_model


def test_a_handler_over_its_time_limit_hands_over_to_the_relay_phase(dsn: str, live: Any) -> None:
    """The slice is abandoned (its session ended: nothing of it lands) and the relay phase charges the
    event as before: attempts, then a dead letter with the reason."""
    ids = publish(dsn, counted(5, 30))
    live(tally(), len(ids))
    hang = ids[5 * 15 + 2]  # k2, i == 15: in the second slice
    p = tally()
    original = p.handler

    def handler(event: ProjectionEvent[Any], tx: Any) -> None:
        if event.id == hang:
            time.sleep(2.5)  # over the limit; the abandoned thread ends by itself
        original(event, tx)

    p.handler = handler
    result = Rebuild(p, make_settings(dsn, "rebuilder", max_attempts=2, batch_size=SLICE,
                                      handler_timeout_seconds=1.0), progress=None).run()
    assert result is not None
    rows = log_rows(dsn)
    assert sum(1 for r in rows if r[3] == 0) == SLICE, "the first slice by the bulk phase, the rest not"
    dead = dead_letters(dsn, "tally")
    assert set(dead) == {hang} and "did not return within" in dead[hang][1], dead
    assert sorted(r[0] for r in rows) == sorted(set(ids) - {hang}), "every other event once"


def _leftovers(dsn: str, worker: str = "rebuilder") -> tuple[list[str], int]:
    """Read-ahead threads alive in this process, and the rebuild's sessions still open on the server."""
    threads = [t.name for t in threading.enumerate() if t.name.startswith("rebuild-read")]
    sessions = fetch_all(dsn, "SELECT count(*) FROM pg_stat_activity WHERE application_name = %s "
                              "AND pid <> pg_backend_pid()", (f"outbox-relay {worker}",))[0][0]
    return threads, sessions


@pytest.mark.parametrize("how", ["crash", "stop", "handler failure", "timeout", "done"])
def test_the_read_ahead_leaves_no_thread_or_session_behind(dsn: str, live: Any, how: str) -> None:
    """The reader (a thread and a connection of its own, one slice ahead) is closed however the bulk
    phase ends: a crash in a handler, a stop, a slice handed over to the relay phase, a handler over its
    time limit, or the end of the rebuild; a read in flight then is waited for, not left running."""
    ids = publish(dsn, counted(10, 30))
    live(tally(), len(ids))
    p = tally(crash_after=2 * SLICE + 5) if how == "crash" else tally(fail_i=12 if how == "handler failure" else None)
    rebuild = Rebuild(p, make_settings(dsn, "rebuilder", max_attempts=2, batch_size=SLICE,
                                       handler_timeout_seconds=1.0), progress=None)
    original = p.handler
    calls = [0]

    def handler(event: ProjectionEvent[Any], tx: Any) -> None:
        calls[0] += 1
        if calls[0] == SLICE + 3:
            if how == "stop":
                rebuild.stop()
            elif how == "timeout":
                time.sleep(2.5)
        original(event, tx)

    p.handler = handler
    if how == "crash":
        with pytest.raises(Crash):
            rebuild.run()
    else:
        rebuild.run()
    deadline = time.monotonic() + 10  # a terminated session leaves pg_stat_activity shortly after
    while _leftovers(dsn) != ([], 0) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _leftovers(dsn) == ([], 0)


def test_a_transaction_open_through_a_switch_over_without_a_relay_phase_is_applied_once_after_it(
        dsn: str, live: Any, caplog: pytest.LogCaptureFixture) -> None:
    """G12/G3 across the switch-over that skips the relay phase: a transaction open at the bulk phase's
    snapshot and still open when the rebuild counts what is left (it counts nothing: not committed) and
    switches over commits afterwards; live processing applies it once, from the adopted cursors."""
    first = publish(dsn, counted(5, 20))
    live_runner = live(tally(), len(first))
    caplog.set_level(logging.INFO)
    outbox = Outbox(default_topic="orders")
    with psycopg.connect(dsn) as open_tx:
        late = outbox.publish(open_tx, type="Counted", key="k0", payload={"i": 100}).id
        result = Rebuild(tally(), settings(dsn), progress=None).run()
        assert result is not None and result.events == len(first)
        assert not [r for r in caplog.records if r.name.startswith("outbox_relay.worker")], "no relay phase"
        assert fetch_all(dsn, "SELECT name FROM outbox.sinks ORDER BY name") == [("tally",)], "switched over"
        open_tx.commit()
    run_until(live_runner, lambda: late in {r[0] for r in log_rows(dsn)})
    live_runner.run_once()
    rows = log_rows(dsn)
    assert sorted(r[0] for r in rows) == sorted([*first, late]), "each event once"
    assert model(dsn) == sorted([(f"k{k}", 20 + (k == 0), sum(range(20)) + (100 if k == 0 else 0))
                                 for k in range(5)])


def test_a_slice_read_over_the_time_limit_hands_over_to_the_relay_phase(
        dsn: str, live: Any, caplog: pytest.LogCaptureFixture) -> None:
    """A slice is read ahead on a connection of its own; a read that does not return within the handler
    time limit (here: blocked behind a lock) ends the bulk phase as a handler over its limit does, its
    query cancelled, and the relay phase goes on from the last slice that landed."""
    ids = publish(dsn, counted(10, 30))
    live(tally(), len(ids))
    live_model = model(dsn)
    caplog.set_level(logging.INFO)
    p = tally()
    original = p.handler
    locked = threading.Event()
    release = threading.Event()

    def hold_lock() -> None:  # blocks every later read of outbox.events until the hand-over is logged
        with psycopg.connect(dsn) as conn:
            conn.execute("LOCK TABLE outbox.events IN ACCESS EXCLUSIVE MODE")
            locked.set()
            release.wait(30)

    locker = threading.Thread(target=hold_lock)
    calls = [0]

    def handler(event: ProjectionEvent[Any], tx: Any) -> None:
        calls[0] += 1
        if calls[0] == 1:  # the first slice: the read of the second one is in flight or done, the third blocks
            locker.start()
            assert locked.wait(10)
        original(event, tx)

    def handed_over() -> None:
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and not any("relay phase takes over" in r.getMessage()
                                                      for r in caplog.records):
            time.sleep(0.05)
        release.set()

    watcher = threading.Thread(target=handed_over)
    watcher.start()
    p.handler = handler
    result = Rebuild(p, make_settings(dsn, "rebuilder", max_attempts=2, batch_size=SLICE,
                                      handler_timeout_seconds=1.0), progress=None).run()
    watcher.join()
    locker.join()
    assert result is not None and model(dsn) == live_model
    assert any("did not return within" in r.getMessage() for r in caplog.records), "the read's time limit"
    rows = log_rows(dsn)
    assert 0 < sum(1 for r in rows if r[3] == 0) < len(ids), "some slices by the bulk phase, the rest by the relay's"
    assert sorted(r[0] for r in rows) == sorted(ids), "every event once"
    assert _leftovers(dsn) == ([], 0)
