"""Producers notify nobody (migration 0010): one relay watches for commits and wakes the owners.

A producer's transaction is a plain INSERT: no NOTIFY (which serialised publishing commits on the
server), so two-phase commit works; relays still wake within milliseconds because the relay that
holds the watch lock (wakeups.py) finds new commits and notifies for them.
"""

from __future__ import annotations

import time
import uuid
from typing import Any

import psycopg
import pytest
from psycopg import sql

from outbox_relay import Outbox
from outbox_relay.worker import Worker
from tests.integration.relay_helpers import RecordingSink, keys_in_bucket, make_settings, publish, running, settled
from tests.servers import wait_until

pytestmark = pytest.mark.pg15  # the PostgreSQL 15 step runs it too (scripts/test.sh)

TOPIC = "orders"


def _listener(dsn: str) -> psycopg.Connection[Any]:
    conn = psycopg.connect(dsn, autocommit=True)
    conn.execute("LISTEN outbox_events_v2")
    return conn


def test_a_publishing_transaction_notifies_nobody(dsn: str) -> None:
    """Neither publish nor the plain SQL path sends a notification: nothing in the producer's commit
    takes PostgreSQL's server-wide notify lock."""
    outbox = Outbox(default_topic=TOPIC)
    with _listener(dsn) as listener:
        with psycopg.connect(dsn) as conn:
            outbox.publish(conn, type="order.created", key="o-1", payload={"n": 1})
            outbox.publish_many(conn, [{"type": "order.paid", "key": f"o-{i}", "payload": {}} for i in range(3)])
            outbox.publish(conn, type="order.created", key="o-9", payload={}, idempotency_key="idem-9")
            conn.execute("INSERT INTO outbox.events (topic, partition_key, type, payload) "
                         "VALUES ('orders', 'o-2', 'order.created', '{}')")
        with psycopg.connect(dsn) as conn:
            stored = conn.execute("SELECT count(*) FROM outbox.events").fetchone()
        assert stored == (6,)
        notes = list(listener.notifies(timeout=1.0))
    assert notes == [], f"a producer's commit sent {notes}"


def _prepared_transactions_enabled(dsn: str) -> bool:
    with psycopg.connect(dsn) as conn:
        row = conn.execute("SELECT current_setting('max_prepared_transactions')::int").fetchone()
    return bool(row and row[0] > 0)


def test_a_transaction_that_published_can_be_prepared_and_its_event_is_delivered(dsn: str) -> None:
    """Two-phase commit: PREPARE TRANSACTION after publish works (a NOTIFY made it fail), and the
    relay wakes for the event when COMMIT PREPARED makes it visible, with polling every 30 s."""
    if not _prepared_transactions_enabled(dsn):
        pytest.skip("the server has max_prepared_transactions = 0")
    sink = RecordingSink("relay-a")
    worker = Worker(make_settings(dsn, "relay-a", listen=True, poll_seconds=30.0, listen_poll_seconds=30.0),
                    sinks=[sink])
    gid = f"outbox-test-{uuid.uuid4().hex[:8]}"
    with running(worker):
        wait_until(lambda: settled(dsn, ["relay-a"]) and worker.watching, 15,
                   message="the relay to hold every bucket and watch for commits")
        with psycopg.connect(dsn, autocommit=True) as conn:
            conn.execute("BEGIN")
            published = Outbox(default_topic=TOPIC).publish(conn, type="order.created", key="o-1", payload={})
            conn.execute(sql.SQL("PREPARE TRANSACTION {}").format(sql.Literal(gid)))
        with psycopg.connect(dsn, autocommit=True) as conn:
            conn.execute(sql.SQL("COMMIT PREPARED {}").format(sql.Literal(gid)))
        wait_until(lambda: sink.delivered_ids() == {published.id}, 10,
                   message="the prepared transaction's event to be delivered")


