"""Migrations: the snapshot sql/schema.sql equals all migrations applied; migrate is idempotent
and safe to run concurrently; the bucket function is the one the relays rely on."""

from __future__ import annotations

import sys
import threading
import uuid
from collections.abc import Callable
from typing import Any

import psycopg
import pytest
from psycopg import sql
from psycopg.conninfo import make_conninfo

from outbox_relay import Outbox
from outbox_relay.errors import SchemaError
from outbox_relay.migrate import Migration, check_schema, migrate, migrations
from outbox_relay.sqlfiles import sql_dir

pytestmark = pytest.mark.pg15  # the PostgreSQL 15 step runs it too (scripts/test.sh)

# Each section lists the objects of schema `outbox` in a form that does not depend on oids, so
# two databases built differently compare equal exactly when their schemas are the same.
CATALOG: dict[str, str] = {
    "schemas": """
        SELECT nspname, coalesce(nspacl, '{}')::text FROM pg_namespace WHERE nspname = 'outbox'
    """,
    "relations": """
        SELECT c.relname, c.relkind, c.relpersistence, coalesce(c.reloptions, '{}')::text,
               coalesce(c.relacl, '{}')::text
        FROM pg_class c
        WHERE c.relnamespace = 'outbox'::regnamespace AND c.relkind IN ('r', 'p', 'v', 'm', 'f', 'S')
        ORDER BY 1
    """,
    "columns": """
        SELECT c.relname,
               row_number() OVER (PARTITION BY c.oid ORDER BY a.attnum) AS position,
               a.attname, format_type(a.atttypid, a.atttypmod) AS type, a.attnotnull,
               pg_get_expr(d.adbin, d.adrelid) AS default_expr, a.attidentity, a.attgenerated,
               coalesce(co.collname, '') AS collation
        FROM pg_attribute a
        JOIN pg_class c ON c.oid = a.attrelid
        LEFT JOIN pg_attrdef d ON d.adrelid = a.attrelid AND d.adnum = a.attnum
        LEFT JOIN pg_collation co ON co.oid = a.attcollation AND a.attcollation <> 0
        WHERE c.relnamespace = 'outbox'::regnamespace AND c.relkind IN ('r', 'p', 'v', 'm', 'f')
          AND a.attnum > 0 AND NOT a.attisdropped
        ORDER BY c.relname, a.attnum
    """,
    "sequences": """
        SELECT sequencename, data_type::text, start_value, min_value, max_value, increment_by, cycle, cache_size
        FROM pg_sequences WHERE schemaname = 'outbox'
        ORDER BY 1
    """,
    "indexes": """
        SELECT tablename, indexname, indexdef FROM pg_indexes WHERE schemaname = 'outbox' ORDER BY 1, 2
    """,
    "constraints": """
        SELECT conrelid::regclass::text, conname, contype, pg_get_constraintdef(oid), condeferrable, condeferred
        FROM pg_constraint
        WHERE connamespace = 'outbox'::regnamespace
        ORDER BY 1, 2
    """,
    "functions": """
        SELECT p.oid::regprocedure::text,
               CASE WHEN p.prokind IN ('f', 'p') THEN pg_get_functiondef(p.oid) ELSE p.prokind::text END,
               coalesce(p.proacl, '{}')::text
        FROM pg_proc p
        WHERE p.pronamespace = 'outbox'::regnamespace
        ORDER BY 1
    """,
    "triggers": """
        SELECT t.tgrelid::regclass::text, t.tgname, pg_get_triggerdef(t.oid), t.tgenabled
        FROM pg_trigger t
        JOIN pg_class c ON c.oid = t.tgrelid
        WHERE c.relnamespace = 'outbox'::regnamespace AND NOT t.tgisinternal
        ORDER BY 1, 2
    """,
    "views": """
        SELECT viewname, definition FROM pg_views WHERE schemaname = 'outbox' ORDER BY 1
    """,
    "types": """
        SELECT t.typname, t.typtype,
               (SELECT string_agg(e.enumlabel, ',' ORDER BY e.enumsortorder) FROM pg_enum e WHERE e.enumtypid = t.oid)
        FROM pg_type t
        WHERE t.typnamespace = 'outbox'::regnamespace AND t.typtype IN ('e', 'd', 'c', 'r')
          AND (t.typrelid = 0 OR (SELECT relkind FROM pg_class WHERE oid = t.typrelid) = 'c')
        ORDER BY 1
    """,
    "comments": """
        SELECT i.type, i.identity, d.description
        FROM pg_description d
        CROSS JOIN LATERAL pg_identify_object(d.classoid, d.objoid, d.objsubid) AS i
        WHERE i.schema = 'outbox' OR (i.type = 'schema' AND i.identity = 'outbox')
        ORDER BY 1, 2
    """,
}


