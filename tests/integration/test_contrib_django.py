"""outbox_relay.contrib.django: events published in Django's ``transaction.atomic()``, on Django's connection.

Against the real PostgreSQL, through Django's psycopg 3 backend: G1 (an event exists iff the atomic
block that published it committed, savepoints included), G2 (one idempotency key, one event), the
refusals (autocommit outside atomic, bad input, another database vendor), on_commit hooks, and the
outbox schema following ``manage.py migrate``. Django's settings are configured once for the module;
each test points the ``default`` alias at its own fresh database.
"""

from __future__ import annotations

import asyncio
import os
import re
import subprocess
import sys
from collections.abc import Callable, Iterator
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import django
import psycopg
import pytest
from django.conf import settings
from psycopg.conninfo import conninfo_to_dict

if not settings.configured:
    settings.configure(
        DATABASES={
            "default": {"ENGINE": "django.db.backends.postgresql", "NAME": "set_per_test"},
            "other": {"ENGINE": "django.db.backends.postgresql", "NAME": "set_per_test"},
            "lite": {"ENGINE": "django.db.backends.sqlite3", "NAME": ":memory:"},
        },
        INSTALLED_APPS=["outbox_relay.contrib.django"],
        DATABASE_ROUTERS=["tests.integration.test_contrib_django.Router"],
        USE_TZ=True,
    )
    django.setup()

from django.core.exceptions import SynchronousOnlyOperation
from django.core.management import call_command
from django.db import OperationalError, connections, models, transaction
from django.db.transaction import TransactionManagementError

from outbox_relay import ConfigurationError, IdempotencyConflict, InvalidEvent, Outbox, Published
from outbox_relay.contrib.django import publish, publish_many
from outbox_relay.errors import NoTransaction
from outbox_relay.migrate import latest_version

ROOT = Path(__file__).resolve().parents[2]
TOPIC = "orders"


class Router:
    """Lets a test keep the outbox schema out of the ``other`` database (``allow_outbox``)."""

    allow_outbox = True

    def allow_migrate(self, db: str, app_label: str, **hints: Any) -> bool | None:
        if app_label == "outbox_relay" and db == "other":
            return Router.allow_outbox
        return None


class Order(models.Model):
    total = models.IntegerField()

    class Meta:
        app_label = "shop"
        db_table = "django_orders"


def point(alias: str, dsn: str) -> None:
    """Aim a Django database alias at ``dsn`` (libpq URL or keywords), closing what it had open."""
    connections[alias].close()
    params: dict[str, Any] = conninfo_to_dict(dsn)
    connections[alias].settings_dict.update(
        NAME=params.pop("dbname"), USER=params.pop("user", ""), PASSWORD=params.pop("password", ""),
        HOST=params.pop("host", ""), PORT=str(params.pop("port", "")), OPTIONS=params)


@pytest.fixture
def shop(dsn: str) -> Iterator[str]:
    """The test database (migrated) behind the ``default`` alias, with the orders table."""
    point("default", dsn)
    try:
        with connections["default"].schema_editor() as editor:
            editor.create_model(Order)
        yield dsn
    finally:
        connections["default"].close()  # before the database is dropped


