"""Every command that reads the database, against databases in the states an operator meets: not
migrated (one line: run `outbox-relay migrate`, exit 2), a role without rights (one line, exit 2),
and `status` naming the oldest open writing transaction without showing its SQL."""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable
from datetime import datetime

import psycopg
import pytest
from psycopg import sql
from psycopg.conninfo import make_conninfo

from outbox_relay import cli
from tests.servers import PgServer, wait_until

pytestmark = pytest.mark.pg15  # the PostgreSQL 15 step runs it too (scripts/test.sh)

APP = ["--projections", "tests.integration.projection_app"]

READ_COMMANDS = [
    ["status"],
    ["status", "--json"],
    ["lag"],
    ["lag", "--sink", "kafka"],
    ["dead-letters", "list"],
    ["dead-letters", "retry", "--sink", "kafka", "--all"],
    ["dead-letters", "discard", "--sink", "kafka", "--all"],
    ["sinks", "list"],
    ["sinks", "drop", "kafka"],
    ["sinks", "recreate", "kafka"],
    ["rebuild", "order_totals", *APP],
    ["rebuild", "order_totals", *APP, "--key", "k"],
    ["rebuild", "order_totals", *APP, "--cancel"],
    ["replay", "--topic", "orders", "--kafka-bootstrap-servers", "127.0.0.1:1"],
]


@pytest.mark.parametrize("argv", READ_COMMANDS, ids=" ".join)
def test_an_unmigrated_database_says_run_migrate(database_factory: Callable[..., str], argv: list[str],
                                                 capsys: pytest.CaptureFixture[str],
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    dsn = database_factory(migrated=False)
    monkeypatch.setenv("OUTBOX_DSN", dsn)
    code = cli.main(argv)
    err = capsys.readouterr().err
    assert code == cli.EXIT_ERROR, err
    assert "run `outbox-relay migrate`" in err and "Traceback" not in err and err.count("\n") == 1, err


def test_a_database_behind_the_code_says_run_migrate(dsn: str, capsys: pytest.CaptureFixture[str]) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("DELETE FROM outbox.schema_migrations WHERE version = (SELECT max(version) "
                     "FROM outbox.schema_migrations)")
    assert cli.main(["status", "--dsn", dsn]) == cli.EXIT_ERROR
    assert "run `outbox-relay migrate`" in capsys.readouterr().err


def test_a_role_without_rights_gets_one_line(dsn: str, pg_server: PgServer, capsys: pytest.CaptureFixture[str]) -> None:
    role = f"outbox_test_norights_{uuid.uuid4().hex[:8]}"
    with pg_server.admin() as admin:
        admin.execute(sql.SQL("CREATE ROLE {} LOGIN").format(sql.Identifier(role)))
    try:
        code = cli.main(["status", "--dsn", make_conninfo(dsn, user=role)])
        err = capsys.readouterr().err
        assert code == cli.EXIT_ERROR, err
        assert err.startswith("outbox-relay: database error: InsufficientPrivilege: permission denied"), err
        assert err.count("\n") == 1
    finally:
        with pg_server.admin() as admin:
            admin.execute(sql.SQL("DROP ROLE {}").format(sql.Identifier(role)))


def test_status_names_the_open_transaction_without_its_sql(dsn: str, capsys: pytest.CaptureFixture[str]) -> None:
    secret_literal = "T0p-Secret-Literal"
    with psycopg.connect(dsn) as other:
        other.execute("SET application_name = 'nightly-batch'")
        other.execute("CREATE TEMP TABLE scratch (v text)")
        other.execute(f"INSERT INTO scratch VALUES ('{secret_literal}')")  # a literal in the query text
        pid = other.info.backend_pid

        def ours() -> str | None:
            # The oldest writing transaction of the whole server: on a shared server, wait out others' short ones.
            assert cli.main(["status", "--dsn", dsn, "--json"]) == cli.EXIT_OK
            text = capsys.readouterr().out
            holders = json.loads(text)["oldest_open_transaction"]
            return text if holders and holders[0]["pid"] == pid else None

        out = wait_until(ours, 10, 0.2, "status to name this test's transaction")
        assert cli.main(["status", "--dsn", dsn]) == cli.EXIT_OK
        table = capsys.readouterr().out
    assert secret_literal not in out and secret_literal not in table
    holders = json.loads(out)["oldest_open_transaction"]
    assert len(holders) == 1, holders
    holder = holders[0]
    assert holder["pid"] == pid and holder["application"] == "nightly-batch" and holder["prepared"] is False, holder
    assert holder["state"] == "idle in transaction" and holder["database"] is not None, holder
    assert float(holder["open_seconds"]) >= 0 and "query" not in holder, holder
    assert "nightly-batch" in table


def test_json_has_numbers_times_and_snake_case_keys_and_tables_no_reprs(dsn: str,
                                                                        capsys: pytest.CaptureFixture[str]) -> None:
    from outbox_relay import store
    from tests.integration.relay_helpers import publish

    with psycopg.connect(dsn, autocommit=True) as conn:
        store.register_sink(conn, "kafka", "kafka")
        store.heartbeat(conn, "relay-a", "alive", ["kafka"], {"listening": False})
        store.acquire_leases(conn, "kafka", "relay-a", range(0, 7), 30.0)
    publish(dsn, [("k", "t", {})])
    with psycopg.connect(dsn, autocommit=True) as conn:
        row = conn.execute("SELECT bucket, xid, seq, partition_key, id FROM outbox.events").fetchone()
        assert row is not None
        b, x, s, k, i = row
        conn.execute("INSERT INTO outbox.dead_letters (sink, event_id, bucket, xid, seq, partition_key, attempts, "
                     "last_error) VALUES ('kafka', %s, %s, %s, %s, %s, 3, 'boom')", (i, b, x, s, k))

    assert cli.main(["status", "--dsn", dsn, "--json"]) == cli.EXIT_OK
    status = json.loads(capsys.readouterr().out)
    assert list(status) == ["workers", "backlog", "oldest_open_transaction", "dead_letters_by_key", "rebuilds",
                            "retention", "history"]
    worker = status["workers"][0]
    assert worker["sinks"] == ["kafka"] and worker["buckets"] == {"kafka": 7}, worker
    assert isinstance(worker["seen_seconds_ago"], int | float), worker
    assert worker["listening"] is False, "a relay that only polls must show as such"
    backlog = status["backlog"][0]
    assert backlog["pending"] == 1 and backlog["leased_buckets"] == 7 and backlog["dead_letters"] == 1, backlog
    assert isinstance(backlog["oldest_pending_seconds"], int | float), backlog
    assert datetime.fromisoformat(status["dead_letters_by_key"][0]["last_dead_at"]).tzinfo is not None

    assert cli.main(["dead-letters", "list", "--dsn", dsn, "--json"]) == cli.EXIT_OK
    (dead,) = json.loads(capsys.readouterr().out)
    assert dead["event_id"] == str(i) and dead["attempts"] == 3 and datetime.fromisoformat(dead["dead_at"])
    assert cli.main(["sinks", "list", "--dsn", dsn, "--json"]) == cli.EXIT_OK
    (sink,) = json.loads(capsys.readouterr().out)
    assert sink["sink"] == "kafka" and sink["dropped_at"] is None and datetime.fromisoformat(sink["created_at"])

    assert cli.main(["status", "--dsn", dsn]) == cli.EXIT_OK
    table = capsys.readouterr().out
    assert "relay-a" in table and "kafka: 7" in table and not any(c in table for c in "[]{}"), table
