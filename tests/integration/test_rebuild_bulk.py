"""The bulk phase of a rebuild (projections/bulk.py) against a real PostgreSQL: the same model as live
processing (G12) in slices across xid partitions, per-key order, resume after a crash mid-slice with
no double effect, a failure handed over to the relay phase, two rebuild processes, events committed
during the phase, a transaction open at its snapshot, upcasters; the phase's lanes (bulk.LANES ranges of
buckets): run by two processes at once, a lane of a dead process resumed by another, a failure handed
over for its lane only, a cancel while lanes run.

The read model's effect is not idempotent (counters), and every handler call records the fence of
its token: the bulk phase applies under fence 0, the relay phase under the fences its leases get
(>= 2), so a test can tell which phase applied an event.

``pg15``: what PostgreSQL 15 runs too (scripts/test.sh): the slices over xid partitions and snapshots, the
resumes, the lanes' claims, the read cancelled behind a lock and the cancel's DDL; not the hand-overs of
a handler's failure or time limit, the upcasters or the read-ahead's threads, Python over the same SQL.
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
from outbox_relay.admin import discard_dead_letters
from outbox_relay.relay import SinkRunner
from projections import ProjectionEvent, Upcasters, projection
from projections.bulk import LANES, lane_buckets
from projections.rebuild import Rebuild, RebuildError
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
          gate: threading.Event | None = None, fail_key: str | None = None) -> Any:
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
        if fail_i is not None and i == fail_i and fail_key in (None, event.key):
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


def lanes(dsn: str) -> list[list[uuid.UUID]]:
    """The stored events of each lane of the bulk phase, in position order (a process alone runs the lanes
    in this order, each in slices of SLICE events)."""
    out: list[list[uuid.UUID]] = [[] for _ in range(LANES)]
    for bucket, id_ in fetch_all(dsn, "SELECT bucket, id FROM outbox.events ORDER BY xid, seq"):
        out[next(lane for lane in range(LANES) if lane_buckets(lane)[0] <= bucket < lane_buckets(lane)[1])].append(id_)
    return out


def slices(n: int) -> list[int]:
    """The sizes of the slices of a lane of n events (the last one is shorter, maybe empty)."""
    return [SLICE] * (n // SLICE) + [n % SLICE]


def landed_before_call(dsn: str, calls: int) -> int:
    """Events the bulk phase of one process commits before its handler call ``calls + 1`` (whose slice
    rolls back)."""
    landed = 0
    for lane in lanes(dsn):
        for size in slices(len(lane)):
            if landed + size > calls:
                return landed
            landed += size
    return landed


def landed_with_failures(dsn: str, failing: set[uuid.UUID]) -> int:
    """Events the bulk phase commits when ``failing`` events fail their slices: per lane, the slices before
    its first failing one (the lane hands over there), or all of it."""
    landed = 0
    for lane in lanes(dsn):
        first = next((n for n, id_ in enumerate(lane) if id_ in failing), None)
        landed += len(lane) if first is None else first // SLICE * SLICE
    return landed


def settings(dsn: str, worker: str = "rebuilder") -> Any:
    return make_settings(dsn, worker, max_attempts=2, batch_size=SLICE)


def outcome_of(p: Any, dsn: str, worker: str) -> Any:
    """``Rebuild(p).run()`` as ``worker``, for a test that runs rebuilds on threads: its result, or the
    exception it raised (the test checks which)."""
    try:
        return Rebuild(p, settings(dsn, worker), progress=None).run()
    except BaseException as exc:  # handed to the test
        return exc


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


@pytest.mark.pg15
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


@pytest.mark.pg15
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


@pytest.mark.pg15
def test_a_crash_mid_slice_resumes_at_the_last_slice_with_no_double_effect(dsn: str, live: Any) -> None:
    ids = publish(dsn, counted(10, 40))
    live(tally(), len(ids))
    live_model = model(dsn)

    with pytest.raises(Crash):
        Rebuild(tally(crash_after=3 * SLICE + 17), settings(dsn), progress=None).run()
    landed = fetch_all(dsn, "SELECT count(*) FROM outbox_rebuild_tally.tally_log")[0][0]
    assert landed == landed_before_call(dsn, 3 * SLICE + 17), "the slices before the crash landed, its slice did not"

    result = Rebuild(tally(), settings(dsn), progress=None).run()
    assert result is not None and result.resumed
    assert model(dsn) == live_model, "no event counted twice, none missed"
    rows = log_rows(dsn)
    assert sorted(r[0] for r in rows) == sorted(ids) and {r[3] for r in rows} == {0}


def discard_live_dead_letters(dsn: str) -> None:
    """`dead-letters discard`: the rebuild meets those events as failures of its own, not live decisions."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        discard_dead_letters(conn, "tally", all=True)