def stored(dsn: str) -> list[tuple[Any, ...]]:
    """(id, type, key, payload, topic) of the committed events, in position order."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        return conn.execute("SELECT id, type, partition_key, payload, topic FROM outbox.events "
                            "ORDER BY xid, seq").fetchall()


def keys(dsn: str) -> list[str]:
    return [row[2] for row in stored(dsn)]


def orders(dsn: str) -> list[int]:
    with psycopg.connect(dsn, autocommit=True) as conn:
        return [row[0] for row in conn.execute("SELECT total FROM django_orders ORDER BY id")]


def place(total: int, **fields: Any) -> Published:
    """The unit of work of a view: an order and its event."""
    Order.objects.create(total=total)
    return publish(type="OrderPlaced", key=f"order:{total}", payload={"total": total}, topic=TOPIC, **fields)


# -- G1: the events share the fate of the atomic block ---------------------------------------------


def test_commit_keeps_the_events_in_the_transaction_of_the_rows(shop: str) -> None:
    with transaction.atomic():
        first = place(1)
        second = place(2)
        paid = publish_many([{"type": "OrderPaid", "key": "order:1", "payload": {}},
                             {"type": "OrderPaid", "key": "order:2", "payload": {}}],
                            outbox=Outbox(default_topic="payments"))
    assert [row[0] for row in stored(shop)] == [first.id, second.id, *(p.id for p in paid)]
    assert [(row[1], row[4]) for row in stored(shop)] == [
        ("OrderPlaced", TOPIC), ("OrderPlaced", TOPIC), ("OrderPaid", "payments"), ("OrderPaid", "payments")]
    assert all(p.created for p in (first, second, *paid))
    with psycopg.connect(shop, autocommit=True) as conn:
        events = conn.execute("SELECT DISTINCT xid::text::bigint % 4294967296 FROM outbox.events").fetchall()
        rows = conn.execute("SELECT DISTINCT xmin::text::bigint FROM django_orders").fetchall()
    assert events == rows and len(rows) == 1, "one transaction wrote the orders and the events"


@pytest.mark.parametrize("ending", ["exception", "set_rollback"])
def test_a_block_that_rolls_back_leaves_no_event(shop: str, ending: str) -> None:
    with pytest.raises(RuntimeError) if ending == "exception" else nullcontext(), transaction.atomic():
        place(1)
        if ending == "exception":
            raise RuntimeError("the business change fails")
        transaction.set_rollback(True)
    with transaction.atomic():  # the connection goes on
        place(2)
    assert keys(shop) == ["order:2"] and orders(shop) == [2]


def test_a_nested_atomic_rolled_back_drops_only_its_events(shop: str) -> None:
    with transaction.atomic():
        place(1)
        with pytest.raises(RuntimeError), transaction.atomic():  # a savepoint
            place(2)
            raise RuntimeError("this part of the change fails")
        with transaction.atomic():  # a savepoint released: its events stay with the block
            place(3)
    assert keys(shop) == ["order:1", "order:3"] and orders(shop) == [1, 3]


def test_on_commit_hooks_run_as_without_the_outbox(shop: str) -> None:
    ran: list[str] = []
    with transaction.atomic():
        transaction.on_commit(lambda: ran.append("before publish"))
        place(1)
        transaction.on_commit(lambda: ran.append("after publish"))
        assert ran == []
    assert ran == ["before publish", "after publish"]
    with pytest.raises(RuntimeError), transaction.atomic():
        transaction.on_commit(lambda: ran.append("rolled back"))
        place(2)
        raise RuntimeError("rolls back")
    assert ran == ["before publish", "after publish"] and keys(shop) == ["order:1"]


def test_statements_go_through_djangos_cursors(shop: str) -> None:
    seen: list[str] = []

    def wrapper(execute: Callable[..., Any], sql: str, params: Any, many: bool, context: Any) -> Any:
        seen.append(sql)
        return execute(sql, params, many, context)

    with connections["default"].execute_wrapper(wrapper), transaction.atomic():
        publish_many([{"type": "OrderPlaced", "key": f"order:{i}", "payload": {}, "topic": TOPIC} for i in (1, 2, 3)])
    assert len(seen) == 1 and "INSERT INTO outbox.events" in seen[0], "one statement for the batch"


# -- refusals ---------------------------------------------------------------------------------------


def test_autocommit_outside_atomic_is_refused(shop: str) -> None:
    with pytest.raises(NoTransaction, match=r"transaction\.atomic\(\)") as info:
        publish(type="OrderPlaced", key="order:1", payload={}, topic=TOPIC)
    assert "Nothing was written" in str(info.value) and "'default'" in str(info.value)
    Order.objects.create(total=1)  # autocommit: stored at once, with no event
    assert stored(shop) == [] and orders(shop) == [1]


def test_autocommit_turned_off_by_the_code_is_its_transaction(shop: str) -> None:
    transaction.set_autocommit(False)
    try:
        place(1)
        transaction.rollback()
        place(2)
        transaction.commit()
    finally:
        transaction.set_autocommit(True)
    assert keys(shop) == ["order:2"]


def test_bad_input_is_refused_and_the_block_goes_on(shop: str) -> None:
    with transaction.atomic():
        place(1)
        with pytest.raises(InvalidEvent, match="key"):
            publish(type="OrderPlaced", key="", payload={}, topic=TOPIC)
        with pytest.raises(InvalidEvent, match="not JSON"):
            publish(type="OrderPlaced", key="order:9", payload={"items": {1, 2}}, topic=TOPIC)
        with pytest.raises(InvalidEvent, match="no topic"):
            publish(type="OrderPlaced", key="order:9", payload={})  # no topic, no OUTBOX_RELAY_DEFAULT_TOPIC
        with pytest.raises(InvalidEvent):
            publish_many([{"type": "OrderPlaced", "key": "order:8", "payload": {}, "topic": TOPIC},
                          {"type": "", "key": "order:9", "payload": {}, "topic": TOPIC}])
        assert not connections["default"].needs_rollback
        place(2)
    assert keys(shop) == ["order:1", "order:2"] and orders(shop) == [1, 2]


def test_a_database_that_is_not_postgresql_is_refused(shop: str) -> None:
    with transaction.atomic(using="lite"), pytest.raises(ConfigurationError, match="'lite' is sqlite"):
        publish(type="OrderPlaced", key="order:1", payload={}, topic=TOPIC, using="lite")


def test_a_failed_statement_marks_the_block_for_rollback(shop: str) -> None:
    # The events table is locked by another session and the lock wait gives up at once: the
    # statement fails, the transaction is aborted, and Django says so at the next query.
    with psycopg.connect(shop) as other:
        other.execute("LOCK TABLE outbox.events IN ACCESS EXCLUSIVE MODE")
        with pytest.raises(TransactionManagementError), transaction.atomic():
            Order.objects.create(total=1)
            with connections["default"].cursor() as cur:
                cur.execute("SET LOCAL lock_timeout = '1ms'")
            with pytest.raises(OperationalError) as info:  # Django's error type, as its ORM raises
                publish(type="OrderPlaced", key="order:1", payload={}, topic=TOPIC)
            assert isinstance(info.value.__cause__, psycopg.errors.LockNotAvailable)
            assert connections["default"].needs_rollback
            Order.objects.create(total=2)  # refused by Django: the block can only roll back
        other.rollback()
    assert stored(shop) == [] and orders(shop) == []


def test_async_code_is_refused_by_django(shop: str) -> None:
    async def view() -> None:
        publish(type="OrderPlaced", key="order:1", payload={}, topic=TOPIC)

    with pytest.raises(SynchronousOnlyOperation):
        asyncio.run(view())
    assert stored(shop) == []


# -- G2: one idempotency key, one event -------------------------------------------------------------


def test_an_idempotency_key_published_again_is_one_event(shop: str) -> None:
    with transaction.atomic():
        first = place(1, idempotency_key="placed-1")
        repeat = publish(type="OrderPlaced", key="order:1", payload={"total": 1}, topic=TOPIC,
                         idempotency_key="placed-1")  # a handler that ran twice
    assert first.created and repeat == Published(first.id, False)
    with transaction.atomic():  # a retried request
        later = publish(type="OrderPlaced", key="order:1", payload={"total": 1}, topic=TOPIC,
                        idempotency_key="placed-1")
    assert later == Published(first.id, False)
    # The key for another event: refused, nothing written, and the block is still usable.
    with transaction.atomic():
        place(2)
        with pytest.raises(IdempotencyConflict, match="placed-1"):
            publish(type="OrderPlaced", key="order:2", payload={}, topic=TOPIC, idempotency_key="placed-1")
        assert not connections["default"].needs_rollback
        place(3)
    assert keys(shop) == ["order:1", "order:2", "order:3"] and orders(shop) == [1, 2, 3]
    # One dict: the library's own single-event INSERT, whose row count tells a known key (Django's cursor).
    event = {"type": "OrderPlaced", "key": "order:1", "payload": {"total": 1}, "topic": TOPIC,
             "idempotency_key": "placed-1"}
    with transaction.atomic():
        assert publish_many([event]) == [Published(first.id, False)]


# -- the outbox schema in a Django project ----------------------------------------------------------


def test_manage_py_migrate_applies_the_outbox_migrations(database_factory: Callable[..., str]) -> None:
    empty = database_factory()
    point("other", empty)
    try:
        call_command("migrate", database="other", verbosity=0)
        with psycopg.connect(empty, autocommit=True) as conn:
            assert conn.execute("SELECT max(version) FROM outbox.schema_migrations").fetchone() == (latest_version(),)
        call_command("migrate", database="other", verbosity=0)  # again: nothing to do
    finally:
        connections["other"].close()


def test_routers_keep_the_schema_out_and_outbox_migrate_applies_it(
        database_factory: Callable[..., str], capsys: pytest.CaptureFixture[str]) -> None:
    empty = database_factory()
    point("other", empty)
    Router.allow_outbox = False
    try:
        call_command("migrate", database="other", verbosity=0)
        with psycopg.connect(empty, autocommit=True) as conn:
            assert conn.execute("SELECT to_regclass('outbox.events')").fetchone() == (None,)
        call_command("outbox_migrate", database="other")
        assert f"({latest_version()} migrations applied)" in capsys.readouterr().out
        with psycopg.connect(empty, autocommit=True) as conn:
            assert conn.execute("SELECT max(version) FROM outbox.schema_migrations").fetchone() == (latest_version(),)
    finally:
        Router.allow_outbox = True
        connections["other"].close()


# -- the example app --------------------------------------------------------------------------------


def test_the_example_app_runs(database_factory: Callable[..., str]) -> None:
    """examples/django_app, run as its README says, against a DSN from the environment."""
    empty = database_factory()
    env = {**os.environ, "OUTBOX_DSN": empty, "PYTHONDONTWRITEBYTECODE": "1"}
    result = subprocess.run([sys.executable, "examples/django_app/demo.py"], cwd=ROOT, env=env,
                            capture_output=True, text=True, timeout=240)
    assert result.returncode == 0, result.stdout + result.stderr
    assert re.search(r"events stored: 2\b", result.stdout), result.stdout



def test_the_testing_kit_reads_through_djangos_connection(shop: str) -> None:
    # What a Django TestCase does: its transaction, rolled back at the end, is the one the test reads.
    from outbox_relay.testing import assert_published, published

    with transaction.atomic():
        place(1)
        assert [(e.key, e.payload) for e in published(connections["default"])] == [("order:1", {"total": 1})]
        assert_published(connections["default"], [{"type": "OrderPlaced", "payload": {"total": 1}}], key="order:1")
        transaction.set_rollback(True)
    assert published(connections["default"]) == []
