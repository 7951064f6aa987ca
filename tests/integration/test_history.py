"""History (0014): a partitioned outbox.events, retention by whole partitions per retention class, the
default partition, idempotency keys that live as long as their event, the conversion of an existing
installation, and relays of schema version 12 running against the new table."""

from __future__ import annotations

import json
import threading
import uuid
from collections.abc import Callable
from typing import Any

import psycopg
import pytest
from psycopg_pool import ConnectionPool

from outbox_relay import cli, history, store
from outbox_relay.housekeeping import Housekeeping
from outbox_relay.migrate import latest_version, migrate, migrations
from outbox_relay.positions import Cursor
from outbox_relay.publish import Outbox, Published
from outbox_relay.relay import SinkRunner
from outbox_relay.sqlfiles import compact, query, sql_dir
from tests.integration.relay_helpers import (  # noqa: F401  (pool_fixture provides `pool`)
    ALL_BUCKETS,
    DELIVER_ALL_SQL,
    SINK,
    RecordingSink,
    close_history,
    dedup_per_key,
    fetch_all,
    make_settings,
    pool_fixture,
    publish,
    register,
    run_until,
    runner_for,
)
from tests.servers import wait_until

pytestmark = pytest.mark.pg15  # the PostgreSQL 15 step runs it too (scripts/test.sh)


def leaves(dsn: str) -> dict[str, str | None]:
    """Leaf partitions of outbox.events with their class (None: a mixed leaf)."""
    return dict(fetch_all(dsn, "SELECT name, class FROM outbox.partitions"))


def where(dsn: str) -> dict[uuid.UUID, str]:
    """Which partition holds each event."""
    return dict(fetch_all(dsn, "SELECT id, tableoid::regclass::text FROM outbox.events"))


