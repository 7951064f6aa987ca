"""The consumer-side inbox against a real broker (Tansu or external) and PostgreSQL (docs/inbox.md)."""

from __future__ import annotations

import re
import threading
from collections import Counter, defaultdict
from collections.abc import Callable
from typing import Any

import psycopg
import pytest

from outbox_relay import timelimit
from outbox_relay.errors import LeaseLost, SchemaError
from outbox_relay.inbox import InboxMessage, apply_test_message, make_message, migrate_inbox
from outbox_relay.inbox.admin import drop_dead_letters, list_dead_letters, request_retry, show_dead_letter
from outbox_relay.inbox.consumer import InboxConsumer
from outbox_relay.inbox.schema import inbox_migrations
from outbox_relay.inbox.store import HandlerBrokeTransaction, InboxStuck, Lease, apply_batch, apply_message, dead_letter
from outbox_relay.inbox.testing import TESTING_MEMBER
from tests.integration import inbox_app
from tests.integration.inbox_helpers import consumer_thread, effects, inbox_database, produce_events, scalar, settings
from tests.servers import KafkaServer, PgServer, create_topic, dbname_of, require_restartable, wait_until


@pytest.fixture
def inbox_dsn(database_factory: Callable[..., str]) -> str:
    return inbox_database(database_factory)


def applied_ids(dsn: str) -> Counter[str]:
    return Counter(e[0] for e in effects(dsn))


def test_duplicates_are_skipped_and_order_per_partition_kept(inbox_dsn: str, kafka_bootstrap: str,
                                                             kafka_topic: str) -> None:
    events = [(f"key-{i % 7}", i % 4, {"n": i}) for i in range(200)]
    ids = produce_events(kafka_bootstrap, kafka_topic, events)
    # The relay's redelivery: the same events (same ce_id) again, at new offsets.
    produce_events(kafka_bootstrap, kafka_topic, events[:50], ids=ids[:50])
    with consumer_thread(settings(inbox_dsn, kafka_bootstrap, kafka_topic)) as consumer:
        wait_until(lambda: consumer.stats.applied + consumer.stats.duplicates >= 250, 60, 0.1, "all 250 handled")
    seen = effects(inbox_dsn)
    assert Counter(e[0] for e in seen) == Counter(ids), "each event applied exactly once"
    assert consumer.stats.duplicates == 50
    per_partition: dict[int, list[int]] = defaultdict(list)
    for _, _, partition, offset in seen:
        per_partition[partition].append(offset)
    assert all(offsets == sorted(offsets) for offsets in per_partition.values()), "offset order per partition"
    by_id = dict(zip(ids, events, strict=True))
    for partition in per_partition:
        ns = [by_id[e[0]][2]["n"] for e in seen if e[2] == partition]
        assert ns == sorted(ns), f"partition {partition} applied out of publish order"
    assert scalar(inbox_dsn, "SELECT sum(duplicates) FROM outbox_inbox.positions") == 50
    assert scalar(inbox_dsn, "SELECT sum(applied) FROM outbox_inbox.positions") == 200


def test_poison_message_goes_to_dead_letters_without_blocking_its_partition_and_is_retried(
        inbox_dsn: str, kafka_bootstrap: str, kafka_topic: str) -> None:
    events = [("k", 0, {"n": 0}), ("k", 0, {"n": 1, "poison": True}), ("k", 0, {"n": 2}), ("other", 1, {"n": 3})]
    ids = produce_events(kafka_bootstrap, kafka_topic, events)
    with consumer_thread(settings(inbox_dsn, kafka_bootstrap, kafka_topic, max_attempts=3)) as consumer:
        wait_until(lambda: consumer.stats.applied >= 3 and consumer.stats.dead == 1, 30, 0.1, "3 applied, 1 dead")
        assert [e[0] for e in effects(inbox_dsn) if e[2] == 0] == [ids[0], ids[2]], "the partition went on"
        with psycopg.connect(inbox_dsn, autocommit=True) as conn:
            [dead] = list_dead_letters(conn, "inbox")
            assert (dead["message_id"], dead["attempts"]) == (ids[1], 3)
            assert "ValueError: poison message" in dead["error"]
            whole = show_dead_letter(conn, "inbox", dead["id"])
            assert dict(zip(whole["header_names"], whole["header_values"], strict=True))["ce_id"] == ids[1].encode()
            # Asked to retry while still poisonous: it fails again, stays, with one more attempt.
            assert request_retry(conn, "inbox", [dead["id"]]) == [dead["id"]]
            wait_until(lambda: scalar(inbox_dsn, "SELECT attempts FROM outbox_inbox.dead_letters") == 4, 15, 0.1)
            conn.execute("INSERT INTO inbox_app.cured VALUES (1)")
            request_retry(conn, "inbox", None)
            wait_until(lambda: scalar(inbox_dsn, "SELECT count(*) FROM outbox_inbox.dead_letters") == 0, 15, 0.1)
    assert applied_ids(inbox_dsn) == Counter(ids), "the retried dead letter applied once"
    assert scalar(inbox_dsn, "SELECT sum(dead) FROM outbox_inbox.positions") == 1


