"""Publish events inside Django's ``transaction.atomic()``, on Django's own connection.

    from django.db import transaction
    from outbox_relay.contrib.django import publish

    with transaction.atomic():
        order = Order.objects.create(customer="alice", total=30)
        publish(type="OrderPlaced", key=f"order:{order.pk}", payload={"total": 30})

The events are rows written by ``Outbox.publish_many`` through a cursor of the database alias
(``using``, default ``"default"``), so they share the fate of the block (G1): a rollback of the
block, or of a nested ``atomic()`` (a savepoint) around them, removes them; ``on_commit`` hooks are
untouched. The statements go through Django's cursors: ``execute_wrapper``s, query logging and
``assertNumQueries`` see them, and a database error marks the block for rollback as ``save()`` does.

Refusals (nothing is written): ``InvalidEvent`` for a bad event, ``IdempotencyConflict`` for an
idempotency key that stands for another event (G2: the same event again returns ``created=False``),
``NoTransaction`` in Django's autocommit mode (outside ``atomic()`` every statement commits on its
own, so the event could not share the business change's fate), ``ConfigurationError`` for a database
alias that is not PostgreSQL.

Django's database layer is synchronous (its async ORM runs sync code in a thread, and ``atomic()`` can
not be used from async code), so there is no ``apublish`` here: in an async view, put the unit of
work into a sync function and call it with ``asgiref.sync.sync_to_async``.

The outbox schema: add ``"outbox_relay.contrib.django"`` to ``INSTALLED_APPS`` and ``manage.py
migrate`` applies the package's own migrations (``outbox-relay migrate``'s) after Django's, on every
database that the routers let the app ``outbox_relay`` migrate; ``manage.py outbox_migrate`` does it
alone. Publishing does not need the app.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterable, Mapping
from datetime import datetime
from types import TracebackType
from typing import Any

from django.conf import settings
from django.db import DEFAULT_DB_ALIAS, connections, router, transaction

from ...errors import ConfigurationError, NoTransaction
from ...event import Event
from ...migrate import Migration, apply_migrations
from ...publish import Outbox, Published

__all__ = ["APP_LABEL", "migrate", "publish", "publish_many"]

APP_LABEL = "outbox_relay"  # the label of the app (apps.py): what routers' allow_migrate are asked about


def publish(
    *, type: str, key: str, payload: Any, topic: str | None = None, headers: Mapping[str, str] | None = None,
    idempotency_key: str | None = None, time: datetime | None = None, id: uuid.UUID | None = None,
    using: str | None = None, outbox: Outbox | None = None,
) -> Published:
    """Publish one event in the open ``atomic()`` block of the database alias ``using``.

    The fields are ``Outbox.publish``'s. ``outbox`` validates it (its ``default_topic`` applies);
    without one, ``Outbox(default_topic=settings.OUTBOX_RELAY_DEFAULT_TOPIC)`` (the setting is optional).
    """
    box = outbox or _default_outbox()
    event = box.event(type=type, key=key, payload=payload, topic=topic, headers=headers,
                      idempotency_key=idempotency_key, time=time, id=id)
    return publish_many([event], using=using, outbox=box)[0]


def publish_many(events: Iterable[Event | dict[str, Any]], *, using: str | None = None,
                 outbox: Outbox | None = None) -> list[Published]:
    """Publish events (``Event`` objects or dicts of ``publish``'s fields) in one statement, in order."""
    alias = using or DEFAULT_DB_ALIAS
    _require_atomic(alias)
    return (outbox or _default_outbox()).publish_many(_Connection(alias), events)


def migrate(using: str | None = None) -> list[Migration]:
    """Apply the outbox schema's pending migrations on the database ``using`` (Django's connection);
    returns those applied. The package's migrations are the only source: this is ``outbox-relay migrate``."""
    alias = using or DEFAULT_DB_ALIAS
    connection = _postgresql(alias)
    connection.ensure_connection()
    return apply_migrations(connection.connection)


def migrate_on_post_migrate(sender: Any, using: str = DEFAULT_DB_ALIAS, **_: Any) -> None:
    """``post_migrate`` receiver (apps.py): every ``manage.py migrate``, and the test runner's
    creation of test databases, bring the outbox schema up to date where routers allow it."""
    if router.allow_migrate(using, APP_LABEL):
        migrate(using)


# -- internals ------------------------------------------------------------------------------------


def _default_outbox() -> Outbox:
    return Outbox(default_topic=getattr(settings, "OUTBOX_RELAY_DEFAULT_TOPIC", None))


def _postgresql(alias: str) -> Any:
    connection = connections[alias]
    if connection.vendor != "postgresql":
        raise ConfigurationError(
            f"the database {alias!r} is {connection.vendor} (ENGINE {connection.settings_dict.get('ENGINE')!r}); "
            "the outbox lives in PostgreSQL: use an alias whose ENGINE is django.db.backends.postgresql")
    return connection


def _require_atomic(alias: str) -> None:
    connection = _postgresql(alias)
    # Outside atomic() Django runs in autocommit mode unless the code turned it off itself
    # (transaction.set_autocommit(False)): then it commits, and the events go with its changes.
    if connection.in_atomic_block or not connection.get_autocommit():
        return
    raise NoTransaction(
        f"publish refused: no transaction is open on the database {alias!r}: Django is in autocommit mode outside "
        "transaction.atomic(), so the event would commit at once, on its own, and stay published even if the "
        "business change fails. Publish inside `with transaction.atomic(using=...):` (or ATOMIC_REQUESTS). "
        "Nothing was written.")


class _Connection:
    """What ``Outbox.publish_many`` runs its statements on: Django's cursors of one alias."""

    def __init__(self, alias: str) -> None:
        self._alias = alias

    def cursor(self) -> _Cursor:
        return _Cursor(connections[self._alias].cursor(), self._alias)


class _Cursor:
    def __init__(self, cursor: Any, alias: str) -> None:
        self._cursor = cursor
        self._alias = alias

    def __enter__(self) -> _Cursor:
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self._cursor.close()

    def execute(self, sql: str, params: dict[str, Any]) -> None:
        # A failed statement leaves the transaction (or savepoint) aborted: mark the atomic block, as
        # Model.save() does, so that Django says so instead of the next query failing. Refusals raised
        # after a statement succeeded (IdempotencyConflict) leave the transaction usable, and unmarked.
        with transaction.mark_for_rollback_on_error(self._alias):
            self._cursor.execute(sql, params)

    def fetchall(self) -> list[Any]:
        return list(self._cursor.fetchall())

    @property
    def description(self) -> Any:
        return self._cursor.description

    @property
    def rowcount(self) -> int:  # a keyed insert's row count says whether its key was free
        return int(self._cursor.rowcount)


