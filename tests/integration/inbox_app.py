"""A handler for the inbox tests (importable by `outbox-relay inbox run --handler tests.integration.inbox_app:handle`).

Every application appends a row to ``inbox_app.effects`` (no unique constraint: a double effect shows
as two rows). A payload ``{"poison": true}`` raises until ``inbox_app.cured`` has a row; ``{"sleep": S}``
sleeps S seconds inside the transaction.
"""

from __future__ import annotations

import time
from typing import Any

import psycopg

from outbox_relay.inbox import InboxMessage

SCHEMA = """
CREATE SCHEMA IF NOT EXISTS inbox_app;
CREATE TABLE IF NOT EXISTS inbox_app.effects (
    seq        bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    message_id text    NOT NULL,
    topic      text    NOT NULL,
    partition  integer NOT NULL,
    "offset"   bigint  NOT NULL,
    key        text
);
CREATE TABLE IF NOT EXISTS inbox_app.cured (x integer);
"""


def setup(conn: psycopg.Connection[Any]) -> None:
    conn.execute(SCHEMA)


def handle(message: InboxMessage, conn: psycopg.Connection[Any]) -> None:
    payload = message.json() or {}
    if payload.get("sleep"):
        time.sleep(float(payload["sleep"]))
    if payload.get("poison") and conn.execute("SELECT count(*) FROM inbox_app.cured").fetchone() == (0,):
        raise ValueError(f"poison message {message.id}")
    conn.execute('INSERT INTO inbox_app.effects (message_id, topic, partition, "offset", key) '
                 "VALUES (%s, %s, %s, %s, %s)",
                 (message.id, message.topic, message.partition, message.offset, message.partition_key))
