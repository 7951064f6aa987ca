"""Privileges by declaration (G13, issue 25 finding 1): every role's rights in the product's schemas are
those of outbox_relay/privileges.py, nothing is open to PUBLIC, and no role can make retention drop
history earlier than the stored policy allows, or take the events table's lock, by calling a function.

The catalog is walked (pg_proc, pg_class, pg_attribute, pg_namespace), not a list: a function or table
that a migration adds without declaring it fails here.
"""

from __future__ import annotations

import re
import sys
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import psycopg
import pytest
from psycopg import sql
from psycopg.conninfo import make_conninfo

from outbox_relay import Outbox, history, migrate, privileges, store
from outbox_relay.inbox.schema import migrate_inbox
from tests.servers import PgServer, dbname_of

pytestmark = pytest.mark.pg15  # the PostgreSQL 15 step runs it too (scripts/test.sh)

BARE = "bare"  # a role with USAGE on the schemas and nothing else


class Roles:
    """The documented roles under names of this test's own (roles are server-wide), plus a bare one."""

    def __init__(self, dsn: str) -> None:
        suffix = uuid.uuid4().hex[:8]
        self.dsn = dsn
        self.names = {r: f"{r}_{suffix}" for r in (*privileges.ROLES, BARE)}

    def rename(self, text: str) -> str:
        for role in privileges.ROLES:
            text = re.sub(rf"\b{role}\b", self.names[role], text)
        return text

    def dsn_of(self, role: str) -> str:
        return make_conninfo(self.dsn, user=self.names[role], password=None)

    def create(self) -> None:
        with psycopg.connect(self.dsn, autocommit=True) as su:
            for name in self.names.values():
                su.execute(sql.SQL("CREATE ROLE {} LOGIN").format(sql.Identifier(name)))
            for schema in privileges.SCHEMAS:
                su.execute(sql.SQL("GRANT USAGE ON SCHEMA {} TO {}").format(
                    sql.Identifier(schema), sql.Identifier(self.names[BARE])))

    def grant(self) -> None:
        with psycopg.connect(self.dsn, autocommit=True) as su:
            for schema in privileges.SCHEMAS:  # two blocks (docs/roles.md, docs/inbox.md)
                su.execute(self.rename(privileges.grants_sql(schema)))

    def drop(self, pg_server: PgServer) -> None:
        with psycopg.connect(self.dsn, autocommit=True) as conn:
            for name in self.names.values():
                if conn.execute("SELECT 1 FROM pg_roles WHERE rolname = %s", (name,)).fetchone():
                    conn.execute(sql.SQL("DROP OWNED BY {}").format(sql.Identifier(name)))
        with pg_server.admin() as admin:
            for name in self.names.values():
                admin.execute(sql.SQL("DROP ROLE IF EXISTS {}").format(sql.Identifier(name)))


@pytest.fixture
def roles(pg_server: PgServer, database_factory: Callable[..., str]) -> Iterator[Roles]:
    dsn = database_factory(migrated=True)
    with psycopg.connect(dsn, autocommit=True) as conn:
        migrate_inbox(conn)
    r = Roles(dsn)
    try:
        r.create()
        yield r
    finally:
        r.drop(pg_server)


