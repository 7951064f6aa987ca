"""`outbox-relay keys show | retry | skip | pause | resume` against a real database and real relay runners.

The relay honours what the commands change: a paused key's events are parked, in order, and none is
retried until it is resumed (G3: nothing lost, G6: nothing reordered); a skipped head is dead-lettered
and its key moves on, even when its relay was retrying it at that moment; retry and resume reach an
idle relay at once over NOTIFY.
"""

from __future__ import annotations

import json
import logging
import threading
import time
import uuid
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest
from psycopg_pool import ConnectionPool

from outbox_relay import cli, store
from outbox_relay.sink import Failure
from outbox_relay.store import StoredEvent
from outbox_relay.worker import Worker
from tests.integration.relay_helpers import (  # noqa: F401  (pool_fixture provides `pool`)
    SINK,
    RecordingSink,
    bucket_of,
    dead_letters,
    dedup_per_key,
    fetch_all,
    keys_in_bucket,
    make_settings,
    parked_ids,
    pool_fixture,
    publish,
    register,
    run_until,
    runner_for,
    settled,
)
from tests.servers import wait_until


@pytest.fixture(autouse=True)
def _restore_logging() -> Iterator[None]:
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    yield
    root.handlers[:] = handlers
    root.setLevel(level)


def keys(capsys: pytest.CaptureFixture[str], dsn: str, action: str, key: str, *argv: str) -> tuple[int, str, str]:
    code = cli.main(["keys", action, "--dsn", dsn, key, *argv])
    out, err = capsys.readouterr()
    return code, out, err


def show(capsys: pytest.CaptureFixture[str], dsn: str, key: str, sink: str = SINK) -> dict[str, Any]:
    """``keys show --json`` for one sink."""
    code, out, err = keys(capsys, dsn, "show", key, "--sink", sink, "--json")
    assert code == cli.EXIT_OK, err
    report = json.loads(out)
    [state] = report["sinks"]
    return {"bucket": report["bucket"], **state}


def fail_ids(ids: set[uuid.UUID], error: str = "broker said no") -> Any:
    """A RecordingSink ``fail``: these events fail every time they are attempted."""
    def fail(e: StoredEvent, _n: int) -> Failure | None:
        return Failure(error) if e.id in ids else None
    return fail


def attempts_of(sink: RecordingSink, key: str) -> list[uuid.UUID]:
    with sink.lock:
        return [a.event_id for a in sink.attempts if a.key == key]


def parked_rows(dsn: str, key: str) -> list[tuple[uuid.UUID, int, str | None]]:
    return [(r[0], r[1], r[2]) for r in fetch_all(
        dsn, "SELECT event_id, attempts, last_error FROM outbox.parked WHERE sink = %s AND partition_key = %s "
             "ORDER BY xid, seq", (SINK, key))]


# -- show -------------------------------------------------------------------------------------