def catalog(dsn: str) -> dict[str, list[tuple[Any, ...]]]:
    with psycopg.connect(dsn, autocommit=True) as conn:
        return {name: [tuple(r) for r in conn.execute(q).fetchall()] for name, q in CATALOG.items()}


def applied_versions(dsn: str) -> list[tuple[int, str]]:
    with psycopg.connect(dsn, autocommit=True) as conn:
        rows = conn.execute("SELECT version, name FROM outbox.schema_migrations ORDER BY version").fetchall()
    return [(int(v), str(n)) for v, n in rows]


def shipped() -> list[tuple[int, str]]:
    return [(m.version, m.name) for m in migrations()]


def load_snapshot(dsn: str) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute((sql_dir() / "schema.sql").read_text())


def test_snapshot_equals_all_migrations(database_factory: Callable[..., str]) -> None:
    migrated, snapshot = database_factory(), database_factory()  # both empty, from template0
    assert migrate(migrated), "a fresh database must get every migration"
    load_snapshot(snapshot)

    expected, actual = catalog(migrated), catalog(snapshot)
    assert expected["relations"], "the catalog query found no outbox tables"
    for section in CATALOG:
        assert actual[section] == expected[section], f"sql/schema.sql differs from the migrations in {section}"
    # The snapshot records the migrations it contains, so migrate leaves it alone.
    assert applied_versions(snapshot) == applied_versions(migrated) == shipped()
    assert migrate(snapshot) == []


@pytest.mark.parametrize(("change", "section"), [
    ("ALTER TABLE outbox.events ALTER COLUMN headers SET DEFAULT '[]'::jsonb", "columns"),
    ("ALTER TABLE outbox.workers ALTER COLUMN metadata DROP NOT NULL", "columns"),
    ("ALTER TABLE outbox.dead_letters ADD COLUMN note text", "columns"),
    ("ALTER TABLE outbox.cursors SET (fillfactor = 90)", "relations"),
    ("DROP INDEX outbox.events_created_at; CREATE INDEX events_created_at ON outbox.events USING brin (created_at)",
     "indexes"),
    ("ALTER TABLE outbox.cursors DROP CONSTRAINT cursors_bucket_valid, "
     "ADD CONSTRAINT cursors_bucket_valid CHECK (bucket >= 0 AND bucket < 512)", "constraints"),
    ("CREATE OR REPLACE FUNCTION outbox.bucket_v1(partition_key text) RETURNS integer "
     "LANGUAGE sql IMMUTABLE PARALLEL SAFE STRICT RETURN (hashtextextended(partition_key, 0) & 127)::integer",
     "functions"),
    ("ALTER TABLE outbox.events DISABLE TRIGGER events_check", "triggers"),
    # A WHEN clause that lets one more row through unchecked is drift too.
    ("DROP TRIGGER events_check ON outbox.events; CREATE TRIGGER events_check BEFORE INSERT ON outbox.events "
     "FOR EACH ROW WHEN (NEW.idempotency_key IS NOT NULL) EXECUTE FUNCTION outbox.check_event_v4()", "triggers"),
    ("COMMENT ON TABLE outbox.events IS 'the log'", "comments"),
])
def test_catalog_comparison_sees_changes(dsn: str, change: str, section: str) -> None:
    # The equality above is only worth something if each kind of drift shows up in the catalog.
    before = catalog(dsn)
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(change)
    after = catalog(dsn)
    assert after[section] != before[section]


