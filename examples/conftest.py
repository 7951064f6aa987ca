"""Fixtures of the example tests (examples/test_order_service.py): one database for the session,
and per test a connection whose work is one transaction, rolled back at the end.

    pytest examples/test_order_service.py                               # a private PostgreSQL 18
    OUTBOX_DSN=postgresql://app@localhost/app_test pytest examples/     # a scratch database of yours

The outbox schema is migrated once; the example's tables are created inside each test's
transaction, so nothing a test does outlives it: not its orders, not its events, not its read model.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import order_service
import psycopg
import pytest
import read_models

from outbox_relay import migrate


@pytest.fixture(scope="session")
def database() -> Iterator[str]:
    """OUTBOX_DSN if set, else an embedded PostgreSQL (the outbox-relay[embedded] extra)."""
    with order_service.database() as dsn:
        migrate(dsn)
        yield dsn


@pytest.fixture
def conn(database: str) -> Iterator[psycopg.Connection[Any]]:
    """A connection inside one transaction (no autocommit), rolled back after the test."""
    with psycopg.connect(database) as conn:
        conn.execute(order_service.SCHEMA)
        conn.execute(read_models.SCHEMA)
        yield conn
        conn.rollback()