def test_watch_commits_finds_a_transaction_that_was_open_at_the_last_look(dsn: str) -> None:
    """A commit of a transaction that was already open when the watcher looked (its id is in that
    snapshot's xip list, below xmax) is found as well as later ones; an empty look returns no buckets."""
    watch = "SELECT snapshot::text, buckets FROM outbox.watch_commits_v1(%s::pg_snapshot, %s, 1)"
    with psycopg.connect(dsn, autocommit=True) as watcher, psycopg.connect(dsn) as early, \
            psycopg.connect(dsn) as late:
        early.execute("SELECT pg_current_xact_id()")  # the early transaction has its id now
        row = watcher.execute(watch, (None, 0)).fetchone()
        assert row is not None and row[1] is None
        since = row[0]
        key_early, key_late = keys_in_bucket(dsn, 3, 1)[0], keys_in_bucket(dsn, 200, 1)[0]
        late.execute("INSERT INTO outbox.events (topic, partition_key, type, payload) VALUES ('t', %s, 'x', '{}')",
                     (key_late,))
        late.commit()
        row = watcher.execute(watch, (since, 2000)).fetchone()
        assert row is not None and row[1] == "200"
        since = row[0]
        row = watcher.execute(watch, (since, 0)).fetchone()
        assert row is not None and row[1] is None, "a look with no new commit named buckets"
        since = row[0]
        early.execute("INSERT INTO outbox.events (topic, partition_key, type, payload) VALUES ('t', %s, 'x', '{}')",
                      (key_early,))
        early.commit()
        row = watcher.execute(watch, (since, 2000)).fetchone()
        assert row is not None and row[1] == "3", "the transaction open at the last look was missed"


def test_watch_commits_names_every_bucket_of_a_large_commit_as_all(dsn: str) -> None:
    with psycopg.connect(dsn, autocommit=True) as watcher:
        (since,) = watcher.execute("SELECT snapshot::text FROM outbox.watch_commits_v1(NULL, 0, 1)").fetchone()  # type: ignore[misc]
        with psycopg.connect(dsn) as conn:
            conn.execute("INSERT INTO outbox.events (topic, partition_key, type, payload) "
                         "SELECT 't', 'k' || i, 'x', '{}' FROM generate_series(1, 10001) AS i")
        row = watcher.execute("SELECT buckets FROM outbox.watch_commits_v1(%s::pg_snapshot, 2000, 1)",
                              (since,)).fetchone()
    assert row == ("*",)


def test_one_relay_watches_and_another_takes_over_when_it_leaves(dsn: str) -> None:
    """Exactly one of three relays watches; when it drains, another one watches, and a commit still
    wakes its bucket's owner with polling every 30 s."""
    names = ["relay-a", "relay-b", "relay-c"]
    sinks = {n: RecordingSink(n) for n in names}
    workers = {n: Worker(make_settings(dsn, n, listen=True, poll_seconds=30.0, listen_poll_seconds=30.0),
                         sinks=[sinks[n]]) for n in names}
    with running(workers["relay-a"]), running(workers["relay-b"]):
        with running(workers["relay-c"]):
            wait_until(lambda: settled(dsn, names), 15, message="the assignment to settle")
            wait_until(lambda: sum(w.watching for w in workers.values()) == 1, 10,
                       message="one relay to watch for commits")
            watcher = next(n for n, w in workers.items() if w.watching)
        if watcher != "relay-c":
            workers[watcher].drain()
        rest = [n for n in names if n not in (watcher, "relay-c")]
        wait_until(lambda: settled(dsn, rest), 15, message="the assignment to settle on the rest")
        wait_until(lambda: [n for n in rest if workers[n].watching] != [], 15,
                   message="another relay to take over watching")
        ids = publish(dsn, [(f"key-{i}", "t", {}) for i in range(20)])
        wait_until(lambda: set().union(*(sinks[n].delivered_ids() for n in rest)) >= set(ids), 10,
                   message="the remaining relays to be woken for the commit")