def test_retention_drops_whole_partitions_per_class_and_deletes_no_row(dsn: str, pool: ConnectionPool[Any]) -> None:
    """notifications keep 0 s, orders for good, everything else the relays' --retention-seconds: once
    every sink delivered them and the partition is closed, the notifications partition is dropped (a DROP,
    no DELETE: no dead tuples), the others stay; the history watermark moves past what went."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        history.set_class(conn, "short", 0.0)
        history.set_class(conn, "orders", None)
        history.map_topic(conn, "notifications", "short")
        history.map_topic(conn, "orders", "orders")
        history.roll(conn, 86400.0, min_width=1000)  # the classes apply from the next partition
        conn.execute("CREATE TABLE dropped (name text)")
        conn.execute("CREATE FUNCTION log_drop() RETURNS event_trigger LANGUAGE plpgsql AS $$ BEGIN "
                     "INSERT INTO public.dropped SELECT object_identity FROM pg_event_trigger_dropped_objects() "
                     "WHERE object_type = 'table'; END $$")
        conn.execute("CREATE EVENT TRIGGER log_drop ON sql_drop EXECUTE FUNCTION log_drop()")
    register(dsn)
    note = publish(dsn, [(f"n{i}", "Sent", {}) for i in range(20)], topic="notifications")
    order = publish(dsn, [(f"o{i}", "Paid", {}) for i in range(20)], topic="orders")
    other = publish(dsn, [(f"x{i}", "Other", {}) for i in range(20)], topic="other")
    assert {where(dsn)[i] for i in note} == {"outbox.events_p2_short"}
    assert {where(dsn)[i] for i in order} == {"outbox.events_p2_orders"}
    assert {where(dsn)[i] for i in other} == {"outbox.events_p2_default"}

    keep_default = make_settings(dsn, "hk", retention_seconds=3600.0)
    assert Housekeeping(pool, keep_default).run_once().deleted_events == 0, "the range is still being written"
    close_history(dsn)
    assert Housekeeping(pool, keep_default).run_once().deleted_events == 0, "the sink has not delivered them"
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(DELIVER_ALL_SQL)
        conn.execute("SELECT pg_stat_force_next_flush()")

    assert Housekeeping(pool, keep_default).run_once().deleted_events == len(note)
    stored = set(where(dsn))
    assert stored == set(order) | set(other)
    assert "events_p2_short" not in leaves(dsn)
    dropped = {r[0] for r in fetch_all(dsn, "SELECT name FROM dropped")}
    assert "outbox.events_p2_short" in dropped and not dropped & {"outbox.events_p2_orders", "outbox.events_p2_default"}
    # No row was deleted from any partition that is left (and the one dropped had none deleted either:
    # a DELETE is refused by events_no_delete).
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("SELECT pg_stat_force_next_flush()")
    [(deleted, dead)] = fetch_all(dsn, "SELECT coalesce(sum(n_tup_del), 0), coalesce(sum(n_dead_tup), 0) "
                                       "FROM pg_stat_user_tables "
                                       "WHERE schemaname = 'outbox' AND relname LIKE 'events%%'")
    assert (deleted, dead) == (0, 0)
    [(removed_events, removed_through)] = fetch_all(dsn, "SELECT removed_events, removed_through FROM outbox.history")
    newest_note = fetch_all(dsn, "SELECT max(created_at) FROM outbox.events")[0][0]
    assert removed_events == len(note) and removed_through is not None and removed_through <= newest_note

    # What holds the rest, as `status` and `retention list` show it.
    with psycopg.connect(dsn, autocommit=True) as conn:
        cols, rows = history.rows(conn, "by_class", 3600.0)
    by_class = {r[0]: dict(zip(cols, r, strict=True)) for r in rows}
    assert "for good" in by_class["orders"]["held_by"]
    assert "within retention" in by_class["default"]["held_by"]
    assert by_class["default"]["oldest_event"] is not None and by_class["default"]["bytes"] > 0
    # With the default class at 0 s too, its partition goes; orders stay for good.
    assert Housekeeping(pool, make_settings(dsn, "hk", retention_seconds=0.0)).run_once().deleted_events == len(other)
    assert set(where(dsn)) == set(order)


def test_events_no_range_covers_land_in_the_default_partition_and_leave_by_truncate(
        dsn: str, pool: ConnectionPool[Any]) -> None:
    """Housekeeping fell behind: a range of a handful of xids fills up and later transactions write to
    events_default (no insert fails). The next range starts above them; they are delivered in order with
    the rest, and once delivered and past retention events_default is emptied with TRUNCATE."""
    register(dsn)
    with psycopg.connect(dsn, autocommit=True) as conn:
        history.roll(conn, 0.001, min_width=3)  # a range of 3 xids
    ids = [publish(dsn, [("k", "t", {"n": n})])[0] for n in range(6)]
    places = where(dsn)
    assert places[ids[0]] != "outbox.events_default" and places[ids[-1]] == "outbox.events_default", places
    with pool.connection() as conn:
        made = history.make_ahead(conn, 86400.0, min_width=1000)
    assert made, "a new range above the default partition's events"
    later = publish(dsn, [("k", "t", {"n": 6})])
    assert where(dsn)[later[0]] != "outbox.events_default"

    sink = RecordingSink("w")
    settings = make_settings(dsn, "w", retention_seconds=0.0)
    run_until(runner_for(sink, pool, settings), lambda: len(sink.delivered_ids()) == 7)
    assert dedup_per_key(sink.attempts) == {"k": ids + later}, "one key's events in publish order"
    close_history(dsn)
    removed = Housekeeping(pool, settings).run_once().deleted_events
    assert removed == 7
    assert fetch_all(dsn, "SELECT count(*) FROM outbox.events") == [(0,)]
    assert "events_default" in leaves(dsn), "events_default stays (emptied), to catch what no range covers"


def test_delivery_is_once_and_in_order_across_partition_boundaries(dsn: str, pool: ConnectionPool[Any]) -> None:
    """Keys whose events span three partitions (a roll between publishes, while the relay reads)."""
    sink = RecordingSink("w")
    settings = make_settings(dsn, "w")
    runner = runner_for(sink, pool, settings)
    published: dict[str, list[uuid.UUID]] = {f"k{i}": [] for i in range(10)}
    for part in range(3):
        for _ in range(3):
            for key, ids in published.items():
                ids.extend(publish(dsn, [(key, "t", {"part": part})]))
            runner.run_once()
        close_history(dsn)
    total = sum(len(v) for v in published.values())
    run_until(runner, lambda: len(sink.delivered_ids()) == total)
    assert dedup_per_key(sink.attempts) == published
    assert len([a for a in sink.attempts if a.ok]) == total, "each event delivered once"
    assert len(fetch_all(dsn, "SELECT DISTINCT tableoid FROM outbox.events")) >= 3


def test_an_idempotency_key_lives_as_long_as_its_event(dsn: str, pool: ConnectionPool[Any]) -> None:
    """G2 across partitions: a retry finds the stored event in an older partition; once retention
    dropped that partition, the key is free again (its documented lifetime)."""
    outbox = Outbox(default_topic="orders")
    register(dsn)
    with psycopg.connect(dsn) as conn:
        first = outbox.publish(conn, type="Paid", key="o1", payload={"n": 1}, idempotency_key="pay-1")
        conn.commit()
    close_history(dsn)
    with psycopg.connect(dsn) as conn:
        assert outbox.publish(conn, type="Paid", key="o1", payload={"n": 1}, idempotency_key="pay-1") == \
            Published(first.id, False), "a retry in a later partition finds the event in the older one"
        # The SQL path: a repeated key is skipped without an error.
        skipped = conn.execute("INSERT INTO outbox.events (topic, partition_key, type, payload, idempotency_key) "
                               "VALUES ('orders', 'o1', 'Paid', '{\"n\": 1}', 'pay-1')")
        assert skipped.rowcount == 0
        conn.commit()
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(DELIVER_ALL_SQL)
    assert Housekeeping(pool, make_settings(dsn, "hk", retention_seconds=0.0)).run_once().deleted_events == 1
    assert fetch_all(dsn, "SELECT count(*) FROM outbox.idempotency_keys") == [(0,)]
    with psycopg.connect(dsn) as conn:
        again = outbox.publish(conn, type="Paid", key="o1", payload={"n": 1}, idempotency_key="pay-1")
        conn.commit()
    assert again.created and again.id != first.id


def _migrate_to(dsn: str, version: int) -> None:
    """Apply the shipped migrations up to ``version`` (an installation of that release)."""
    with psycopg.connect(dsn, autocommit=True) as conn, conn.transaction():
        conn.execute("CREATE SCHEMA IF NOT EXISTS outbox; CREATE TABLE IF NOT EXISTS outbox.schema_migrations "
                     "(version integer NOT NULL PRIMARY KEY, name text NOT NULL, "
                     "applied_at timestamptz NOT NULL DEFAULT clock_timestamp())")
        done = {r[0] for r in conn.execute("SELECT version FROM outbox.schema_migrations")}
        for m in migrations():
            if m.version > version or m.version in done:
                continue
            conn.execute(m.path.read_text())
            conn.execute("INSERT INTO outbox.schema_migrations (version, name) VALUES (%s, %s)", (m.version, m.name))


def version_12_fetch() -> str:
    """The relay's read as schema version 12 shipped it: today's fetch_events without the xid bounds 0014
    wrote out for partition pruning and the partition floor added after it (the changes of the schema
    since; the fence and lease check, the ``fences`` parameter and the last row's columns are the code's)."""
    text = (sql_dir() / "queries" / "relay.sql").read_text()
    block = text[text.index("-- name: fetch_events"):text.index("-- name: fetch_parked")]
    lines = block.splitlines()
    drop = {"AND e.xid >= pg_snapshot_xmin(w.seen) AND e.xid < pg_snapshot_xmax(w.seen)",
            "AND e.xid >= w.later_xid AND e.xid >= {floor}::xid8", "AND e.xid >= {floor}::xid8"}
    kept = [ln for ln in lines if ln.strip() not in drop]
    assert len(lines) - len(kept) == 3, "fetch_events changed: update version_12_fetch"
    return compact("\n".join(kept[2:]))


# A version-12 relay's retention step, as it was (sql/queries/housekeeping.sql, apply_retention): a
# DELETE by row address, which on a partitioned table names a row in every partition.
OLD_RETENTION = """
WITH old AS (SELECT e.ctid FROM outbox.events e WHERE e.created_at < clock_timestamp() ORDER BY e.created_at LIMIT 10)
DELETE FROM outbox.events WHERE ctid = ANY(ARRAY(SELECT ctid FROM old)) RETURNING created_at, xid
"""


def test_migration_converts_an_installation_and_old_relays_keep_reading(
        database_factory: Callable[..., str]) -> None:
    """An installation at schema version 12 with events, a sink part-way through them and idempotency
    keys is migrated: the old table becomes events_legacy, positions are kept, so the relay delivers
    the rest once and in order (including events published after the migration, in the new partitions);
    keys stay taken; a version-12 relay's read still runs, its row-by-row retention is refused."""
    dsn = database_factory()
    _migrate_to(dsn, 12)
    outbox = Outbox(default_topic="orders")
    with psycopg.connect(dsn) as conn:
        for n in range(30):  # the version-12 SQL path: ON CONFLICT on the old unique index
            conn.execute("INSERT INTO outbox.events (topic, partition_key, type, payload, idempotency_key) "
                         "VALUES ('orders', %s, 'Paid', %s, %s) "
                         "ON CONFLICT ((coalesce(topic, '')), idempotency_key) WHERE idempotency_key IS NOT NULL "
                         "DO NOTHING", (f"k{n % 3}", json.dumps({"n": n}), f"key-{n}"))
        conn.commit()
        # What a version-12 relay does to register its sink (today's register_sink writes 0015's columns).
        conn.execute("INSERT INTO outbox.sinks (name, kind, history_from) "
                     "VALUES (%s, 'projection', (SELECT removed_through FROM outbox.history))", (SINK,))
        conn.execute("INSERT INTO outbox.cursors (sink, bucket) SELECT %s, b FROM generate_series(0, 255) AS b",
                     (SINK,))
        conn.commit()
    before = [r[0] for r in fetch_all(dsn, "SELECT id FROM outbox.events ORDER BY xid, seq")]
    with ConnectionPool(dsn, min_size=1, max_size=4, kwargs={"autocommit": True}) as pool:
        # Today's relay stands in for version 12's (its cursors are the same since 0007); its one read of a
        # newer table, the parked events' copies (0015), gets an empty stand-in until the migration.
        with psycopg.connect(dsn, autocommit=True) as conn:
            conn.execute("CREATE TABLE outbox.kept_events (id uuid, xid xid8, seq bigint, partition_key text, "
                         "bucket int, topic text, type text, payload jsonb, headers jsonb, occurred_at timestamptz, "
                         "created_at timestamptz, schema_version int)")
            # ... and its lease statements, the lapse check of 0016 (v3): the same answers as version 12's v2.
            conn.execute("CREATE FUNCTION outbox.bucket_has_work_v3(sink text, bucket integer, snapshot pg_snapshot, "
                         "target pg_snapshot, after_xid xid8, after_seq bigint) RETURNS boolean LANGUAGE sql "
                         "RETURN outbox.bucket_has_work_v2(sink, bucket, snapshot, target, after_xid, after_seq)")
            # ... and the column its lease statements clear (0021: who re-fenced a bucket).
            conn.execute("ALTER TABLE outbox.cursors ADD COLUMN fenced_by text")
        sink = RecordingSink("w")
        runner = SinkRunner(sink, pool, make_settings(dsn, "w", batch_size=7))  # registered above, as version 12
        runner.desired = set(ALL_BUCKETS)
        run_until(runner, lambda: len(sink.delivered_ids()) >= 10)  # part-way, at version 12
        runner.release_all()
        with psycopg.connect(dsn, autocommit=True) as conn:
            conn.execute("DROP TABLE outbox.kept_events")
            conn.execute("DROP FUNCTION outbox.bucket_has_work_v3")
            conn.execute("ALTER TABLE outbox.cursors DROP COLUMN fenced_by")
        assert [m.version for m in migrate(dsn)][-1] == latest_version()
        assert leaves(dsn).get("events_legacy", "missing") is None
        assert set(where(dsn).values()) == {"outbox.events_legacy"}
        with psycopg.connect(dsn) as conn:
            retry = outbox.publish(conn, type="Paid", key="k0", payload={"n": 0}, idempotency_key="key-0")
            after = [outbox.publish(conn, type="Paid", key=f"k{n % 3}", payload={"n": n}).id for n in range(30, 36)]
            conn.commit()
        assert retry == Published(before[0], False), "keys stored before the migration stay taken"
        assert all(where(dsn)[i].startswith("outbox.events_p") for i in after)

        # A relay of the previous version reads the new table as before ...
        with psycopg.connect(dsn, autocommit=True) as conn:
            bucket = fetch_all(dsn, "SELECT outbox.bucket_v1('k0')")[0][0]
            store.register_sink(conn, "old", "projection")
            store.acquire_leases(conn, "old", "w", [bucket], 60.0)
            origin = Cursor.at((0, 0)).params()
            params = {"sink": "old", "worker": "w", "buckets": [bucket], "limits": [1000], "seen": [origin[0]],
                      "targets": [origin[1]], "after_xids": [origin[2]], "after_seqs": [origin[3]],
                      "types": None, "topics": None,
                      "formatted": True,  # a later, read-only parameter (Kafka header columns or not)
                      "fences": [None]}  # a later one too (None: any fence of the worker's lease)
            old = [r[3] for r in conn.execute(version_12_fetch(), params).fetchall() if r[3] is not None]
            new = [e.id for e in store.fetch_events(conn, "old", "w", {bucket: (1000, Cursor.at((0, 0)))}).events]
            assert old and old == new, "the old read finds the bucket's events across the legacy and new partitions"
            # ... and its retention is refused (a DELETE by ctid would name a row in every partition).
            with pytest.raises(psycopg.errors.FeatureNotSupported, match="events leave by partition"):
                conn.execute(OLD_RETENTION)

        runner = runner_for(sink, pool, make_settings(dsn, "w", batch_size=7))
        run_until(runner, lambda: len(sink.delivered_ids()) == len(before) + len(after))
    delivered = dedup_per_key(sink.attempts)
    published = {k: [i for i in before + after if i in set(ids_of_key(dsn, k))] for k in ("k0", "k1", "k2")}
    assert delivered == published, "every event once, in publish order per key, across the conversion"
    assert len([a for a in sink.attempts if a.ok]) == len(before) + len(after), "nothing delivered twice"