def test_a_handler_past_its_time_limit_fails_its_attempt_and_its_writes_roll_back(
        inbox_dsn: str, kafka_bootstrap: str, kafka_topic: str) -> None:
    # In one batch (one transaction) with a message before it: that one is applied again on its own.
    ids = produce_events(kafka_bootstrap, kafka_topic, [("k", 0, {"n": 0}), ("k", 0, {"sleep": 3}), ("k", 0, {"n": 2})])
    s = settings(inbox_dsn, kafka_bootstrap, kafka_topic, handler_timeout_seconds=0.5, max_attempts=2)

    def handler(message: InboxMessage, conn: psycopg.Connection[Any]) -> None:
        conn.execute("INSERT INTO inbox_app.cured VALUES (1)")  # must never commit for the slow one
        inbox_app.handle(message, conn)

    with consumer_thread(s, handler) as consumer:
        wait_until(lambda: consumer.stats.dead == 1 and consumer.stats.applied == 2, 30, 0.1)
    assert [e[0] for e in effects(inbox_dsn)] == [ids[0], ids[2]]
    assert scalar(inbox_dsn, "SELECT count(*) FROM inbox_app.cured") == 2, "the slow message's write rolled back"
    assert "HandlerTimeout" in scalar(inbox_dsn, "SELECT error FROM outbox_inbox.dead_letters")


def test_handlers_that_never_return_stop_the_consumer_and_free_its_partitions(
        inbox_dsn: str, kafka_bootstrap: str, kafka_topic: str, monkeypatch: pytest.MonkeyPatch) -> None:
    # The process's cap of abandoned threads (timelimit.py, shared with the relay's sinks), 4 more from here.
    monkeypatch.setattr(timelimit, "MAX_ABANDONED", timelimit.abandoned_threads() + 3)
    produce_events(kafka_bootstrap, kafka_topic, [("k", 0, {"n": 0})])
    release = threading.Event()

    def hangs(message: InboxMessage, conn: psycopg.Connection[Any]) -> None:
        release.wait(30)

    consumer = InboxConsumer(settings(inbox_dsn, kafka_bootstrap, kafka_topic, handler_timeout_seconds=0.2,
                                      max_attempts=100), hangs)
    failed: list[BaseException] = []

    def run() -> None:
        try:
            consumer.run(threading.Event())
        except BaseException as exc:
            failed.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(30)
    release.set()
    assert not thread.is_alive() and len(failed) == 1 and isinstance(failed[0], InboxStuck), failed
    assert consumer.stats.dead == 0 and effects(inbox_dsn) == []
    assert scalar(inbox_dsn, "SELECT count(*) FROM outbox_inbox.positions WHERE owner IS NOT NULL") == 0


def test_two_consumers_share_the_partitions_and_one_takes_over_when_the_other_stops(
        inbox_dsn: str, kafka_bootstrap: str, kafka_topic: str) -> None:
    ids = produce_events(kafka_bootstrap, kafka_topic, [(f"k{i}", i % 4, {"n": i}) for i in range(40)])
    a = settings(inbox_dsn, kafka_bootstrap, kafka_topic, member_id="a")
    b = settings(inbox_dsn, kafka_bootstrap, kafka_topic, member_id="b")
    with consumer_thread(a) as first:
        with consumer_thread(b) as second:
            wait_until(lambda: len(first.partitions) == 2 and len(second.partitions) == 2, 30, 0.1, "2 and 2")
            wait_until(lambda: sum(applied_ids(inbox_dsn).values()) >= 40, 30, 0.1)
        more = produce_events(kafka_bootstrap, kafka_topic, [(f"k{i}", i % 4, {"n": i}) for i in range(40, 60)])
        wait_until(lambda: len(first.partitions) == 4, 30, 0.1, "the survivor holds all 4")
        wait_until(lambda: sum(applied_ids(inbox_dsn).values()) >= 60, 30, 0.1)
    assert applied_ids(inbox_dsn) == Counter(ids + more)