def problems(roles: Roles) -> list[str]:
    """Every way the database's rights differ from outbox_relay/privileges.py, for the documented roles, a
    bare role and PUBLIC, over every function, table, sequence, column and schema of the product."""
    found: list[str] = []
    who = {**{r: r for r in privileges.ROLES}, BARE: BARE}
    with psycopg.connect(roles.dsn, autocommit=True) as conn:
        for schema, acl in conn.execute(
                "SELECT nspname, coalesce(nspacl, acldefault('n', nspowner))::text FROM pg_namespace "
                "WHERE nspname = ANY(%s)", (list(privileges.SCHEMAS),)):
            if "=U" in acl.replace(" ", "") and re.search(r'(^|[{,])=', acl):
                found.append(f"schema {schema} is open to PUBLIC: {acl}")
            for kind, role in who.items():
                name = roles.names[role]
                usage, create = conn.execute("SELECT has_schema_privilege(%s, %s, 'USAGE'), "
                                             "has_schema_privilege(%s, %s, 'CREATE')",
                                             (name, schema, name, schema)).fetchone() or (None, None)
                wanted = kind == BARE or schema in privileges.schemas_of(kind)
                if usage != wanted or create:
                    found.append(f"{kind} on schema {schema}: USAGE {usage}, CREATE {create}")
        for schema, signature, oid, public in conn.execute(
                "SELECT n.nspname, "
                "       replace(regexp_replace(p.oid::regprocedure::text, '^' || n.nspname || '\\.', ''), ',', ', '), "
                "       p.oid, "
                "       p.proacl IS NULL OR EXISTS (SELECT FROM aclexplode(p.proacl) a WHERE a.grantee = 0) "
                "FROM pg_proc p JOIN pg_namespace n ON n.oid = p.pronamespace WHERE n.nspname = ANY(%s) "
                "ORDER BY 1, 2", (list(privileges.SCHEMAS),)).fetchall():
            if public:
                found.append(f"function {schema}.{signature} is open to PUBLIC")
            if signature not in privileges.declared_functions(schema):
                found.append(f"function {schema}.{signature} is not declared in outbox_relay/privileges.py")
            for kind in who:
                row = conn.execute("SELECT has_function_privilege(%s, %s::oid, 'EXECUTE')",
                                   (roles.names[who[kind]], oid)).fetchone()
                wanted = kind != BARE and signature in privileges.expected_functions(kind, schema)
                if row is None or row[0] != wanted:
                    found.append(f"{kind} EXECUTE on {schema}.{signature}: {row and row[0]}, declared {wanted}")
        for schema, table, oid, relkind, leaf, public in conn.execute(
                "SELECT n.nspname, c.relname, c.oid, c.relkind, c.relispartition, "
                "       EXISTS (SELECT FROM aclexplode(c.relacl) a WHERE a.grantee = 0) "
                "FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace "
                "WHERE n.nspname = ANY(%s) AND c.relkind IN ('r', 'p', 'v', 'm', 'f', 'S') ORDER BY 1, 2",
                (list(privileges.SCHEMAS),)).fetchall():
            if public:
                found.append(f"{schema}.{table} is open to PUBLIC")
            for kind in who:
                name = roles.names[kind]
                # Leaves of outbox.events: reached through the parent only; sequences: identities, no grants.
                listed = kind != BARE and not leaf and relkind != "S"
                table_rights = privileges.expected_table_rights(kind, schema).get(table, set()) if listed else set()
                column_rights = privileges.expected_column_rights(kind, schema) if listed else {}
                if relkind == "S":
                    have = {p for p in ("USAGE", "SELECT", "UPDATE") if conn.execute(
                        "SELECT has_sequence_privilege(%s, %s::oid, %s)", (name, oid, p)).fetchone() == (True,)}
                else:
                    have = {p for p in privileges.TABLE_PRIVILEGES if conn.execute(
                        "SELECT has_table_privilege(%s, %s::oid, %s)", (name, oid, p)).fetchone() == (True,)}
                if have != table_rights:
                    found.append(f"{kind} on {schema}.{table}: {sorted(have)}, declared {sorted(table_rights)}")
                if relkind == "S":
                    continue
                for column, in conn.execute("SELECT attname FROM pg_attribute WHERE attrelid = %s::oid "
                                            "AND attnum > 0 AND NOT attisdropped", (oid,)).fetchall():
                    for p in ("SELECT", "INSERT", "UPDATE", "REFERENCES"):
                        row = conn.execute("SELECT has_column_privilege(%s, %s::oid, %s, %s)",
                                           (name, oid, column, p)).fetchone()
                        wanted = p in table_rights or column in column_rights.get((table, p), set())
                        if row is None or row[0] != wanted:
                            found.append(f"{kind} {p} on {schema}.{table}.{column}: {row and row[0]}, "
                                         f"declared {wanted}")
    return found


