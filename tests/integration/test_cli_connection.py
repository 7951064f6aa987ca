"""Connecting goes wrong: the reason in one line (``connection_problem``), and never the password.

Real errors only: a private PostgreSQL 18 (from the embedded wheel) with password authentication for
one role and prepared transactions enabled, which the session's server (trust authentication) can
not give; the session's server for the failures that need no password (connection limit, missing
database, nothing listening)."""

from __future__ import annotations

import io
import json
import logging
import uuid
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest
from psycopg import sql
from psycopg.conninfo import conninfo_to_dict, make_conninfo
from psycopg_pool import ConnectionPool, PoolTimeout

from outbox_relay import cli
from outbox_relay.cli import logs
from outbox_relay.dsn import connection_problem, probe_connection, remember_dsn
from outbox_relay.migrate import migrate
from tests.servers import EmbeddedPg, PgServer, free_port

ROLE = "outbox_pw_user"
RIGHT = "Right-Pa55word"
# Wrong passwords in the shapes that slipped through before: a space, a tab, a percent-escape.
WRONG = {"space": "Wr0ng Pa55 w0rd", "tab": "Wr0ng\tPa55\tw0rd", "percent": "Wr0ng%Pa55%w0rd"}


class PrivateServer:
    def __init__(self) -> None:
        self.server = EmbeddedPg()
        with self.server.admin() as conn:
            conn.execute("ALTER SYSTEM SET max_prepared_transactions = 4")
            conn.execute(sql.SQL("CREATE ROLE {} LOGIN SUPERUSER PASSWORD {}").format(
                sql.Identifier(ROLE), sql.Literal(RIGHT)))
        hba = self.server.pgdata / "pg_hba.conf"
        # First match wins: this role must give its password; everyone else stays trusted.
        hba.write_text(f"local all {ROLE} scram-sha-256\n" + hba.read_text())
        self.server.restart()
        self.socket_dir = str(conninfo_to_dict(self.server.admin_dsn)["host"])

    def url(self, password: str, dbname: str = "postgres") -> str:
        """URL form, the password percent-encoded only where libpq requires it (never a tab)."""
        encoded = password.replace("%", "%25").replace(" ", "%20")
        return f"postgresql://{ROLE}:{encoded}@/{dbname}?host={self.socket_dir}"

    def keywords(self, password: str, dbname: str = "postgres") -> str:
        return make_conninfo("", host=self.socket_dir, user=ROLE, password=password, dbname=dbname)


@pytest.fixture(scope="module")
def private() -> Iterator[PrivateServer]:
    server = PrivateServer()
    try:
        yield server
    finally:
        server.server.close()


def fragments(password: str) -> list[str]:
    """Pieces of a password that must not appear anywhere (each is 4+ characters)."""
    return [p for p in password.replace("\t", " ").replace("%", " ").split() if len(p) >= 4]


def test_the_right_password_works(private: PrivateServer) -> None:
    assert probe_connection(private.url(RIGHT)) is None
    assert probe_connection(private.keywords(RIGHT)) is None


@pytest.mark.parametrize("shape", sorted(WRONG))
@pytest.mark.parametrize("form", ["url", "keywords"])
def test_a_wrong_password_is_named_as_such_and_never_shown(private: PrivateServer, shape: str, form: str,
                                                           capsys: pytest.CaptureFixture[str]) -> None:
    password = WRONG[shape]
    dsn = private.url(password) if form == "url" else private.keywords(password)
    with pytest.raises(psycopg.OperationalError) as caught:
        psycopg.connect(dsn).close()
    assert connection_problem(caught.value).startswith("authentication failed (socket "), caught.value
    for argv in (["status"], ["migrate"], ["sinks", "list"], ["dead-letters", "list"]):
        code = cli.main([*argv, "--dsn", dsn])
        err = capsys.readouterr().err
        assert code == cli.EXIT_ERROR, (argv, err)
        assert "authentication failed" in err and err.count("\n") == 1, (argv, err)
        assert not any(f in err for f in fragments(password)), (argv, err)