def test_migrate_is_idempotent(database_factory: Callable[..., str]) -> None:
    dsn = database_factory()
    first = migrate(dsn)
    assert [(m.version, m.name) for m in first] == shipped()
    schema = catalog(dsn)

    assert migrate(dsn) == []
    assert applied_versions(dsn) == shipped()
    assert catalog(dsn) == schema


def migrate_concurrently(dsn: str, workers: int) -> list[list[Migration]]:
    """Run migrate from ``workers`` threads released at once; returns what each applied."""
    barrier = threading.Barrier(workers)
    results: list[list[Migration]] = []
    errors: list[BaseException] = []
    lock = threading.Lock()

    def run() -> None:
        try:
            barrier.wait(timeout=30)
            applied = migrate(dsn)
            with lock:
                results.append(applied)
        except BaseException as exc:
            with lock:
                errors.append(exc)

    threads = [threading.Thread(target=run) for _ in range(workers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors
    return results


def test_concurrent_migrate_applies_each_migration_once(database_factory: Callable[..., str]) -> None:
    for _ in range(3):  # a few rounds: the interesting interleavings are not guaranteed in one
        dsn = database_factory()
        results = migrate_concurrently(dsn, workers=4)
        # Exactly one run applied everything; the others found nothing to do.
        assert sorted(len(r) for r in results) == [0, 0, 0, len(shipped())]
        assert applied_versions(dsn) == shipped()


def test_check_schema(database_factory: Callable[..., str]) -> None:
    dsn = database_factory()
    with psycopg.connect(dsn, autocommit=True) as conn:
        with pytest.raises(SchemaError, match="migrate"):
            check_schema(conn)
        migrate(dsn)
        check_schema(conn)
        conn.execute("DELETE FROM outbox.schema_migrations WHERE version = %s", (shipped()[-1][0],))
        with pytest.raises(SchemaError, match="version"):
            check_schema(conn)


def test_migrate_refuses_a_version_recorded_under_another_name(database_factory: Callable[..., str]) -> None:
    """A database migrated by another build (a branch, a withdrawn migration) whose version N is not this
    code's N: migrate would skip this code's N for good, and check_schema would call the schema current.
    Both refuse, naming the version and both names, and migrate applies nothing."""
    dsn = database_factory()
    ours = migrations()
    middle = ours[len(ours) // 2]
    with psycopg.connect(dsn, autocommit=True) as conn:
        migrate(dsn)
        conn.execute("UPDATE outbox.schema_migrations SET name = 'withdrawn_index' WHERE version = %s",
                     (middle.version,))
        recorded = applied_versions(dsn)
        with pytest.raises(SchemaError, match=f"version {middle.version} .*'withdrawn_index'.*'{middle.name}'"):
            migrate(dsn)
        assert applied_versions(dsn) == recorded
        with pytest.raises(SchemaError, match=f"version {middle.version} .*'withdrawn_index'.*'{middle.name}'"):
            check_schema(conn)


def test_a_newer_schema_is_refused_only_when_its_migrations_need_newer_code(dsn: str) -> None:
    """Relays of the previous release keep running while a rollout migrates first, unless a migration
    says they can not (its ``-- min-code-version``)."""
    ours = shipped()[-1][0]
    with psycopg.connect(dsn, autocommit=True) as conn:
        # migrate recorded each migration's header (0005 is the first that needs code of its own version).
        recorded = conn.execute("SELECT version, min_code_version FROM outbox.schema_migrations WHERE version >= 5 "
                                "ORDER BY version").fetchall()
        assert recorded == [(m.version, m.min_code_version) for m in migrations() if m.version >= 5]
        assert recorded[0] == (5, 5)
        conn.execute("INSERT INTO outbox.schema_migrations (version, name, min_code_version) "
                     "VALUES (%s, 'additive', NULL)", (ours + 1,))
        check_schema(conn)  # newer, but nothing in it needs newer code
        conn.execute("INSERT INTO outbox.schema_migrations (version, name, min_code_version) "
                     "VALUES (%s, 'breaking', %s)", (ours + 2, ours + 1))
        with pytest.raises(SchemaError, match=f"at version {ours + 2}.*written for schema version {ours + 1}"):
            check_schema(conn)


def test_migrate_connection_error_names_no_password() -> None:
    with pytest.raises(SchemaError) as info:
        migrate("postgresql://outbox:s3cret-pw@127.0.0.1:1/nowhere?connect_timeout=2")
    assert "s3cret-pw" not in str(info.value)
    assert "127.0.0.1" in str(info.value)


# Pinned: the bucket of a key must never change (stored rows, cursors and every producer in any
# language depend on it), whatever the server version.
PINNED_BUCKETS = {"order-1": 203, "customer:42": 21, "ключ": 128, "🙂": 118}


def test_bucket_v1_is_stable_and_in_range(dsn: str) -> None:
    keys = [*PINNED_BUCKETS, *(f"key-{i}" for i in range(5000))]
    with psycopg.connect(dsn) as conn:
        # A plain SQL producer (no Python package) gets its bucket from the generated column.
        conn.execute(
            "INSERT INTO outbox.events (partition_key, type, topic, payload) "
            "SELECT k, 'plain', 't', '{}'::jsonb FROM unnest(%s::text[]) AS k",
            (keys,),
        )
        rows = conn.execute(
            "SELECT partition_key, bucket, outbox.bucket_v1(partition_key) FROM outbox.events"
        ).fetchall()
        published = Outbox(default_topic="t").publish(conn, type="py", key="order-1", payload={})
        via_package = conn.execute("SELECT bucket FROM outbox.events WHERE id = %s", (published.id,)).fetchone()
        conn.commit()
    buckets = {key: bucket for key, bucket, _ in rows}
    assert all(stored == computed for _, stored, computed in rows)
    assert all(0 <= b < 256 for b in buckets.values())
    assert set(buckets.values()) == set(range(256)), "5000 keys should reach every bucket"
    assert {k: buckets[k] for k in PINNED_BUCKETS} == PINNED_BUCKETS
    assert via_package == (buckets["order-1"],)


def test_producers_granted_columns_can_publish_after_the_upgrade_to_schema_versions(
        database_factory: Callable[..., str], monkeypatch: pytest.MonkeyPatch) -> None:
    """A producer role granted INSERT on the event columns of docs/roles.md before migration 0012
    publishes after it too: the migration grants it the new schema_version column (publish names it)."""
    migrate_module = sys.modules["outbox_relay.migrate"]  # the package exports a function of that name
    dsn = database_factory()
    shipped_migrations = migrate_module.migrations()
    monkeypatch.setattr(migrate_module, "migrations", lambda: [m for m in shipped_migrations if m.version < 12])
    migrate(dsn)
    role = f"producer_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(sql.SQL("CREATE ROLE {} LOGIN").format(sql.Identifier(role)))
        conn.execute(sql.SQL("GRANT USAGE ON SCHEMA outbox TO {}").format(sql.Identifier(role)))
        conn.execute(sql.SQL("GRANT INSERT (id, topic, partition_key, type, payload, headers, idempotency_key, "
                             "occurred_at) ON outbox.events TO {}").format(sql.Identifier(role)))
    try:
        monkeypatch.undo()
        assert [m.version for m in migrate(dsn)] == [v for v, _ in shipped() if v >= 12]
        with psycopg.connect(make_conninfo(dsn, user=role, password=None)) as conn:
            Outbox(default_topic="t").publish(conn, type="t", key="k", payload={}, version=2)
    finally:
        with psycopg.connect(dsn, autocommit=True) as conn:
            conn.execute(sql.SQL("DROP OWNED BY {}").format(sql.Identifier(role)))
            conn.execute(sql.SQL("DROP ROLE {}").format(sql.Identifier(role)))