def test_a_broker_that_lost_its_log_is_read_from_the_start_without_double_effects(
        inbox_dsn: str, kafka_server: KafkaServer, kafka_topic: str) -> None:
    require_restartable(kafka_server)
    bootstrap = kafka_server.bootstrap
    before = produce_events(bootstrap, kafka_topic, [(f"k{i}", i % 4, {"n": i}) for i in range(40)])
    with consumer_thread(settings(inbox_dsn, bootstrap, kafka_topic)) as consumer:
        wait_until(lambda: consumer.stats.applied == 40, 30, 0.1)
        kafka_server.restart()  # memory storage: the topic and its offsets are gone
        create_topic(bootstrap, kafka_topic, partitions=4)
        # The relay re-sends what it had not seen acknowledged (duplicates), then new events follow;
        # they start at offset 0 again, below the positions stored.
        again = produce_events(bootstrap, kafka_topic, [(f"k{i}", i % 4, {"n": i}) for i in range(5)], ids=before[:5])
        after = produce_events(bootstrap, kafka_topic, [(f"k{i}", i % 4, {"n": i}) for i in range(40, 60)])
        wait_until(lambda: consumer.stats.applied == 60, 60, 0.1, "the new events after the restart")
        wait_until(lambda: consumer.stats.duplicates == 5, 10, 0.1)
    assert again == before[:5]
    assert applied_ids(inbox_dsn) == Counter(before + after)
    assert consumer.stats.log_resets >= 1


def test_connections_cut_mid_stream_cost_no_attempts_and_lose_nothing(
        inbox_dsn: str, pg_server: PgServer, kafka_bootstrap: str, kafka_topic: str) -> None:
    first = produce_events(kafka_bootstrap, kafka_topic, [(f"k{i}", i % 4, {"n": i}) for i in range(40)])
    with consumer_thread(settings(inbox_dsn, kafka_bootstrap, kafka_topic, max_attempts=1)) as consumer:
        wait_until(lambda: consumer.stats.applied == 40, 30, 0.1)
        more: list[str] = []
        for round_ in range(3):
            # The consumer reconnects on its own schedule: cut as soon as it holds a session again.
            wait_until(lambda: pg_server.terminate_backends(dbname_of(inbox_dsn)) >= 1, 30, 0.05,
                       f"a consumer session to cut (round {round_})")
            more += produce_events(kafka_bootstrap, kafka_topic,
                                   [(f"k{i}", i % 4, {"n": i}) for i in range(100 * round_, 100 * round_ + 20)])
        wait_until(lambda: consumer.stats.applied == 100, 60, 0.1, "all applied after the cuts")
    assert consumer.stats.dead == 0, "a database that went away is not the message's fault"
    assert applied_ids(inbox_dsn) == Counter(first + more)


def test_a_restarted_consumer_finds_the_log_it_left_and_goes_on_after_it(
        inbox_dsn: str, kafka_bootstrap: str, kafka_topic: str) -> None:
    first = produce_events(kafka_bootstrap, kafka_topic, [(f"k{i}", i % 4, {"n": i}) for i in range(20)])
    s = settings(inbox_dsn, kafka_bootstrap, kafka_topic)
    with consumer_thread(s) as consumer:
        wait_until(lambda: consumer.stats.applied == 20, 30, 0.1)
    second = produce_events(kafka_bootstrap, kafka_topic, [(f"k{i}", i % 4, {"n": i}) for i in range(20, 30)])
    with consumer_thread(s) as consumer:
        wait_until(lambda: consumer.stats.applied == 10, 30, 0.1)
        assert consumer.stats.duplicates == 0, "read on from the stored positions, not from the start"
    assert consumer.stats.log_resets == 0
    assert applied_ids(inbox_dsn) == Counter(first + second)


