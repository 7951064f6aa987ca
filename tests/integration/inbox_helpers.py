"""Helpers of the inbox tests: a migrated consumer database, relay-shaped messages, a consumer thread."""

from __future__ import annotations

import contextlib
import json
import threading
import uuid
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import psycopg
from confluent_kafka import Producer

from outbox_relay.inbox import InboxConsumer, InboxSettings, migrate_inbox
from outbox_relay.inbox.store import Handler
from tests.integration import inbox_app


def inbox_database(make: Callable[..., str]) -> str:
    """A new empty database (no outbox schema) with the inbox tables and the test app's tables."""
    dsn = make()
    with psycopg.connect(dsn, autocommit=True) as conn:
        migrate_inbox(conn)
        inbox_app.setup(conn)
    return dsn


def produce_events(bootstrap: str, topic: str, events: Sequence[tuple[str, int, Any]],
                   ids: Sequence[str] | None = None) -> list[str]:
    """Produce (key, partition, payload) as the relay does (CloudEvents binary headers); returns the ce_ids.
    ``ids``: reuse these ce_ids (a redelivery)."""
    producer = Producer({"bootstrap.servers": bootstrap, "enable.idempotence": True, "log_level": 3})
    out = list(ids) if ids is not None else [str(uuid.uuid4()) for _ in events]
    errors: list[str] = []
    for (key, partition, payload), ce_id in zip(events, out, strict=True):
        producer.produce(topic, value=json.dumps(payload).encode(), key=key.encode(), partition=partition,
                         headers=[("ce_specversion", b"1.0"), ("ce_id", ce_id.encode()), ("ce_type", b"test.made"),
                                  ("ce_partitionkey", key.encode()), ("content-type", b"application/json")],
                         on_delivery=lambda err, _m: errors.append(str(err)) if err else None)
    assert producer.flush(15) == 0 and not errors, errors
    return out


def settings(dsn: str, bootstrap: str, topic: str, **overrides: Any) -> InboxSettings:
    values: dict[str, Any] = {"dsn": dsn, "bootstrap_servers": bootstrap, "topics": [topic],
                              "backoff_base_seconds": 0.05, "backoff_max_seconds": 0.2, "lease_seconds": 2.0,
                              "poll_seconds": 0.05, "verify_seconds": 2.0, **overrides}
    return InboxSettings(**values)


@contextlib.contextmanager
def consumer_thread(s: InboxSettings, handler: Handler = inbox_app.handle) -> Iterator[InboxConsumer]:
    consumer = InboxConsumer(s, handler)
    stop = threading.Event()
    failed: list[BaseException] = []

    def run() -> None:
        try:
            consumer.run(stop)
        except BaseException as exc:
            failed.append(exc)

    thread = threading.Thread(target=run, name="inbox-test-consumer", daemon=True)
    thread.start()
    try:
        yield consumer
    finally:
        stop.set()
        thread.join(30)
    assert not failed, failed


def effects(dsn: str) -> list[tuple[str, str, int, int]]:
    """(message_id, topic, partition, offset) of every application, in the order they committed."""
    with psycopg.connect(dsn) as conn:
        return [tuple(r) for r in conn.execute(  # type: ignore[misc]
            'SELECT message_id, topic, partition, "offset" FROM inbox_app.effects ORDER BY seq')]


def scalar(dsn: str, sql: str, params: Any = None) -> Any:
    with psycopg.connect(dsn) as conn:
        row = conn.execute(sql, params).fetchone()
    return None if row is None else row[0]