def ids_of_key(dsn: str, key: str) -> list[uuid.UUID]:
    return [r[0] for r in fetch_all(dsn, "SELECT id FROM outbox.events WHERE partition_key = %s ORDER BY xid, seq",
                                    (key,))]


def test_the_retention_command(dsn: str, capsys: pytest.CaptureFixture[str]) -> None:
    def run(*argv: str) -> tuple[int, str, str]:
        code = cli.main(["retention", *argv, "--dsn", dsn])
        out, err = capsys.readouterr()
        return code, out, err

    assert run("class", "short", "--keep", "1d")[0] == cli.EXIT_OK
    assert run("topic", "notifications", "--class", "short")[0] == cli.EXIT_OK
    code, _, err = run("topic", "orders", "--class", "missing")
    assert code == cli.EXIT_ERROR and "retention class 'missing' does not exist" in err
    code, _, err = run("class", "Bad-Name", "--keep", "1d")
    assert code == cli.EXIT_ERROR and "retention class name 'Bad-Name' is invalid" in err
    code, _, err = run("class", "short", "--keep", "soon")
    assert code == cli.EXIT_ERROR and "not a duration" in err
    code, _, err = run("drop-class", "short")
    assert code == cli.EXIT_ERROR and "topics or partitions still use it" in err
    code, out, _ = run("roll", "--json")
    assert code == cli.EXIT_OK and json.loads(out)["partition"] == "events_p2"
    code, out, _ = run("list", "--json")
    doc = json.loads(out)
    classes = {c["class"]: c for c in doc["classes"]}
    assert classes["short"]["keep"] == "1 day" and classes["short"]["keep_seconds"] == 86400
    assert classes["short"]["topics"] == ["notifications"]
    assert classes["default"]["keep_from_relays"] is True
    assert {h["class"] for h in doc["history"]} >= {"default", "short"}
    code, out, _ = run("partitions", "--json")
    names = {p["name"] for p in json.loads(out)["partitions"]}
    assert {"events_default", "events_p2_short", "events_p2_default"} <= names
    assert cli.main(["status", "--json", "--dsn", dsn]) == cli.EXIT_OK
    assert "retention" in json.loads(capsys.readouterr().out)