def test_the_testing_aid_runs_the_real_transaction(inbox_dsn: str) -> None:
    with psycopg.connect(inbox_dsn) as conn:
        message = make_message({"n": 1}, ce_id="e-1", offset=7)
        assert apply_test_message(conn, inbox_app.handle, message) == "applied"
        assert apply_test_message(conn, inbox_app.handle, make_message({"n": 1}, ce_id="e-1", offset=8)) == "duplicate"
        with pytest.raises(ValueError, match="poison"):
            apply_test_message(conn, inbox_app.handle, value={"poison": True}, ce_id="e-2")

        def commits(message: InboxMessage, conn: psycopg.Connection[Any]) -> None:
            conn.commit()

        with pytest.raises(HandlerBrokeTransaction):
            apply_test_message(conn, commits, ce_id="e-3")
    assert [e[0] for e in effects(inbox_dsn)] == ["e-1"]
    assert scalar(inbox_dsn, "SELECT count(*) FROM outbox_inbox.messages") == 1, "no record of what failed"
    assert scalar(inbox_dsn, "SELECT next_offset FROM outbox_inbox.positions") == 9


def test_a_process_that_lost_its_lease_writes_nothing(inbox_dsn: str) -> None:
    with psycopg.connect(inbox_dsn) as conn:
        assert apply_test_message(conn, inbox_app.handle, ce_id="e-1", offset=0) == "applied"
        fence = scalar(inbox_dsn, "SELECT fence FROM outbox_inbox.positions")
        # Another process took the partition over (a new fence): the old holder's apply is refused.
        with pytest.raises(LeaseLost):
            apply_message(conn, Lease("inbox", TESTING_MEMBER, fence - 1), make_message(ce_id="e-2", offset=1),
                          inbox_app.handle)
        with pytest.raises(LeaseLost):
            dead_letter(conn, Lease("inbox", "someone-else", fence), make_message(ce_id="e-3", offset=1), 3, "x")
    assert [e[0] for e in effects(inbox_dsn)] == ["e-1"]
    assert scalar(inbox_dsn, "SELECT count(*) FROM outbox_inbox.messages") == 1
    assert scalar(inbox_dsn, "SELECT count(*) FROM outbox_inbox.dead_letters") == 0
    assert scalar(inbox_dsn, "SELECT next_offset FROM outbox_inbox.positions") == 1


def test_a_batch_applies_a_second_copy_once_and_commits_what_came_before_a_failing_handler(inbox_dsn: str) -> None:
    with psycopg.connect(inbox_dsn) as conn:
        apply_test_message(conn, inbox_app.handle, ce_id="lease", offset=0)  # leases the partition (fence)
        fence = scalar(inbox_dsn, "SELECT fence FROM outbox_inbox.positions")
        lease = Lease("inbox", TESTING_MEMBER, fence)
        batch = [make_message(ce_id="a", offset=1), make_message(ce_id="a", offset=2),
                 make_message(ce_id="b", offset=3), make_message({"poison": True}, ce_id="c", offset=4),
                 make_message(ce_id="d", offset=5)]
        result = apply_batch(conn, lease, batch, inbox_app.handle)
    assert result.outcomes == ["applied", "duplicate", "applied"]
    assert isinstance(result.failure, ValueError)
    assert [e[0] for e in effects(inbox_dsn)] == ["lease", "a", "b"]
    assert scalar(inbox_dsn, "SELECT next_offset FROM outbox_inbox.positions") == 4, "after b, before c"
    assert scalar(inbox_dsn, "SELECT count(*) FROM outbox_inbox.messages WHERE message_id IN ('c', 'd')") == 0


def test_retention_deletes_old_dedupe_records_in_bounded_batches(inbox_dsn: str, kafka_bootstrap: str) -> None:
    with psycopg.connect(inbox_dsn) as conn:
        for i in range(25):
            apply_test_message(conn, inbox_app.handle, ce_id=f"old-{i}", offset=i)
        apply_test_message(conn, inbox_app.handle, ce_id="new", offset=25)
        conn.execute("UPDATE outbox_inbox.messages SET applied_at = now() - interval '8 days' "
                     "WHERE message_id LIKE 'old-%'")
        conn.commit()
    consumer = InboxConsumer(settings(inbox_dsn, kafka_bootstrap, "t", retention_batch=10), inbox_app.handle)
    consumer.start()
    try:
        assert consumer.housekeeping() == 25
    finally:
        consumer.close()
    assert scalar(inbox_dsn, "SELECT array_agg(message_id) FROM outbox_inbox.messages") == ["new"]