@pytest.mark.parametrize(("columns", "values", "message"), [
    ("xid, topic, partition_key, type, payload", "'1', 't', 'k', 'x', '{}'", "xid is set by the database"),
    ("created_at, topic, partition_key, type, payload", "now() - interval '1 day', 't', 'k', 'x', '{}'",
     "created_at is set by the database"),
    ("topic, partition_key, type, payload", "'no spaces', 'k', 'x', '{}'", "is not a Kafka topic name"),
    ("topic, partition_key, type, payload", "'..', 'k', 'x', '{}'", "is not a Kafka topic name"),
    ("topic, partition_key, type, payload, headers", "'t', 'k', 'x', '{}', '{\"ce_id\": \"1\"}'",
     "is reserved for the relay"),
    ("topic, partition_key, type, payload, occurred_at", "'t', 'k', 'x', '{}', 'infinity'",
     "occurred_at infinity is outside 0001-01-02 to 9999-12-30 UTC"),
    ("topic, partition_key, type, payload, occurred_at", "'t', 'k', 'x', '{}', '0001-01-01 23:59:59.999999+00'",
     "occurred_at .* is outside"),
    ("topic, partition_key, type, payload, occurred_at", "'t', 'k', 'x', '{}', '9999-12-31 00:00:00+00'",
     "occurred_at .* is outside"),
])
def test_the_sql_path_still_refuses_what_no_relay_could_deliver(dsn: str, columns: str, values: str,
                                                                 message: str) -> None:
    """The check trigger runs only for rows its WHEN clause picks; a plain row with a bad field must
    still be one of them."""
    with psycopg.connect(dsn) as conn, pytest.raises(psycopg.errors.CheckViolation, match=message):
        conn.execute(f"INSERT INTO outbox.events ({columns}) VALUES ({values})")  # type: ignore[arg-type]


# Rows this transaction's sequential scans read from the leaves of outbox.events (scans count on the
# leaves, not on the partitioned parent; an empty leaf's scan reads none and costs nothing).
LEAF_SEQ_ROWS = ("SELECT coalesce(sum(s.seq_tup_read), 0)::bigint FROM pg_partition_tree('outbox.events') t "
                 "JOIN pg_stat_xact_user_tables s ON s.relid = t.relid")


def watch_looks(dsn: str, conn: psycopg.Connection[Any], since: str, looks: int, *, publish: bool = False) -> str:
    """``looks`` whole looks of the watch on ``conn``, each after a transaction with an id ended elsewhere
    (0022: while none ends, a look only compares snapshots) that published an event or (by default) nothing;
    the snapshot of the last."""
    with psycopg.connect(dsn, autocommit=True) as ender:
        for _ in range(looks):
            ender.execute("INSERT INTO outbox.events (topic, partition_key, type, payload) VALUES ('t', 'k', 'x', '{}')"
                          if publish else "SELECT pg_current_xact_id()")
            row = conn.execute("SELECT snapshot::text, buckets FROM outbox.watch_commits_v1(%s::pg_snapshot, 5, 1)",
                               (since,)).fetchone()
            assert row is not None and (row[1] is not None) == publish
            since = row[0]
    return since