def test_show_says_why_a_key_waits(dsn: str, pool: ConnectionPool[Any], capsys: pytest.CaptureFixture[str]) -> None:
    ids = publish(dsn, [("order:1", "Placed", {}), ("order:1", "Paid", {}), ("order:1", "Shipped", {}),
                        ("order:2", "Placed", {})])
    sink = RecordingSink(fail=fail_ids({ids[0]}, "KafkaError{code=MSG_TIMED_OUT}"))
    # A long backoff: the head waits for its retry while we look.
    runner = runner_for(sink, pool, make_settings(dsn, "w", backoff_base_seconds=60, backoff_max_seconds=60))
    run_until(runner, lambda: sink.delivered_ids() == {ids[3]} and len(parked_ids(dsn)) == 3)
    [late] = publish(dsn, [("order:1", "Refunded", {})])  # committed, not read yet

    code, out, err = keys(capsys, dsn, "show", "order:1", "--sink", SINK)
    assert code == cli.EXIT_OK, err
    lines = out.splitlines()
    assert lines[0] == f"key 'order:1' (bucket {bucket_of(dsn, 'order:1')})"
    assert lines[1].startswith(f"  {SINK}: waiting for a retry in "), out
    assert " s (attempt 1 of 10 failed: KafkaError{code=MSG_TIMED_OUT}); 2 event(s) queued behind it" in lines[1], out
    assert f"parked head: event {ids[0]} (Placed), 1 failed attempt(s)" in out
    assert "held by w (fence 1" in out and "not read by the sink yet: 1 event(s)" in out, out

    state = show(capsys, dsn, "order:1")
    assert state["state"] == "retrying" and state["owner"] == "w" and state["bucket"] == bucket_of(dsn, "order:1")
    assert state["head"]["event_id"] == str(ids[0]) and state["head"]["attempts"] == 1
    assert 25 < state["head"]["retry_in_seconds"] <= 60  # 30-60 s: the backoff with its jitter
    assert state["head"]["last_error"] == "KafkaError{code=MSG_TIMED_OUT}"
    assert (state["parked"], state["queued_behind"], state["unread"], state["undelivered"]) == (3, 2, 1, 4)
    assert state["paused"] is None and state["dead_letters"]["count"] == 0
    assert show(capsys, dsn, "order:2")["summary"] == "flowing (nothing waiting)"
    assert late not in sink.delivered_ids()


def test_show_states_and_errors(dsn: str, pool: ConnectionPool[Any], capsys: pytest.CaptureFixture[str]) -> None:
    ids = publish(dsn, [("k", "t", {}), ("k", "t", {})])
    sink = RecordingSink(fail=fail_ids({ids[0]}, "too large"))
    runner = runner_for(sink, pool, make_settings(dsn, "w", max_attempts=1))
    run_until(runner, lambda: sink.delivered_ids() == {ids[1]})
    state = show(capsys, dsn, "k")
    assert state["state"] == "dead-lettered"
    assert state["summary"].startswith("dead-lettered head moved on (1 dead letter(s), the last at "), state
    assert [d["event_id"] for d in state["dead_letters"]["recent"]] == [str(ids[0])]
    assert state["dead_letters"]["recent"][0]["last_error"] == "too large"
    # A new event on its way while no relay holds the bucket: the line says both.
    [waiting] = publish(dsn, [("k", "t", {})])
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("UPDATE outbox.cursors SET owner = NULL, lease_expires_at = NULL")
    state = show(capsys, dsn, "k")
    assert state["summary"].endswith(f": too large); 1 event(s) on their way; no relay holds bucket "
                                     f"{state['bucket']} now"), state["summary"]
    assert state["owner"] is None and state["unread"] == 1 and waiting not in sink.delivered_ids()

    # Every sink when none is named; a key nothing was published under is unknown (a typo must not look fine).
    code, out, _ = keys(capsys, dsn, "show", "never-published")
    assert code == cli.EXIT_OK and f"  {SINK}: unknown: no event of this key is stored" in out, out
    code, _, err = keys(capsys, dsn, "show", "k", "--sink", "nope")
    assert code == cli.EXIT_ERROR and "no sink named 'nope'" in err, err
    code, _, err = keys(capsys, dsn, "show", "k", "--max-attempts", "0")
    assert code == cli.EXIT_ERROR and "--max-attempts: must be 1-1000, not 0" in err, err
    code, _, err = keys(capsys, dsn, "show", "")
    assert code == cli.EXIT_ERROR and "a partition key is not empty" in err, err
    code, _, err = keys(capsys, dsn, "show", "x" * 1025)
    assert code == cli.EXIT_ERROR and "at most 1024 bytes, not 1025" in err, err
    code, _, err = keys(capsys, dsn, "pause", "k")
    assert code == cli.EXIT_ERROR and "the following arguments are required: --sink" in err, err


# -- retry ------------------------------------------------------------------------------------


