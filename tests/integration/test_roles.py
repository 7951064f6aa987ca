"""The least-privilege roles of docs/roles.md, run as written there (the SQL is read from the page).

Roles are server-wide, so each run renames them with a suffix of its own and drops them afterwards.
Every step runs as the role the page says: migrate as the migrator, publish as a service in
``outbox_producer``, deliver and apply retention as ``outbox_relay``, keep and rebuild a projection as
its read-model role; the producer is refused what it must not do.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest
from psycopg_pool import ConnectionPool

from outbox_relay import Outbox, migrate
from outbox_relay.housekeeping import Housekeeping
from outbox_relay.relay import SinkRunner
from projections import ProjectionEvent, projection
from projections.rebuild import Rebuild
from projections.sink import ProjectionSink
from tests.integration.doc_roles import doc_roles, printed_grants
from tests.integration.relay_helpers import ALL_BUCKETS, RecordingSink, close_history, make_settings, run_until
from tests.servers import PgServer

pytestmark = pytest.mark.pg15  # the PostgreSQL 15 step runs it too (scripts/test.sh)

DOC = Path(__file__).resolve().parents[2] / "docs" / "roles.md"
ROLES = ("outbox_migrator", "outbox_relay", "outbox_producer", "outbox_projector", "outbox_console",
         "orders_read_models")


def doc_blocks() -> list[str]:
    """The SQL blocks of the roles page, in order."""
    return re.findall(r"```sql\n(.*?)```", DOC.read_text(), re.S)


@pytest.fixture
def roles(pg_server: PgServer, database_factory: Callable[..., str]) -> Iterator[dict[str, Any]]:
    with doc_roles(pg_server, database_factory(migrated=False), (*ROLES, "orders_service", "reader")) as roles:
        yield roles


def test_the_documented_roles_can_do_their_job_and_no_more(roles: dict[str, Any]) -> None:
    dsn, rename, as_role = roles["dsn"], roles["rename"], roles["as"]
    setup, read_models = doc_blocks()
    grants = printed_grants()  # `outbox-relay grants | psql`, as the page says
    assert "outbox-relay grants | psql" in DOC.read_text()
    with psycopg.connect(dsn, autocommit=True) as su:
        su.execute(rename(setup))
        su.execute(rename("CREATE ROLE orders_service LOGIN; CREATE ROLE reader LOGIN;"))
        su.execute("CREATE TABLE orders (id int PRIMARY KEY, status text NOT NULL)")
        su.execute(rename("GRANT SELECT, INSERT, UPDATE ON orders TO orders_service"))
    migrate(as_role("outbox_migrator"))
    with psycopg.connect(as_role("outbox_migrator"), autocommit=True) as migrator:
        migrator.execute(rename(grants))
    with psycopg.connect(dsn, autocommit=True) as su:
        su.execute(rename("GRANT outbox_producer TO orders_service"))

    # A service publishes in its own transaction, idempotently.
    outbox = Outbox(default_topic="orders")
    with psycopg.connect(as_role("orders_service")) as svc:
        svc.execute("INSERT INTO orders VALUES (1, 'paid')")
        first = outbox.publish(svc, type="OrderPaid", key="order:1", payload={"id": 1}, idempotency_key="paid-1")
        svc.commit()
        again = outbox.publish(svc, type="OrderPaid", key="order:1", payload={"id": 1}, idempotency_key="paid-1")
        svc.commit()
    assert first.created and not again.created and again.id == first.id
    # ... and is refused what a producer must not do.
    for forbidden in ("INSERT INTO outbox.events (partition_key, type, payload, xid) VALUES ('k', 't', '{}', '1')",
                      "INSERT INTO outbox.events (partition_key, type, payload, created_at) "
                      "VALUES ('k', 't', '{}', '1970-01-01')",
                      "SELECT payload FROM outbox.events",
                      "UPDATE outbox.cursors SET owner = 'me'"):
        with psycopg.connect(as_role("orders_service"), autocommit=True) as svc, \
                pytest.raises(psycopg.errors.InsufficientPrivilege):
            svc.execute(forbidden)

    # The relay role delivers, sees another role's open transaction, and applies retention.
    relay_dsn = as_role("outbox_relay")
    with ConnectionPool(relay_dsn, min_size=1, max_size=4, kwargs={"autocommit": True}) as pool:
        sink = RecordingSink("r", name="kafka", kind="kafka")
        with pool.connection() as conn:
            from outbox_relay import store

            store.register_sink(conn, "kafka", "kafka")
        runner = SinkRunner(sink, pool, make_settings(relay_dsn, "r", retention_seconds=0.0))
        runner.desired = set(ALL_BUCKETS)
        run_until(runner, lambda: first.id in sink.delivered_ids())
        with psycopg.connect(as_role("orders_service")) as open_tx:
            open_tx.execute("UPDATE orders SET status = 'refunded' WHERE id = 1")
            with psycopg.connect(relay_dsn, autocommit=True) as relay:
                from outbox_relay.sqlfiles import query

                holder = relay.execute(query("admin", "horizon_holder"), {"all_databases": False}).fetchone()
            assert holder is not None and holder[0] == open_tx.info.backend_pid and holder[4] is not None
            open_tx.rollback()
        runner.release_all()
        close_history(dsn)
        with psycopg.connect(relay_dsn, autocommit=True) as relay:  # status and the metrics, as the relays' role
            from outbox_relay import history

            assert history.rows(relay, "by_class", 0.0)[1], "history per retention class"
            assert history.rows(relay, "partitions", 0.0)[1]
            # `outbox-relay verify`'s reads of the store (its Kafka read-back needs no database rights).
            from outbox_relay.verify import stored

            record = stored.sink_record(relay, "kafka")
            assert [e.id for events in stored.buckets(relay, record) for e in events] == [first.id]
            assert relay.execute(query("verify", "stored_ids"), {"ids": [first.id]}).fetchall() == [(first.id,)]
        assert Housekeeping(pool, make_settings(relay_dsn, "r", retention_seconds=0.0)).run_once().deleted_events == 1

    # A service's read-model role keeps its projection and rebuilds it; readers keep their grants.
    with psycopg.connect(dsn, autocommit=True) as su:
        su.execute(rename(read_models))
    with psycopg.connect(as_role("orders_read_models"), autocommit=True) as owner:  # in its own schema
        owner.execute("CREATE TABLE order_totals (customer text PRIMARY KEY, paid int NOT NULL)")
        owner.execute("CREATE TABLE order_customers (order_id int PRIMARY KEY, customer text NOT NULL)")
        owner.execute(rename("GRANT USAGE ON SCHEMA orders_read TO reader"))
        owner.execute(rename("GRANT SELECT ON order_totals TO reader"))

    @projection("order_totals", events=["OrderPaid"], tables=["order_totals", "order_customers"])
    def totals(event: ProjectionEvent[Any], tx: Any) -> None:
        tx.execute("INSERT INTO order_customers VALUES (%s, 'c') ON CONFLICT DO NOTHING", (event.payload["id"],))
        tx.execute("INSERT INTO order_totals VALUES ('c', 1) ON CONFLICT (customer) "
                   "DO UPDATE SET paid = order_totals.paid + 1")

    with psycopg.connect(as_role("orders_service")) as svc:
        outbox.publish(svc, type="OrderPaid", key="order:2", payload={"id": 2})
        svc.commit()
    rm_dsn = as_role("orders_read_models")
    with ConnectionPool(rm_dsn, min_size=1, max_size=4, kwargs={"autocommit": True}) as pool:
        psink = ProjectionSink(totals, rm_dsn)
        try:
            with pool.connection() as conn:
                store.register_sink(conn, psink.name, psink.kind)
            runner = SinkRunner(psink, pool, make_settings(rm_dsn, "p"))
            runner.desired = set(ALL_BUCKETS)
            run_until(runner, lambda: bool(_rows(rm_dsn, "SELECT paid FROM order_totals")))
            runner.release_all()
        finally:
            psink.close()
    assert _rows(rm_dsn, "SELECT paid FROM order_totals") == [(1,)]
    result = Rebuild(totals, make_settings(rm_dsn, "p-rebuild"), progress=None).run()
    assert result is not None
    assert _rows(as_role("reader"), "SELECT paid FROM orders_read.order_totals") == [(1,)], \
        "the reader kept its grant"

    # ... and, whatever a handler runs in its transaction, the read-model role can not delete events,
    # move the Kafka sink's progress, stop or take over housekeeping, or plant objects in public.
    cursors_sql = ("SELECT bucket, snapshot::text, target::text, after_xid::text, after_seq FROM outbox.cursors "
                   "WHERE sink = 'kafka' ORDER BY bucket")
    kafka_cursors = _rows(dsn, cursors_sql)
    with psycopg.connect(rm_dsn, autocommit=True) as rm:
        for forbidden in ("DELETE FROM outbox.events",
                          "UPDATE outbox.housekeeping SET run_by = 'me'",
                          "CREATE FUNCTION public.lower(text) RETURNS text LANGUAGE sql RETURN $1"):
            with pytest.raises(psycopg.errors.InsufficientPrivilege):
                rm.execute(forbidden)
        moved = rm.execute("UPDATE outbox.cursors SET snapshot = '1:1:', owner = 'me' WHERE sink = 'kafka'")
        assert moved.rowcount == 0
        assert rm.execute("DELETE FROM outbox.sinks WHERE name = 'kafka'").rowcount == 0
        assert rm.execute("SELECT count(*) FROM outbox.parked WHERE sink = 'kafka'").fetchone() == (0,)
    assert _rows(dsn, cursors_sql) == kafka_cursors
    with ConnectionPool(rm_dsn, min_size=1, max_size=2, kwargs={"autocommit": True}) as pool:
        assert Housekeeping(pool, make_settings(rm_dsn, "p")).run_once().ran is False
    owners = _rows(dsn, "SELECT schemaname, tableowner FROM pg_tables "
                        "WHERE tablename IN ('order_totals', 'order_customers')")
    assert set(owners) == {("orders_read", roles["names"]["orders_read_models"])}


def _rows(dsn: str, sql: str) -> list[tuple[Any, ...]]:
    with psycopg.connect(dsn, autocommit=True) as conn:
        return conn.execute(sql).fetchall()