def test_watching_reads_the_index_not_the_table_whatever_its_size(dsn: str) -> None:
    """The watcher looks a thousand times a second; PL/pgSQL caches a generic plan of its look after
    five runs. Neither plan may scan outbox.events: with 100,000 delivered events stored, ten whole
    looks (custom and generic plans) make no sequential scan of any of its leaves."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("INSERT INTO outbox.events (topic, partition_key, type, payload) "
                     "SELECT 't', 'k' || (i % 1000), 'x', '{}' FROM generate_series(1, 100000) AS i")
        conn.execute("ANALYZE outbox.events")
    with psycopg.connect(dsn) as conn, psycopg.connect(dsn) as other:
        other.execute("SELECT pg_current_xact_id()")  # an open transaction: the looks probe its id too
        (since,) = conn.execute("SELECT snapshot::text FROM outbox.watch_commits_v1(NULL, 0, 1)").fetchone()  # type: ignore[misc]
        watch_looks(dsn, conn, since, 10)
        (scans,) = conn.execute(LEAF_SEQ_ROWS).fetchone()  # type: ignore[misc]
    assert scans == 0, f"the watcher's sequential scans read {scans} rows of the events table"


def test_a_plan_made_while_the_table_was_empty_still_reads_the_index_once_it_has_grown(dsn: str) -> None:
    """The watcher's session plans its look once, when the relay starts, often on an empty or new partition
    whose statistics say "tiny"; the plan stays until the partition is next analysed. A sequential scan
    chosen then would read the whole partition at every look as it grows (seen: the watcher's backend at
    half a core at 5,000 events/s, bench/results/2026-12-04-watcher-plan.md)."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("ANALYZE outbox.events")  # as autovacuum does to a new partition: "empty", and believed
    with psycopg.connect(dsn) as conn, psycopg.connect(dsn) as other:
        other.execute("SELECT pg_current_xact_id()")
        (since,) = conn.execute("SELECT snapshot::text FROM outbox.watch_commits_v1(NULL, 0, 1)").fetchone()  # type: ignore[misc]
        # Custom plans, then the generic one, while the table holds a few rows (as when a relay starts).
        since = watch_looks(dsn, conn, since, 10, publish=True)
        conn.commit()
        with psycopg.connect(dsn, autocommit=True) as writer:  # grows, not analysed: the cached plans stay
            for _ in range(40):
                writer.execute("INSERT INTO outbox.events (topic, partition_key, type, payload) "
                               "SELECT 't', 'k' || (i % 1000), 'x', '{}' FROM generate_series(1, 500) AS i")
        # A new first snapshot (a call without one scans nothing), so that the rows just written are not news.
        (since,) = conn.execute("SELECT snapshot::text FROM outbox.watch_commits_v1(NULL, 0, 1)").fetchone()  # type: ignore[misc]
        (before,) = conn.execute(LEAF_SEQ_ROWS).fetchone()  # type: ignore[misc]
        watch_looks(dsn, conn, since, 10)
        (after,) = conn.execute(LEAF_SEQ_ROWS).fetchone()  # type: ignore[misc]
    assert after - before == 0, f"the watcher's sequential scans read {after - before} rows in ten looks"


def test_a_short_statement_timeout_does_not_stop_the_watch(dsn: str) -> None:
    """A role or database with statement_timeout below the watch's one-second wait: the relay waits
    at most half of it per call, keeps watching, and wakes the owner with polling every 30 s."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(sql.SQL("ALTER DATABASE {} SET statement_timeout = '300ms'").format(
            sql.Identifier(conn.info.dbname)))
    sink = RecordingSink("relay-a")
    worker = Worker(make_settings(dsn, "relay-a", listen=True, poll_seconds=30.0, listen_poll_seconds=30.0),
                    sinks=[sink])
    with running(worker):
        wait_until(lambda: settled(dsn, ["relay-a"]) and worker.watching, 15, message="the relay to watch")
        for i in range(5):
            time.sleep(0.4)  # past a whole wait each time
            [event] = publish(dsn, [(f"key-{i}", "t", {})])
            wait_until(lambda e=event: e in sink.delivered_ids(), 10, message="the relay to be woken")
        assert worker.watching and worker.listening


def test_an_open_bulk_transaction_is_not_read_at_every_look(dsn: str) -> None:
    """A transaction still open with 20,000 uncommitted events (a bulk load): the watcher's looks skip
    it until it commits (its rows are not visited each millisecond), then name every bucket."""
    with psycopg.connect(dsn) as bulk, psycopg.connect(dsn) as conn:
        (since,) = conn.execute("SELECT snapshot::text FROM outbox.watch_commits_v1(NULL, 0, 1)").fetchone()  # type: ignore[misc]
        conn.commit()
        bulk.execute("INSERT INTO outbox.events (topic, partition_key, type, payload) "
                     "SELECT 't', 'k' || i, 'x', '{}' FROM generate_series(1, 20000) AS i")
        row = conn.execute("SELECT snapshot::text, buckets FROM outbox.watch_commits_v1(%s::pg_snapshot, 200, 1)",
                           (since,)).fetchone()
        assert row is not None and row[1] is None
        # Index entries this transaction's scans of events_xid returned (not yet flushed to pg_stat_*).
        (read,) = conn.execute(  # type: ignore[misc]
            "SELECT pg_stat_get_xact_tuples_returned('outbox.events_xid'::regclass)").fetchone()
        assert read <= 20000, f"the looks read {read} index entries of the open transaction"
        conn.commit()
        bulk.commit()
        row = conn.execute("SELECT buckets FROM outbox.watch_commits_v1(%s::pg_snapshot, 2000, 1)",
                           (row[0],)).fetchone()
    assert row == ("*",)