def test_retry_makes_the_head_due_and_wakes_its_idle_relay(dsn: str, capsys: pytest.CaptureFixture[str]) -> None:
    """The head waits a minute for its retry; `keys retry` has its relay (idle, polling every 30 s) deliver it
    at once, then the events behind it, in order."""
    broken = threading.Event()
    broken.set()

    def fail(e: StoredEvent, _n: int) -> Failure | None:
        return Failure("broker said no") if e.type == "a" and broken.is_set() else None

    sink = RecordingSink("relay-a", fail=fail)
    worker = Worker(make_settings(dsn, "relay-a", listen=True, poll_seconds=30.0, listen_poll_seconds=30.0,
                                  backoff_base_seconds=60, backoff_max_seconds=60), sinks=[sink])
    assert worker.start()
    waiter = threading.Thread(target=worker.wait)
    waiter.start()
    try:
        # Settled first: a bucket acquired later would have its runner look at the park anyway.
        wait_until(lambda: settled(dsn, ["relay-a"]), 15, message="the relay to hold every bucket")
        ids = publish(dsn, [("order:1", "a", {}), ("order:1", "b", {}), ("order:1", "c", {})])
        wait_until(lambda: len(parked_ids(dsn)) == 3, 15, message="the key to park behind its failed head")
        broken.clear()  # the cause is fixed
        code, out, err = keys(capsys, dsn, "retry", "order:1", "--sink", SINK)
        assert code == cli.EXIT_OK, err
        assert f"event {ids[0]} (a), the head of key 'order:1', is due now" in out, out
        assert "then the 2 event(s) behind it" in out
        wait_until(lambda: sink.delivered_ids() == set(ids), 10, message="the retry, at once rather than in 60 s")
    finally:
        worker.drain()
        waiter.join(20)
    assert dedup_per_key(sink.attempts)["order:1"] == ids
    assert parked_ids(dsn) == set()


def test_dead_letters_retry_wakes_the_idle_relay_at_once(dsn: str, capsys: pytest.CaptureFixture[str]) -> None:
    """A dead letter sent back by `dead-letters retry` is delivered at once by its relay (idle, with nothing
    parked, so looking at its park only once a minute), because the command tells it so (notify_parked)."""
    broken = threading.Event()
    broken.set()
    sink = RecordingSink("relay-a", fail=lambda e, _n: Failure("no", retriable=False) if broken.is_set() else None)
    worker = Worker(make_settings(dsn, "relay-a", listen=True, poll_seconds=30.0, listen_poll_seconds=30.0),
                    sinks=[sink])
    assert worker.start()
    waiter = threading.Thread(target=worker.wait)
    waiter.start()
    try:
        wait_until(lambda: settled(dsn, ["relay-a"]), 15, message="the relay to hold every bucket")
        ids = publish(dsn, [("order:9", "a", {})])
        wait_until(lambda: fetch_all(dsn, "SELECT count(*) FROM outbox.dead_letters") == [(1,)], 15,
                   message="the event to be dead-lettered")
        broken.clear()
        time.sleep(0.5)  # the runner has looked at its (empty) park since, and idles
        code = cli.main(["dead-letters", "retry", "--dsn", dsn, "--sink", SINK, "--key", "order:9"])
        assert code == cli.EXIT_OK, capsys.readouterr().err
        wait_until(lambda: sink.delivered_ids() == set(ids), 10, message="the retried dead letter, at once")
    finally:
        worker.drain()
        waiter.join(20)


