"""History per retention class (0015): what retention removed is recorded per class and the topics its
partitions held, so a projection's rebuild refuses only when history of the topics it reads is gone;
parked events and dead letters no longer hold their partitions (copies are kept for their retries)."""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import psycopg
import pytest
from psycopg import sql
from psycopg_pool import ConnectionPool

from outbox_relay import admin, cli, history, store
from outbox_relay.errors import WaitTimeout
from outbox_relay.housekeeping import Housekeeping
from outbox_relay.migrate import migrate
from outbox_relay.progress import wait_for
from outbox_relay.publish import Outbox, Published
from outbox_relay.relay import SinkRunner
from projections import Projection, ProjectionEvent, projection
from projections.rebuild import Rebuild, RebuildError, history_gap
from projections.sink import ProjectionSink
from tests.integration.relay_helpers import (  # noqa: F401  (pool_fixture provides `pool`)
    ALL_BUCKETS,
    RecordingSink,
    close_history,
    dead_letters,
    dedup_per_key,
    fetch_all,
    make_settings,
    pool_fixture,
    publish,
    run_until,
    runner_for,
    undelivered,
)
from tests.integration.test_history import _migrate_to

pytestmark = pytest.mark.pg15  # the PostgreSQL 15 step runs it too (scripts/test.sh)


def seen_projection(name: str, topics: list[str] | None, fail: set[uuid.UUID] | None = None) -> Projection:
    """Records each event it applies in ``<name>_seen``, in order; raises for the events in ``fail``."""
    table = sql.Identifier(f"{name}_seen")

    @projection(name, topics=topics, tables=[f"{name}_seen"])
    def apply(event: ProjectionEvent[Any], tx: Any) -> None:
        if fail and event.id in fail:
            raise ValueError("not yet")
        tx.execute(sql.SQL("INSERT INTO {} (event_id, key) VALUES (%s, %s)").format(table), (event.id, event.key))

    return apply


def seen(dsn: str, name: str) -> list[uuid.UUID]:
    return [r[0] for r in fetch_all(dsn, f'SELECT event_id FROM "{name}_seen" ORDER BY n')]


@pytest.fixture
def live(dsn: str, pool: ConnectionPool[Any]) -> Iterator[Callable[..., SinkRunner]]:
    """``live(projection)``: its table, and a SinkRunner for it registered as a relay registers it (with
    the topics it reads)."""
    sinks: list[ProjectionSink] = []

    def make(p: Projection, **settings: Any) -> SinkRunner:
        with psycopg.connect(dsn, autocommit=True) as conn:
            conn.execute(sql.SQL("CREATE TABLE IF NOT EXISTS {} (n bigserial PRIMARY KEY, event_id uuid NOT NULL "
                                 "UNIQUE, key text NOT NULL)").format(sql.Identifier(f"{p.name}_seen")))
        sink = ProjectionSink(p, dsn)
        sinks.append(sink)
        with pool.connection() as conn:
            store.register_sink(conn, sink.name, sink.kind, p.topics)
        r = SinkRunner(sink, pool, make_settings(dsn, p.name, **{"max_attempts": 2, **settings}))
        r.desired = set(ALL_BUCKETS)
        return r

    yield make
    for s in sinks:
        s.close()


def rebuild(p: Projection, dsn: str) -> int:
    result = Rebuild(p, make_settings(dsn, "rebuilder", batch_size=200), progress=None).run()
    assert result is not None
    return result.events


def status_history(dsn: str, capsys: pytest.CaptureFixture[str]) -> dict[str, dict[str, Any]]:
    capsys.readouterr()
    assert cli.main(["status", "--json", "--dsn", dsn]) == cli.EXIT_OK
    return {r["projection"]: r for r in json.loads(capsys.readouterr().out)["history"]}


def retire(pool: ConnectionPool[Any], dsn: str, retention_seconds: float) -> int:
    return Housekeeping(pool, make_settings(dsn, "hk", retention_seconds=retention_seconds))._apply_retention()