@pytest.mark.pg15
def test_a_live_dead_letter_is_followed_by_the_bulk_phase_without_a_hand_over(dsn: str, live: Any) -> None:
    """Events live processing dead-lettered are dead for the replay too (G12): the bulk phase records them
    as such in its slice, never calls the handler with them, and so has no failure to hand over."""
    ids = publish(dsn, counted(10, 30))
    live(tally(fail_i=12), len(ids) - 10)
    live_model, live_dead = model(dsn), dead_letters(dsn, "tally")

    result = Rebuild(tally(fail_i=12), settings(dsn), progress=None).run()

    assert result is not None and result.clean
    assert model(dsn) == live_model
    assert {r[3] for r in log_rows(dsn)} == {0}, "the bulk phase applied everything"
    assert dead_letters(dsn, "tally") == live_dead, "the live dead letters stay as they were"


def test_a_handler_failure_hands_over_to_the_relay_phase(dsn: str, live: Any, caplog: pytest.LogCaptureFixture) -> None:
    """The failing events are retried and dead-lettered by the relay phase exactly as before; in each lane
    everything before the slice of its first failing event was applied by the bulk phase, the rest by the
    relay phase. The hand-over logs the handler's error as raised (it said "Redo: 'customer'" for a
    KeyError: the walk's exception that carried it)."""
    ids = publish(dsn, counted(10, 30))
    poison = ids[10 * 12 + 3]  # key k3, i == 12: in the third slice
    live(tally(fail_i=12), len(ids) - 10)
    live_model = model(dsn)
    caplog.set_level(logging.INFO, logger="outbox_relay.rebuild")
    discard_live_dead_letters(dsn)  # else the replay follows them without calling the handler (G12)

    result = Rebuild(tally(fail_i=12), settings(dsn), progress=None).run()

    handed = [r.getMessage() for r in caplog.records if "relay phase takes over" in r.getMessage()]
    assert handed and all("(ValueError: event 12 fails)" in m for m in handed), handed

    assert result is not None
    assert model(dsn) == live_model
    rows = log_rows(dsn)
    assert poison not in {r[0] for r in rows}
    fences = {r[3] for r in rows}
    assert any(f > 0 for f in fences), "the relay phase"
    assert sum(1 for r in rows if r[3] == 0) == landed_with_failures(dsn, set(ids[120:130])), (
        "each lane's bulk phase ended at its last slice that landed")
    dead = dead_letters(dsn, "tally")
    assert set(dead) == set(ids[120:130]), "i == 12 of every key: dead letters"
    assert all(attempts == 2 and "fails" in error for attempts, error in dead.values()), dead


@pytest.mark.pg15
def test_two_rebuild_processes_at_once_apply_each_event_once(dsn: str, live: Any) -> None:
    ids = publish(dsn, counted(20, 30))
    live(tally(), len(ids))
    live_model = model(dsn)
    results: list[Any] = []

    def run(worker: str) -> None:
        results.append(outcome_of(tally(), dsn, worker))

    threads = [threading.Thread(target=run, args=(w,)) for w in ("rebuilder-a", "rebuilder-b")]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert len(results) == 2 and all(r is not None and not isinstance(r, BaseException) for r in results), results
    assert model(dsn) == live_model
    assert sorted(r[0] for r in log_rows(dsn)) == sorted(ids)


@pytest.mark.pg15
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
    # The first lane with events pinned its snapshot before the later ones; the others may have after.
    entered_lane = next(lane for lane in lanes(dsn) if set(lane) & set(first))
    assert all(r[3] > 0 for r in rows if r[0] in set(later) & set(entered_lane)), (
        "the later ones of the lane that had begun by the relay phase (or live)")
    assert model(dsn) == [(f"k{k}", 25, sum(range(25))) for k in sorted(range(10), key=lambda k: f"k{k}")]


@pytest.mark.pg15
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


@pytest.mark.pg15
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
    assert 0 < partial < len(ids) and partial == landed_before_call(dsn, partial), "whole slices: " + str(partial)
    result = Rebuild(tally(), settings(dsn), progress=None).run()
    assert result is not None and result.resumed and model(dsn) == live_model