def test_retry_refuses_a_key_with_nothing_parked_or_paused(dsn: str, pool: ConnectionPool[Any],
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    register(dsn)
    code, _, err = keys(capsys, dsn, "retry", "k", "--sink", SINK)
    assert code == cli.EXIT_ERROR
    assert f"nothing to retry: no event of key 'k' is parked for sink '{SINK}'" in err, err
    assert f"outbox-relay keys show k --sink {SINK}" in err
    code, _, err = keys(capsys, dsn, "retry", "k", "--sink", "nope")
    assert code == cli.EXIT_ERROR and "no sink named 'nope'" in err, err

    ids = publish(dsn, [("k", "t", {})])
    sink = RecordingSink(fail=fail_ids(set(ids)))
    runner = runner_for(sink, pool, make_settings(dsn, "w", backoff_base_seconds=60, backoff_max_seconds=60))
    run_until(runner, lambda: parked_ids(dsn) == set(ids))
    assert keys(capsys, dsn, "pause", "k", "--sink", SINK)[0] == cli.EXIT_OK
    before = fetch_all(dsn, "SELECT available_at FROM outbox.parked")
    code, _, err = keys(capsys, dsn, "retry", "k", "--sink", SINK)
    assert code == cli.EXIT_ERROR and "key 'k' is paused for sink" in err and "keys resume k" in err, err
    assert fetch_all(dsn, "SELECT available_at FROM outbox.parked") == before


# -- skip -------------------------------------------------------------------------------------


def test_skip_dead_letters_the_head_and_the_key_moves_on(dsn: str, pool: ConnectionPool[Any],
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    ids = publish(dsn, [("k", "a", {}), ("k", "b", {}), ("k", "c", {})])
    sink = RecordingSink(fail=fail_ids({ids[0]}, "poison"))
    runner = runner_for(sink, pool, make_settings(dsn, "w", backoff_base_seconds=60, backoff_max_seconds=60))
    run_until(runner, lambda: len(parked_ids(dsn)) == 3)

    code, _, err = keys(capsys, dsn, "skip", "k", "--sink", SINK, "--event", str(ids[1]))
    assert code == cli.EXIT_ERROR
    assert f"event {ids[1]} is not the head of key 'k' for sink '{SINK}' (the head is {ids[0]})" in err, err
    assert len(parked_ids(dsn)) == 3 and dead_letters(dsn) == {}

    code, out, err = keys(capsys, dsn, "skip", "k", "--sink", SINK, "--event", str(ids[0]), "--json")
    assert code == cli.EXIT_OK, err
    result = json.loads(out)
    assert (result["event_id"], result["now_due"], result["attempts"]) == (str(ids[0]), 2, 1)
    assert dead_letters(dsn) == {ids[0]: (1, cli.SKIPPED_ERROR)}
    state = show(capsys, dsn, "k")
    assert state["state"] == "due" and state["head"]["event_id"] == str(ids[1])
    assert state["summary"] == "retry due now (not attempted yet); 1 event(s) queued behind it", state["summary"]
    # The key moves on at once: the events behind the head were due already, the runner has no reason to wait
    # (its first batch there may be fenced out: skip fences the bucket, and the runner acquires it again).
    run_until(runner, lambda: sink.delivered_ids() == {ids[1], ids[2]} and not parked_ids(dsn))
    assert dedup_per_key(sink.attempts)["k"] == [ids[1], ids[2]]
    assert parked_ids(dsn) == set()
    assert show(capsys, dsn, "k")["state"] == "dead-lettered"

    code, _, err = keys(capsys, dsn, "skip", "k", "--sink", SINK)
    assert code == cli.EXIT_ERROR and "nothing to skip: no event of key 'k' is parked" in err, err


def test_a_head_skipped_while_its_retry_is_in_flight_stays_skipped(dsn: str, pool: ConnectionPool[Any],
                                                                   capsys: pytest.CaptureFixture[str]) -> None:
    """The relay is delivering the head again when the operator skips it; the attempt fails. The relay's
    checkpoint must not put the head back into the park (the key would be stuck behind it again, and the
    event would be parked and dead-lettered at once)."""
    ids = publish(dsn, [("k", "a", {}), ("k", "b", {}), ("k", "c", {})])
    gate = threading.Event()
    gate.set()
    sink = RecordingSink(fail=fail_ids({ids[0]}, "poison"), gate=gate)
    runner = runner_for(sink, pool, make_settings(dsn, "w", backoff_base_seconds=0.01, backoff_max_seconds=0.01))
    run_until(runner, lambda: len(parked_ids(dsn)) == 3)

    gate.clear()
    sink.entered.clear()
    in_flight = threading.Thread(target=lambda: run_until(runner, lambda: sink.entered.is_set(), timeout=10))
    in_flight.start()
    try:
        assert sink.entered.wait(10), "the retry did not start"
        with sink.lock:
            assert sink.batches[-1].events[0] == ids[0], "the batch in flight is the parked chain"
        code, _, err = keys(capsys, dsn, "skip", "k", "--sink", SINK)
        assert code == cli.EXIT_OK, err
    finally:
        gate.set()  # the head fails again, its checkpoint runs
        in_flight.join(20)
    assert [a.error for a in sink.attempts_of(ids[0])] == ["poison", "poison"]
    assert ids[0] not in parked_ids(dsn), "the skipped head was parked again by the retry that was in flight"
    assert dead_letters(dsn) == {ids[0]: (1, cli.SKIPPED_ERROR)}
    run_until(runner, lambda: sink.delivered_ids() == {ids[1], ids[2]})
    assert dedup_per_key(sink.attempts)["k"] == [ids[1], ids[2]]


# -- pause and resume -------------------------------------------------------------------------


def test_a_paused_key_is_held_in_order_and_resumed_without_loss(dsn: str, pool: ConnectionPool[Any],
                                                                capsys: pytest.CaptureFixture[str]) -> None:
    """G3 and G6 across a pause: the key's events (already committed, and published while paused) are parked
    and never attempted; its bucket's other keys flow; after resume the key's events arrive in publish order."""
    paused, other = keys_in_bucket(dsn, 7, 2, prefix="pause-")
    first = publish(dsn, [(paused, "t", {"n": 1}), (other, "t", {"n": 1}), (paused, "t", {"n": 2})])
    register(dsn)
    code, out, err = keys(capsys, dsn, "pause", paused, "--sink", SINK, "--reason", "fixing its read model")
    assert code == cli.EXIT_OK, err
    assert f"paused key '{paused}' for sink '{SINK}'" in out and f"keys resume {paused} --sink {SINK}" in out, out

    sink = RecordingSink()
    runner = runner_for(sink, pool, make_settings(dsn, "w"))
    run_until(runner, lambda: sink.delivered_ids() == {first[1]} and len(parked_ids(dsn)) == 2)
    later = publish(dsn, [(paused, "t", {"n": 3}), (other, "t", {"n": 2}), (paused, "t", {"n": 4})])
    run_until(runner, lambda: sink.delivered_ids() == {first[1], later[1]} and len(parked_ids(dsn)) == 4)
    for _ in range(5):  # more cycles: the parked events are due, yet held
        runner.run_once()
    assert attempts_of(sink, paused) == [], "a paused key's events were attempted"
    assert [r[0] for r in parked_rows(dsn, paused)] == [first[0], first[2], later[0], later[2]]

    state = show(capsys, dsn, paused)
    assert state["state"] == "paused" and state["paused"]["reason"] == "fixing its read model"
    assert state["summary"].startswith("paused since ") and ": fixing its read model; 4 parked event(s) held" in \
        state["summary"], state["summary"]
    assert "@" in state["paused"]["by"] and state["paused"]["role"]

    code, out, err = keys(capsys, dsn, "resume", paused, "--sink", SINK)
    assert code == cli.EXIT_OK, err
    assert f"resumed key '{paused}' for sink '{SINK}'" in out and "its 4 parked event(s) are due now" in out, out
    last = publish(dsn, [(paused, "t", {"n": 5})])
    expected = [first[0], first[2], later[0], later[2], last[0]]
    run_until(runner, lambda: set(expected) <= sink.delivered_ids())
    assert dedup_per_key(sink.attempts)[paused] == expected
    assert dedup_per_key(sink.attempts)[other] == [first[1], later[1]]
    assert parked_ids(dsn) == set() and fetch_all(dsn, "SELECT count(*) FROM outbox.paused_keys") == [(0,)]


def test_a_paused_key_s_failed_head_is_not_retried_until_resumed(dsn: str, pool: ConnectionPool[Any],
                                                                  capsys: pytest.CaptureFixture[str]) -> None:
    paused, control = keys_in_bucket(dsn, 11, 2, prefix="retry-")
    [head] = publish(dsn, [(paused, "t", {})])
    failing = {head}
    sink = RecordingSink(fail=fail_ids(failing))
    runner = runner_for(sink, pool, make_settings(dsn, "w", backoff_base_seconds=0.05, backoff_max_seconds=0.05))
    run_until(runner, lambda: parked_ids(dsn) == {head})
    assert keys(capsys, dsn, "pause", paused, "--sink", SINK)[0] == cli.EXIT_OK
    # A key of the same bucket fails once too, after the paused head: once its retry went out, the paused
    # head (due earlier) would have gone out in the same pass, were it not held.
    [probe] = publish(dsn, [(control, "t", {})])
    failing.add(probe)
    run_until(runner, lambda: probe in {a.event_id for a in sink.attempts})
    failing.clear()
    run_until(runner, lambda: probe in sink.delivered_ids())
    assert attempts_of(sink, paused) == [head], "the paused key's head was retried"
    assert show(capsys, dsn, paused)["summary"].endswith("(its head: attempt 1 of 10 failed: broker said no)")

    assert keys(capsys, dsn, "resume", paused, "--sink", SINK)[0] == cli.EXIT_OK
    run_until(runner, lambda: head in sink.delivered_ids())
    assert parked_ids(dsn) == set()


def test_resume_wakes_the_idle_relay_at_once(dsn: str, capsys: pytest.CaptureFixture[str]) -> None:
    sink = RecordingSink("relay-a")
    worker = Worker(make_settings(dsn, "relay-a", listen=True, poll_seconds=30.0, listen_poll_seconds=30.0),
                    sinks=[sink])
    assert worker.start()
    waiter = threading.Thread(target=worker.wait)
    waiter.start()
    try:
        wait_until(lambda: settled(dsn, ["relay-a"]), 15, message="the relay to hold every bucket")
        assert keys(capsys, dsn, "pause", "k", "--sink", SINK)[0] == cli.EXIT_OK
        ids = publish(dsn, [("k", "t", {}), ("k", "t", {})])
        wait_until(lambda: parked_ids(dsn) == set(ids), 10, message="the paused key's events to be parked")
        assert keys(capsys, dsn, "resume", "k", "--sink", SINK)[0] == cli.EXIT_OK
        wait_until(lambda: sink.delivered_ids() == set(ids), 10, message="delivery at once, not at the next poll")
    finally:
        worker.drain()
        waiter.join(20)
    assert dedup_per_key(sink.attempts)["k"] == ids


def test_nothing_lost_or_reordered_while_a_key_is_paused_and_resumed_under_load(
        dsn: str, capsys: pytest.CaptureFixture[str]) -> None:
    """Two relays deliver while a producer keeps publishing one key (and others); the key is paused and
    resumed twice meanwhile. Every event arrives, and per key in publish order."""
    names = ["relay-a", "relay-b"]
    sinks = {n: RecordingSink(n) for n in names}
    workers = {n: Worker(make_settings(dsn, n, listen=True), sinks=[sinks[n]]) for n in names}
    waiters = []
    published: list[tuple[str, uuid.UUID]] = []
    stop = threading.Event()

    def produce() -> None:
        i = 0
        while not stop.is_set() and i < 400:
            batch = [("hot", "t", {"i": i}), (f"other-{i % 7}", "t", {"i": i})]
            published.extend(zip([k for k, _, _ in batch], publish(dsn, batch), strict=True))
            i += 1

    producer = threading.Thread(target=produce)
    try:
        for w in workers.values():
            assert w.start()
            waiters.append(threading.Thread(target=w.wait))
            waiters[-1].start()
        wait_until(lambda: settled(dsn, names), 15, message="the assignment to settle")
        producer.start()
        for _ in range(2):
            more_published(published, 40)
            assert keys(capsys, dsn, "pause", "hot", "--sink", SINK)[0] == cli.EXIT_OK
            more_published(published, 60)
            wait_until(lambda: parked_rows(dsn, "hot"), 10, message="the paused key's events to be held")
            assert keys(capsys, dsn, "resume", "hot", "--sink", SINK)[0] == cli.EXIT_OK
        producer.join(60)
        expected: dict[str, list[uuid.UUID]] = {}
        for k, i in published:
            expected.setdefault(k, []).append(i)
        everything = {i for _, i in published}

        def delivered() -> set[uuid.UUID]:
            return sinks["relay-a"].delivered_ids() | sinks["relay-b"].delivered_ids()

        wait_until(lambda: everything <= delivered(), 30, message="every event to arrive")
    finally:
        stop.set()
        if producer.is_alive():
            producer.join(60)
        for w in workers.values():
            w.drain()
        for t in waiters:
            t.join(20)
    # One bucket is held by one relay at a time; per key the first deliveries follow publish order.
    by_key = dedup_per_key([a for s in sinks.values() for a in sorted(s.attempts, key=lambda a: a.position)])
    for k, ids in expected.items():
        assert by_key[k] == ids, f"key {k}: delivered out of publish order"
    assert parked_ids(dsn) == set()


def more_published(published: list[Any], n: int) -> None:
    start = len(published)
    wait_until(lambda: len(published) >= start + n, 20, message=f"{n} more events to be published")


def test_pause_and_resume_are_idempotent_and_need_a_live_sink(dsn: str, capsys: pytest.CaptureFixture[str]) -> None:
    register(dsn)
    assert keys(capsys, dsn, "pause", "k", "--sink", SINK, "--reason", "first")[0] == cli.EXIT_OK
    code, out, _ = keys(capsys, dsn, "pause", "k", "--sink", SINK, "--reason", "second", "--json")
    assert code == cli.EXIT_OK
    result = json.loads(out)
    assert result["already_paused"] is True and result["reason"] == "first"
    code, out, _ = keys(capsys, dsn, "resume", "k", "--sink", SINK)
    assert code == cli.EXIT_OK and "resumed key 'k'" in out
    code, out, _ = keys(capsys, dsn, "resume", "k", "--sink", SINK)
    assert code == cli.EXIT_OK and "key 'k' is not paused for sink" in out, out
    code, _, err = keys(capsys, dsn, "pause", "k", "--sink", "nope")
    assert code == cli.EXIT_ERROR and "no sink named 'nope'" in err, err

    # A dropped sink takes its pauses along: recreated, it starts with none.
    assert keys(capsys, dsn, "pause", "k", "--sink", SINK)[0] == cli.EXIT_OK
    assert cli.main(["sinks", "--dsn", dsn, "drop", SINK]) == cli.EXIT_OK
    code, _, err = keys(capsys, dsn, "pause", "k", "--sink", SINK)
    assert code == cli.EXIT_ERROR and f"sink '{SINK}' was dropped" in err, err
    assert fetch_all(dsn, "SELECT count(*) FROM outbox.paused_keys") == [(0,)]


# -- what the relay's queries see -------------------------------------------------------------


def test_a_paused_key_s_parked_events_are_no_work_for_the_relay(dsn: str, capsys: pytest.CaptureFixture[str]) -> None:
    """Parked events of a paused key are neither due (next_parked_retry, has_parked) nor work that makes a
    lost lease count as a lapse (bucket_has_work_v2): the relay will not retry them, so it must neither
    spin on them nor blame a crash on them."""
    register(dsn)
    [event] = publish(dsn, [("k", "t", {})])
    bucket = bucket_of(dsn, "k")
    with psycopg.connect(dsn, autocommit=True) as conn:
        # Delivered as far as the cursor goes, and parked (due now), as the relay leaves a held key's event.
        conn.execute("UPDATE outbox.cursors SET snapshot = pg_current_snapshot() WHERE sink = %s", (SINK,))
        conn.execute("INSERT INTO outbox.parked (sink, bucket, xid, seq, partition_key, event_id) "
                     "SELECT %s, bucket, xid, seq, partition_key, id FROM outbox.events", (SINK,))

        def work() -> bool:
            row = conn.execute("SELECT outbox.bucket_has_work_v2(sink, bucket, snapshot, target, after_xid, after_seq) "
                               "FROM outbox.cursors WHERE sink = %s AND bucket = %s", (SINK, bucket)).fetchone()
            return bool(row and row[0])

        assert work() and store.has_parked(conn, SINK, bucket)
        assert (store.next_parked_retry(conn, SINK, [bucket]) or 0) <= 0
        assert keys(capsys, dsn, "pause", "k", "--sink", SINK)[0] == cli.EXIT_OK
        assert not work()
        assert not store.has_parked(conn, SINK, bucket)
        assert store.next_parked_retry(conn, SINK, [bucket]) is None
        assert store.fetch_parked(conn, SINK, [bucket], 10, 10) == []
        assert keys(capsys, dsn, "resume", "k", "--sink", SINK)[0] == cli.EXIT_OK
        assert work() and [e.id for e in store.fetch_parked(conn, SINK, [bucket], 10, 10)] == [event]


def test_an_idle_relay_waits_for_a_head_s_retry_time_not_for_the_events_queued_behind_it(
        dsn: str, pool: ConnectionPool[Any]) -> None:
    """The events queued behind a failed head are parked due at once (they wait for the head, not for a
    time of their own). The runner's park timer must follow the head: when it followed the queue, an idle
    relay polled the park every few milliseconds for as long as the head waited."""
    ids = publish(dsn, [("k", "t", {}), ("k", "t", {}), ("k", "t", {})])
    sink = RecordingSink(fail=fail_ids({ids[0]}))
    runner = runner_for(sink, pool, make_settings(dsn, "w", backoff_base_seconds=60, backoff_max_seconds=60))
    run_until(runner, lambda: len(parked_ids(dsn)) == 3)
    bucket = bucket_of(dsn, "k")
    with psycopg.connect(dsn, autocommit=True) as conn:
        queued_due = fetch_all(dsn, "SELECT count(*) FROM outbox.parked WHERE available_at <= clock_timestamp()")
        assert queued_due == [(2,)], "the queue behind the head is parked due at once"
        due_in = store.next_parked_retry(conn, SINK, [bucket])
    assert due_in is not None and 25 < due_in <= 60  # the head's backoff (30-60 s with its jitter)


def test_retry_skip_and_resume_notify_the_bucket_s_owner(dsn: str, pool: ConnectionPool[Any],
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    ids = publish(dsn, [("k", "t", {}), ("k", "t", {})])
    sink = RecordingSink(fail=fail_ids({ids[0]}))
    runner = runner_for(sink, pool, make_settings(dsn, "w", backoff_base_seconds=60, backoff_max_seconds=60))
    run_until(runner, lambda: len(parked_ids(dsn)) == 2)
    bucket = bucket_of(dsn, "k")
    with psycopg.connect(dsn, autocommit=True) as listener:
        listener.execute("LISTEN outbox_events_v2")
        assert keys(capsys, dsn, "retry", "k", "--sink", SINK)[0] == cli.EXIT_OK
        assert keys(capsys, dsn, "pause", "k", "--sink", SINK)[0] == cli.EXIT_OK
        assert keys(capsys, dsn, "resume", "k", "--sink", SINK)[0] == cli.EXIT_OK
        assert keys(capsys, dsn, "skip", "k", "--sink", SINK)[0] == cli.EXIT_OK
        notes = [n.payload for n in listener.notifies(timeout=2.0, stop_after=3)]
    assert notes == [f"parked:{bucket}"] * 3  # pause changes nothing the relay would act on at once