def test_a_short_class_going_refuses_only_the_rebuilds_that_read_it(
        dsn: str, pool: ConnectionPool[Any], live: Callable[..., SinkRunner],
        capsys: pytest.CaptureFixture[str]) -> None:
    """notifications (class short, 0 s) go; orders (kept for good) and other topics (default class,
    within retention) stay. The orders-only projection rebuilds without a flag; the one that reads
    notifications is refused, naming the class, its topics and from when history exists."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        history.set_class(conn, "short", 0.0)
        history.set_class(conn, "orders", None)
        history.map_topic(conn, "notifications", "short")
        history.map_topic(conn, "orders", "orders")
    close_history(dsn)
    orders_p, notes_p = seen_projection("orders_view", ["orders"]), seen_projection("notes_view", ["notifications"])
    runners = [live(orders_p), live(notes_p)]
    order_ids = publish(dsn, [(f"o{i}", "Paid", {}) for i in range(6)], topic="orders")
    note_ids = publish(dsn, [(f"n{i}", "Sent", {}) for i in range(4)], topic="notifications")
    for r, n in zip(runners, (len(order_ids), len(note_ids)), strict=True):
        run_until(r, lambda n=n, r=r: len(seen(dsn, r.sink.name)) == n and undelivered(dsn, r.sink.name) == 0)
    close_history(dsn)

    assert retire(pool, dsn, 3600.0) == len(note_ids), "the short class's partition went, nothing else"
    rows = {r["projection"]: r for r in status_history(dsn, capsys).values()}
    assert rows["orders_view"]["full_rebuild_complete"] is True and rows["orders_view"]["topics"] == ["orders"]
    assert rows["notes_view"]["full_rebuild_complete"] is False and rows["notes_view"]["missing"].startswith("short")
    assert rows["notes_view"]["removed_events"] == len(note_ids)

    with pytest.raises(RebuildError, match=r"would be partial: retention has removed 4 events .* of its topics "
                                           r"notifications \(class short \(topics notifications\): 4 events") as no:
        rebuild(notes_p, dsn)
    assert "history now exists from no event at all on" in str(no.value)
    assert rebuild(orders_p, dsn) == len(order_ids), "nothing the orders projection read is gone"
    assert sorted(seen(dsn, "orders_view")) == sorted(order_ids)


def test_a_topic_moved_to_another_class_counts_what_left_with_its_old_class(
        dsn: str, pool: ConnectionPool[Any], live: Callable[..., SinkRunner]) -> None:
    """orders first lands in the default class's partition, then (mapped, from the next range on) in a
    class kept for good. The default partition that held early orders goes: a projection that applied
    them is refused. A projection that began after that sees a later default partition go, which held
    no orders (its range gave them to the orders class): its rebuild is complete."""
    early = seen_projection("early_view", ["orders"])
    early_runner = live(early)
    first = publish(dsn, [("o1", "Paid", {"n": 1})], topic="orders")  # the default class's leaf of its range
    with psycopg.connect(dsn, autocommit=True) as conn:
        history.set_class(conn, "orders", None)
        history.map_topic(conn, "orders", "orders")
    close_history(dsn)  # the mapping applies from this range on
    later = publish(dsn, [("o1", "Paid", {"n": 2})], topic="orders")
    other = publish(dsn, [("x1", "Other", {})], topic="other")
    run_until(early_runner, lambda: len(seen(dsn, "early_view")) == 2 and undelivered(dsn, "early_view") == 0)
    assert retire(pool, dsn, 0.0) == len(first), "the first range's default leaf (with the early order) went"

    late = seen_projection("late_view", ["orders"])
    late_runner = live(late)
    run_until(late_runner, lambda: seen(dsn, "late_view") == later and undelivered(dsn, "late_view") == 0)
    close_history(dsn)
    assert retire(pool, dsn, 0.0) == len(other), "the second range's default leaf went (it held no orders)"

    with pytest.raises(RebuildError, match=r"class default \(every topic\): 1 events"):
        rebuild(early, dsn)
    with psycopg.connect(dsn, autocommit=True) as conn:
        assert history_gap(conn, "late_view", ["orders"]) is None
        assert history_gap(conn, "late_view", ["other"]) is not None, "other topics were in that leaf"
    assert rebuild(late, dsn) == len(later)


def test_the_legacy_partition_holds_every_topic(
        database_factory: Callable[..., str], live: Callable[..., SinkRunner], pool: ConnectionPool[Any]) -> None:
    """An installation converted by 0014: events_legacy holds every topic, so its removal counts for a
    projection of any topic."""
    dsn = database_factory()
    _migrate_to(dsn, 13)
    with psycopg.connect(dsn, autocommit=True) as conn:
        for n in range(3):
            conn.execute("INSERT INTO outbox.events (topic, partition_key, type, payload) "
                         "VALUES ('orders', %s, 'Paid', '{}')", (f"k{n}",))
    migrate(dsn)
    with ConnectionPool(dsn, min_size=1, max_size=4, kwargs={"autocommit": True}) as own_pool:
        p = seen_projection("orders_view", ["orders"])
        sink = ProjectionSink(p, dsn)
        try:
            with psycopg.connect(dsn, autocommit=True) as conn:
                conn.execute("CREATE TABLE orders_view_seen (n bigserial PRIMARY KEY, event_id uuid NOT NULL UNIQUE, "
                             "key text NOT NULL)")
                store.register_sink(conn, sink.name, sink.kind, p.topics)
            runner = SinkRunner(sink, own_pool, make_settings(dsn, "w"))
            runner.desired = set(ALL_BUCKETS)
            run_until(runner, lambda: len(seen(dsn, "orders_view")) == 3)
        finally:
            sink.close()
        assert Housekeeping(own_pool, make_settings(dsn, "hk", retention_seconds=0.0))._apply_retention() == 3
    assert fetch_all(dsn, "SELECT class, topics FROM outbox.history_removed") == [("(all)", None)]
    with psycopg.connect(dsn, autocommit=True) as conn:
        gap = history_gap(conn, "orders_view", ["orders"])
    assert gap is not None and "events_legacy or events_default (every topic): 3 events" in gap.describe()


def test_a_dead_letter_whose_partition_went_is_retried_once_in_order(
        dsn: str, pool: ConnectionPool[Any], live: Callable[..., SinkRunner]) -> None:
    """G3/G6/G9 across retention: a dead letter no longer holds its partition (it goes, the event is
    kept as a copy with its idempotency key); `dead-letters retry` delivers it once, after the events of
    its key that passed it and before those published after the retry; then the copy and key go."""
    failing: set[uuid.UUID] = set()
    p = seen_projection("view", None, fail=failing)
    runner = live(p)
    outbox = Outbox(default_topic="orders")
    with psycopg.connect(dsn) as conn:
        dead = outbox.publish(conn, type="Paid", key="k", payload={"n": 1}, idempotency_key="pay-1").id
        conn.commit()
    failing.add(dead)
    passed = publish(dsn, [("k", "Paid", {"n": 2})])
    run_until(runner, lambda: seen(dsn, "view") == passed and dead in dead_letters(dsn, "view"))
    close_history(dsn)

    assert retire(pool, dsn, 0.0) == 2, "the partition went although it held a dead letter"
    assert fetch_all(dsn, "SELECT count(*) FROM outbox.events") == [(0,)]
    assert fetch_all(dsn, "SELECT id FROM outbox.kept_events") == [(dead,)]
    with psycopg.connect(dsn) as conn:
        assert outbox.publish(conn, type="Paid", key="k", payload={"n": 1}, idempotency_key="pay-1") == \
            Published(dead, False), "the key lives as long as the event is kept"
        conn.rollback()
    with psycopg.connect(dsn, autocommit=True) as conn:
        [row] = admin.dead_letters(conn, sink="view").records()
        assert (row["event_id"], row["type"], row["topic"]) == (dead, "Paid", "orders"), "listed from its copy"
        failing.clear()
        assert admin.retry_dead_letters(conn, "view", key="k").count == 1
    after = publish(dsn, [("k", "Paid", {"n": 3})])
    run_until(runner, lambda: len(seen(dsn, "view")) == 3)
    run_until(runner, lambda: True)
    assert seen(dsn, "view") == [*passed, dead, *after], "once, before what came after the retry"
    assert dead_letters(dsn, "view") == {}

    assert retire(pool, dsn, 3600.0) == 0
    assert fetch_all(dsn, "SELECT count(*) FROM outbox.kept_events") == [(0,)], "the copy went with its last use"
    with psycopg.connect(dsn) as conn:
        assert outbox.publish(conn, type="Paid", key="k", payload={"n": 1}, idempotency_key="pay-1").created
        conn.commit()


def test_parked_events_of_a_paused_key_survive_their_partition(dsn: str, pool: ConnectionPool[Any]) -> None:
    """A paused key's events wait parked for as long as the operator wants: their partition goes, and
    once resumed they are delivered from the copies, in order, with the key's later events behind them."""
    sink = RecordingSink("w")
    runner = runner_for(sink, pool, make_settings(dsn, "w"))
    with psycopg.connect(dsn, autocommit=True) as conn:
        admin.pause_key(conn, "k", sink.name, reason="hold")
    held = publish(dsn, [("k", "t", {"n": n}) for n in range(3)])
    other = publish(dsn, [("j", "t", {})])
    run_until(runner, lambda: sink.delivered_ids() == set(other)
              and fetch_all(dsn, "SELECT count(*) FROM outbox.parked") == [(3,)])
    close_history(dsn)
    assert retire(pool, dsn, 0.0) == 4
    later = publish(dsn, [("k", "t", {"n": 3})])
    with psycopg.connect(dsn, autocommit=True) as conn:
        with pytest.raises(WaitTimeout, match="paused"):  # held, not unknown: its copy stands for it
            wait_for(conn, held, sink=sink.name, timeout=0.2)
        admin.resume_key(conn, "k", sink.name)
    run_until(runner, lambda: sink.delivered_ids() == set(held) | set(other) | set(later))
    assert dedup_per_key(sink.attempts)["k"] == held + later
    assert len([a for a in sink.attempts if a.ok and a.key == "k"]) == 4, "each once"


