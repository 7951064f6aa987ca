"""Roles run as a docs page writes them: renamed per test (roles are server-wide) and dropped after it."""

from __future__ import annotations

import contextlib
import io
import re
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import psycopg
from psycopg.conninfo import make_conninfo

from outbox_relay.cli import main as cli_main
from tests.servers import PgServer, dbname_of


@contextmanager
def doc_roles(pg_server: PgServer, dsn: str, roles: tuple[str, ...]) -> Iterator[dict[str, Any]]:
    """``rename`` rewrites a page's SQL to this test's role names and database, ``as`` is the conninfo
    of a login role, ``names`` the renamed roles. Whatever they own is reassigned and they are dropped."""
    suffix = uuid.uuid4().hex[:8]
    names = {r: f"{r}_{suffix}" for r in roles}
    db = dbname_of(dsn)

    def rename(sql: str) -> str:
        for r in sorted(names, key=len, reverse=True):
            sql = re.sub(rf"\b{r}\b", names[r], sql)
        return sql.replace("DATABASE app", f'DATABASE "{db}"')

    def as_role(role: str) -> str:
        return make_conninfo(dsn, user=names[role], password=None)

    try:
        yield {"dsn": dsn, "names": names, "rename": rename, "as": as_role}
    finally:
        with pg_server.admin() as admin, psycopg.connect(dsn, autocommit=True) as conn:
            existing = [n for n in names.values()
                        if conn.execute("SELECT 1 FROM pg_roles WHERE rolname = %s", (n,)).fetchone()]
            for name in existing:
                conn.execute(f'REASSIGN OWNED BY "{name}" TO CURRENT_USER')
                conn.execute(f'DROP OWNED BY "{name}"')
            conn.close()
            for name in existing:
                admin.execute(f'REVOKE ALL ON DATABASE "{db}" FROM "{name}"')
                admin.execute(f'DROP ROLE IF EXISTS "{name}"')


def printed_grants(*args: str) -> str:
    """What `outbox-relay grants ARGS` prints: the docs pipe it into psql as the migrator."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert cli_main(["grants", *args]) == 0
    return out.getvalue()