def test_pool_warnings_and_log_lines_are_masked(private: PrivateServer) -> None:
    """psycopg_pool logs libpq's message as it is, and libpq quotes the token it could not parse."""
    secret = "Unparse%zzable-Secret"
    dsn = f"postgresql://{ROLE}:{secret}@/postgres?host={private.socket_dir}"
    remember_dsn(dsn)  # what RelaySettings does with its DSN
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.setFormatter(logs._RedactingFormatter("%(levelname)s %(name)s %(message)s"))
    pool_log = logging.getLogger("psycopg.pool")
    pool_log.addHandler(handler)
    try:
        pool: ConnectionPool[Any] = ConnectionPool(dsn, min_size=1, open=False, reconnect_timeout=0.5)
        with pytest.raises(PoolTimeout):
            pool.open(wait=True, timeout=1.0)
        pool.close()
        logging.getLogger("outbox_relay.worker").warning("database %s is unavailable", dsn)  # the relay's own line
    finally:
        pool_log.removeHandler(handler)
    logged = stream.getvalue()
    assert "invalid percent-encoded token" in logged, logged
    assert "Unparse" not in logged and "Secret" not in logged, logged


def test_status_shows_a_prepared_transaction(private: PrivateServer, capsys: pytest.CaptureFixture[str]) -> None:
    dbname = f"outbox_prepared_{uuid.uuid4().hex[:8]}"
    with private.server.admin() as admin:
        admin.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(dbname)))
    dsn = private.keywords(RIGHT, dbname)
    migrate(dsn)
    gid = f"forgotten-{uuid.uuid4().hex[:6]}"
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("CREATE TABLE ledger (v int)")
        conn.execute("BEGIN")
        conn.execute("INSERT INTO ledger VALUES (1)")
        conn.execute(sql.SQL("PREPARE TRANSACTION {}").format(sql.Literal(gid)))
    try:
        assert cli.main(["status", "--dsn", dsn, "--json"]) == cli.EXIT_OK
        holders = json.loads(capsys.readouterr().out)["oldest_open_transaction"]
        assert len(holders) == 1 and holders[0]["prepared"] is True, holders
        assert holders[0]["gid"] == gid and holders[0]["pid"] is None and holders[0]["database"] == dbname
        assert holders[0]["state"] == "prepared" and holders[0]["role"] == ROLE, holders
    finally:
        with psycopg.connect(dsn, autocommit=True) as conn:
            conn.execute(sql.SQL("ROLLBACK PREPARED {}").format(sql.Literal(gid)))


# -- the other causes, on the session's server ----------------------------------------------------


def test_a_role_over_its_connection_limit_is_too_many_connections(dsn: str, pg_server: PgServer) -> None:
    role = f"outbox_test_limited_{uuid.uuid4().hex[:8]}"
    with pg_server.admin() as admin:
        admin.execute(sql.SQL("CREATE ROLE {} LOGIN CONNECTION LIMIT 0").format(sql.Identifier(role)))
    try:
        problem = probe_connection(make_conninfo(dsn, user=role))
    finally:
        with pg_server.admin() as admin:
            admin.execute(sql.SQL("DROP ROLE {}").format(sql.Identifier(role)))
    assert problem is not None and problem.startswith("too many connections: the server has no connection slot free")
    assert f'too many connections for role "{role}"' in problem and "SQLSTATE 53300" in problem, problem


def test_a_missing_database(dsn: str) -> None:
    problem = probe_connection(make_conninfo(dsn, dbname="outbox_no_such_database"))
    assert problem is not None and problem.startswith("the database does not exist"), problem
    assert 'database "outbox_no_such_database" does not exist' in problem


def test_nothing_listening() -> None:
    problem = probe_connection(f"postgresql://relay:S3cret-pw@127.0.0.1:{free_port()}/app")
    assert problem is not None and problem.startswith('the server is not reachable (server "127.0.0.1", port '), problem
    assert "Connection refused" in problem and "S3cret" not in problem


def test_pool_timeout_says_so() -> None:
    pool: ConnectionPool[Any] = ConnectionPool(f"postgresql://relay@127.0.0.1:{free_port()}/app", min_size=1,
                                               open=False)
    with pytest.raises(PoolTimeout) as caught:
        pool.open(wait=True, timeout=0.5)
    pool.close()
    assert connection_problem(caught.value).startswith("no connection could be opened in time")