def test_a_relay_older_than_this_schema_keeps_dead_letters_partitions(
        dsn: str, pool: ConnectionPool[Any], live: Callable[..., SinkRunner]) -> None:
    """A relay of schema version 14 reads parked events from their partitions only: while one is alive,
    a partition with a dead letter stays, and says why."""
    failing: set[uuid.UUID] = set()
    runner = live(seen_projection("view", None, fail=failing))
    (dead,) = publish(dsn, [("k", "t", {})])
    failing.add(dead)
    run_until(runner, lambda: dead in dead_letters(dsn, "view"))
    close_history(dsn)
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("INSERT INTO outbox.workers (id, metadata) VALUES ('old-relay', '{\"version\": \"0.14\"}')")
    assert retire(pool, dsn, 0.0) == 0  # (a pass stores its --retention-seconds, which the report then applies)
    with psycopg.connect(dsn, autocommit=True) as conn:
        cols, rows = history.rows(conn, "partitions", 0.0)
    holds = [dict(zip(cols, r, strict=True))["held_by"] for r in rows]
    assert any(h and "relay old-relay is older than schema version 15" in h for h in holds), holds
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("UPDATE outbox.workers SET status = 'dead' WHERE id = 'old-relay'")
    assert retire(pool, dsn, 0.0) == 1