def test_a_handler_over_its_time_limit_hands_over_to_the_relay_phase(dsn: str, live: Any) -> None:
    """The slice is abandoned (its session ended: nothing of it lands) and the relay phase charges the
    event as before: attempts, then a dead letter with the reason."""
    ids = publish(dsn, counted(5, 30))
    live_runner = live(tally(), len(ids))
    hang = ids[5 * 15 + 2]  # k2, i == 15
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
    assert sum(1 for r in rows if r[3] == 0) == landed_with_failures(dsn, {hang}), (
        "its lane's first slice by the bulk phase, the rest of that lane not; the other lanes by the bulk phase")
    # The relay phase may catch up (and switch over) while k2 waits for its retry: the live projection
    # then carries the retry on (adopt_parked), without the slow handler.
    run_until(live_runner, lambda: len(log_rows(dsn)) + len(dead_letters(dsn, "tally")) >= len(ids))
    dead = dead_letters(dsn, "tally")
    assert set(dead) <= {hang} and all("did not return within" in d[1] for d in dead.values()), dead
    rows = log_rows(dsn)
    assert sorted(r[0] for r in rows) == sorted(set(ids) - set(dead)), "every other event once"


def _leftovers(dsn: str, worker: str = "rebuilder") -> tuple[list[str], int]:
    """Read-ahead threads alive in this process, and the rebuild's sessions still open on the server."""
    threads = [t.name for t in threading.enumerate() if t.name.startswith("rebuild-read")]
    sessions = fetch_all(dsn, "SELECT count(*) FROM pg_stat_activity WHERE application_name = %s "
                              "AND pid <> pg_backend_pid()", (f"outbox-relay {worker}",))[0][0]
    return threads, sessions


@pytest.mark.parametrize("how", [pytest.param("crash", marks=pytest.mark.pg15), "stop", "handler failure", "timeout",
                                 "done"])
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


@pytest.mark.pg15
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


@pytest.mark.pg15
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


@pytest.mark.pg15
def test_two_rebuild_processes_run_lanes_at_once(dsn: str, live: Any) -> None:
    """Each process's handler waits at its first call until the other's has been called too: the two
    run lanes at the same time (with one bulk phase for both, the first one would wait alone)."""
    ids = publish(dsn, counted(20, 30))
    live(tally(), len(ids))
    live_model = model(dsn)
    both = threading.Barrier(2, timeout=30)
    results: dict[str, Any] = {}
    applied: dict[str, int] = {}

    def run(worker: str) -> None:
        p = tally()
        original = p.handler
        applied[worker] = 0

        def handler(event: ProjectionEvent[Any], tx: Any) -> None:
            if applied[worker] == 0:
                both.wait()
            applied[worker] += 1
            original(event, tx)

        p.handler = handler
        results[worker] = outcome_of(p, dsn, worker)

    threads = [threading.Thread(target=run, args=(w,)) for w in ("rebuilder-a", "rebuilder-b")]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert len(results) == 2 and all(r is not None and not isinstance(r, BaseException)
                                     for r in results.values()), results
    assert not both.broken, "the two processes never ran lanes at the same time"
    assert model(dsn) == live_model, "G12"
    rows = log_rows(dsn)
    assert sorted(r[0] for r in rows) == sorted(ids), "each event once"
    assert {r[3] for r in rows} == {0}, "all of it by the bulk phase"
    assert all(n > 0 for n in applied.values()), applied