def test_every_function_table_and_column_has_exactly_the_declared_rights(roles: Roles) -> None:
    roles.grant()
    assert problems(roles) == []
    roles.grant()  # the grants are rerun after every migration: a rerun leaves the same
    assert problems(roles) == []


def test_an_undeclared_function_or_table_fails_the_walk(roles: Roles) -> None:
    roles.grant()
    with psycopg.connect(roles.dsn, autocommit=True) as owner:
        owner.execute("CREATE FUNCTION outbox.sneaky_v1() RETURNS int LANGUAGE sql RETURN 1")
        owner.execute("CREATE TABLE outbox_inbox.sneaky (id int)")
        owner.execute("GRANT SELECT ON outbox_inbox.sneaky TO PUBLIC")
    found = problems(roles)
    assert "function outbox.sneaky_v1() is open to PUBLIC" in found
    assert "function outbox.sneaky_v1() is not declared in outbox_relay/privileges.py" in found
    assert "outbox_inbox.sneaky is open to PUBLIC" in found
    # ... and migrate closes what a migration left open (PostgreSQL's default for a new function).
    with psycopg.connect(roles.dsn, autocommit=True) as owner:
        owner.execute(privileges.close_to_public("outbox"))
        owner.execute(privileges.close_to_public("outbox_inbox"))
    found = problems(roles)
    assert "function outbox.sneaky_v1() is open to PUBLIC" not in found
    assert "outbox_inbox.sneaky is open to PUBLIC" not in found


def test_the_inbox_role_is_walked_too(roles: Roles) -> None:
    """A grant the inbox consumer lacks, or one it has beyond the table (here: on schema outbox), fails the walk."""
    roles.grant()
    consumer = roles.names[privileges.INBOX_CONSUMER]
    assert privileges.expected_table_rights(privileges.INBOX_CONSUMER, "outbox_inbox")["messages"] == {
        "SELECT", "INSERT", "DELETE"}
    with psycopg.connect(roles.dsn, autocommit=True) as owner:
        owner.execute(sql.SQL("REVOKE DELETE ON outbox_inbox.messages FROM {}").format(sql.Identifier(consumer)))
        owner.execute(sql.SQL("GRANT USAGE ON SCHEMA outbox TO {0}; GRANT SELECT ON outbox.events TO {0}").format(
            sql.Identifier(consumer)))
    found = problems(roles)
    assert f"{privileges.INBOX_CONSUMER} on outbox_inbox.messages: ['INSERT', 'SELECT'], declared " \
           "['DELETE', 'INSERT', 'SELECT']" in found
    assert f"{privileges.INBOX_CONSUMER} on schema outbox: USAGE True, CREATE False" in found
    assert f"{privileges.INBOX_CONSUMER} on outbox.events: ['SELECT'], declared []" in found
    # The inbox's block gives the DELETE back; the outbox's names only the outbox's roles (a relay's database
    # has no inbox role), so taking back what was granted to the inbox role there is left to whoever granted it.
    roles.grant()
    left = problems(roles)
    consumer_prefix = f"{privileges.INBOX_CONSUMER} "
    assert left and all(p.startswith(consumer_prefix) and "outbox_inbox" not in p[len(consumer_prefix):]
                        for p in left), left