def test_migration_from_version_14_keeps_what_the_global_watermark_said(
        database_factory: Callable[..., str]) -> None:
    """At version 14 retention had removed events: a sink registered before that is incomplete, one
    registered after is complete. 0015 turns the global watermark into a row for every topic and keeps
    both answers."""
    dsn = database_factory()
    _migrate_to(dsn, 14)
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("INSERT INTO outbox.sinks (name, kind) VALUES ('before', 'projection')")
        conn.execute("UPDATE outbox.history SET removed_through = clock_timestamp(), removed_xid = '5', "
                     "removed_events = 7, removed_at = clock_timestamp()")
        conn.execute("INSERT INTO outbox.sinks (name, kind, history_from) "
                     "VALUES ('after', 'projection', (SELECT removed_through FROM outbox.history))")
    migrate(dsn)
    with psycopg.connect(dsn, autocommit=True) as conn:
        gap = history_gap(conn, "before", ["orders"])
        assert gap is not None and gap.removed == 7 and "every topic" in gap.describe()
        assert history_gap(conn, "after", ["orders"]) is None
        assert history_gap(conn, "after", None) is None


def test_a_relay_records_the_topics_its_sinks_read_and_its_schema_version(dsn: str) -> None:
    """What `status` and the partition hold read: the topics of each sink as its relay registered it
    (changed when the projection's topics change), and the schema version of each relay."""
    from outbox_relay.migrate import latest_version
    from outbox_relay.worker import Worker

    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("CREATE TABLE view_seen (n bigserial PRIMARY KEY, event_id uuid NOT NULL UNIQUE, "
                     "key text NOT NULL)")
    for topics in (["orders", "invoices"], None):
        sink = ProjectionSink(seen_projection("view", topics), dsn)
        worker = Worker(make_settings(dsn, "relay-t"), sinks=[sink])
        try:
            assert worker.start() is True
            assert fetch_all(dsn, "SELECT topics FROM outbox.sinks WHERE name = 'view'") == \
                [(sorted(topics) if topics else None,)]
            [(version,)] = fetch_all(dsn, "SELECT metadata -> 'schema_version' FROM outbox.workers")
            assert version == latest_version()
        finally:
            worker.stop_hard()
            worker.wait()
            sink.close()