def test_a_read_of_the_relay_finds_events_of_every_partition(dsn: str) -> None:
    """fetch_events from a cursor at the origin returns a bucket's events from all partitions in order."""
    register(dsn)
    ids: list[uuid.UUID] = []
    for _ in range(3):
        ids += publish(dsn, [("same-key", "t", {})])
        close_history(dsn)
    with psycopg.connect(dsn, autocommit=True) as conn:
        bucket = fetch_all(dsn, "SELECT outbox.bucket_v1('same-key')")[0][0]
        store.acquire_leases(conn, SINK, "w", [bucket], 60.0)
        got = store.fetch_events(conn, SINK, "w", {bucket: (100, Cursor.at((0, 0)))}).events
    assert [e.id for e in got] == ids
    assert query("relay", "fetch_events")  # the statement under test is the relay's own


def test_a_parked_head_blocks_its_key_across_a_partition_boundary(dsn: str, pool: ConnectionPool[Any]) -> None:
    """G6/G9 across partitions: a key's head fails and is parked in one partition; its next event, in the
    next partition, waits behind it; after the retry both arrive in publish order."""
    from outbox_relay.sinks.engine import Failure

    (head,) = publish(dsn, [("k", "t", {"n": 1})])
    close_history(dsn)
    (behind,) = publish(dsn, [("k", "t", {"n": 2})])
    assert where(dsn)[head] != where(dsn)[behind]
    sink = RecordingSink("w", fail=lambda e, n: Failure("not yet") if e.id == head and n == 0 else None)
    runner = runner_for(sink, pool, make_settings(dsn, "w", backoff_base_seconds=0.05, backoff_max_seconds=0.05))
    run_until(runner, lambda: sink.delivered_ids() == {head, behind})
    assert dedup_per_key(sink.attempts) == {"k": [head, behind]}
    assert [a.event_id for a in sink.attempts] == [head, head, behind], "the second waited for the head's retry"