def test_the_inbox_block_runs_in_a_database_without_the_outbox(
        pg_server: PgServer, database_factory: Callable[..., str]) -> None:
    """A consuming service's database has schema outbox_inbox only, and the inbox's role only."""
    dsn = database_factory()
    role = f"{privileges.INBOX_CONSUMER}_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(dsn, autocommit=True) as owner:
        migrate_inbox(owner)
        owner.execute(sql.SQL("CREATE ROLE {} NOLOGIN").format(sql.Identifier(role)))
        try:
            block = re.sub(rf"\b{privileges.INBOX_CONSUMER}\b", role, privileges.grants_sql("outbox_inbox"))
            assert "outbox." not in block and "outbox_producer" not in block
            owner.execute(block)
            owner.execute(block)
            assert owner.execute("SELECT has_table_privilege(%s, 'outbox_inbox.positions', 'UPDATE'), "
                                 "has_table_privilege(%s, 'outbox_inbox.positions', 'DELETE')",
                                 (role, role)).fetchone() == (True, False)
        finally:
            owner.execute(sql.SQL("DROP OWNED BY {}").format(sql.Identifier(role)))
    with pg_server.admin() as admin:
        admin.execute(sql.SQL("DROP ROLE IF EXISTS {}").format(sql.Identifier(role)))


def _call(conn: psycopg.Connection[Any], signature: str) -> None:
    """Call a function of schema outbox with NULL arguments (privileges are checked before it runs)."""
    name, args = signature.split("(", 1)
    types = [t.strip() for t in args.rstrip(")").split(",") if t.strip()]
    conn.execute(f"SELECT * FROM outbox.{name}({', '.join(f'NULL::{t}' for t in types)})")


def _security_definer(dsn: str) -> list[tuple[str, bool]]:
    with psycopg.connect(dsn, autocommit=True) as conn:
        return [(r[0], r[1]) for r in conn.execute(
            "SELECT replace(regexp_replace(p.oid::regprocedure::text, '^outbox\\.', ''), ',', ', '), "
            "       p.prorettype = 'trigger'::regtype "
            "FROM pg_proc p WHERE p.pronamespace = 'outbox'::regnamespace AND p.prosecdef ORDER BY 1")]


@pytest.mark.parametrize("kind", [BARE, *privileges.ROLES])
def test_every_security_definer_function_refuses_the_roles_it_is_not_declared_for(roles: Roles, kind: str) -> None:
    roles.grant()
    definers = _security_definer(roles.dsn)
    assert {s for s, _ in definers} >= {"add_partition_v1(bigint, double precision)",
                                        "roll_partition_v1(bigint, double precision)",
                                        "retire_partition_v1(interval)", "retire_partition_v2()",
                                        "release_kept_events_v1()", "check_event_v4()"}
    allowed = privileges.expected_functions(kind) if kind != BARE else set()
    tried = 0
    with psycopg.connect(roles.dsn_of(kind), autocommit=True) as conn:
        for signature, trigger in definers:
            if signature in allowed:
                continue
            tried += 1
            with pytest.raises(psycopg.errors.InsufficientPrivilege):
                if trigger:  # attached to a table of the caller's own: refused too
                    conn.execute("CREATE TEMPORARY TABLE IF NOT EXISTS mine (id int)")
                    conn.execute(f"CREATE TRIGGER t BEFORE INSERT ON mine FOR EACH ROW "
                                 f"EXECUTE FUNCTION outbox.{signature}")
                else:
                    _call(conn, signature)
    assert tried >= (1 if kind == privileges.RELAY else 6)  # the relay: the trigger


def _delivered_history(dsn: str) -> tuple[Outbox, list[str]]:
    """Three events with idempotency keys, delivered by the one sink, in a closed partition."""
    outbox = Outbox(default_topic="orders")
    with psycopg.connect(dsn) as conn:
        ids = [str(outbox.publish(conn, type="OrderPaid", key=f"order:{i}", payload={"i": i},
                                  idempotency_key=f"paid-{i}").id) for i in range(3)]
        conn.commit()
    with psycopg.connect(dsn, autocommit=True) as conn:
        store.register_sink(conn, "kafka", "kafka")
        conn.execute("UPDATE outbox.cursors SET snapshot = pg_current_snapshot()")  # all delivered
        history.roll(conn, 86400.0, min_width=1000)
        # The relays' housekeeping with the default --retention-seconds (7 days): nothing may go yet.
        assert sum(r.events for r in history.retire(conn, 604800.0, 5.0)) == 0
    return outbox, ids


