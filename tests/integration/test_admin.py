"""``outbox_relay.admin``: the operator actions, called directly against a real database and real relays.

What the actions do to the relays lives here (a paused key is held in order and resumed without loss:
G3, G6; a skipped head stays dead-lettered even while its retry is in flight: G9; retry and resume
wake an idle relay at once; a drop can not race a lease). The tests of tests/integration/test_cli_*.py
cover what the command adds: arguments, output, exit codes.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest
from psycopg_pool import ConnectionPool

from outbox_relay import admin, store
from outbox_relay.errors import ConfigurationError, OutboxError
from outbox_relay.housekeeping import Housekeeping
from outbox_relay.sinks.engine import Failure
from outbox_relay.worker import Worker
from tests.integration.relay_helpers import (  # noqa: F401  (pool_fixture provides `pool`)
    SINK,
    RecordingSink,
    attempts_of,
    bucket_of,
    close_history,
    dead_letters,
    dedup_per_key,
    fail_ids,
    fetch_all,
    keys_in_bucket,
    make_settings,
    parked_ids,
    parked_rows,
    pool_fixture,
    publish,
    register,
    run_until,
    runner_for,
    settled,
)
from tests.servers import wait_until

pytestmark = pytest.mark.pg15  # the PostgreSQL 15 step runs it too (scripts/test.sh)


@pytest.fixture
def conn(dsn: str) -> Iterator[psycopg.Connection[Any]]:
    with psycopg.connect(dsn, autocommit=True) as c:
        yield c


def dead_letter_rows(dsn: str, key: str, n: int, sink: str = SINK) -> list[str]:
    """Publish ``n`` events of ``key`` and dead-letter them for ``sink``, one second apart; newest first."""
    ids = publish(dsn, [(key, "t", {"i": i}) for i in range(n)])
    with psycopg.connect(dsn, autocommit=True) as c:
        for i, event_id in enumerate(ids):
            c.execute("INSERT INTO outbox.dead_letters (sink, event_id, bucket, xid, seq, partition_key, attempts, "
                      "last_error, dead_at) SELECT %s, id, bucket, xid, seq, partition_key, 3, 'boom', "
                      "now() - make_interval(secs => %s) FROM outbox.events WHERE id = %s", (sink, n - i, event_id))
    return [str(i) for i in reversed(ids)]


# -- status, sinks, dead letters ------------------------------------------------------------------


def test_status_returns_its_tables(dsn: str, conn: psycopg.Connection[Any]) -> None:
    register(dsn)
    with psycopg.connect(dsn, autocommit=True) as c:
        store.heartbeat(c, "relay-a", "alive", [SINK], {})
    dead_letter_rows(dsn, "k", 2)
    found = admin.status(conn)
    assert [r["id"] for r in found.workers.records()] == ["relay-a"], found.workers
    [backlog] = found.backlog.records()
    assert backlog["sink"] == SINK and backlog["dead_letters"] == 2, backlog
    assert [(r["partition_key"], r["dead_letters"]) for r in found.dead_letters_by_key.records()] == [("k", 2)]
    assert found.rebuilds.rows == [] and found.oldest_open_transaction.rows == []
    assert [b.sink for b in admin.backlog(conn)] == [SINK]


def test_dead_letters_page_by_event_id(dsn: str, conn: psycopg.Connection[Any]) -> None:
    register(dsn)
    newest_first = dead_letter_rows(dsn, "k", 5)
    first = admin.dead_letters(conn, sink=SINK, limit=2)
    assert [str(r["event_id"]) for r in first.records()] == newest_first[:2] and first.more
    second = admin.dead_letters(conn, sink=SINK, limit=2, after=first.last_event_id)
    last = admin.dead_letters(conn, sink=SINK, limit=2, after=second.last_event_id)
    assert [str(r["event_id"]) for r in second.records() + last.records()] == newest_first[2:]
    assert second.more and not last.more
    with pytest.raises(OutboxError, match="no dead letter of event"):
        admin.dead_letters(conn, sink=SINK, after=uuid.uuid4())
    with pytest.raises(OutboxError, match="no sink named 'nope'"):
        admin.dead_letters(conn, sink="nope")
    with pytest.raises(ConfigurationError, match="1-10000, not 0"):
        admin.dead_letters(conn, limit=0)


def test_retry_and_discard_dead_letters(dsn: str, conn: psycopg.Connection[Any]) -> None:
    register(dsn)
    ids = dead_letter_rows(dsn, "k", 3)
    dead_letter_rows(dsn, "other", 1)
    with pytest.raises(ConfigurationError, match="event ids, a key, or all"):
        admin.retry_dead_letters(conn, SINK)
    with pytest.raises(OutboxError, match="no sink named 'nope'"):
        admin.discard_dead_letters(conn, "nope", all=True)
    retried = admin.retry_dead_letters(conn, SINK, key="k")
    assert (retried.count, retried.event_ids) == (3, sorted(ids))
    assert {str(i) for i in parked_ids(dsn)} == set(ids)
    assert fetch_all(dsn, "SELECT partition_key FROM outbox.dead_letters") == [("other",)]
    discarded = admin.discard_dead_letters(conn, SINK, all=True)
    assert discarded.count == 1 and fetch_all(dsn, "SELECT count(*) FROM outbox.dead_letters") == [(0,)]


def test_drop_refuses_a_sink_in_use_unless_forced_and_recreate_undoes_it(dsn: str,
                                                                         conn: psycopg.Connection[Any]) -> None:
    register(dsn)
    with psycopg.connect(dsn, autocommit=True) as c:
        store.heartbeat(c, "relay-a", "alive", [SINK], {})
    with pytest.raises(OutboxError, match=f"sink '{SINK}' is in use: relay relay-a"):
        admin.drop_sink(conn, SINK)
    assert [r["dropped_at"] for r in admin.sinks(conn).records()] == [None]
    drop = admin.drop_sink(conn, SINK, force=True)
    assert drop.dropped and drop.in_use and drop.in_use[0].startswith("relay relay-a (alive")
    again = admin.drop_sink(conn, SINK)
    assert not again.dropped and again.dropped_at is not None
    with pytest.raises(OutboxError, match=f"sink '{SINK}' was dropped at"):
        admin.pause_key(conn, "k", SINK)
    assert admin.recreate_sink(conn, SINK).kind == "projection"
    with pytest.raises(OutboxError, match="is not dropped"):
        admin.recreate_sink(conn, SINK)
    with pytest.raises(OutboxError, match="no sink named 'nope'"):
        admin.drop_sink(conn, "nope")


def test_a_lease_taken_while_the_drop_checks_is_seen(dsn: str) -> None:
    """The drop locks the sink's cursors before it looks for leases: a relay acquiring a lease at that
    moment either commits first (and the drop refuses) or waits for the drop (and finds no cursor)."""
    register(dsn)
    result: dict[str, Any] = {}

    def drop() -> None:
        with psycopg.connect(dsn, autocommit=True, application_name="dropping") as c:
            try:
                admin.drop_sink(c, SINK)
            except OutboxError as exc:
                result["error"] = str(exc)

    with psycopg.connect(dsn) as relay:
        store.acquire_leases(relay, SINK, "relay-c", range(0, 3), 30.0)  # not committed yet
        dropping = threading.Thread(target=drop)
        dropping.start()
        wait_until(lambda: fetch_all(dsn, "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() "
                                          "AND application_name = 'dropping' AND wait_event_type = 'Lock'"
                                     )[0][0] == 1,
                   10, message="the drop to wait for the lease's row locks")
        relay.commit()
        dropping.join(30)
    assert "3 bucket(s) leased by relay-c" in result["error"], result
    assert fetch_all(dsn, "SELECT dropped_at IS NULL, (SELECT count(*) FROM outbox.cursors WHERE sink = %s) "
                          "FROM outbox.sinks WHERE name = %s", (SINK, SINK)) == [(True, 256)]


def test_retention_ignores_a_dropped_sink(dsn: str, conn: psycopg.Connection[Any]) -> None:
    """A lagging sink holds retention back; once dropped, retention deletes what the live sink passed."""
    register(dsn, "live")
    register(dsn, SINK)
    publish(dsn, [(f"key-{i}", "t", {}) for i in range(50)])
    # The live sink delivered everything: its cursors are past every stored event.
    conn.execute("UPDATE outbox.cursors SET snapshot = pg_current_snapshot() WHERE sink = 'live'")
    close_history(dsn)
    settings = make_settings(dsn, "housekeeper", retention_seconds=0.0)
    with ConnectionPool(dsn, min_size=1, max_size=2, kwargs={"autocommit": True}) as pool:
        assert Housekeeping(pool, settings).run_once().deleted_events == 0, "the lagging sink holds retention"
        assert admin.drop_sink(conn, SINK).dropped
        assert Housekeeping(pool, settings).run_once().deleted_events == 50
    assert fetch_all(dsn, "SELECT count(*) FROM outbox.events") == [(0,)]


def test_retention_actions(dsn: str, conn: psycopg.Connection[Any]) -> None:
    """The retention command's actions as library calls: classes, topics, a roll, and what list, partitions
    and status report of them (docs/history.md)."""
    assert admin.set_retention_class(conn, "short", 3600.0) == admin.RetentionClassSet("short", 3600.0, False)
    assert admin.set_retention_class(conn, "audit", None).keep_seconds is None  # kept for good
    assert admin.set_topic_retention(conn, "notifications", "short") == admin.TopicRetention("notifications", "short")
    with pytest.raises(ConfigurationError, match="for the default class only"):
        admin.set_retention_class(conn, "short", "relays")
    assert admin.set_retention_class(conn, "default", "relays").follows_relays
    with pytest.raises(ConfigurationError, match="retention class 'missing' does not exist"):
        admin.set_topic_retention(conn, "orders", "missing")
    with pytest.raises(ConfigurationError, match="topics or partitions still use it"):
        admin.drop_retention_class(conn, "short")
    admin.drop_retention_class(conn, "audit")  # nothing uses it
    rolled = admin.roll_history(conn)
    found = admin.retention(conn, retention_seconds=60.0)
    classes = {c["class"]: c for c in found.classes.records()}
    assert set(classes) == {"default", "short"} and classes["short"]["topics"] == ["notifications"], classes
    assert classes["default"]["keep_seconds"] == 60, "the default class keeps the relays' setting"
    names = {p["name"] for p in admin.history_partitions(conn).records()}
    assert {f"{rolled.partition}_short", f"{rolled.partition}_default", "events_default"} <= names, names
    assert {r["class"] for r in admin.status(conn).retention.records()} >= {"default", "short"}


# -- keys -----------------------------------------------------------------------------------------


def test_key_state_of_a_retrying_key(dsn: str, pool: ConnectionPool[Any], conn: psycopg.Connection[Any]) -> None:
    ids = publish(dsn, [("order:1", "Placed", {}), ("order:1", "Paid", {})])
    sink = RecordingSink(fail=fail_ids({ids[0]}, "KafkaError{code=MSG_TIMED_OUT}"))
    runner = runner_for(sink, pool, make_settings(dsn, "w", backoff_base_seconds=60, backoff_max_seconds=60))
    run_until(runner, lambda: len(parked_ids(dsn)) == 2)
    found = admin.key_state(conn, "order:1", max_attempts=7)
    assert (found.key, found.bucket, found.max_attempts) == ("order:1", bucket_of(dsn, "order:1"), 7)
    [state] = found.sinks
    assert state.state == "retrying" and state.owner == "w" and state.head is not None
    assert (state.head.event_id, state.head.attempts, state.parked, state.queued_behind) == (ids[0], 1, 2, 1)
    assert "attempt 1 of 7 failed: KafkaError{code=MSG_TIMED_OUT}" in state.summary, state.summary
    assert admin.key_state(conn, "never-published").sinks[0].state == "unknown"
    with pytest.raises(OutboxError, match="no sink named 'nope'"):
        admin.key_state(conn, "order:1", sink="nope")


def test_key_state_before_any_relay_ran(conn: psycopg.Connection[Any]) -> None:
    found = admin.key_state(conn, "k")
    assert (found.bucket, found.sinks) == (None, [])


def test_retry_refuses_a_key_with_nothing_parked_or_paused(dsn: str, pool: ConnectionPool[Any],
                                                          conn: psycopg.Connection[Any]) -> None:
    register(dsn)
    with pytest.raises(OutboxError, match=f"nothing to retry: no event of key 'k' is parked for sink '{SINK}'"):
        admin.retry_key(conn, "k", SINK)
    ids = publish(dsn, [("k", "t", {})])
    sink = RecordingSink(fail=fail_ids(set(ids)))
    runner = runner_for(sink, pool, make_settings(dsn, "w", backoff_base_seconds=60, backoff_max_seconds=60))
    run_until(runner, lambda: parked_ids(dsn) == set(ids))
    assert not admin.pause_key(conn, "k", SINK).already_paused
    before = fetch_all(dsn, "SELECT available_at FROM outbox.parked")
    with pytest.raises(OutboxError, match="key 'k' is paused for sink"):
        admin.retry_key(conn, "k", SINK)
    assert fetch_all(dsn, "SELECT available_at FROM outbox.parked") == before
    assert admin.resume_key(conn, "k", SINK).now_due == 1
    retried = admin.retry_key(conn, "k", SINK)
    assert (retried.event_id, retried.parked) == (ids[0], 1)


def test_skip_refuses_an_event_that_is_not_the_head(dsn: str, pool: ConnectionPool[Any],
                                                    conn: psycopg.Connection[Any]) -> None:
    ids = publish(dsn, [("k", "a", {}), ("k", "b", {}), ("k", "c", {})])
    sink = RecordingSink(fail=fail_ids({ids[0]}, "poison"))
    runner = runner_for(sink, pool, make_settings(dsn, "w", backoff_base_seconds=60, backoff_max_seconds=60))
    run_until(runner, lambda: len(parked_ids(dsn)) == 3)
    with pytest.raises(OutboxError, match=f"event {ids[1]} is not the head of key 'k'"):
        admin.skip_key(conn, "k", SINK, event_id=ids[1])
    assert len(parked_ids(dsn)) == 3 and dead_letters(dsn) == {}
    skipped = admin.skip_key(conn, "k", SINK, event_id=ids[0])
    assert (skipped.event_id, skipped.now_due, skipped.attempts, skipped.paused) == (ids[0], 2, 1, False)
    assert dead_letters(dsn) == {ids[0]: (1, admin.SKIPPED_ERROR)}
    run_until(runner, lambda: sink.delivered_ids() == {ids[1], ids[2]} and not parked_ids(dsn))
    assert dedup_per_key(sink.attempts)["k"] == [ids[1], ids[2]]


def test_retry_wakes_its_idle_relay_at_once(dsn: str) -> None:
    """The head waits a minute for its retry; retry_key has its relay (idle, polling every 30 s) deliver it
    at once, then the events behind it, in order."""
    broken = threading.Event()
    broken.set()

    def fail(e: Any, _n: int) -> Failure | None:
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
        with psycopg.connect(dsn, autocommit=True) as conn:
            assert admin.retry_key(conn, "order:1", SINK).event_id == ids[0]
        wait_until(lambda: sink.delivered_ids() == set(ids), 10, message="the retry, at once rather than in 60 s")
    finally:
        worker.drain()
        waiter.join(20)
    assert dedup_per_key(sink.attempts)["order:1"] == ids
    assert parked_ids(dsn) == set()


def test_dead_letters_retry_wakes_the_idle_relay_at_once(dsn: str) -> None:
    """A dead letter sent back by retry_dead_letters is delivered at once by its relay (idle, with nothing
    parked, so looking at its park only once a minute), because the action tells it so (notify_parked)."""
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
        with psycopg.connect(dsn, autocommit=True) as conn:
            assert admin.retry_dead_letters(conn, SINK, key="order:9").count == 1
        wait_until(lambda: sink.delivered_ids() == set(ids), 10, message="the retried dead letter, at once")
    finally:
        worker.drain()
        waiter.join(20)


def test_a_head_skipped_while_its_retry_is_in_flight_stays_skipped(dsn: str, pool: ConnectionPool[Any]) -> None:
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
        with psycopg.connect(dsn, autocommit=True) as conn:
            admin.skip_key(conn, "k", SINK)
    finally:
        gate.set()  # the head fails again, its checkpoint runs
        in_flight.join(20)
    assert [a.error for a in sink.attempts_of(ids[0])] == ["poison", "poison"]
    assert ids[0] not in parked_ids(dsn), "the skipped head was parked again by the retry that was in flight"
    assert dead_letters(dsn) == {ids[0]: (1, admin.SKIPPED_ERROR)}
    run_until(runner, lambda: sink.delivered_ids() == {ids[1], ids[2]})
    assert dedup_per_key(sink.attempts)["k"] == [ids[1], ids[2]]


def test_a_paused_key_is_held_in_order_and_resumed_without_loss(dsn: str, pool: ConnectionPool[Any],
                                                                conn: psycopg.Connection[Any]) -> None:
    """G3 and G6 across a pause: the key's events (already committed, and published while paused) are parked
    and never attempted; its bucket's other keys flow; after resume the key's events arrive in publish order."""
    paused, other = keys_in_bucket(dsn, 7, 2, prefix="pause-")
    first = publish(dsn, [(paused, "t", {"n": 1}), (other, "t", {"n": 1}), (paused, "t", {"n": 2})])
    register(dsn)
    pause = admin.pause_key(conn, paused, SINK, reason="fixing its read model", by="ops@host")
    assert (pause.already_paused, pause.paused_by, pause.reason) == (False, "ops@host", "fixing its read model")

    sink = RecordingSink()
    runner = runner_for(sink, pool, make_settings(dsn, "w"))
    run_until(runner, lambda: sink.delivered_ids() == {first[1]} and len(parked_ids(dsn)) == 2)
    later = publish(dsn, [(paused, "t", {"n": 3}), (other, "t", {"n": 2}), (paused, "t", {"n": 4})])
    run_until(runner, lambda: sink.delivered_ids() == {first[1], later[1]} and len(parked_ids(dsn)) == 4)
    for _ in range(5):  # more cycles: the parked events are due, yet held
        runner.run_once()
    assert attempts_of(sink, paused) == [], "a paused key's events were attempted"
    assert [r[0] for r in parked_rows(dsn, paused)] == [first[0], first[2], later[0], later[2]]

    [state] = admin.key_state(conn, paused, sink=SINK).sinks
    assert state.state == "paused" and state.paused is not None and state.paused.reason == "fixing its read model"
    assert ": fixing its read model; 4 parked event(s) held" in state.summary, state.summary

    resumed = admin.resume_key(conn, paused, SINK)
    assert resumed.was_paused and resumed.now_due == 4
    last = publish(dsn, [(paused, "t", {"n": 5})])
    expected = [first[0], first[2], later[0], later[2], last[0]]
    run_until(runner, lambda: set(expected) <= sink.delivered_ids())
    assert dedup_per_key(sink.attempts)[paused] == expected
    assert dedup_per_key(sink.attempts)[other] == [first[1], later[1]]
    assert parked_ids(dsn) == set() and fetch_all(dsn, "SELECT count(*) FROM outbox.paused_keys") == [(0,)]
    assert not admin.resume_key(conn, paused, SINK).was_paused


def test_a_paused_key_s_failed_head_is_not_retried_until_resumed(dsn: str, pool: ConnectionPool[Any],
                                                                  conn: psycopg.Connection[Any]) -> None:
    paused, control = keys_in_bucket(dsn, 11, 2, prefix="retry-")
    [head] = publish(dsn, [(paused, "t", {})])
    failing = {head}
    sink = RecordingSink(fail=fail_ids(failing))
    runner = runner_for(sink, pool, make_settings(dsn, "w", backoff_base_seconds=0.05, backoff_max_seconds=0.05))
    run_until(runner, lambda: parked_ids(dsn) == {head})
    admin.pause_key(conn, paused, SINK)
    # A key of the same bucket fails once too, after the paused head: once its retry went out, the paused
    # head (due earlier) would have gone out in the same pass, were it not held.
    [probe] = publish(dsn, [(control, "t", {})])
    failing.add(probe)
    run_until(runner, lambda: probe in {a.event_id for a in sink.attempts})
    failing.clear()
    run_until(runner, lambda: probe in sink.delivered_ids())
    assert attempts_of(sink, paused) == [head], "the paused key's head was retried"
    [state] = admin.key_state(conn, paused, sink=SINK).sinks
    assert state.summary.endswith("(its head: attempt 1 of 10 failed: broker said no)"), state.summary

    admin.resume_key(conn, paused, SINK)
    run_until(runner, lambda: head in sink.delivered_ids())
    assert parked_ids(dsn) == set()


def test_resume_wakes_the_idle_relay_at_once(dsn: str, conn: psycopg.Connection[Any]) -> None:
    sink = RecordingSink("relay-a")
    worker = Worker(make_settings(dsn, "relay-a", listen=True, poll_seconds=30.0, listen_poll_seconds=30.0),
                    sinks=[sink])
    assert worker.start()
    waiter = threading.Thread(target=worker.wait)
    waiter.start()
    try:
        wait_until(lambda: settled(dsn, ["relay-a"]), 15, message="the relay to hold every bucket")
        admin.pause_key(conn, "k", SINK)
        ids = publish(dsn, [("k", "t", {}), ("k", "t", {})])
        wait_until(lambda: parked_ids(dsn) == set(ids), 10, message="the paused key's events to be parked")
        admin.resume_key(conn, "k", SINK)
        wait_until(lambda: sink.delivered_ids() == set(ids), 10, message="delivery at once, not at the next poll")
    finally:
        worker.drain()
        waiter.join(20)
    assert dedup_per_key(sink.attempts)["k"] == ids


def test_nothing_lost_or_reordered_while_a_key_is_paused_and_resumed_under_load(dsn: str) -> None:
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

    def more_published(n: int) -> None:
        start = len(published)
        wait_until(lambda: len(published) >= start + n, 20, message=f"{n} more events to be published")

    producer = threading.Thread(target=produce)
    try:
        for w in workers.values():
            assert w.start()
            waiters.append(threading.Thread(target=w.wait))
            waiters[-1].start()
        wait_until(lambda: settled(dsn, names), 15, message="the assignment to settle")
        producer.start()
        with psycopg.connect(dsn, autocommit=True) as conn:
            for _ in range(2):
                more_published(40)
                admin.pause_key(conn, "hot", SINK)
                more_published(60)
                wait_until(lambda: parked_rows(dsn, "hot"), 10, message="the paused key's events to be held")
                admin.resume_key(conn, "hot", SINK)
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


@pytest.mark.parametrize("version", ["v2", "v3"])  # v2: relays of version 15 still call it (0016)
def test_a_paused_key_s_parked_events_are_no_work_for_the_relay(dsn: str, conn: psycopg.Connection[Any],
                                                                version: str) -> None:
    """Parked events of a paused key are neither due (next_parked_retry, has_parked) nor work that makes a
    lost lease count as a lapse (bucket_has_work_v3, and v2): the relay will not retry them, so it must
    neither spin on them nor blame a crash on them."""
    register(dsn)
    [event] = publish(dsn, [("k", "t", {})])
    bucket = bucket_of(dsn, "k")
    # Delivered as far as the cursor goes, and parked (due now), as the relay leaves a held key's event.
    conn.execute("UPDATE outbox.cursors SET snapshot = pg_current_snapshot() WHERE sink = %s", (SINK,))
    conn.execute("INSERT INTO outbox.parked (sink, bucket, xid, seq, partition_key, event_id) "
                 "SELECT %s, bucket, xid, seq, partition_key, id FROM outbox.events", (SINK,))

    def work() -> bool:
        row = conn.execute(f"SELECT outbox.bucket_has_work_{version}(sink, bucket, snapshot, target, after_xid, "
                           "after_seq) FROM outbox.cursors WHERE sink = %s AND bucket = %s", (SINK, bucket)).fetchone()
        return bool(row and row[0])

    assert work() and store.has_parked(conn, SINK, bucket)
    assert (store.next_parked_retry(conn, SINK, [bucket]) or 0) <= 0
    admin.pause_key(conn, "k", SINK)
    assert not work()
    assert not store.has_parked(conn, SINK, bucket)
    assert store.next_parked_retry(conn, SINK, [bucket]) is None
    assert store.fetch_parked(conn, SINK, [bucket], 10, 10) == []
    admin.resume_key(conn, "k", SINK)
    assert work() and [e.id for e in store.fetch_parked(conn, SINK, [bucket], 10, 10)] == [event]


def test_retry_skip_and_resume_notify_the_bucket_s_owner(dsn: str, pool: ConnectionPool[Any],
                                                          conn: psycopg.Connection[Any]) -> None:
    ids = publish(dsn, [("k", "t", {}), ("k", "t", {})])
    sink = RecordingSink(fail=fail_ids({ids[0]}))
    runner = runner_for(sink, pool, make_settings(dsn, "w", backoff_base_seconds=60, backoff_max_seconds=60))
    run_until(runner, lambda: len(parked_ids(dsn)) == 2)
    bucket = bucket_of(dsn, "k")
    with psycopg.connect(dsn, autocommit=True) as listener:
        listener.execute("LISTEN outbox_events_v2")
        admin.retry_key(conn, "k", SINK)
        admin.pause_key(conn, "k", SINK)
        admin.resume_key(conn, "k", SINK)
        admin.skip_key(conn, "k", SINK)
        notes = [n.payload for n in listener.notifies(timeout=2.0, stop_after=3)]
    assert notes == [f"parked:{bucket}"] * 3  # pause changes nothing the relay would act on at once


def test_actions_join_the_caller_s_transaction(dsn: str, pool: ConnectionPool[Any]) -> None:
    """On a connection inside a transaction an action is a savepoint of it: rolled back with it."""
    ids = publish(dsn, [("k", "t", {})])
    sink = RecordingSink(fail=fail_ids(set(ids)))
    runner = runner_for(sink, pool, make_settings(dsn, "w", backoff_base_seconds=60, backoff_max_seconds=60))
    run_until(runner, lambda: parked_ids(dsn) == set(ids))
    with psycopg.connect(dsn, autocommit=True) as conn, pytest.raises(RuntimeError), conn.transaction():
        admin.skip_key(conn, "k", SINK)
        assert fetch_all(dsn, "SELECT count(*) FROM outbox.dead_letters") == [(0,)], "not committed yet"
        raise RuntimeError("the caller's own work fails")
    assert parked_ids(dsn) == set(ids) and dead_letters(dsn) == {}