def test_a_long_transactions_events_are_kept_for_their_class_keep_after_it_ended(dsn: str) -> None:
    """An event's created_at is its transaction's start (issue 25, finding 4): a transaction open for longer
    than the keep wrote events that looked old at commit, and went as soon as they were delivered. Since
    0019 a range's keep counts from when retention first saw it closed, too."""
    keep = 1.0
    register(dsn)
    with psycopg.connect(dsn, autocommit=True) as conn:
        history.roll(conn, 0.001, min_width=3)  # a range of 3 xids, which the long transaction writes into
    with psycopg.connect(dsn) as long_tx:
        event = publish_in(long_tx)
        started = long_tx.execute("SELECT now()").fetchone()
        with psycopg.connect(dsn, autocommit=True) as other:
            for _ in range(5):  # later transactions take ids past the range: only the long one holds it open
                other.execute("SELECT pg_current_xact_id()")
            wait_until(lambda: other.execute("SELECT clock_timestamp() - %s > make_interval(secs => %s)",
                                              (started[0] if started else None, 2 * keep)).fetchone() == (True,),
                       timeout=30, message="the long transaction to be older than the keep")
        long_tx.commit()
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(DELIVER_ALL_SQL)
        assert sum(r.events for r in history.retire(conn, keep, 5.0)) == 0, "went at once, on delivery"
        assert [str(r[0]) for r in conn.execute("SELECT id FROM outbox.events")] == [str(event)]
        held = conn.execute("SELECT outbox.partition_hold_v1(p.name, make_interval(secs => %s)) "
                            "FROM outbox.events e "
                            "JOIN outbox.partitions p ON 'outbox.' || p.name = e.tableoid::regclass::text",
                            (keep,)).fetchone()
        assert held is not None and "its range closed" in str(held[0]), held
        # ... and it goes once the keep has passed since then.
        wait_until(lambda: sum(r.events for r in history.retire(conn, keep, 5.0)) == 1, timeout=30, interval=0.2,
                   message="the event to go a keep after its transaction ended")


