"""Events whose stored headers the Kafka sink can not send as they are.

Migration 0005's trigger refuses such headers at insert, but rows written before it (or by a
superuser past it) may hold anything the jsonb column takes. Each such event is charged alone: a
header the relay reserves for itself is dropped (the relay's value is the one consumers get), headers
that are not a JSON object of strings dead-letter the event at once with the reason. The rest of the
batch, the same key's later events included, is delivered.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import re
from pathlib import Path
from typing import Any

import psycopg
import pytest
from psycopg_pool import ConnectionPool

from outbox_relay.event import RESERVED_HEADER_PREFIX, RESERVED_HEADERS
from outbox_relay.sinks.kafka import KafkaSink, is_reserved_header
from tests.integration.relay_helpers import (  # noqa: F401  (pool_fixture provides `pool`)
    cursor_row,
    dead_letters,
    keys_in_bucket,
    make_settings,
    pool_fixture,
    run_until,
    runner_for,
)
from tests.integration.test_relay_kafka import all_handled, stored_events
from tests.servers import consume_all

KAFKA = "kafka"
MIGRATION = Path(__file__).resolve().parents[2] / "sql" / "migrations" / "0005_hardening.sql"


def insert_past_the_trigger(dsn: str, rows: list[tuple[str, str, str]]) -> list[Any]:
    """Insert (key, type, headers as JSON text) as a row written before migration 0005 would be:
    triggers off (superuser only), so the headers are stored as they are."""
    with psycopg.connect(dsn) as conn:
        conn.execute("SET session_replication_role = replica")
        ids = [conn.execute("INSERT INTO outbox.events (partition_key, type, payload, headers) "
                            "VALUES (%s, %s, '{}', %s::jsonb) RETURNING id", row).fetchone()[0]  # type: ignore[index]
               for row in rows]
        conn.execute("RESET session_replication_role")
    return ids


def test_headers_that_can_not_be_sent_are_charged_to_their_event_alone(
        dsn: str, pool: ConnectionPool[Any], kafka_bootstrap: str, kafka_topic: str,
        caplog: pytest.LogCaptureFixture) -> None:
    a, b, c, d = keys_in_bucket(dsn, 7, 4)  # one bucket: one batch
    first, number, after, array, reserved, null = insert_past_the_trigger(dsn, [
        (a, "fine", '{"trace-id": "t-1"}'),
        (a, "number", '{"trace-id": "t-2", "n": 1}'),
        (a, "after", "{}"),  # behind the dead-lettered event of its key: delivered
        (b, "array", '["trace-id", "t-4"]'),
        (c, "reserved", '{"ce_id": "spoofed", "Outbox_Fence": "999", "CONTENT-TYPE": "text/plain", "trace-id": "t-5"}'),
        (d, "null", '{"trace-id": null}'),
    ])
    sink = KafkaSink(KAFKA, {"bootstrap.servers": kafka_bootstrap}, kafka_topic, "urn:test")
    try:
        with caplog.at_level(logging.WARNING, logger="outbox_relay.kafka"):
            run_until(runner_for(sink, pool, make_settings(dsn, "relay-h", max_attempts=10)),
                      lambda: all_handled(dsn), timeout=20)
    finally:
        sink.close()

    letters = dead_letters(dsn, KAFKA)
    assert set(letters) == {number, array, null}
    assert all(attempts == 1 for attempts, _ in letters.values()), "undeliverable headers are not retried"
    assert "'n' is a JSON number, not a string" in letters[number][1]
    assert "a JSON object of strings, not a JSON array" in letters[array][1]
    assert "'trace-id' is a JSON null, not a string" in letters[null][1]

    messages = {m.headers["ce_id"]: m for m in consume_all(kafka_bootstrap, kafka_topic, 3, timeout=20, settle=0.5)}
    assert set(messages) == {str(first), str(after), str(reserved)}, "ce_id is the event's id, never a header's"
    assert messages[str(first)].headers["trace-id"] == "t-1"
    spoofed = messages[str(reserved)].headers
    assert spoofed["trace-id"] == "t-5", "the event's other headers ride along"
    assert spoofed["outbox_fence"] == str(cursor_row(dsn, 7, KAFKA)["fence"])
    assert spoofed["content-type"] == "application/json"
    assert "Outbox_Fence" not in spoofed and "CONTENT-TYPE" not in spoofed
    warned = " ".join(r.getMessage() for r in caplog.records)
    assert all(name in warned for name in ("'ce_id'", "'Outbox_Fence'", "'CONTENT-TYPE'")), warned


def test_the_reserved_names_are_the_ones_the_trigger_refuses_and_the_relay_sets() -> None:
    """event.RESERVED_HEADERS (what the Kafka sink sets), as migration 0005's trigger comment says: the same names, and
    every header the relay sets itself is among them."""
    trigger = MIGRATION.read_text()
    listed = re.search(r"lower\(name\) IN \(([^)]*)\)", trigger)
    prefix = re.search(r"lower\(name\) LIKE '([^']*)'", trigger)
    assert listed is not None and prefix is not None, "the trigger's reserved-name check moved"
    assert set(re.findall(r"'([^']*)'", listed.group(1))) == RESERVED_HEADERS
    assert prefix.group(1).replace("\\_", "_").rstrip("%") == RESERVED_HEADER_PREFIX

    sink = KafkaSink(KAFKA, {"bootstrap.servers": "127.0.0.1:1"}, "t", "urn:test",
                     extra_headers=[("outbox_replay", b"1")])
    try:
        (event,) = stored_events(["k"], 1, first_seq=1)
        headers = sink.headers.of(event, 1)
    finally:
        sink.close()
    assert isinstance(headers, list)
    assert all(is_reserved_header(name) for name, _ in headers), [n for n, _ in headers if not is_reserved_header(n)]


@pytest.mark.parametrize("headers, problem", [
    ('"just a string"', "not a JSON string"),
    ('{"a": {"b": "c"}}', "'a' is a JSON object"),
    ('{"a": true}', "'a' is a JSON boolean"),
    ('{"a": ["x"]}', "'a' is a JSON array"),
])
def test_headers_are_checked_without_raising(headers: str, problem: str) -> None:
    sink = KafkaSink(KAFKA, {"bootstrap.servers": "127.0.0.1:1"}, "t", "urn:test")
    try:
        (event,) = stored_events(["k"], 1, first_seq=1)
        outcome = sink.headers.of(dataclasses.replace(event, headers_text=headers), 1)
    finally:
        sink.close()
    assert not isinstance(outcome, list), f"{json.loads(headers)!r} was accepted"
    assert not outcome.retriable and problem in outcome.error