def test_migrate_is_idempotent_and_needs_no_outbox_schema(database_factory: Callable[..., str]) -> None:
    dsn = database_factory()
    with psycopg.connect(dsn, autocommit=True) as conn:
        applied = migrate_inbox(conn)
        assert applied == [f"{v:04d}_{name}" for v, name, _ in inbox_migrations()]
        assert applied[:2] == ["0001_initial", "0002_crash_attempts"] and "0004_incarnations" in applied
        assert migrate_inbox(conn) == []
        assert conn.execute("SELECT to_regnamespace('outbox')").fetchone() == (None,)


def test_migrate_refuses_inbox_tables_that_another_build_migrated(database_factory: Callable[..., str]) -> None:
    """The outbox's runner, so the same check: a version recorded under another name is refused by name,
    not skipped for good."""
    dsn = database_factory()
    with psycopg.connect(dsn, autocommit=True) as conn:
        migrate_inbox(conn)
        conn.execute("UPDATE outbox_inbox.schema_migrations SET name = 'from_a_branch' WHERE version = 2")
        with pytest.raises(SchemaError, match="outbox_inbox schema's version 2 is 'from_a_branch'"):
            migrate_inbox(conn)


def test_dead_letter_operations_refuse_unknown_ids_and_drop(inbox_dsn: str) -> None:
    with psycopg.connect(inbox_dsn, autocommit=True) as conn:
        conn.execute("INSERT INTO outbox_inbox.dead_letters (consumer, message_id, topic, partition, \"offset\", "
                     "attempts, error) VALUES ('inbox', 'x', 't', 0, 1, 5, 'boom'), ('inbox', 'y', 't', 0, 2, 5, 'b')")
        ids = [r["id"] for r in list_dead_letters(conn, "inbox")]
        from outbox_relay.errors import OutboxError
        with pytest.raises(OutboxError, match="no dead letter 999"):
            drop_dead_letters(conn, "inbox", [ids[0], 999])
        assert len(list_dead_letters(conn, "inbox")) == 2, "nothing of a partly wrong command is done"
        assert drop_dead_letters(conn, "inbox", [ids[0]]) == [ids[0]]
        assert [r["id"] for r in list_dead_letters(conn, "inbox")] == ids[1:]


def test_status_says_what_happens_to_each_partition(inbox_dsn: str) -> None:
    """Each state of ``inbox status`` from the rows a consumer leaves (lease 9 s, renewed every 3 s)."""
    from outbox_relay.inbox.admin import positions

    with psycopg.connect(inbox_dsn, autocommit=True) as conn:
        conn.execute("""
            INSERT INTO outbox_inbox.members (consumer, member, incarnation, heartbeat_at) VALUES
                ('inbox', 'live', 'r2', clock_timestamp() - interval '1 second'),
                ('inbox', 'quiet', 'r1', clock_timestamp() - interval '6 seconds');
            INSERT INTO outbox_inbox.positions (consumer, topic, partition, owner, owner_incarnation, lease_until,
                                                attempts, last_error) VALUES
                ('inbox', 't', 0, 'live', 'r2', clock_timestamp() + interval '8 seconds', 0, NULL),
                ('inbox', 't', 1, 'live', 'r2', clock_timestamp() + interval '8 seconds', 2, 'ValueError: no'),
                ('inbox', 't', 2, 'live', 'r1', clock_timestamp() + interval '4 seconds', 0, NULL),
                ('inbox', 't', 3, 'quiet', 'r1', clock_timestamp() + interval '3 seconds', 0, NULL),
                ('inbox', 't', 4, 'gone', 'r0', clock_timestamp() - interval '5 seconds', 0, NULL),
                ('inbox', 't', 5, NULL, NULL, NULL, 0, NULL)""")
        rows = positions(conn, "inbox")
    assert [r["state"] for r in rows] == ["consuming", "retrying", "waiting for previous run", "silent", "lapsed",
                                          "free"]
    detail = [str(r["detail"]) for r in rows]
    assert detail[0] == "" and "attempt 2 (last error: ValueError: no)" in detail[1]
    # Seconds as the query saw them (a loaded machine may take a while between the insert and the query).
    assert "previous run of live" in detail[2] and re.search(r"claimable in [1-4]s", detail[2]), detail[2]
    assert re.search(r"not heard from for ([6-9]|\d\d)s", detail[3]), detail[3]
    assert re.search(r"stopped without releasing it ([5-9]|\d\d)s ago", detail[4]), detail[4]
