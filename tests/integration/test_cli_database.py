"""Every command that reads the database, against databases in the states an operator meets: not
migrated (one line: run `outbox-relay migrate`, exit 2), a role without rights (one line, exit 2)."""

from __future__ import annotations

import logging
import uuid
from collections.abc import Callable, Iterator

import psycopg
import pytest
from psycopg import sql
from psycopg.conninfo import make_conninfo

from outbox_relay import cli
from tests.servers import PgServer

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
    ["rebuild", "order_totals", *APP],
    ["rebuild", "order_totals", *APP, "--key", "k"],
    ["rebuild", "order_totals", *APP, "--cancel"],
    ["replay", "--topic", "orders", "--kafka-bootstrap-servers", "127.0.0.1:1"],
]


@pytest.fixture(autouse=True)
def _restore_logging() -> Iterator[None]:
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    yield
    root.handlers[:] = handlers
    root.setLevel(level)


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

