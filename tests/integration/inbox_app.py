"""A handler for the inbox tests (importable by `outbox-relay inbox run --handler tests.integration.inbox_app:handle`).

Every application appends a row to ``inbox_app.effects`` (no unique constraint: a double effect shows
as two rows; ``late``: applied from a dead-letter retry). A payload ``{"poison": true}`` raises until
``inbox_app.cured`` has a row; ``{"exit": true}`` ends the process with ``os._exit`` until then (each
call first appends a line to the file ``$INBOX_APP_EXITS`` when set); ``{"sleep": S}`` sleeps S seconds
inside the transaction.
"""

from __future__ import annotations

import os
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
    key        text,
    late       boolean NOT NULL DEFAULT false
);
CREATE TABLE IF NOT EXISTS inbox_app.cured (x integer);
"""


def setup(conn: psycopg.Connection[Any]) -> None:
    conn.execute(SCHEMA)


def handle(message: InboxMessage, conn: psycopg.Connection[Any]) -> None:
    payload = message.json() or {}
    if payload.get("sleep"):
        time.sleep(float(payload["sleep"]))
    if (payload.get("poison") or payload.get("exit")) and \
            conn.execute("SELECT count(*) FROM inbox_app.cured").fetchone() == (0,):
        if payload.get("exit"):
            if os.environ.get("INBOX_APP_EXITS"):
                with open(os.environ["INBOX_APP_EXITS"], "a") as calls:
                    calls.write(f"{message.id}\n")
            os._exit(17)  # no exception, no cleanup: what a segfault or the OOM killer leaves
        raise ValueError(f"poison message {message.id}")
    conn.execute('INSERT INTO inbox_app.effects (message_id, topic, partition, "offset", key, late) '
                 "VALUES (%s, %s, %s, %s, %s, %s)",
                 (message.id, message.topic, message.partition, message.offset, message.partition_key, message.late))
