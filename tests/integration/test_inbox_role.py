"""The inbox consumer's role (docs/inbox.md, "Roles"), run as written there (the SQL is read from the page).

A real consumer logs in as the service's role, a member of ``outbox_inbox_consumer`` with the page's grants
and its handler's own tables, and does every part of its job: start (schema check), register, claim,
apply, dead-letter, retry a dead letter an operator asked for, delete expired dedupe records and a
crashed process's registration, leave. Each step is checked by its effect, so a grant the page lacks
fails here (the consumer logs and goes on where it can). The same login is refused the outbox's tables
and DDL. tests/integration/test_privileges.py checks the grants are exactly those of the table.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest

from outbox_relay.inbox import migrate_inbox
from outbox_relay.inbox.admin import list_dead_letters, positions, request_retry
from outbox_relay.inbox.schema import check_inbox_schema
from tests.integration import inbox_app
from tests.integration.doc_roles import doc_roles, printed_grants
from tests.integration.inbox_helpers import consumer_thread, effects, produce_events, scalar, settings
from tests.servers import PgServer, wait_until

pytestmark = pytest.mark.pg15  # the PostgreSQL 15 step runs it too (scripts/test.sh)

DOC = Path(__file__).resolve().parents[2] / "docs" / "inbox.md"
ROLES = ("outbox_inbox_consumer", "orders_migrator", "orders_service")


def doc_blocks() -> list[str]:
    """The SQL blocks of the "Roles" section: the roles (the grants are printed by `outbox-relay grants`)."""
    text = DOC.read_text()
    start = text.index("## Roles")
    section = text[start:text.index("\n## ", start)]
    return re.findall(r"```sql\n(.*?)```", section, re.S)


@pytest.fixture
def roles(pg_server: PgServer, database_factory: Callable[..., str]) -> Iterator[dict[str, Any]]:
    # The outbox's schema too: the consumer's login must be refused there.
    with doc_roles(pg_server, database_factory(migrated=True), ROLES) as roles:
        yield roles


def test_a_consumer_in_the_documented_role_does_its_whole_job_and_nothing_more(
        roles: dict[str, Any], kafka_bootstrap: str, kafka_topic: str) -> None:
    dsn, rename, as_role = roles["dsn"], roles["rename"], roles["as"]
    (setup,) = doc_blocks()
    grants = printed_grants("--schema", "outbox_inbox")  # as the page says: `outbox-relay grants ... | psql`
    assert "outbox-relay grants --schema outbox_inbox | psql" in DOC.read_text()
    with psycopg.connect(dsn, autocommit=True) as su:
        su.execute(rename("CREATE ROLE orders_migrator LOGIN; CREATE ROLE orders_service LOGIN;"))
        su.execute(rename(setup))
    with psycopg.connect(as_role("orders_migrator"), autocommit=True) as migrator:
        migrate_inbox(migrator)
        migrator.execute(rename(grants))
        migrator.execute(rename(grants))  # rerun after every migration: it leaves the same
        # The handler's own tables: the user's to grant (docs/inbox.md).
        inbox_app.setup(migrator)
        migrator.execute(rename("GRANT USAGE ON SCHEMA inbox_app TO orders_service; "
                                "GRANT SELECT, INSERT ON ALL TABLES IN SCHEMA inbox_app TO orders_service"))
        # A process that crashed long ago: housekeeping deletes its registration.
        migrator.execute("INSERT INTO outbox_inbox.members (consumer, member, heartbeat_at) "
                         "VALUES ('inbox', 'crashed', now() - interval '1 day')")

    service = as_role("orders_service")
    events = [("k", 0, {"n": 0}), ("k", 0, {"n": 1, "poison": True}), ("k", 0, {"n": 2}),
              ("other", 1, {"n": 3}), ("other", 1, {"n": 4})]
    ids = produce_events(kafka_bootstrap, kafka_topic, events)
    s = settings(service, kafka_bootstrap, kafka_topic, max_attempts=2, housekeeping_seconds=1.0,
                 retention_seconds=60.0)
    with consumer_thread(s) as consumer:
        wait_until(lambda: consumer.stats.applied >= 4 and consumer.stats.dead == 1, 30, 0.1, "4 applied, 1 dead")
        wait_until(lambda: scalar(dsn, "SELECT count(*) FROM outbox_inbox.members WHERE member = 'crashed'") == 0,
                   30, 0.1, "the crashed process's registration deleted")
        # The operator commands, as the same role.
        with psycopg.connect(service, autocommit=True) as operator:
            check_inbox_schema(operator)
            assert {p["partition"] for p in positions(operator, "inbox")} >= {0, 1}
            [dead] = list_dead_letters(operator, "inbox")
            assert dead["message_id"] == ids[1]
            with psycopg.connect(dsn, autocommit=True) as owner:
                owner.execute("INSERT INTO inbox_app.cured VALUES (1)")
            assert request_retry(operator, "inbox", [dead["id"]]) == [dead["id"]]
        wait_until(lambda: scalar(dsn, "SELECT count(*) FROM outbox_inbox.dead_letters") == 0, 30, 0.1,
                   "the retried dead letter applied")
        with psycopg.connect(dsn, autocommit=True) as owner:
            owner.execute("UPDATE outbox_inbox.messages SET applied_at = now() - interval '1 day'")
        wait_until(lambda: scalar(dsn, "SELECT count(*) FROM outbox_inbox.messages") == 0, 30, 0.1,
                   "retention deleted the expired dedupe records")
    assert Counter(e[0] for e in effects(dsn)) == Counter(ids), "each message applied once"
    assert scalar(dsn, "SELECT count(*) FROM outbox_inbox.members") == 0, "the consumer left"
    assert scalar(dsn, "SELECT count(*) FROM outbox_inbox.positions WHERE owner IS NOT NULL") == 0, "leases released"

    refused = (
        # The outbox's tables and functions.
        "SELECT id FROM outbox.events",
        "INSERT INTO outbox.events (partition_key, type, payload) VALUES ('k', 't', '{}')",
        "SELECT * FROM outbox.cursors",
        "SELECT outbox.bucket_v1('k')",
        # DDL, and what the consumer never does to its own tables.
        "CREATE TABLE outbox_inbox.mine (id int)",
        "ALTER TABLE outbox_inbox.positions ADD COLUMN x int",
        "CREATE INDEX ON outbox_inbox.messages (topic)",
        "DROP TABLE outbox_inbox.messages",
        "TRUNCATE outbox_inbox.messages",
        "DELETE FROM outbox_inbox.positions",
        "UPDATE outbox_inbox.messages SET topic = 'x'",
        "INSERT INTO outbox_inbox.schema_migrations (version, name) VALUES (999, 'mine')",
    )
    for statement in refused:
        with psycopg.connect(service, autocommit=True) as conn, pytest.raises(psycopg.errors.InsufficientPrivilege):
            conn.execute(statement)
    with psycopg.connect(service, autocommit=True) as conn, pytest.raises(psycopg.errors.InsufficientPrivilege):
        migrate_inbox(conn)  # `inbox migrate` is the migrator's