def _history_intact(dsn: str, outbox: Outbox, ids: list[str]) -> None:
    with psycopg.connect(dsn) as conn:
        kept = {str(r[0]) for r in conn.execute("SELECT id FROM outbox.events")}
        assert set(ids) <= kept, "delivered events within retention were dropped"
        again = outbox.publish(conn, type="OrderPaid", key="order:0", payload={"i": 0}, idempotency_key="paid-0")
        conn.rollback()
    assert not again.created and str(again.id) == ids[0], "the idempotency key was freed: a retry made a new event"


def test_a_role_with_usage_only_can_not_roll_and_retire_history_away(roles: Roles) -> None:
    """The exploit of issue 25: roll_partition_v1 then retire_partition_v1('0 seconds') as a bare role
    dropped every closed, delivered partition (it succeeded before 0019)."""
    outbox, ids = _delivered_history(roles.dsn)
    with psycopg.connect(roles.dsn_of(BARE), autocommit=True) as bare:
        with pytest.raises(psycopg.errors.InsufficientPrivilege):
            bare.execute("SELECT outbox.roll_partition_v1(1000, 86400)")
        with pytest.raises(psycopg.errors.InsufficientPrivilege):
            bare.execute("SELECT * FROM outbox.retire_partition_v1('0 seconds')")
        with pytest.raises(psycopg.errors.InsufficientPrivilege):
            bare.execute("SELECT outbox.add_partition_v1(1, 0.001)")
        with pytest.raises(psycopg.errors.InsufficientPrivilege):
            bare.execute("SELECT outbox.release_kept_events_v1()")
    _history_intact(roles.dsn, outbox, ids)


def test_retention_keeps_the_stored_policy_whatever_a_caller_passes(roles: Roles) -> None:
    """The relay role may call the partition functions (its housekeeping does), but retention goes by the
    keep the last pass stored: asking retire_partition_v1 (relays of version 18) for 0 seconds drops nothing."""
    roles.grant()
    outbox, ids = _delivered_history(roles.dsn)
    with psycopg.connect(roles.dsn_of(privileges.RELAY), autocommit=True) as relay:
        relay.execute("SELECT outbox.roll_partition_v1(1000, 86400)")
        # Empty leaves (the ranges a roll closes before they were written) may go; no event does.
        for call in ("SELECT * FROM outbox.retire_partition_v1('0 seconds')",
                     "SELECT * FROM outbox.retire_partition_v2()"):
            assert [r[1] for r in relay.execute(call).fetchall()] in ([], [0]), call
        held = relay.execute("SELECT outbox.partition_hold_v1(name, '0 seconds') FROM outbox.partitions "
                             "WHERE class = 'default' ORDER BY xid_from LIMIT 1").fetchone()
        assert held is not None and str(held[0]).startswith("within retention"), held
    _history_intact(roles.dsn, outbox, ids)
    # The relays' own setting still rules: a pass with --retention-seconds 0 stores 0, then removes them.
    with psycopg.connect(roles.dsn_of(privileges.RELAY), autocommit=True) as relay:
        removed = history.retire(relay, 0.0, 5.0)
    assert sum(r.events for r in removed) == 3