def publish_in(conn: psycopg.Connection[Any]) -> uuid.UUID:
    return Outbox(default_topic="t").publish(conn, type="t", key="k", payload={}).id


def test_a_roll_waiting_for_the_events_table_lets_producers_through(dsn: str) -> None:
    """`retention roll` behind a long reader: producers queue behind a waiting ACCESS EXCLUSIVE request, so
    the roll asks for it a short wait at a time (issue 25, finding 4: one wait of 5 s held them all up)."""
    result: dict[str, Any] = {}
    with psycopg.connect(dsn) as reader:
        reader.execute("SELECT count(*) FROM outbox.events")  # holds ACCESS SHARE until it ends

        def rolling() -> None:
            try:
                with psycopg.connect(dsn, autocommit=True) as conn:
                    result["rolled"] = history.roll(conn, 86400.0, min_width=1000)
            except psycopg.Error as exc:
                result["error"] = exc

        thread = threading.Thread(target=rolling)
        thread.start()
        wait_until(lambda: fetch_all(dsn, "SELECT count(*) FROM pg_locks WHERE NOT granted "
                                          "AND relation = 'outbox.events'::regclass AND mode = 'AccessExclusiveLock'")
                   == [(1,)], timeout=10, interval=0.005, message="the roll to wait for the lock")
        with psycopg.connect(dsn) as producer:
            publish_in(producer)
            producer.commit()
        assert thread.is_alive() and not result, "the producer got through only once the roll gave up"
    thread.join(timeout=30)
    assert "rolled" in result, result