def test_a_kafka_dead_letter_whose_partition_went_reaches_the_topic_once_in_key_order(
        dsn: str, pool: ConnectionPool[Any], kafka_bootstrap: str, kafka_topic: str) -> None:
    """The Kafka sink, against the test broker: an event without a topic is dead-lettered at once (no
    default topic configured); its partition goes; the relay is fixed (a default topic) and the dead
    letter retried: it reaches the topic once, after the key's event that passed it and before the one
    published after the retry."""
    from outbox_relay.sinks.kafka import KafkaSink
    from tests.servers import consume_all

    with psycopg.connect(dsn, autocommit=True) as conn:  # a producer in another language left out the topic
        (lost,) = conn.execute("INSERT INTO outbox.events (partition_key, type, payload) "
                               "VALUES ('k', 'no.topic', '{\"n\": 1}') RETURNING id").fetchone() or ()
    (passed,) = publish(dsn, [("k", "t", {"n": 2})], topic=kafka_topic)
    unfixed = KafkaSink("kafka", {"bootstrap.servers": kafka_bootstrap}, None, "urn:test")
    try:
        run_until(runner_for(unfixed, pool, make_settings(dsn, "relay-k")),
                  lambda: lost in dead_letters(dsn, "kafka") and undelivered(dsn, "kafka") == 0, timeout=20)
    finally:
        unfixed.close()
    close_history(dsn)
    assert retire(pool, dsn, 0.0) == 2 and fetch_all(dsn, "SELECT count(*) FROM outbox.events") == [(0,)]

    with psycopg.connect(dsn, autocommit=True) as conn:
        assert admin.retry_dead_letters(conn, "kafka", event_ids=[lost]).count == 1
    (after,) = publish(dsn, [("k", "t", {"n": 3})], topic=kafka_topic)
    fixed = KafkaSink("kafka", {"bootstrap.servers": kafka_bootstrap}, kafka_topic, "urn:test")
    try:
        run_until(runner_for(fixed, pool, make_settings(dsn, "relay-k")),
                  lambda: undelivered(dsn, "kafka") == 0 and not fetch_all(dsn, "SELECT 1 FROM outbox.parked"),
                  timeout=20)
    finally:
        fixed.close()
    messages = consume_all(kafka_bootstrap, kafka_topic, 3, timeout=20, settle=1.0)
    in_order = sorted(messages, key=lambda m: (m.partition, m.offset))
    assert [m.headers["ce_id"] for m in in_order] == [str(passed), str(lost), str(after)]
    assert [m.json() for m in in_order] == [{"n": 2}, {"n": 1}, {"n": 3}]
    assert dead_letters(dsn, "kafka") == {}