@pytest.mark.pg15
def test_a_lane_of_a_process_that_dies_is_resumed_by_another(dsn: str, live: Any) -> None:
    """Process A dies (its session and lane lock go) in its lane's second slice while process B runs
    other lanes; B, waiting for that lane at the end, resumes it from A's last slice: each event once,
    all of it in the bulk phase."""
    ids = publish(dsn, counted(20, 30))
    live(tally(), len(ids))
    live_model = model(dsn)
    b_running = threading.Event()
    a_calls = [0]
    a = tally()
    a_original = a.handler

    def a_handler(event: ProjectionEvent[Any], tx: Any) -> None:
        a_calls[0] += 1
        if a_calls[0] == SLICE + 1:  # the first event of the lane's second slice: die once B runs too
            assert b_running.wait(30), "B never ran a lane while A held one"
            raise Crash()
        a_original(event, tx)

    a.handler = a_handler
    b = tally()
    b_original = b.handler

    def b_handler(event: ProjectionEvent[Any], tx: Any) -> None:
        b_running.set()
        b_original(event, tx)

    b.handler = b_handler
    a_lane = next(lane for lane in lanes(dsn) if lane)
    assert len(a_lane) > SLICE + 1, "the first lane has a second slice"
    crashed: list[BaseException] = []

    def run_a() -> None:
        try:
            Rebuild(a, settings(dsn, "rebuilder-a"), progress=None).run()
        except BaseException as exc:  # checked below
            crashed.append(exc)

    thread = threading.Thread(target=run_a)
    thread.start()
    deadline = time.monotonic() + 30
    while a_calls[0] == 0 and time.monotonic() < deadline:  # A holds its lane before B starts
        time.sleep(0.01)
    result = Rebuild(b, settings(dsn, "rebuilder-b"), progress=None).run()
    thread.join(60)
    assert crashed and isinstance(crashed[0], Crash), crashed
    assert result is not None
    assert model(dsn) == live_model, "no event counted twice, none missed"
    rows = log_rows(dsn)
    assert sorted(r[0] for r in rows) == sorted(ids), "each event once"
    assert {r[3] for r in rows} == {0}, "all of it by the bulk phase: B resumed A's lane"


def test_a_handler_failure_hands_over_only_its_lane(dsn: str, live: Any) -> None:
    """One event fails: its lane hands over to the relay phase from the last slice that landed; the other
    lanes finish in the bulk phase."""
    ids = publish(dsn, counted(10, 30))
    poison = ids[10 * 12 + 3]  # key k3, i == 12
    live(tally(fail_i=12, fail_key="k3"), len(ids) - 1)
    live_model = model(dsn)
    discard_live_dead_letters(dsn)

    result = Rebuild(tally(fail_i=12, fail_key="k3"), settings(dsn), progress=None).run()

    assert result is not None
    assert model(dsn) == live_model
    rows = log_rows(dsn)
    assert sorted(r[0] for r in rows) == sorted(set(ids) - {poison}), "every other event once"
    poisoned = next(set(lane) for lane in lanes(dsn) if poison in lane)
    by_relay = {r[0] for r in rows if r[3] > 0}
    assert by_relay and by_relay <= poisoned, "the relay phase applied only events of the failing lane"
    assert sum(1 for r in rows if r[3] == 0) == landed_with_failures(dsn, {poison})
    assert set(dead_letters(dsn, "tally")) == {poison}


@pytest.mark.pg15
def test_a_cancel_while_two_processes_run_lanes_changes_nothing_live(dsn: str, live: Any) -> None:
    ids = publish(dsn, counted(20, 30))
    live(tally(), len(ids))
    live_model = model(dsn)
    live_log = log_rows(dsn)
    both = threading.Barrier(3, timeout=30)  # both processes in a slice, and the test
    gate = threading.Event()
    results: dict[str, Any] = {}

    def run(worker: str) -> None:
        p = tally()
        original = p.handler
        calls = [0]

        def handler(event: ProjectionEvent[Any], tx: Any) -> None:
            calls[0] += 1
            if calls[0] == 1:
                both.wait()
                gate.wait(30)
            original(event, tx)

        p.handler = handler
        results[worker] = outcome_of(p, dsn, worker)

    threads = [threading.Thread(target=run, args=(w,)) for w in ("rebuilder-a", "rebuilder-b")]
    for t in threads:
        t.start()
    both.wait()  # both hold a lane, each in its first slice
    canceller = threading.Thread(target=lambda: results.setdefault("cancel", Rebuild(tally(), settings(dsn)).cancel()))
    canceller.start()
    # The cancel either waits for the slices in flight (their writes to the shadow tables) or, when they
    # hold no lock on them yet, drops the schema at once: the slices are released then, not after 30 s.
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and canceller.is_alive() and not fetch_all(
            dsn, "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' "
                 "AND query LIKE 'DROP SCHEMA%%'")[0][0]:
        time.sleep(0.02)
    gate.set()
    canceller.join(60)
    for t in threads:
        t.join(60)
    assert results["cancel"] is True
    for worker in ("rebuilder-a", "rebuilder-b"):
        assert isinstance(results[worker], RebuildError) and "cancelled" in str(results[worker]), results
    assert model(dsn) == live_model and log_rows(dsn) == live_log, "the live model is untouched"
    assert fetch_all(dsn, "SELECT count(*) FROM outbox.rebuilds")[0][0] == 0
    assert fetch_all(dsn, "SELECT name FROM outbox.sinks ORDER BY name") == [("tally",)]