def test_partition_oldest_reads_leaves_of_the_events_table_only(roles: Roles) -> None:
    roles.grant()
    with psycopg.connect(roles.dsn) as owner:
        Outbox(default_topic="t").publish(owner, type="t", key="k", payload={})
    with psycopg.connect(roles.dsn_of(privileges.RELAY), autocommit=True) as relay:
        assert relay.execute("SELECT outbox.partition_oldest_v1(name) FROM outbox.partitions "
                             "WHERE name <> 'events_default' AND class = 'default'").fetchone() != (None,)
        assert relay.execute("SELECT outbox.partition_oldest_v1('workers')").fetchone() == (None,)
        assert relay.execute("SELECT outbox.partition_oldest_v1('events')").fetchone() == (None,)


# The grants the roles page gave before schema version 19 (the part that matters here).
OLD_GRANTS = """
GRANT USAGE ON SCHEMA outbox TO outbox_producer, outbox_relay, outbox_projector;
GRANT INSERT (id, topic, partition_key, type, payload, headers, idempotency_key, occurred_at, schema_version)
    ON outbox.events TO outbox_producer;
GRANT SELECT (id, topic, idempotency_key, idempotency_fingerprint) ON outbox.events TO outbox_producer;
GRANT SELECT ON outbox.idempotency_keys TO outbox_producer;
GRANT SELECT ON outbox.events, outbox.partitions TO outbox_relay, outbox_projector;
GRANT SELECT, INSERT, UPDATE, DELETE ON outbox.sinks, outbox.cursors TO outbox_relay, outbox_projector;
GRANT SELECT, UPDATE ON outbox.housekeeping, outbox.history TO outbox_relay;
GRANT EXECUTE ON ALL FUNCTIONS IN SCHEMA outbox TO outbox_relay, outbox_projector;
"""


def test_the_migration_closes_a_database_granted_as_the_old_docs_said(
        pg_server: PgServer, database_factory: Callable[..., str], monkeypatch: pytest.MonkeyPatch) -> None:
    migrate_module = sys.modules["outbox_relay.migrate"]  # the package exports a function of that name
    dsn = database_factory()
    shipped = migrate_module.migrations()
    monkeypatch.setattr(migrate_module, "migrations", lambda: [m for m in shipped if m.version < 19])
    migrate(dsn)
    with psycopg.connect(dsn, autocommit=True) as conn:
        migrate_inbox(conn)
    roles = Roles(dsn)
    try:
        roles.create()
        with psycopg.connect(dsn, autocommit=True) as owner:
            owner.execute(roles.rename(OLD_GRANTS))
        with psycopg.connect(roles.dsn_of(privileges.PROJECTOR), autocommit=True) as projector:
            projector.execute("SELECT outbox.roll_partition_v1(1000, 86400)")  # open before 0019
        monkeypatch.undo()
        assert [m.version for m in migrate(dsn)] == [m.version for m in shipped if m.version >= 19]
        # Without running the new grants: every function's EXECUTE is what the table declares, per kind (but for
        # the console's role, which the old docs did not have: it gets its rights from the current block).
        execute = [p for p in problems(roles) if (" EXECUTE on " in p or "function" in p)
                   and not p.startswith(f"{privileges.CONSOLE} ")]
        assert execute == []
        with psycopg.connect(roles.dsn_of(privileges.PROJECTOR), autocommit=True) as projector:
            for call in ("SELECT outbox.roll_partition_v1(1000, 86400)",
                         "SELECT * FROM outbox.retire_partition_v1('0 seconds')"):
                with pytest.raises(psycopg.errors.InsufficientPrivilege):
                    projector.execute(call)
        with psycopg.connect(roles.dsn_of(privileges.RELAY), autocommit=True) as relay:
            assert history.make_ahead(relay, 86400.0) is not None  # the relays' housekeeping still runs
            assert sum(r.events for r in history.retire(relay, 604800.0, 1.0)) == 0
        with psycopg.connect(roles.dsn_of(privileges.PRODUCER)) as producer:
            assert Outbox(default_topic="t").publish(producer, type="t", key="k", payload={},
                                                     idempotency_key="once").created
    finally:
        roles.drop(pg_server)
    assert dbname_of(dsn)
